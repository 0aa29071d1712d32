"""Where the suite's CPU seconds go, per test: what each test's setup, call and teardown cost in
user + system seconds of the pytest process and every process it started and waited for
(torchrun and its ranks, flow CLIs, servers a fixture stops).

    CPT_CPU_REPORT=build/cpu make test          # each pytest process writes build/cpu/<worker>.jsonl
    python -m support.cpu_report build/cpu      # the table: by file, then the 40 dearest tests

A child's seconds reach the parent only when it is waited for, so a session server's whole life is
charged to the teardown that stops it, and the suite's total is `/usr/bin/time`'s, not this sum
(the xdist controller and collection are outside any test).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

ENV = "CPT_CPU_REPORT"


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


class Recorder:
    """A pytest plugin: one JSON line per test phase, appended to <dir>/<worker>.jsonl."""

    def __init__(self, folder: Path, worker: str):
        folder.mkdir(parents=True, exist_ok=True)
        self._out = open(folder / f"{worker}.jsonl", "a", buffering=1)  # noqa: SIM115 (the session's life)

    def _wrap(self, item, phase: str):
        own0, kids0 = _cpu()
        t0 = time.monotonic()
        result = yield
        own1, kids1 = _cpu()
        row = {
            "test": item.nodeid,
            "phase": phase,
            # a phase that raised: a failure, an error or a skip (read the run's log for which)
            "raised": getattr(result, "exception", None) is not None,
            "own": round(own1 - own0, 3),
            "children": round(kids1 - kids0, 3),
            "wall": round(time.monotonic() - t0, 3),
        }
        self._out.write(json.dumps(row) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self._wrap(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        yield from self._wrap(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        yield from self._wrap(item, "teardown")


def register(config) -> None:
    """Installs the recorder when CPT_CPU_REPORT names a folder (tests/conftest.py calls this)."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    config.pluginmanager.register(Recorder(Path(folder), worker), f"cpu-report-{worker}")


def table(folder: Path, top: int = 40) -> str:
    per_test: dict[str, float] = defaultdict(float)
    per_file: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    phases: dict[tuple[str, str], float] = {}
    raised: set[str] = set()
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            cpu = row["own"] + row["children"]
            per_test[row["test"]] += cpu
            wall[row["test"]] += row["wall"]
            per_file[row["test"].split("::")[0]] += cpu
            phases[(row["test"], row["phase"])] = phases.get((row["test"], row["phase"]), 0.0) + cpu
            if row.get("raised"):
                raised.add(f"{row['test']} ({row['phase']})")
    total = sum(per_test.values())
    lines = [f"{len(per_test)} tests, {total:,.0f} CPU-s inside tests", "", "## by file", ""]
    lines += ["| CPU-s | share | file |", "|---:|---:|---|"]
    for name, cpu in sorted(per_file.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {cpu:,.1f} | {cpu / total:.1%} | {name} |")
    lines += ["", f"## the {top} dearest tests (setup / call / teardown)", ""]
    lines += ["| CPU-s | setup | call | teardown | wall s | test |", "|---:|---:|---:|---:|---:|---|"]
    for name, cpu in sorted(per_test.items(), key=lambda kv: -kv[1])[:top]:
        parts = [phases.get((name, p), 0.0) for p in ("setup", "call", "teardown")]
        lines.append(f"| {cpu:,.1f} | {parts[0]:.1f} | {parts[1]:.1f} | {parts[2]:.1f} | {wall[name]:.0f} | {name} |")
    if raised:
        lines += ["", "## phases that raised (failed, errored or skipped)", "", *sorted(raised)]
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    print(table(Path(args[0] if args else "build/cpu"), int(args[1]) if len(args) > 1 else 40))
