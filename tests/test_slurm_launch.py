"""`tasks.core.launch.torchrun.run_engine` on the Slurm backend, on the real two-node test cluster (integration):

- a CPT stage with HybridParallel tp=2, one rank on each Slurm node: `shard`, then `train` with
  rank 1 SIGKILLed after step 2 (CPT_TO_SFT_FAULT) -> StageFailed naming the job state, the node
  and the rank; the retry resumes from step 2 and finishes; the manifests record world size 2 and
  both node names;
- re-attach without a record: the process that submitted the job is SIGKILLed while the job runs
  and its record is deleted (the sbatch-returned-but-not-recorded window); the next call finds
  the job by name and comment, follows it without replaying what was logged, and never submits
  a second job;
- the flow's pre-flight runs the Slurm checks.

    python -m pytest -m "" tests/test_slurm_launch.py
"""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_config_raw

pytest_plugins = ["tests.conftest_slurm"]
pytestmark = pytest.mark.integration

STEPS, EVERY = 4, 2


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _logger(name: str) -> tuple[logging.Logger, _Lines]:
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    handler = _Lines()
    logger.addHandler(handler)
    return logger, handler


def _stage(tiny_model_dir: Path, tmp_path: Path):
    from tasks.core.config.load import parse_config

    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["cpt"].update(
        max_steps=STEPS,
        checkpoint_every=EVERY,
        launch={
            "backend": "slurm",
            "nnodes": 2,
            "nproc_per_node": 1,
            "slurm": {"partition": "debug", "time_limit": "10"},
        },
    )
    assert raw["cpt"]["plugin"]["tp_size"] == 2  # tensor parallel across the two Slurm nodes
    return parse_config(raw)


def _job(cfg, tmp_path: Path, model_dir: Path, verb: str):
    """The job the stage tasks write (tasks/stages/train.py:_job)."""
    from support.engine import prepared_data
    from tasks.core.run.job import Job, Parent

    data_dir = prepared_data(cfg.cpt.model_dump(mode="json"), "cpt", model_dir, tmp_path / "data-cpt")
    return Job(
        verb=verb,
        phase="cpt",
        phase_cfg=cfg.cpt,
        trust_remote_code=cfg.base_model.trust_remote_code,
        model_dir=model_dir,
        tokenizer_dir=model_dir,
        data_dir=data_dir,
        stage_dir=tmp_path / "run" / "cpt",
        parent=Parent(uri=str(model_dir), digest="base-digest"),
        config_digest="c" * 64,
    )


def test_cpt_stage_across_two_slurm_nodes_fails_on_a_killed_rank_and_resumes(slurm_cluster, tiny_model_dir, tmp_path):
    from tasks.core.errors import StageFailed
    from tasks.core.launch.torchrun import run_engine
    from tasks.core.run.manifest import verify_artifact

    cfg = _stage(tiny_model_dir, tmp_path)
    logger, handler = _logger("slurm-stage")
    events: list[tuple[str, dict]] = []
    env = {"GLOO_SOCKET_IFNAME": "lo"}
    t0 = time.monotonic()
    run_engine(
        "shard",
        _job(cfg, tmp_path, tiny_model_dir, "shard"),
        tmp_path / "jobs" / "cpt-shard.json",
        cfg.cpt.launch,
        "t-cpt-shard",
        logger,
        env=env,
    )
    train = _job(cfg, tmp_path, tiny_model_dir, "train")
    with pytest.raises(StageFailed) as failed:
        run_engine(
            "train",
            train,
            tmp_path / "jobs" / "cpt-train.json",
            cfg.cpt.launch,
            "t-cpt-train",
            logger,
            on_event=lambda k, r: events.append((k, r)),
            env={**env, "CPT_TO_SFT_FAULT": f"kill@step={EVERY}@rank=1"},
        )
    msg = str(failed.value)
    m = re.search(r"Slurm job (\d+) \(engine verb 'train'\) ended FAILED .*? on node (n[12]), rank 1: ", msg)
    assert m, msg[:3000]
    # The node named is the one that ran rank 1: its own output file shows rank 1's lines.
    rank1_log = tmp_path / "run" / "cpt" / ".launch" / "logs" / f"job-{m.group(1)}.{m.group(2)}.log"
    assert re.search(
        r"\[rank 1[]|]", rank1_log.read_text(errors="replace")
    )  # "[rank 1]" or with its level, "[rank 1|error]"
    assert [r["step"] for k, r in events if k == "checkpoint"] == [EVERY]

    progress = run_engine(
        "train",
        train,
        tmp_path / "jobs" / "cpt-train.json",
        cfg.cpt.launch,
        "t-cpt-train",
        logger,
        on_event=lambda k, r: events.append((k, r)),
        env={**env, "CPT_TO_SFT_FAULT": f"kill@step={EVERY}@rank=1"},
    )
    elapsed = time.monotonic() - t0
    assert [p["step"] for p in progress] == list(range(EVERY + 1, STEPS + 1))  # resumed from the step-2 checkpoint
    stage_dir = tmp_path / "run" / "cpt"
    for step in (0, EVERY, STEPS):
        manifest = verify_artifact(stage_dir / f"step-{step:06d}")
        meta = manifest["meta"]
        assert meta["world_size"] == 2 and manifest["config_digest"] == "c" * 64
        assert meta["nodes"] == ["n1", "n2"] and sorted(meta["rank_nodes"]) == ["n1", "n2"], meta
    # The engine logs from rank 0; its lines carry the node it ran on (c10d decides which).
    ranked = {
        tuple(ln[1 : ln.index("]")].split()[::2])
        for ln in handler.lines
        if ln.startswith("[n") and " rank " in ln.split("]")[0]
    }
    assert ranked and all(node in ("n1", "n2") for node, _ in ranked), ranked
    record = json.loads((stage_dir / ".launch" / "train.slurm.json").read_text())
    assert record["job_id"].isdigit() and record["name"] == "t-cpt-train"
    assert sorted(p.name for p in (stage_dir / ".launch" / "logs").glob(f"job-{record['job_id']}.n*.log")) == [
        f"job-{record['job_id']}.n1.log",
        f"job-{record['job_id']}.n2.log",
    ]
    assert slurm_cluster.leftovers() == []
    print(f"two-node CPT shard + failed train + resumed train on Slurm: {elapsed:.1f}s")


