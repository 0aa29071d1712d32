"""Teardown of a real torchrun with 2 ranks that ignore SIGTERM (tasks/core/launch/proctree.py).

A driver process plays the Prefect task (it becomes the subreaper, as the task does; pytest
itself is left alone): it starts torchrun with the stage token, waits until both ranks write into
a watched directory, optionally SIGKILLs torchrun's process group first, the naive teardown (the
ranks, in sessions of their own, survive that as orphans), then tears the stage down.
Checked: no process of the stage exists, at once and 10 s later, and no file in the watched
directory changes after teardown returned.

    .venv/bin/python -m pytest -q -s -m distributed tests/test_proctree.py     # ~40 s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tasks.core.launch.proctree import TOKEN_ENV, StageProcesses, new_token, teardown

REPO = Path(__file__).resolve().parents[1]

DRIVER = r"""
import json, os, signal, subprocess, sys, time
from tasks.core.launch.proctree import StageProcesses, TOKEN_ENV, become_subreaper, new_token, teardown
mode, watched = sys.argv[1], sys.argv[2]
subreaper = become_subreaper()
token = new_token()
argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "tests/_stubborn_rank.py", watched]
proc = subprocess.Popen(argv, env={**os.environ, TOKEN_ENV: token}, start_new_session=True,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
files = [os.path.join(watched, f"rank-{r}.txt") for r in (0, 1)]
deadline = time.monotonic() + 180
while not all(os.path.exists(f) for f in files):
    assert time.monotonic() < deadline and proc.poll() is None, "ranks did not start"
    time.sleep(0.1)
ranks = [int(open(f).read().split()[0]) for f in files]
info = {"driver": os.getpid(), "torchrun": proc.pid, "ranks": ranks, "subreaper": subreaper,
        "rank_sessions": [os.getsid(p) for p in ranks]}
stage = StageProcesses(proc.pid, token)
if mode == "orphans":
    os.killpg(proc.pid, signal.SIGKILL)   # the naive teardown: torchrun's own process group only
    proc.wait()
    time.sleep(1.0)
    import psutil
    info["after_killpg"] = {p: (psutil.Process(p).ppid() if psutil.pid_exists(p) else None) for p in ranks}
report = teardown(stage, grace_s=2.0)
info["teardown_s"] = report.seconds
info["terminated"], info["killed"] = report.terminated, report.killed
print(json.dumps(info), flush=True)
"""


def _state(d: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(d.iterdir())}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _run_driver(mode: str, watched: Path) -> tuple[dict, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, mode, str(watched)],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    returned = time.monotonic()
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), returned


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["tree", "orphans"])
def test_every_rank_is_torn_down_and_writes_nothing_after(tmp_path, mode):
    watched = tmp_path / "stage"
    watched.mkdir()
    info, returned = _run_driver(mode, watched)
    print(f"\n{mode}: {json.dumps(info)}")
    # The premise: torch's elastic agent puts each rank in a session of its own.
    assert all(sid == pid for sid, pid in zip(info["rank_sessions"], info["ranks"]))
    if mode == "orphans":
        # killpg(torchrun) missed both ranks; as the subreaper's orphans they stayed in its tree.
        assert all(ppid is not None for ppid in info["after_killpg"].values()), info
        if info["subreaper"]:
            assert set(info["after_killpg"].values()) == {info["driver"]}, info
    pids = info["ranks"] + ([info["torchrun"]] if mode == "tree" else [])
    assert set(info["ranks"]) <= set(info["killed"]), "the ranks ignore SIGTERM, so they needed SIGKILL"
    assert all(_gone(p) for p in pids)
    before = _state(watched)
    time.sleep(max(0.0, 10.0 - (time.monotonic() - returned)))
    assert all(_gone(p) for p in pids), "a process of the stage exists 10 s after teardown"
    assert _state(watched) == before, "a file in the stage directory changed after teardown returned"


def test_snapshot_finds_token_carriers_outside_the_tree_and_leaves_others(tmp_path):
    """Unit tier: a process carrying the token but not under the root (an orphan that escaped to
    PID 1) is found; a sibling without it is not touched."""
    token = new_token()
    sleeper = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
    ]
    marked = subprocess.Popen(sleeper, env={**os.environ, TOKEN_ENV: token}, start_new_session=True)
    other = subprocess.Popen(sleeper, start_new_session=True)
    try:
        time.sleep(0.3)
        stage = StageProcesses(root_pid=2**22 + 12345, token=token)  # the root is long gone
        assert [p.pid for p in stage.snapshot()] == [marked.pid]
        report = teardown(stage, grace_s=0.5)
        assert report.killed == [marked.pid] and marked.poll() is not None
        assert other.poll() is None
    finally:
        for p in (marked, other):
            p.kill()
            p.wait()
