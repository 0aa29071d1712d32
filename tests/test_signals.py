"""Ctrl-C and SIGKILL of a real `python -m flows.cpt_to_sft` process on its embedded Prefect server,
during the tiny demo's CPT training stage (real torchrun ranks):

- the first SIGINT, sent to the process group as the terminal's Ctrl-C is, ends the stage's
  processes, writes run.json, releases the lease and ends the flow run Cancelled, exit 130,
  within 10 s; a second SIGINT exits at once, and the run's processes still go;
- SIGKILL of the flow process takes its embedded Prefect server (and the stage) along.

    python -m pytest -q -m "" tests/test_signals.py        # ~3 min on 2 busy cores
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from support.servers.prefect_home import seeded_home
from tests.conftest import REPO, tiny_config_raw, write_config

pytestmark = [pytest.mark.integration, pytest.mark.distributed]
SERVER_APP = "prefect.server.api.server:create_app"
FIRST_STEP = "cpt  step 1/"  # the console's step line (log_every 1): the training stage's first step is done


def _start(tmp_path: Path, model: Path) -> tuple[subprocess.Popen, Path, Path]:
    """The real flow CLI up to train_cpt (long enough to be interrupted) on its own embedded server."""
    run_root = tmp_path / "run"
    cfg = write_config(
        tmp_path / "cfg.yaml",
        tiny_config_raw(model, run_root, cpt={"max_steps": 5000, "checkpoint_every": 1000, "log_every": 1}),
    )
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")
    }  # the embedded server, as a user runs it
    env.update(
        PREFECT_HOME=str(seeded_home(tmp_path / "prefect")),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
    )
    env.pop("CPT_TO_SFT_FAULT", None)
    log = tmp_path / "flow.log"
    # Its own session: the test's signals reach its process group as a terminal's would.
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cpt_to_sft", "--config", str(cfg), "--stop-after", "train_cpt"],
        cwd=REPO,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, run_root, log


def _wait_for(proc: subprocess.Popen, log: Path, text: str, timeout: float = 480) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"never saw {text!r}: " + log.read_text()[-4000:]
        time.sleep(0.2)


def _matching(needle: str) -> list[psutil.Process]:
    """Live processes whose command line holds `needle`."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and needle in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _servers_of(proc: subprocess.Popen) -> list[psutil.Process]:
    """The embedded API servers this flow process started (its descendants running the server app)."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [k for k in kids if SERVER_APP in " ".join(k.cmdline())]


def _gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _cleanup(proc: subprocess.Popen, extra: list[psutil.Process]) -> None:
    for p in [*extra, *([psutil.Process(proc.pid)] if proc.poll() is None else [])]:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait()


def test_first_ctrl_c_tears_the_run_down_and_ends_it_cancelled(tiny_model_dir, tmp_path):
    proc, run_root, log = _start(tmp_path, tiny_model_dir)
    job = str(run_root / "jobs" / "cpt-")  # cpt-shard.json: train_cpt adopted the shared launch
    servers: list[psutil.Process] = []
    try:
        _wait_for(proc, log, FIRST_STEP)  # the training stage's first step
        servers = _servers_of(proc)
        ranks = _matching(job)
        assert servers and ranks, log.read_text()[-3000:]
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
        rc = proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        _cleanup(proc, servers)
    out = log.read_text()
    print(f"first Ctrl-C to exit 130: {took:.1f}s")
    assert rc == 130 and took < 10, (rc, took, out[-4000:])
    assert _matching(job) == [], "a rank outlived the interrupted run"
    assert not (run_root / ".lease.json").exists(), "the lease was not released"
    summary = json.loads((run_root / "run.json").read_text())
    train = next(s for s in summary["stages"] if s["stage"] == "train_cpt")
    assert train["status"] == "failed" and "SIGINT" in train["detail"]["error"], train
    assert "Finished in state Cancelled(" in out and "interrupted by SIGINT (Ctrl-C)" in out.splitlines()[-1], out[
        -3000:
    ]
    assert "Traceback" not in out, out[-4000:]
    assert _gone(servers, 10) == [], "the embedded server outlived its flow process"


def test_second_ctrl_c_exits_at_once_and_the_run_still_goes(tiny_model_dir, tmp_path):
    proc, run_root, log = _start(tmp_path, tiny_model_dir)
    job = str(run_root / "jobs" / "cpt-")  # cpt-shard.json: train_cpt adopted the shared launch
    servers: list[psutil.Process] = []
    try:
        _wait_for(proc, log, FIRST_STEP)
        servers, ranks = _servers_of(proc), _matching(job)
        assert servers and ranks, log.read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        _wait_for(proc, log, "Ctrl-C again exits at once", timeout=10)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        _cleanup(proc, servers)
    assert rc == 130 and took < 2, (rc, took, log.read_text()[-3000:])
    assert _gone([*ranks, *servers], 10) == [], "a process of the run outlived its flow process"


def test_sigkill_of_the_flow_process_takes_its_embedded_server(tiny_model_dir, tmp_path):
    proc, run_root, log = _start(tmp_path, tiny_model_dir)
    job = str(run_root / "jobs" / "cpt-")  # cpt-shard.json: train_cpt adopted the shared launch
    servers: list[psutil.Process] = []
    try:
        _wait_for(proc, log, FIRST_STEP)
        servers, ranks = _servers_of(proc), _matching(job)
        assert servers and ranks, log.read_text()[-3000:]
        proc.kill()
        proc.wait(timeout=30)
        left = _gone([*servers, *ranks], 10)
    finally:
        _cleanup(proc, servers)
    assert left == [], f"alive 10 s after SIGKILL of the flow process: {[' '.join(p.cmdline())[:120] for p in left]}"


def test_the_run_outlives_the_reader_of_its_console(tiny_model_dir, tmp_path):
    """Whatever reads the flow's output goes away (a dead parent, a closed terminal) before any stage
    ran: the stages still run and log (up to prepare_sft here: before console_guard the first log line
    ended the run), and the run ends complete."""
    run_root = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.yaml", tiny_config_raw(tiny_model_dir, run_root))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update(
        PREFECT_HOME=str(seeded_home(tmp_path / "prefect")),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
    )
    env.pop("CPT_TO_SFT_FAULT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cpt_to_sft", "--config", str(cfg), "--stop-after", "prepare_sft"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "Beginning flow run" in line:
                break
        proc.stdout.close()  # the reader is gone: every later write of the flow process hits a broken pipe
        rc = proc.wait(timeout=300)
    finally:
        _cleanup(proc, [])
    summary = json.loads((run_root / "run.json").read_text())
    statuses = {s["stage"]: (s["status"], s["detail"].get("error")) for s in summary["stages"]}
    assert rc == 0, (rc, statuses, "".join(seen)[-2000:])
    assert summary["stopped_after"] == "prepare_sft" and statuses["prepare_sft"][0] == "completed", statuses
