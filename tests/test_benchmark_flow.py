"""The benchmark stage in the flow: the session's demo run scores the shipped local tasks for the
base and the export (tests/conftest.py `demo_run`); re-runs over a copy of it launch no training.

    PYTHONPATH=$PWD python -m pytest -q -m "" tests/test_benchmark_flow.py
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import write_config

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def _statuses(summary: dict) -> dict[str, str]:
    return {s["stage"]: s["status"] for s in summary["stages"]}


def test_demo_run_records_base_and_export_scores_in_run_json_the_manifest_and_the_card(demo_run):
    from tasks.core.config.load import load_config
    from tasks.core.hub.card import model_card

    assert demo_run.rc == 0, demo_run.summary
    assert _statuses(demo_run.summary)["benchmark"] == "completed"
    scores = demo_run.summary["evaluation"]["benchmark"]
    tasks = scores["tasks"]
    assert set(tasks) == {"veyra_facts", "general_text"}
    for metric in ("acc", "acc_norm"):
        m = tasks["veyra_facts"][metric]
        assert 0.0 <= m["base"] <= 1.0 and 0.0 <= m["export"] <= 1.0
    assert tasks["general_text"]["bits_per_byte"]["base"] > 0 and not tasks["general_text"]["bits_per_byte"]["higher_is_better"]
    s = scores["settings"]
    assert (s["num_fewshot"], s["dtype"], s["lm_eval"], s["apply_chat_template"], s["fewshot_as_multiturn"]) == (0, "fp32", "0.4.13", False, False)
    art = demo_run.run_root / "eval" / "benchmark"
    recorded = json.loads((art / "metrics.json").read_text())
    assert recorded["tasks"] == tasks and {f["path"] for rec in recorded["files"] for f in rec["files"]} == {
        "veyra_facts/data/test-0-veyra_facts.jsonl", "general_text/data/test-0-general_text.jsonl"}
    assert all((art / "tasks" / f["path"]).is_file() for rec in recorded["files"] for f in rec["files"])
    cfg = load_config(str(demo_run.config))
    manifest = json.loads((demo_run.run_root / "export" / ".cpt-to-sft" / "manifest.json").read_text())
    card = model_card(cfg, manifest, {}, demo_run.summary["evaluation"])
    assert "veyra_facts" in card and "lm-eval 0.4.13, 0-shot" in card and f"{tasks['veyra_facts']['acc']['export']:.6g}"[:5] in card
    print("demo benchmark:", json.dumps({t: {k: (v["base"], v["export"]) for k, v in ms.items()} for t, ms in tasks.items()}),
          "export", scores["export"], "base", scores["base"])


def test_rerun_skips_it_a_new_num_fewshot_reruns_only_it_and_the_gate_holds_a_failing_max_drop(demo_run_copy):
    import flows.cpt_to_sft as flow_mod

    copy = demo_run_copy
    assert flow_mod.main(["--config", str(copy.config)]) == 0
    again = json.loads((copy.run_root / "run.json").read_text())
    assert {st for st, status in _statuses(again).items() if status not in ("skipped", "passed", "not-configured")} == set()

    raw = {**copy.raw, "benchmark": {**copy.raw["benchmark"], "num_fewshot": 1}}
    tasks = copy.summary["evaluation"]["benchmark"]["tasks"]
    # the metric that moved most against the export: a limit just under its drop fails, one over it holds
    task, metric, _ = max(((t, k, v) for t, ms in tasks.items() for k, v in ms.items() if v["drop_pct"] is not None), key=lambda x: x[2]["drop_pct"])
    raw["gate"] = {**raw["gate"], "benchmarks": {task: {"metric": metric, "max_drop": 0.0, "min": None}}}
    rc = flow_mod.main(["--config", str(write_config(copy.run_root.parent / "fewshot.yaml", raw))])
    summary = json.loads((copy.run_root / "run.json").read_text())
    ran = {st for st, status in _statuses(summary).items() if status == "completed"}
    assert ran == {"benchmark"}, _statuses(summary)
    now = summary["evaluation"]["benchmark"]
    assert now["settings"]["num_fewshot"] == 1 and now["n_shot"] == {"veyra_facts": 1, "general_text": 1} and now["base"]["cached"] is False
    check = next(c for c in summary["gate"]["checks"] if c["check"] == f"benchmark:{task}")
    moved = now["tasks"][task][metric]["drop_pct"]
    if moved > 0:  # worse than the base at 1-shot too: held back, naming task and figures
        assert rc == 3 and not check["ok"] and _statuses(summary)["push_to_hub"] == "failed-gate"
        assert f"benchmark '{task}' {metric}: export" in summary["gate"]["reasons"][0] and "allowed at most 0%" in summary["gate"]["reasons"][0]
    raw["gate"]["benchmarks"] = {task: {"metric": metric, "max_drop": max(moved, 0.0) + 1.0}}
    assert flow_mod.main(["--config", str(write_config(copy.run_root.parent / "holds.yaml", raw))]) == 0
    holds = json.loads((copy.run_root / "run.json").read_text())
    assert _statuses(holds)["benchmark"] == "skipped" and holds["gate"]["passed"] and holds["evaluation"]["benchmark"] == now
