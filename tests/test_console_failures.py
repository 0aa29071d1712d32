"""A failure is one line on the console, without a traceback; the traceback stays in the task run's log.

    .venv/bin/python -m pytest -q tests/test_console_failures.py            # the console rule
    .venv/bin/python -m pytest -q -m "" tests/test_console_failures.py      # + the real CLI

The CLI cases run `python -m flows.cli run` against the session's Prefect server (no torchrun launch):
a pre-flight refusal, a malformed JSONL line found by a process-pool worker in prepare_cpt, and pickle
weights whose shapes disagree with config.json, found by load_from_hf's conversion (pre-flight never opens
a pickle). Each prints its cause once, last, and no traceback;
the Prefect API holds the failed task run's traceback.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import flows.cpt_to_sft  # noqa: F401 - Prefect's logging set up, as in the CLI
from tasks.flowkit.console_log import NOT_ON_CONSOLE, install, uninstall
from tests.conftest import REPO, tiny_config_raw, write_config


def _console() -> tuple[logging.Handler, io.StringIO]:
    from prefect.logging.formatters import PrefectFormatter
    from prefect.logging.handlers import PrefectConsoleHandler

    out = io.StringIO()
    h = PrefectConsoleHandler(stream=out)
    h.setFormatter(PrefectFormatter(format="%(levelname)s | %(name)s - %(message)s"))
    return h, out


class _Keep(logging.Handler):
    """Stands for Prefect's API handler on the run loggers: what the task run's log receives."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(logging.Formatter().format(record))


def test_the_console_shows_no_echo_of_a_failure_and_no_traceback_while_the_run_log_keeps_them():
    from tasks.core.launch.torchrun import Router

    console, out = _console()
    api = _Keep()
    task_log = logging.getLogger("prefect.task_runs.h38c-test")
    flow_log = logging.getLogger("prefect.flow_runs.h38c-test")
    other = logging.getLogger("h38c-test.other")
    loggers = (task_log, flow_log, other)
    for lg in loggers:
        lg.propagate, lg.level = False, logging.DEBUG
        lg.handlers = [api, console]  # the API handler first, as the record meets it on the way to the root
    done = install([console])
    try:
        try:
            raise ValueError("cpt.jsonl:600: malformed JSON")
        except ValueError as exc:
            task_log.error("Task run failed with exception: %r", exc, exc_info=True)
            other.exception("a library's error")
        task_log.error("Task run failed with state: Refused(...)", exc_info=True)  # Prefect 3.9's `NoneType: None`
        task_log.error("Finished in state Failed('Task run encountered an exception ValueError: ...')")
        flow_log.info("Finished in state Refused('pre-flight failed ...', type=FAILED)")
        flow_log.info("Finished in state Crashed('Execution was aborted')")
        flow_log.info("Finished in state Completed()")
        task_log.info("Finished in state Skipped(type=COMPLETED)")
        task_log.info("Task run failed with exception: OSError() - Retry 1/2 will start 15 second(s) from now")
        task_log.error("the report", extra=NOT_ON_CONSOLE)
        router = Router(task_log)
        for raw in (
            "[rank 0] step 3",
            "[rank 1|error] engine train failed: RuntimeError: boom",
            "[rank 1|error] Traceback (most recent call last):",
            "[rank 0|warning] slow step",
            "Traceback (most recent call last):",
            "E1203 11:42:17.831000 1 api.py:1002] failed (exitcode: 1)",
        ):
            router.line(raw)
        router.line("[rank 2|error] lost", node="node-1")
    finally:
        uninstall(done)
        for lg in loggers:
            lg.handlers = []
    shown = out.getvalue()
    assert "Traceback" not in shown and "NoneType" not in shown, shown
    assert [line.split(" - ", 1)[1] for line in shown.splitlines()] == [
        "a library's error",
        "Finished in state Completed()",
        "Finished in state Skipped(type=COMPLETED)",
        "Task run failed with exception: OSError() - Retry 1/2 will start 15 second(s) from now",
        "[rank 0] step 3",
        "[rank 0] slow step",
    ], shown
    kept = "\n".join(api.lines)  # every record, tracebacks included, reached the run's log
    assert (
        kept.count("Traceback (most recent call last)") >= 4
        and "malformed JSON" in kept
        and "the report" in kept
        and "[node-1 rank 2] lost" in kept
    )
    # Uninstalled: the handler is Prefect's own again.
    assert not console.filters and type(console.formatter).__name__ == "PrefectFormatter"


