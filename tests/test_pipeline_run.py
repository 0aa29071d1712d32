"""Unit tier: one run's lifecycle (tasks/flowkit/run.py `PipelineRun`) on its own, over the real stage table.

    .venv/bin/python -m pytest -q tests/test_pipeline_run.py

No Prefect server: each row's task is a plain function with the parameters the table says it reads
(tasks/flowkit/pipeline.py `arguments` fills them), and the two Prefect views the runner sends (a
stage's event, the stage table artifact) are recorded here instead; the flow tests send them to a
real server. The lease, run.json, the card hook, stop_after, the preemption retry and a failed gate's
hold on the push are the runner's own.
"""

from __future__ import annotations

import inspect
import json
import logging

import pytest

from tests._dummy_stage import DUMMY, add_dummy_stage
from tests.conftest import tiny_config_raw


@pytest.fixture
def run(tmp_path, monkeypatch):
    """(calls, events, make_run): the tasks' calls, the events sent, a PipelineRun over a config on tmp_path."""
    from tasks.core.config.load import parse_config
    from tasks.core.run import stages as table
    from tasks.flowkit import automation, ui
    from tasks.flowkit.run import PipelineRun

    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    raw["cpt"]["elastic"] = {"retry_wait_s": 0, "max_preemptions": 1}
    cfg = parse_config(raw)
    calls: list[tuple[str, str | None, list[str]]] = []
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(automation, "stage_event", lambda stage, status, *a, **kw: events.append((stage, str(status))))
    monkeypatch.setattr(ui, "stage_table", lambda rows: None)

    def make_run(behave=None, **kwargs):
        behave = behave or {}
        tasks = {spec.name: _task(spec, calls, behave.get(spec.name)) for spec in table.STAGES}
        return PipelineRun(cfg, tasks=tasks, logger=logging.getLogger("test_pipeline_run"), **kwargs)

    return calls, events, make_run


def _task(spec, calls, behave):
    """A task taking the config, its phase, one parameter per stage it reads and `results` (push_to_hub's)."""
    from tasks.core.run.stages import Status
    from tasks.flowkit.stage import StageResult

    def task(cfg, phase, *read, results=None):
        calls.append((spec.name, phase, [r.stage for r in read]))
        out = behave(len([c for c in calls if c[0] == spec.name])) if behave else None
        return out or StageResult(spec.name, Status.COMPLETED, spec.artifact)

    P = inspect.Parameter
    params = [P("cfg", P.POSITIONAL_OR_KEYWORD), P("phase", P.POSITIONAL_OR_KEYWORD)]
    params += [P(f"read{i}", P.POSITIONAL_OR_KEYWORD) for i in range(len(spec.reads))]
    params += [P("results", P.POSITIONAL_OR_KEYWORD, default=None)]
    signed = lambda cfg, phase, *rest: task(cfg, phase, *rest[: len(spec.reads)], results=rest[len(spec.reads)])
    signed.__signature__ = inspect.Signature(params)
    return signed


def _run_json(tmp_path) -> dict:
    return json.loads((tmp_path / "run" / "run.json").read_text())


def test_the_runner_runs_the_table_in_order_each_task_with_what_its_row_reads(run, tmp_path):
    from tasks.core.run.stages import run_stages

    STAGES = run_stages(("cpt", "sft"))  # a run without dpo: the optional phase's rows are not in it
    calls, events, make_run = run
    carded: list[list[str]] = []
    summary = make_run(card=lambda cfg, results: (carded.append(list(results)), ("export/README.md", False))[1]).run()
    assert [c[0] for c in calls] == [s.name for s in STAGES]
    assert {c[0]: (c[1], c[2]) for c in calls} == {s.name: (s.phase, list(s.reads)) for s in STAGES}
    assert summary["complete"] is True and _run_json(tmp_path)["complete"] is True
    assert [s["stage"] for s in _run_json(tmp_path)["stages"]] == [s.name for s in STAGES]
    publishes = next(s.name for s in STAGES if s.publishes)
    assert carded == [[s.name for s in STAGES[: [x.name for x in STAGES].index(publishes)]]], carded  # before the push
    assert not (tmp_path / "run" / ".lease.json").exists() and events == []


def test_a_dummy_stage_is_one_row_plus_its_task_and_stop_after_reads_the_table(run, tmp_path, monkeypatch):
    from tasks.flowkit.run import check_stop_after

    calls, _, make_run = run
    add_dummy_stage(monkeypatch)  # its row, after load_from_hf, reading it
    check_stop_after(DUMMY)  # a stage now: --stop-after takes it
    summary = make_run(stop_after=DUMMY).run()
    assert [c[0] for c in calls] == ["load_from_hf", DUMMY] and calls[1][2] == ["load_from_hf"]
    statuses = {s["stage"]: s["status"] for s in summary["stages"]}
    assert list(statuses)[:2] == ["load_from_hf", DUMMY] and statuses.pop(DUMMY) == "completed"
    assert statuses.pop("load_from_hf") == "completed" and set(statuses.values()) == {"not-run"}
    assert summary["stopped_after"] == DUMMY and summary["complete"] is False