def test_reattach_after_the_submitting_process_dies(slurm_cluster, tiny_model_dir, tmp_path):
    from tasks.core.launch.slurm import SlurmCli
    from tasks.core.launch.torchrun import run_engine

    cfg = _stage(tiny_model_dir, tmp_path)
    job = _job(cfg, tmp_path, tiny_model_dir, "shard")
    job_path = tmp_path / "jobs" / "cpt-shard.json"
    (tmp_path / "cfg.json").write_text(
        json.dumps({"job": job.model_dump(mode="json"), "launch": cfg.cpt.launch.model_dump(mode="json")})
    )
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import json, logging, sys
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from tasks.core.config.schema import LaunchConfig
from tasks.core.run.job import parse_job
from tasks.core.launch.torchrun import run_engine
d = json.loads(Path({str(tmp_path / "cfg.json")!r}).read_text())
logging.basicConfig(level=logging.INFO)
run_engine("shard", parse_job(d["job"]), Path({str(job_path)!r}), LaunchConfig(**d["launch"]), "t-reattach", logging.getLogger("child"), env={{"GLOO_SOCKET_IFNAME": "lo"}})
""",
        ],
        cwd=str(REPO),
        start_new_session=True,
    )
    record = tmp_path / "run" / "cpt" / ".launch" / "shard.slurm.json"
    seen = record.with_name("shard.slurm.seen.json")
    cli = SlurmCli()
    deadline = time.monotonic() + 180
    while True:  # the job runs and the child has logged (and saved how far it read) its first lines
        assert time.monotonic() < deadline and child.poll() is None, "the child never recorded a running job"
        if record.exists() and seen.exists():
            job_id = json.loads(record.read_text())["job_id"]
            info = cli.job(job_id)
            read = json.loads(seen.read_text()).get(job_id, {})
            if info is not None and info.state == "RUNNING" and read.get(f"job-{job_id}.batch.log", 0) > 0:
                break
        time.sleep(0.2)
    child.send_signal(signal.SIGKILL)  # the flow-run process dies; the Slurm job does not
    child.wait(timeout=30)
    assert [j for j, _ in cli.queue()] == [job_id]
    record.unlink()  # as if the child had died right after sbatch returned, before recording

    logger, handler = _logger("slurm-reattach")
    seen_queues: list[list[str]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen_queues.append([j for j, _ in cli.queue()])
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run_engine("shard", job, job_path, cfg.cpt.launch, "t-reattach", logger)
    finally:
        stop.set()
        sampler.join(timeout=30)
    assert seen_queues and all(q in ([], [job_id]) for q in seen_queues), seen_queues
    attach = [ln for ln in handler.lines if f"re-attaching to Slurm job {job_id}" in ln]
    assert (
        attach
        and "found by name t-reattach" in attach[0]
        and "already logged by the earlier attempt is skipped" in attach[0]
    ), handler.lines[:20]
    assert not any("submitted Slurm job" in ln for ln in handler.lines)
    assert not any("@@slurm" in ln for ln in handler.lines)  # the batch script's first line was logged by the child
    assert json.loads(record.read_text())["job_id"] == job_id
    from tasks.core.run.manifest import verify_artifact

    assert verify_artifact(tmp_path / "run" / "cpt" / "step-000000")["meta"]["world_size"] == 2


def test_flow_preflight_runs_the_slurm_checks(slurm_cluster, tiny_model_dir, tmp_path):
    from tasks.core.config.load import parse_config
    from tasks.core.preflight.checks import preflight_report

    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["cpt"]["launch"] = {"backend": "slurm", "nnodes": 2, "nproc_per_node": 1, "slurm": {"partition": "debug"}}
    raw["sft"]["launch"] = {"backend": "slurm", "nnodes": 3, "nproc_per_node": 1, "slurm": {"partition": "h100"}}
    report = preflight_report(parse_config(raw), token_present=None)
    fields = [f for f, _ in report.problems]
    assert "sft.launch.slurm.partition" in fields and not any(f.startswith("cpt.") for f in fields), report.problems
    assert any("cpt slurm: the cluster answers" in line for line in report.checked), report.checked
    assert any("must be a shared filesystem" in w for w in report.warnings)


def test_scancel_signal_usr1_checkpoints_the_step_and_the_requeued_stage_resumes(
    slurm_cluster, tiny_model_dir, tmp_path
):
    """`scancel --signal=USR1` to the running train job (what `#SBATCH --signal=USR1@90` sends before
    the time limit) with `cpt.elastic.notices: [{source: slurm}]`: the torchrun agent on each node
    passes SIGUSR1 on to its rank, every rank finishes the same step, commits it and exits 75, and
    the launcher raises Preempted with that record; the stage submitted again (the flow's retry)
    resumes from that checkpoint and finishes, nothing of either job left behind."""
    from tasks.core.config.load import parse_config
    from tasks.core.errors import Preempted
    from tasks.core.launch.slurm_runner import record_path
    from tasks.core.launch.torchrun import run_engine
    from tasks.core.run.manifest import verify_artifact

    raw = _stage(tiny_model_dir, tmp_path).model_dump(mode="json")
    raw["cpt"]["elastic"] = {"notices": [{"source": "slurm", "grace_s": 30}]}
    cfg = parse_config(raw)
    logger, _ = _logger("slurm-preempt")
    env = {"GLOO_SOCKET_IFNAME": "lo"}
    run_engine(
        "shard",
        _job(cfg, tmp_path, tiny_model_dir, "shard"),
        tmp_path / "jobs" / "cpt-shard.json",
        cfg.cpt.launch,
        "t-cpt-shard",
        logger,
        env=env,
    )
    train = _job(cfg, tmp_path, tiny_model_dir, "train")
    sent: list[str] = []

    def notice_after_the_first_step(rec: dict) -> None:
        if not sent:  # the job's id was recorded right after sbatch returned
            job_id = json.loads(record_path(train, "train").read_text())["job_id"]
            slurm_cluster.client("scancel", "--signal=USR1", job_id)
            sent.append(job_id)

    # The ranks wait after step 1 until the notice reaches them: a tiny step takes less than the
    # launcher's log poll, so without the hold training would end before scancel is sent.
    with pytest.raises(Preempted) as preempted:
        run_engine(
            "train",
            train,
            tmp_path / "jobs" / "cpt-train.json",
            cfg.cpt.launch,
            "t-cpt-train",
            logger,
            on_progress=notice_after_the_first_step,
            env={**env, "CPT_TO_SFT_FAULT": "hold@step=1"},
        )
    rec = preempted.value.record
    assert rec["source"] == "slurm" and rec["grace_s"] == 30, rec
    step = rec["checkpoint_step"]
    assert step == rec["noticed_step"] and rec["steps_lost"] == 0 and 1 <= step < STEPS, rec
    stage_dir = tmp_path / "run" / "cpt"
    verify_artifact(stage_dir / f"step-{step:06d}")  # committed, manifest last
    assert not list(stage_dir.glob(".step-*.tmp")), "a torn temporary checkpoint was left"

    progress = run_engine(
        "train",
        train,
        tmp_path / "jobs" / "cpt-train.json",
        cfg.cpt.launch,
        "t-cpt-train",
        logger,
        env=env,
    )
    assert [p["step"] for p in progress] == list(range(step + 1, STEPS + 1))  # resumed from the notice's checkpoint
    assert json.loads(record_path(train, "train").read_text())["job_id"] != sent[0]  # a new job: requeued
    verify_artifact(stage_dir / f"step-{STEPS:06d}")
    assert slurm_cluster.leftovers() == []
