"""CPT → SFT → LoRA DPO in one flow run on the tiny model: the gate fails on a DPO limit and nothing is pushed.

    .venv/bin/python -m pytest -q -m "" tests/test_dpo_flow.py -p no:cacheprovider

No CPT or SFT is trained here: the flow runs over a copy of the session's demo run (tests/conftest.py
`demo_run`) with a `dpo:` section added, and every stage of the demo is skipped, its artifact verified
and its digest unchanged by the new section. The phase's rows then run: prepare_dpo, unshard_sft,
reference, reboost_dpo and train_dpo, the export of dpo/'s checkpoint, evaluate_sft (SFT's loss on
sft/hf, the generation check on the export) and evaluate_dpo. The gate fails on `gate.dpo_min_margin`;
the push is held back (the test Hub never sees the repo); run.json holds the DPO figures beside the SFT
model's, and so does the model card.

DPO trains a LoRA adapter (`dpo.lora`) on sft/hf, the way SFT trains one on cpt/hf: its checkpoints hold
the adapter alone, its first loss is log 2 (a fresh adapter adds exactly zero: the policy is the reference
model), a preemption notice after step 2 commits step 3 and the flow resumes the adapter from it in
the same run (one more launch), and the export merges it onto sft/hf, every other tensor sft/hf's, beside
`export-adapter/` (peft's layout, based on sft/hf). Full DPO's training, kill and resume: tests/test_dpo_dist.py.
"""

from __future__ import annotations

import json
import math
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
    "lr": 1.0e-2,  # an adapter starts at zero: a higher rate than full DPO's
    "checkpoint_every": 4,
    "eval": {"heldout_fraction": 0.1},
    "lora": {"r": 8, "alpha": 16},  # every projection (the default targets) of sft/hf
    "elastic": {"retry_wait_s": 0},  # the preemption below: the run retries at once
}


def test_cpt_sft_dpo_the_gate_fails_on_a_dpo_limit_and_nothing_is_pushed(
    demo_run, prefect_harness, hub_env, tmp_path, monkeypatch
):
    from huggingface_hub import HfApi
    from safetensors.torch import load_file

    from flows.cli import flow_main as main
    from tasks.core.run.manifest import read_manifest, verify_artifact

    monkeypatch.setenv("HF_TOKEN", hub_env.token)
    monkeypatch.setenv("CPT_TO_SFT_FAULT", "term@step=2@phase=dpo@rank=1")  # a notice to one rank after step 2
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
    # The stages before train_dpo ran in the first pass; the pass after the preemption found their artifacts
    # verified and skipped them (no earlier run made them: the demo run has no dpo rows).
    assert all(st[s] == "skipped" for s in DPO_STAGES[:4]) and all(st[s] == "completed" for s in DPO_STAGES[4:]), st
    assert all(verify_artifact(root / rel) for rel in ("data/dpo", "sft/hf", "reference", "dpo/step-000000"))
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

    # LoRA: the checkpoints hold the adapter (never the base), its manifest references sft/hf.
    dpo = root / "dpo"
    final = read_manifest(dpo / "step-000004")
    assert "adapter/adapter_model.safetensors" in final["files"], sorted(final["files"])
    assert not any(f.startswith("model/") for f in final["files"])
    lora = final["meta"]["lora"]
    assert lora["base"]["uri"].endswith("/sft/hf") and 0 < lora["trainable_params"] < lora["total_params"]
    state = json.loads((dpo / "step-000004" / "train_state.json").read_text())
    # The policy at step 1 is sft/hf plus an adapter whose B is zero: the reference model, so the loss is log 2.
    assert abs(state["losses"][0] - math.log(2)) < 1e-6 and abs(state["preference"]["margin"][0]) < 1e-6, state
    assert len(state["losses"]) == 4
    # The notice after step 2 committed step 3, the step in flight; the flow resumed the adapter from it in the
    # same run, losing no step, and the adapter trained (its B matrices left zero).
    (rec,) = summary["preemptions"]
    assert (rec["stage"], rec["phase"], rec["checkpoint_step"], rec["steps_lost"]) == ("train_dpo", "dpo", 3, 0), rec
    assert {"step-000003", "step-000004"} <= {p.name for p in dpo.glob("step-*")}
    b = load_file(dpo / "step-000004" / "adapter" / "adapter_model.safetensors")
    assert any("lora_B" in k and t.abs().sum() > 0 for k, t in b.items()) and state["preference"]["margin"][-1] != 0
    # The export merges the adapter onto sft/hf: only the adapted weights differ from sft/hf's (bitwise, checked
    # by the export itself), and export-adapter/ is the adapter alone on that base.
    merged = read_manifest(root / "export")["meta"]["verification"]["lora"]
    assert merged["touched"] > 0 and merged["untouched_bitwise"] > 0, merged
    adapter = read_manifest(root / "export-adapter")
    assert adapter["meta"]["base"]["name_or_path"].endswith("/sft/hf")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(adapter["files"])
