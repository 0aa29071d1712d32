"""CPT → SFT → DPO in one flow run on the tiny model: the gate fails on a DPO limit and nothing is pushed.

    .venv/bin/python -m pytest -q -m "" tests/test_dpo_flow.py -p no:cacheprovider

No CPT or SFT is trained here: the flow runs over a copy of the session's demo run (tests/conftest.py
`demo_run`) with a `dpo:` section added, and every stage of the demo is skipped, its artifact verified
and its digest unchanged by the new section. The phase's rows then run: prepare_dpo, unshard_sft,
reference, reboost_dpo and train_dpo (two 2-rank launches), the export of dpo/'s checkpoint,
evaluate_sft (SFT's loss on sft/hf, the generation check on the export) and evaluate_dpo. The gate
fails on `gate.dpo_min_margin`; the push is held back (the test Hub never sees the repo); run.json
holds the DPO figures beside the SFT model's, and so does the model card.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import REPO
from tests.conftest import write_config

pytest_plugins = ["tests.conftest_servers"]
pytestmark = [pytest.mark.e2e, pytest.mark.integration]

DEMO_STAGES = (
    "load_from_hf",
    "prepare_cpt",
    "prepare_sft",
    "boost_and_shard",
    "train_cpt",
    "unshard",
    "evaluate_cpt",
    "reboost",
    "train_sft",
)
DPO_STAGES = (
    "prepare_dpo",
    "unshard_sft",
    "reference",
    "reboost_dpo",
    "train_dpo",
    "export",
    "evaluate_sft",
    "evaluate_dpo",
)
DPO = {
    "data": {"uri": str(REPO / "data" / "sample" / "dpo.jsonl")},
    "plugin": {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
    "launch": {"nproc_per_node": 2},
    "max_steps": 4,
    "micro_batch_size": 2,
    "seq_len": 128,
    "lr": 1.0e-3,
    "checkpoint_every": 4,
    "eval": {"heldout_fraction": 0.1},
}


def test_cpt_sft_dpo_the_gate_fails_on_a_dpo_limit_and_nothing_is_pushed(
    demo_run, prefect_harness, hub_env, tmp_path, monkeypatch
):
    from huggingface_hub import HfApi

    from flows.cli import flow_main as main
    from tasks.core.run.manifest import read_manifest

    monkeypatch.setenv("HF_TOKEN", hub_env.token)
    copy = demo_run.copy_to(tmp_path / "dpo")
    root, raw = copy.run_root, {**copy.raw, "dpo": DPO}
    raw["benchmark"] = {"tasks": []}  # the benchmark's own flow test scores the export; here it is not configured
    raw["gate"] = {**(raw.get("gate") or {}), "dpo_min_margin": 100.0, "dpo_max_chosen_logp_drop": 50.0}
    raw["hub"] = {"repo_id": "org/dpo-tiny", "private": True}
    rc = main(["--config", str(write_config(tmp_path / "dpo.yaml", raw))])
    summary = json.loads((root / "run.json").read_text())
    st = {s["stage"]: s["status"] for s in summary["stages"]}
    assert rc == 3, st  # FailedGate: not a crash, every artifact kept
    assert list(st) == [
        *DEMO_STAGES[:3],
        "prepare_dpo",
        *DEMO_STAGES[3:],
        *DPO_STAGES[1:5],
        "export",
        "evaluate_sft",
        "evaluate_dpo",
        "benchmark",
        "gate",
        "push_to_hub",
    ], list(st)
    assert all(st[s] == "skipped" for s in DEMO_STAGES), st  # the dpo section changes none of their digests
    assert all(st[s] == "completed" for s in DPO_STAGES), st
    assert st["gate"] == "failed-gate" and st["push_to_hub"] == "failed-gate", st
    assert any("gate.dpo_min_margin" in r for r in summary["gate"]["reasons"]), summary["gate"]
    assert not HfApi(token=hub_env.token).repo_exists("org/dpo-tiny")  # held back: nothing pushed

    # The export is the DPO model: converted from dpo/'s final checkpoint.
    assert read_manifest(root / "export")["meta"]["from_checkpoint"].endswith("/dpo/step-000004")
    # run.json: the DPO figures beside the SFT model's (scored against itself: margin 0)
    ev = summary["evaluation"]
    d, s = ev["dpo"]["dpo"], ev["dpo"]["sft"]
    assert ev["dpo"]["pairs"] > 0 and s["margin"] == 0.0 and d["margin"] != 0.0
    assert set(d) == set(s) >= {"accuracy", "margin", "chosen_logp", "chosen_logp_per_token", "prefers_chosen"}
    assert ev["sft"]["sft"]["loss"] < ev["sft"]["pre_sft"]["loss"]  # evaluate_sft on sft/hf, as before
    # ... and in the model card, with the gate's word
    card = (root / "export" / "README.md").read_text()
    assert "then DPO on preference pairs" in card
    assert "| DPO held-out reward margin | SFT 0.0000 | DPO " in card and "| FAIL |" in card
    assert "gate.dpo_min_margin" in card
    train = next(r for r in summary["stages"] if r["stage"] == "train_dpo")
    assert train["detail"]["steps"] == 4 and Path(train["uri"]).parent.name == "dpo"
