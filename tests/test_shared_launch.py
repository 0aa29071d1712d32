"""Unit tier: when a shard stage and its training share one launch (tasks/core/launch/shared.py), and the
hand-off file between the flow and the waiting ranks (tasks/core/run/handoff.py). No torchrun: the
shared launch itself runs in the demo flow (tests/test_flow_e2e.py, the session's demo run).

    .venv/bin/python -m pytest -q tests/test_shared_launch.py
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.core.config.load import parse_config
from tasks.core.launch import shared
from tasks.core.run import handoff
from tests.conftest import tiny_config_raw


def test_the_hand_off_file_is_a_go_or_a_stop_written_whole_and_cleared_before_a_launch(tmp_path):
    job = tmp_path / "cpt-shard.json"
    assert handoff.read(job) is None
    handoff.write_go(job, tmp_path / "cpt-train.json", fault="kill@step=5@phase=cpt")
    assert handoff.read(job) == {"job": str(tmp_path / "cpt-train.json"), "fault": "kill@step=5@phase=cpt"}
    assert [p.name for p in tmp_path.iterdir()] == ["cpt-shard.json.go"]  # no temporary file left beside it
    handoff.write_stop(job, "stopped after boost_and_shard")
    assert handoff.read(job) == {"stop": "stopped after boost_and_shard"}
    handoff.clear(job)
    assert handoff.read(job) is None
    handoff.go_path(job).write_text('{"neither": 1}')
    with pytest.raises(ValueError, match="holds a job or a stop"):
        handoff.read(job)


def test_a_launch_is_shared_only_inside_a_run_on_the_local_backend_one_node_and_a_local_run_root(tmp_path):
    launch = parse_config(tiny_config_raw(tmp_path / "model", tmp_path / "run")).cpt.launch
    assert not shared.can_share(launch, local_store=True)  # a task called outside the runner: a launch each
    with shared.session(logging.getLogger("test")):
        assert shared.can_share(launch, local_store=True)
        assert not shared.can_share(launch, local_store=False)  # the sink publishes step 0 between the stages
        assert not shared.can_share(launch.model_copy(update={"share": False}), local_store=True)
        assert not shared.can_share(launch.model_copy(update={"backend": "slurm"}), local_store=True)
        assert not shared.can_share(launch.model_copy(update={"nnodes": 2}), local_store=True)
    assert not shared.can_share(launch, local_store=True)


class _Local:
    """A started launch's stand-in (no torchrun in the unit tier): a real process, alive or exited;
    told to stop, it is ended and waited for, as the ranks of a real one end on the stop."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def alive(self) -> bool:
        return self.proc.poll() is None

    def follow(self, router, verb, notices, until=None) -> bool:
        self.proc.kill()
        self.proc.wait()
        return True

    def tear_down(self):
        self.follow(None, "", [])


def _live(job, job_path: Path, argv: list[str]) -> shared.SharedLaunch:
    live = shared.HELD[job.phase] = shared.SharedLaunch(job.phase, job, job_path, _Local(subprocess.Popen(argv)))
    return live


def test_the_train_stage_adopts_only_a_live_launch_of_its_layout_and_one_it_cannot_is_stopped(tmp_path):
    from tasks.core.run.job import Job

    cfg = parse_config(tiny_config_raw(tmp_path / "model", tmp_path / "run"))
    job = Job(
        verb="shard",
        phase="cpt",
        phase_cfg=cfg.cpt,
        trust_remote_code=False,
        model_dir=tmp_path / "model",
        tokenizer_dir=tmp_path / "model",
        data_dir=tmp_path / "data",
        stage_dir=tmp_path / "run" / "cpt",
        parent=None,
        config_digest=None,
    )
    train = job.model_copy(update={"verb": "train"})
    other = train.model_copy(update={"phase_cfg": cfg.cpt.model_copy(update={"plugin": cfg.sft.plugin})})
    log = logging.getLogger("test-shared")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with shared.session(log):
        live = _live(job, tmp_path / "a.json", sleeper)
        assert shared.adopt(train, log) is live and "cpt" not in shared.HELD  # adopted once: nobody else holds it
        live.local.tear_down()

        live = _live(job, tmp_path / "b.json", sleeper)
        assert shared.adopt(other, log) is None and "cpt" not in shared.HELD and not live.local.alive()
        said = handoff.read(tmp_path / "b.json")["stop"]  # told to stop: its ranks exit, the stage launches its own
        assert "not adopted: the train stage's launch or plugin differs" in said, said

        live = _live(job, tmp_path / "c.json", [sys.executable, "-c", "pass"])
        live.local.proc.wait()
        assert shared.adopt(train, log) is None and "cpt" not in shared.HELD  # it exited: the stage launches its own

        held = _live(job, tmp_path / "d.json", sleeper)
    # the run ended with a launch nobody adopted (--stop-after boost_and_shard, say): stopped with the run
    assert not shared.HELD and not held.local.alive()
    assert handoff.read(tmp_path / "d.json")["stop"].startswith("the run ended before its train stage adopted")


def test_a_shared_launchs_shard_part_counts_for_the_shard_stage_and_not_again_when_reaped():
    from tasks.core.run import cputime

    shard = cputime.CpuClock()
    cputime.advance(12.5)  # the ranks' time at the hand-off: the shard stage's, though they run on
    first = shard.read()
    train = cputime.CpuClock()
    cputime.settle(12.5)  # torchrun reaped in the train stage: RUSAGE_CHILDREN holds those 12.5 s too now
    second = train.read()
    assert first["cpu_children_seconds"] >= 12.5 and first["cpu_seconds"] >= 12.5
    assert second["cpu_children_seconds"] == 0.0  # nothing was reaped here: the advance only comes off again
