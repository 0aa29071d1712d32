"""Preempted is not failed: the stages that do not train stop at a safe point on a notice
(tasks/flowkit/notices.py), the preemption records and the flow's retry policy
(tasks/core/run/preemptions.py), and what shows them (the end-of-run table, the stage table's note, the card).

    .venv/bin/python -m pytest -q tests/test_preemption_flow.py

The flow-level run (a 2-rank CPT stage preempted, retried by the flow, bitwise at the end) is
tests/test_elastic_flow.py's, on a copy of the session's demo run.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.core.config.elastic import ElasticConfig
from tasks.core.errors import Preempted
from tasks.core.run import preemptions
from tasks.flowkit.notices import critical, signal_sources, stop_on_notice


def _cfg(*notices: dict) -> SimpleNamespace:
    el = ElasticConfig(notices=list(notices))
    return SimpleNamespace(phase=lambda phase: SimpleNamespace(elastic=el if phase == "cpt" else ElasticConfig()))


def test_signal_sources_are_the_signal_rows_any_phase_lists():
    cfg = _cfg({"source": "sigterm", "grace_s": 20}, {"source": "slurm"}, {"source": "gcp"})
    assert signal_sources(cfg) == {"SIGTERM": ("sigterm", 20.0), "SIGUSR1": ("slurm", 60.0)}
    assert signal_sources(_cfg()) == {}


def test_a_notice_stops_the_stage_with_preempted_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as caught, stop_on_notice("prepare_cpt", _cfg({"source": "sigterm", "grace_s": 20})):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000_000):  # the handler raises at the next bytecode
            pass
    rec = caught.value.record
    assert (rec["stage"], rec["source"], rec["grace_s"], rec["steps_lost"]) == ("prepare_cpt", "sigterm", 20.0, 0)
    assert 0 <= rec["notice_to_commit_s"] < 20
    assert signal.getsignal(signal.SIGTERM) is before
    with stop_on_notice("export", _cfg()) as listening:  # no notice listed: nothing installed
        assert listening is False and signal.getsignal(signal.SIGTERM) is before


def test_a_notice_inside_a_critical_stretch_is_raised_when_it_ends():
    done = []
    with pytest.raises(Preempted), stop_on_notice("export", _cfg({"source": "slurm", "grace_s": 5})):
        with critical():
            os.kill(os.getpid(), signal.SIGUSR1)
            done.append("swapped")
        done.append("after")  # never reached: raised as the stretch ends
    assert done == ["swapped"]


def test_a_notice_during_the_artifact_swap_leaves_the_new_artifact_whole(tmp_path, monkeypatch):
    """fresh_dir: a notice while the artifact is built removes the build and keeps the old artifact;
    one during the swap lets the swap finish, then stops the stage: never a torn artifact."""
    from tasks.flowkit import stage as stage_mod

    monkeypatch.setattr(stage_mod, "set_aside", lambda path: None)  # no Prefect logger outside a run
    art = tmp_path / "export"
    art.mkdir()
    (art / "old.txt").write_text("old")
    cfg = _cfg({"source": "sigterm", "grace_s": 20})
    with pytest.raises(Preempted), stop_on_notice("export", cfg), stage_mod.fresh_dir(art) as tmp:
        (tmp / "half.txt").write_text("half")
        os.kill(os.getpid(), signal.SIGTERM)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"] and (art / "old.txt").read_text() == "old"

    real_rename = Path.rename

    def rename_then_notice(self, target):  # the notice lands in the middle of the swap
        os.kill(os.getpid(), signal.SIGTERM)
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename_then_notice)
    with pytest.raises(Preempted), stop_on_notice("export", cfg), stage_mod.fresh_dir(art) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert [p.name for p in art.iterdir()] == ["new.txt"]


def test_records_restart_and_policy():
    eng = {"source": "sigterm", "grace_s": 20.0, "noticed_step": 5, "checkpoint_step": 5, "steps_lost": 0}
    rec = preemptions.record(eng | {"notice_to_commit_s": 0.5, "grace_left_s": 19.5, "checkpoint": "x"}, "cpt", 1e9)
    assert rec["at"] == preemptions.utc(1e9 - 0.5) and rec["restart_to_first_step_s"] is None
    late = preemptions.record(eng | {"notice_to_commit_s": None, "grace_left_s": 2.0, "steps_lost": 1}, "cpt", 1e9)
    assert late["at"] == preemptions.utc(1e9 - 18.0)  # nothing saved: the grace spent dates the notice
    log = preemptions.restarted([rec, late], 12.25)
    assert [r["restart_to_first_step_s"] for r in log] == [None, 12.25]
    assert [r["restart_to_first_step_s"] for r in preemptions.restarted(log, 3.0)] == [3.0, 12.25]
    assert preemptions.parse(preemptions.dump(log)) == log and preemptions.parse("{torn") == []
    assert (
        preemptions.short(log)
        == "preempted 2x, steps lost 1, notice to commit <= 0.5 s, restart to first step <= 12.2 s"
    )
    assert "checkpoint step 5, steps lost 0, notice to commit 0.5 s of 20.0 s grace" in preemptions.describe(rec)
    assert "no save fitted the 20.0 s grace" in preemptions.describe(late)
    policy = preemptions.Policy(max_preemptions=2, wait_s=0)
    assert [policy.retry(n) for n in (1, 2, 3)] == [True, True, False]


def test_the_end_of_run_table_and_the_card_show_each_preemption():
    from tasks.core.run.trainlog import summary_table

    rec = preemptions.restarted(
        [
            preemptions.record(
                {"source": "aws", "grace_s": 120.0, "noticed_step": 7, "checkpoint_step": 7}
                | {"steps_lost": 0, "notice_to_commit_s": 1.5, "grace_left_s": 118.5},
                "cpt",
                1e9,
            )
        ],
        30.0,
    )
    stages = [{"stage": "train_cpt", "status": "completed", "seconds": 3.0, "detail": {"preemptions": rec}}]
    table = summary_table(stages, "/runs/x")
    assert preemptions.describe(rec[0]) in table.splitlines()
    from tasks.core.hub.card import preemption_cell

    line = preemption_cell({"cpt": {"preemptions": rec}}, "cpt")
    assert "step 7 checkpointed, 0 lost, 1.5 s notice to commit (grace 120.0 s), 30.0 s restart to first step" in line
    assert preemption_cell({"cpt": {}}, "cpt") == "none"


def test_the_retry_reads_the_config_again_and_refuses_another_run_root(tmp_path):
    """After a preemption's wait the runbook reads the config again (the capacity that came back is said
    there): unchanged, the run's own config comes back and nothing is checked again; a run root that
    changed is refused, naming the field, before anything launches (tests/test_elastic_flow.py runs the
    retry on one rank that a changed config asks for)."""
    import logging

    from flows.cpt_to_sft import reread_config, resolve_config
    from tasks.core.errors import ConfigError
    from tests.conftest import tiny_config_raw, write_config

    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    path = str(write_config(tmp_path / "run.yaml", raw))
    cfg = resolve_config(path, None, rules=False)
    log = logging.getLogger("test-reread")
    assert reread_config(path, None, cfg, log) is cfg
    raw["run_root"] = str(tmp_path / "elsewhere")
    write_config(tmp_path / "run.yaml", raw)
    with pytest.raises(ConfigError) as caught:
        reread_config(path, None, cfg, log)
    ((field, why),) = caught.value.problems
    assert field == "run_root" and why.startswith(f"changed from {tmp_path / 'run'} to {tmp_path / 'elsewhere'}"), why
