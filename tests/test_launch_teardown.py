"""`run_engine` (tasks/core/launch/torchrun.py) tears down every process of a failed stage: a failure reported
beside the reader (a publish that spent its retries) and a rank that dies. After `run_engine`
raised, no process of the stage exists, then or 10 s later, and nothing in the stage directory
changes any more.

    .venv/bin/python -m pytest -q -s -m distributed tests/test_launch_teardown.py    # ~2 min
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import psutil
import pytest

from support.engine import engine, phase_raw, write_job
from tasks.core.config.schema import LaunchConfig
from tasks.core.errors import StageFailed
from tasks.core.launch.torchrun import run_engine
from tasks.core.run.job import parse_job

pytestmark = pytest.mark.distributed
DDP = {"name": "torch_ddp", "precision": "fp32"}


def _stage_processes(job: Path) -> list[psutil.Process]:
    """Test-side check only: processes whose command line names this test's job file."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(job) in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _tree(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("teardown")
    section = phase_raw("cpt", DDP, max_steps=400, checkpoint_every=2, keep_last=2)
    stage_dir = work / "cpt"
    engine(
        "shard",
        write_job(
            work / "shard.json",
            verb="shard",
            phase="cpt",
            phase_cfg=section,
            model_dir=tiny_model_dir,
            stage_dir=stage_dir,
        ),
    )
    return work, section, stage_dir, tiny_model_dir


def _assert_nothing_left(job_path: Path, stage_dir: Path, raised_at: float) -> None:
    assert _stage_processes(job_path) == [], "a process of the stage outlived run_engine"
    before = _tree(stage_dir)
    time.sleep(max(0.0, 10.0 - (time.monotonic() - raised_at)))
    assert _stage_processes(job_path) == [], "a process of the stage exists 10 s later"
    assert _tree(stage_dir) == before, "the stage directory changed after the failure was reported"


def test_background_failure_stops_the_stage(sharded, tmp_path):
    _, section, base, model = sharded
    stage_dir = tmp_path / "cpt"
    shutil.copytree(base / "step-000000", stage_dir / "step-000000")
    job = parse_job(
        json.loads(
            write_job(
                tmp_path / "j.json", verb="train", phase="cpt", phase_cfg=section, model_dir=model, stage_dir=stage_dir
            ).read_text()
        )
    )
    job_path = tmp_path / "train-a.json"
    seen: list[int] = []
    boom = RuntimeError("publish of checkpoint s3://bucket/run/cpt/step-000002 failed after 5 attempt(s)")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="step-000002 failed") as err:
        run_engine(
            "train",
            job,
            job_path,
            LaunchConfig(nproc_per_node=2),
            "teardown-a",
            logging.getLogger("test"),
            on_event=lambda kind, rec: seen.append(rec["step"]) if kind == "checkpoint" else None,
            failure=lambda: boom if seen else None,
        )
    raised_at = time.monotonic()
    assert err.value is boom and seen
    print(f"\nbackground failure: stage ended {raised_at - t0:.1f}s after launch, {len(seen)} checkpoint(s) seen")
    _assert_nothing_left(job_path, stage_dir, raised_at)


def test_dead_rank_fails_the_stage_and_leaves_nothing(sharded, tmp_path):
    _, section, base, model = sharded
    stage_dir = tmp_path / "cpt"
    shutil.copytree(base / "step-000000", stage_dir / "step-000000")
    job = parse_job(
        json.loads(
            write_job(
                tmp_path / "j.json", verb="train", phase="cpt", phase_cfg=section, model_dir=model, stage_dir=stage_dir
            ).read_text()
        )
    )
    job_path = tmp_path / "train-b.json"
    with pytest.raises(StageFailed):
        run_engine(
            "train",
            job,
            job_path,
            LaunchConfig(nproc_per_node=2),
            "teardown-b",
            logging.getLogger("test"),
            env={"CPT_TO_SFT_FAULT": "kill@step=3"},
        )
    _assert_nothing_left(job_path, stage_dir, time.monotonic())