def test_a_failed_stage_ends_the_run_failed_naming_it_and_the_rest_not_run(run, tmp_path):
    calls, events, make_run = run

    def boom(n):
        raise RuntimeError("boom: the rank died")

    state = make_run(behave={"train_cpt": boom}).run()
    assert state.is_failed() and state.message == "stage train_cpt failed: RuntimeError: boom: the rank died"
    rows = {s["stage"]: s for s in _run_json(tmp_path)["stages"]}
    assert rows["train_cpt"]["status"] == "failed" and rows["train_cpt"]["uri"].endswith("/run/cpt")
    assert rows["unshard"]["status"] == "not-run" and calls[-1][0] == "train_cpt"
    assert events == [("train_cpt", "failed")] and not (tmp_path / "run" / ".lease.json").exists()


def test_a_failed_gate_holds_the_push_back_and_a_preempted_stage_is_retried_by_its_phase_policy(run, tmp_path):
    from tasks.core.errors import Preempted
    from tasks.core.run.stages import Status
    from tasks.flowkit.stage import StageResult

    calls, events, make_run = run
    rereads = []

    def preempt_once(n):
        if n == 1:
            raise Preempted("notice", cause="gcp: preempted", record={"phase": "cpt", "source": "gcp"})

    def failing_gate(n):
        return StageResult("gate", Status.FAILED_GATE, detail={"passed": False, "reasons": ["cpt perplexity rose"]})

    state = make_run(
        behave={"train_cpt": preempt_once, "gate": failing_gate}, reread=lambda c: rereads.append(c) or c
    ).run()
    assert state.is_completed() and state.name == "FailedGate", state  # not a crash: the artifacts are kept
    assert state.message == "gate failed, nothing pushed, every artifact kept: cpt perplexity rose"
    summary = state.result()
    names = [c[0] for c in calls]
    assert names.count("train_cpt") == 2 and names.count("load_from_hf") == 2 and len(rereads) == 1
    assert "push_to_hub" not in names  # held back by the gate's verdict, never called
    rows = {s["stage"]: s for s in summary["stages"]}
    assert rows["push_to_hub"]["status"] == "failed-gate"
    assert rows["push_to_hub"]["detail"] == {"reason": "the gate failed", "reasons": ["cpt perplexity rose"]}
    assert len(summary["preemptions"]) == 1 and rows["train_cpt"]["status"] == "completed"
    assert events == [("train_cpt", "preempted"), ("push_to_hub", "failed-gate")]
    assert summary["gate"]["passed"] is False and summary["complete"] is False


def test_with_a_dpo_section_the_phases_rows_run_and_the_export_the_benchmark_and_the_gate_take_dpo(
    tmp_path, monkeypatch
):
    from support import REPO
    from tasks.core.config.load import parse_config
    from tasks.core.run import stages as table
    from tasks.flowkit import automation, ui
    from tasks.flowkit.run import PipelineRun

    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    raw["dpo"] = {
        "data": {"uri": str(REPO / "data" / "sample" / "dpo.jsonl")},
        "plugin": {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
        "max_steps": 2,
        "seq_len": 128,
        "lr": 1.0e-5,
    }
    cfg = parse_config(raw)
    monkeypatch.setattr(automation, "stage_event", lambda *a, **kw: None)
    monkeypatch.setattr(ui, "stage_table", lambda rows: None)
    calls: list = []
    tasks = {
        spec.name: _task(spec, calls, None) for spec in table.run_stages(cfg.phases)
    }  # the rows as the run has them
    summary = PipelineRun(cfg, tasks=tasks, logger=logging.getLogger("test_pipeline_run")).run()
    ran = {name: (phase, reads) for name, phase, reads in calls}
    assert [c[0] for c in calls] == [s.name for s in table.run_stages(("cpt", "sft", "dpo"))]
    assert ran["reference"] == ("dpo", ["unshard_sft", "prepare_dpo"])
    assert ran["train_dpo"] == ("dpo", ["reboost_dpo", "reference"]) and ran["export"] == (None, ["train_dpo"])
    assert ran["evaluate_sft"] == ("sft", ["unshard", "unshard_sft", "export"])  # SFT's model; the export's generations
    assert ran["evaluate_dpo"] == ("dpo", ["unshard_sft", "export"]) and ran["benchmark"][1] == [
        "load_from_hf",
        "export",
    ]
    assert ran["gate"][1] == ["evaluate_cpt", "evaluate_sft", "benchmark", "evaluate_dpo"]
    assert [s["stage"] for s in summary["stages"]] == [c[0] for c in calls] and summary["complete"] is True