def test_tracebacks_stay_on_the_console_when_asked(monkeypatch):
    monkeypatch.setenv("CPT_TO_SFT_TRACEBACKS", "1")
    console, out = _console()
    lg = logging.getLogger("h38c-test.tracebacks")
    lg.propagate, lg.handlers = False, [console]
    done = install([console])
    try:
        try:
            raise ValueError("kept")
        except ValueError:
            lg.exception("with its traceback")
    finally:
        uninstall(done)
        lg.handlers = []
    assert "Traceback (most recent call last)" in out.getvalue()


# -- the real CLI ---------------------------------------------------------------------------------


def _flow_run_ids(console: str) -> list[str]:
    return re.findall(r"/runs/flow-run/([0-9a-f-]{36})", console)


def _task_run_logs(flow_run_ids: list[str]) -> dict[str, str]:
    """Task run name -> its log as the Prefect API holds it, over the given flow runs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterTaskRunId

    out: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_run_ids)))
        for run in runs:
            logs = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[run.id])), limit=200)
            out[run.name] = "\n".join(log.message for log in logs)
    return out


def _bad_jsonl(tmp_path: Path, raw: dict) -> tuple[dict, str]:
    """Two corpus files (so a process pool tokenizes them); the second's last line is cut mid-record."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = (REPO / "data" / "sample" / "cpt.jsonl").read_text().splitlines()
    (corpus / "a.jsonl").write_text("\n".join(lines[:300]) + "\n")
    (corpus / "b.jsonl").write_text("\n".join(lines[:-1] + [lines[-1][:40]]) + "\n")
    raw["cpt"]["data"]["uri"] = str(corpus)
    return raw, f"{corpus / 'b.jsonl'}:{len(lines)}: malformed JSON"


def _mismatched_pickle(tmp_path: Path, raw: dict) -> tuple[dict, str]:
    """A base model whose only weights are a pickle (allowed by base_model.allow_pickle) with a final norm one
    value too many for its config.json. Pre-flight never opens a pickle (unpickling is the risk allow_pickle
    accepts, taken only by load_from_hf's torch.load(weights_only=True)), so it cannot see the shapes that a
    safetensors header would have shown it; load_from_hf's conversion to safetensors fails on them."""
    import torch
    from safetensors.torch import load_file

    model = tmp_path / "model"
    shutil.copytree(raw["base_model"]["uri"], model)
    weights = model / "model.safetensors"
    state = load_file(weights)
    n = state["model.norm.weight"].shape[0]
    state["model.norm.weight"] = torch.ones(n + 1)
    torch.save(state, model / "pytorch_model.bin")
    weights.unlink()
    raw["base_model"]["uri"] = str(model)
    raw["base_model"]["allow_pickle"] = True
    return raw, f"'model.norm.weight' in pytorch_model.bin has shape [{n + 1}], config.json implies [{n}]"


def _refused(tmp_path: Path, raw: dict) -> tuple[dict, str]:
    raw["cpt"]["data"]["text_field"] = "body"
    return raw, "cpt.data.text_field: "


CASES = {
    # case: (config change, the failure's text, the task run whose log keeps the traceback)
    "refusal": (_refused, None),
    "prepare": (_bad_jsonl, "tokenize "),
    "stage": (_mismatched_pickle, "load_from_hf"),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", list(CASES))
def test_the_cli_prints_a_failure_once_and_the_task_run_log_keeps_its_traceback(
    prefect_harness, tiny_model_dir, tmp_path, case
):
    from prefect.settings import PREFECT_API_URL

    change, task_name = CASES[case]
    raw, failure = change(tmp_path, tiny_config_raw(tiny_model_dir, tmp_path / "run"))
    cfg = write_config(tmp_path / f"{case}.yaml", raw)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": PREFECT_API_URL.value()}
    env.pop("CPT_TO_SFT_TRACEBACKS", None)
    r = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--config", str(cfg)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    console = r.stdout + r.stderr
    assert r.returncode == 1, console[-4000:]
    assert "Traceback" not in console and "NoneType: None" not in console, console[-6000:]
    hits = [line for line in console.splitlines() if failure in line]
    assert len(hits) == 1, (failure, console[-6000:])  # once, not once per task, subflow and flow
    last = [line for line in r.stderr.splitlines() if line.strip()]
    if case == "refusal":
        assert last[-1].startswith("pre-flight stopped") and "Finished in state Refused" not in console, console[-6000:]
        return
    assert failure in last[-1], last[-3:]
    logs = _task_run_logs(_flow_run_ids(console))
    failed = {
        name: text
        for name, text in logs.items()
        if name.startswith(task_name) and "Traceback (most recent call last)" in text
    }
    assert failed, logs
    if case == "prepare":  # the process-pool worker's own task run: b.jsonl's
        assert list(failed) == [f"tokenize {Path(raw['cpt']['data']['uri']) / 'b.jsonl'}"] and "malformed JSON" in next(
            iter(failed.values())
        )
