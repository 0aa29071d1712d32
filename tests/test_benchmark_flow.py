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
    assert (
        tasks["general_text"]["bits_per_byte"]["base"] > 0
        and not tasks["general_text"]["bits_per_byte"]["higher_is_better"]
    )
    s = scores["settings"]
    assert (s["num_fewshot"], s["dtype"], s["lm_eval"], s["apply_chat_template"], s["fewshot_as_multiturn"]) == (
        0,
        "fp32",
        "0.4.13",
        False,
        False,
    )
    art = demo_run.run_root / "eval" / "benchmark"
    recorded = json.loads((art / "metrics.json").read_text())
    assert recorded["tasks"] == tasks and {f["path"] for rec in recorded["files"] for f in rec["files"]} == {
        "veyra_facts/data/test-0-veyra_facts.jsonl",
        "general_text/data/test-0-general_text.jsonl",
    }
    assert all((art / "tasks" / f["path"]).is_file() for rec in recorded["files"] for f in rec["files"])
    cfg = load_config(str(demo_run.config))
    manifest = json.loads((demo_run.run_root / "export" / ".cpt-to-sft" / "manifest.json").read_text())
    card = model_card(cfg, manifest, {}, demo_run.summary["evaluation"])
    assert (
        "veyra_facts" in card
        and "lm-eval 0.4.13, 0-shot" in card
        and f"{tasks['veyra_facts']['acc']['export']:.6g}"[:5] in card
    )
    print(
        "demo benchmark:",
        json.dumps({t: {k: (v["base"], v["export"]) for k, v in ms.items()} for t, ms in tasks.items()}),
        "export",
        scores["export"],
        "base",
        scores["base"],
    )


def _noise_task(dest) -> str:
    """A perplexity task on symbols the sample corpora never contain: training moves probability
    to the tokens it sees, so the export's bits per byte are worse than the random base's (measured
    on the 30-step demo: 9.01 -> 9.82)."""
    import random

    rng = random.Random(7)
    (dest / "noise_text.jsonl").write_text(
        "".join(
            json.dumps({"text": "".join(rng.choice("@#~^|{}[]<>%&*+=") for _ in range(120))}) + "\n" for _ in range(6)
        )
    )
    (dest / "noise_text.yaml").write_text(
        "task: noise_text\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        "noise_text.jsonl\ntest_split: test\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
        "  - metric: bits_per_byte\n    aggregation: bits_per_byte\n    higher_is_better: false\n"
    )
    return str(dest / "noise_text.yaml")


def test_rerun_skips_it_a_new_num_fewshot_reruns_only_it_and_the_gate_holds_a_failing_max_drop(demo_run_copy):
    import shutil

    from flows.cli import flow_main

    copy = demo_run_copy
    root = copy.run_root

    def run(name: str, raw: dict) -> tuple[int, dict]:
        rc = flow_main(["--config", str(write_config(root.parent / f"{name}.yaml", raw))])
        return rc, json.loads((root / "run.json").read_text())

    rc, again = run("same", copy.raw)
    assert rc == 0 and _statuses(again)["benchmark"] == "skipped"
    assert {
        st for st, status in _statuses(again).items() if status not in ("skipped", "passed", "not-configured")
    } == set()

    # the scores were made once per base: without the artifact, the stage runs again and reuses the base's
    shutil.rmtree(root / "eval" / "benchmark")
    rc, rebuilt = run("same", copy.raw)
    assert (
        rc == 0
        and _statuses(rebuilt)["benchmark"] == "completed"
        and rebuilt["evaluation"]["benchmark"]["base"]["cached"] is True
    )
    assert rebuilt["evaluation"]["benchmark"]["tasks"] == copy.summary["evaluation"]["benchmark"]["tasks"]

    raw = {**copy.raw, "benchmark": {**copy.raw["benchmark"], "num_fewshot": 1}}
    rc, fewshot = run("fewshot", raw)
    assert rc == 0 and {st for st, status in _statuses(fewshot).items() if status == "completed"} == {"benchmark"}, (
        _statuses(fewshot)
    )
    now = fewshot["evaluation"]["benchmark"]
    assert (
        now["settings"]["num_fewshot"] == 1
        and now["n_shot"] == {"veyra_facts": 1, "general_text": 1}
        and now["base"]["cached"] is False
    )

    raw["benchmark"]["tasks"] = [*raw["benchmark"]["tasks"], _noise_task(root.parent)]
    raw["gate"] = {**raw["gate"], "benchmarks": {"noise_text": {"metric": "bits_per_byte", "max_drop": 0.0}}}
    rc, held = run("failing", raw)
    m = held["evaluation"]["benchmark"]["tasks"]["noise_text"]["bits_per_byte"]
    assert m["export"] > m["base"] and rc == 3, (m, _statuses(held))
    assert _statuses(held)["push_to_hub"] == "failed-gate" and held["gate"]["passed"] is False
    assert held["gate"]["reasons"] == [
        (
            f"benchmark 'noise_text' bits_per_byte: export {m['export']:.4g} vs base {m['base']:.4g}; "
            f"{m['drop_pct']:.2f}% worse (allowed at most 0% by gate.benchmarks.noise_text.max_drop)"
        )
    ]

    raw["gate"]["benchmarks"] = {"noise_text": {"metric": "bits_per_byte", "max_drop": m["drop_pct"] + 1.0}}
    rc, holds = run("holds", raw)
    assert rc == 0 and _statuses(holds)["benchmark"] == "skipped" and holds["gate"]["passed"]
    assert next(c for c in holds["gate"]["checks"] if c["check"] == "benchmark:noise_text")["ok"]
