"""The whole flow with its CPT stage on the Slurm backend, on the real two-node test cluster and a
real Prefect server (integration, e2e): CPT runs HybridParallel tp=2 with one rank on each of the
emulated nodes n1 and n2; SFT and every other stage run on the worker (the local backend).

1. Cancellation: a deployment run on a process worker; once its Slurm job runs, the flow run is
   set to CANCELLING through the Prefect REST API. Prefect's worker SIGTERMs the flow-run process,
   the task's wait raises, the launcher scancels the job: the queue is empty and no slurmstepd,
   torchrun or engine process is left within 10 s, and the run ends Cancelled.
2. Re-attach: `python -m flows.cpt_to_sft` is SIGKILLed (its whole process group) while its CPT
   Slurm job trains; the re-run (after `--break-lease`, as the operator guide says) re-attaches to
   that job with squeue showing at most that one job throughout, and the flow completes with
   verified checkpoints that name both nodes.

    python -m pytest -m "" tests/test_slurm_flow.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support.servers.prefect_home import seeded_home
from support.servers.prefect_ops import PrefectServer, run_id_from, stop_group
from tasks.core.run.manifest import MANIFEST
from tests.conftest import REPO, tiny_config_raw, write_config

pytest_plugins = ["tests.conftest_slurm"]
pytestmark = [pytest.mark.e2e, pytest.mark.integration]

SLURM_CPT = {"backend": "slurm", "nnodes": 2, "nproc_per_node": 1, "slurm": {"partition": "debug", "time_limit": "15"}}
# Both emulated nodes are 127.0.0.1; gloo must use the loopback interface to meet there.
ENGINE_ENV = {"GLOO_SOCKET_IFNAME": "lo"}


def _config(tmp: Path, model_dir: Path, name: str, cpt_steps: int) -> tuple[Path, Path]:
    run_root = tmp / name
    raw = tiny_config_raw(model_dir, run_root)
    raw["name"] = name
    raw["cpt"].update(max_steps=cpt_steps, checkpoint_every=10, launch=SLURM_CPT)
    raw["sft"].update(max_steps=4, checkpoint_every=2)
    raw.setdefault("gate", {})["enabled"] = False  # a 4-step random model earns no gate; tested elsewhere
    return write_config(tmp / f"{name}.yaml", raw), run_root


@pytest.fixture(scope="module")
def server(slurm_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slurm-flow")
    srv = PrefectServer(seeded_home(tmp / "prefect-home"))
    try:
        srv.start(timeout=300)  # a loaded 2-core machine takes minutes
        yield srv
    finally:
        srv.stop()


def _wait_running_job(
    slurm_cluster, stage_dir: Path, verbs: tuple[str, ...], proc: subprocess.Popen | None = None, timeout: float = 600
) -> tuple[str, str]:
    """(verb, job id) of the first recorded Slurm job of `verbs` that runs with both nodes'
    engine processes up (a rank may print nothing for a long while, so processes are counted)."""
    from tasks.core.launch.slurm import SlurmCli

    cli = SlurmCli()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, "the flow process ended before its Slurm job ran"
        for verb in verbs:
            record = stage_dir / ".launch" / f"{verb}.slurm.json"
            if not record.exists():
                continue
            job_id = json.loads(record.read_text())["job_id"]
            info = cli.job(job_id)
            engines = [p for p in slurm_cluster.leftovers() if " -m tasks.engine " in p]
            if info is not None and info.state == "RUNNING" and len(engines) >= 2:
                return verb, job_id
        time.sleep(0.3)
    raise AssertionError(f"no running Slurm job for {verbs} after {timeout:.0f}s: {slurm_cluster.queue()}")


def test_cancelling_the_flow_run_through_the_api_ends_the_slurm_job(server, slurm_cluster, tiny_model_dir, tmp_path):
    config, run_root = _config(tmp_path, tiny_model_dir, "slurm-cancel", cpt_steps=200)
    server.cli("work-pool", "create", "gpu", "--type", "process")
    server.cli("deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
    server.start_worker(
        "gpu", tmp_path / "worker.log", CPT_TO_SFT_HOME=str(REPO), PREFECT_WORKER_QUERY_SECONDS="1", **ENGINE_ENV
    )
    out = server.cli("deployment", "run", "cpt-to-sft/default", "-p", f"config={config}")
    run_id = run_id_from(out.stdout)
    _, job_id = _wait_running_job(slurm_cluster, run_root / "cpt", ("shard", "train"))

    t0 = time.monotonic()
    server.api(
        "POST", f"/flow_runs/{run_id}/set_state", {"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True}
    )
    while time.monotonic() - t0 < 60 and (slurm_cluster.queue() or slurm_cluster.leftovers()):
        time.sleep(0.2)
    ended_s = time.monotonic() - t0
    assert slurm_cluster.queue() == [] and slurm_cluster.leftovers() == [], (
        slurm_cluster.queue(),
        slurm_cluster.leftovers(),
    )
    run = server.wait_terminal(run_id, timeout=120)
    # The flow ends its own run Cancelled (it read Cancelling before it took the SIGTERM for a cancel), so
    # the state can be in before its process has sent its last log lines: they follow within seconds.
    deadline = time.monotonic() + 30
    while True:
        logs = [x["message"] for x in server.logs(run_id)]
        if any(f"cancelled Slurm job {job_id}" in m for m in logs) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(f"cancel -> Slurm job {job_id} gone and no process left: {ended_s:.1f}s; flow run {run['state']['type']}")
    assert ended_s <= 10, f"the Slurm job outlived the cancellation by {ended_s:.1f}s"
    assert run["state"]["type"] == "CANCELLED", run["state"]
    assert any(f"cancelled Slurm job {job_id}" in m for m in logs), logs[-20:]


def _flow(server: PrefectServer, config: Path, log: Path, *extra: str) -> subprocess.Popen:
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cpt_to_sft", "--config", str(config), *extra],
            cwd=str(REPO),
            env=server.env(**ENGINE_ENV),
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def test_flow_survives_its_own_death_and_completes_with_cpt_on_two_slurm_nodes(
    server, slurm_cluster, tiny_model_dir, tmp_path
):
    from tasks.core.launch.slurm import SlurmCli
    from tasks.core.run.manifest import verify_artifact

    steps = 20
    config, run_root = _config(tmp_path, tiny_model_dir, "slurm-flow", cpt_steps=steps)
    log = tmp_path / "flow.log"
    cli = SlurmCli()
    first = _flow(server, config, log)
    try:
        _, job_id = _wait_running_job(slurm_cluster, run_root / "cpt", ("train",), proc=first)
        seen = run_root / "cpt" / ".launch" / "train.slurm.seen.json"
        deadline = time.monotonic() + 60
        while not seen.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        # The job is held (SUSPENDED: SIGSTOP to its steps, still an active job) until the re-run
        # has re-attached, so the re-run always finds it training however long the flow takes to
        # start again on a loaded machine (a job left running once finished first, and there was
        # nothing to re-attach to).
        cli.run("scontrol", "suspend", job_id)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the flow-run process dies; the Slurm job must not
        first.wait(timeout=30)
    assert [j for j, _ in cli.queue()] == [job_id]

    queues: list[list[str]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            queues.append([j for j, _ in cli.queue()])
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        assert (
            subprocess.run(
                [sys.executable, "-m", "flows.cpt_to_sft", "--config", str(config), "--break-lease"],
                cwd=str(REPO),
                env=server.env(),
                capture_output=True,
                timeout=120,
                check=False,
            ).returncode
            == 0
        )
        second = _flow(server, config, log)
        try:
            deadline = time.monotonic() + 600
            while f"re-attaching to Slurm job {job_id}" not in log.read_text(errors="replace"):
                assert second.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-6000:]
                time.sleep(0.5)
            cli.run("scontrol", "resume", job_id)
            rc = second.wait(timeout=900)
        finally:
            stop_group(second)
            cli.run("scontrol", "resume", job_id, check=False)  # a failed test leaves no job stopped
    finally:
        stop.set()
        sampler.join(timeout=30)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-6000:]
    print(
        f"re-run after SIGKILL: re-attached to Slurm job {job_id} and completed the flow in {time.monotonic() - t0:.1f}s"
    )
    assert all(q in ([], [job_id]) for q in queues), queues
    assert f"re-attaching to Slurm job {job_id}" in text
    summary = json.loads((run_root / "run.json").read_text())
    assert summary["complete"], summary
    for step in (0, steps):
        meta = verify_artifact(run_root / "cpt" / f"step-{step:06d}")["meta"]
        assert meta["world_size"] == 2 and meta["nodes"] == ["n1", "n2"], meta
    assert (run_root / "export" / MANIFEST).exists()
    assert slurm_cluster.leftovers() == []
