"""Families end to end: a tiny random model of each through the whole flow, every logits check streamed
a layer at a time (e2e tier: one flow run per family).

    .venv/bin/python -m pytest -q -m "" tests/test_derived_flow.py -p no:cacheprovider

- OLMo 2 has no run of its own: OLMo 3 below is its layout (transformers builds Olmo3 on Olmo2's modules)
  plus sliding-window layers, and a whole flow costs ~95 CPU-s (measured). OLMo 2's own proofs: its
  derived table's export with proof and fingerprint (tests/test_families.py), its plan row at tp=2 against
  the unsharded model (benchmarks/shardformer_policies.py --smoke, in tests/test_benchmarks.py).
- gemma3_text, a named row (scaled embedding, four norms a layer, q/k norms, sliding-window layers, tied
  head): CPT under low_level_zero ZeRO-2, SFT under torch_ddp.
- phi3, a named row (fused qkv_proj and gate_up_proj): CPT under torch_ddp, SFT under low_level_zero.
- smollm3 and olmo3, families only later transformers build (4.53, 4.57: skipped on an older one, whose
  pre-flight refusal is tests/test_tp_plan.py's): derived tables with a plan row, so CPT runs under
  hybrid_parallel at tp=2 with the derived tensor-parallel policy (`tasks/core/models/tp_plan.py`), SFT under
  low_level_zero ZeRO-2 (SmolLM3, a NoPE layer in four) and torch_ddp (OLMo 3, sliding-window layers).
Each run's CPT checkpoint (its manifest names the plugin and tp it ran under) is the one its CPT bridge
(cpt/hf) converts bitwise, with the logits the engine recorded at the save; the export loads in plain
transformers as the family's class and gives the logits the SFT checkpoint recorded. (Falcon's named row at tp=2: tests/test_named_rows_dist.py.)
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tasks.core.models.tp_plan import too_old
from tasks.core.run.manifest import MANIFEST, PROVENANCE_DIR, verify_artifact
from tests._consumer_rules import assert_consumer_rules
from tests.conftest import tiny_config_raw, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

STAGES = ("load_from_hf", "boost_and_shard", "train_cpt", "unshard", "evaluate_cpt", "reboost", "train_sft", "export")
LLZ2 = {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"}
DDP = {"name": "torch_ddp", "precision": "fp32"}
TP2 = {"name": "hybrid_parallel", "tp_size": 2, "pp_size": 1, "zero_stage": 0, "precision": "fp32"}
# family -> (CPT plugin, SFT plugin, the class plain transformers loads)
FLOWS = {
    "gemma3_text": (LLZ2, DDP, "Gemma3ForCausalLM"),
    "phi3": (DDP, LLZ2, "Phi3ForCausalLM"),
    "smollm3": (TP2, LLZ2, "SmolLM3ForCausalLM"),
    "olmo3": (TP2, DDP, "Olmo3ForCausalLM"),
}


def _family(name: str):
    """A flow parameter, skipped where the installed transformers does not build the family yet."""
    return pytest.param(name, marks=pytest.mark.skipif(bool(too_old(name)), reason=too_old(name) or "built"))


@pytest.fixture(scope="module", params=[_family(f) for f in sorted(FLOWS)])
def family_run(request, prefect_harness, tmp_path_factory):
    from flows.cli import flow_main as main
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    family = request.param
    cpt, sft, _ = FLOWS[family]
    tmp = tmp_path_factory.mktemp(f"{family}-flow")
    base = build_tiny_model(tmp / family, build_tokenizer(DEFAULT_CORPUS, vocab_size=512), family=family)
    raw = tiny_config_raw(base, tmp / "run")
    raw["cpt"]["plugin"], raw["sft"]["plugin"] = dict(cpt), dict(sft)
    raw["verify_memory_gb"] = 1e-6  # every logits check streams the model a layer at a time
    raw["gate"] = {"enabled": False}  # 8 steps of a random model: what is proven here is the plumbing
    rc = main(["--config", str(write_config(tmp / f"{family}.yaml", raw))])
    return family, rc, tmp / "run", base


def test_a_family_runs_the_whole_flow_and_its_export_loads_in_plain_transformers(family_run):
    from transformers import AutoModelForCausalLM

    from support.engine import read_model_dir, train_state
    from tasks.core.models.convert import load_state_dict_from_dir
    from tasks.core.models.families import expected_tensors
    from tasks.core.models.fingerprint import hf_dir_logits, load_fingerprint, max_abs_diff, model_logits

    family, rc, run_root, base = family_run
    summary = json.loads((run_root / "run.json").read_text())
    status = {s["stage"]: s["status"] for s in summary["stages"]}
    assert rc == 0 and summary["complete"], status
    assert all(status[s] == "completed" for s in STAGES), status
    for rel in ("cpt/hf", "export"):
        verify_artifact(run_root / rel)
    mc = json.loads((base / "config.json").read_text())
    table = expected_tensors(mc)
    # the CPT checkpoint: every step trained, every tensor of the table saved, trained (not the base's)
    step = max((run_root / "cpt").glob("step-*"))
    plugin = json.loads((step / MANIFEST).read_text())["meta"]["plugin"]
    assert (plugin["name"], plugin["tp"]) == (FLOWS[family][0]["name"], FLOWS[family][0].get("tp_size", 1)), plugin
    losses = train_state(step)["losses"]
    assert len(losses) == 8 and all(map(math.isfinite, losses)), losses
    saved, start = read_model_dir(step / "model"), load_state_dict_from_dir(base)
    assert list(saved) == list(table) or sorted(saved) == sorted(table)
    assert not all(torch.equal(saved[k], start[k]) for k in start)
    # the CPT bridge is that checkpoint bitwise, a model transformers loads, with the logits the engine recorded
    bridge = load_state_dict_from_dir(run_root / "cpt/hf")
    assert sorted(bridge) == sorted(saved) and all(torch.equal(bridge[k], saved[k]) for k in saved)
    assert type(AutoModelForCausalLM.from_pretrained(run_root / "cpt/hf")).__name__ == FLOWS[family][2]
    assert max_abs_diff(load_fingerprint(step), hf_dir_logits(run_root / "cpt/hf", dtype="fp32")) <= 1e-4
    # the export: proven bitwise against the SFT checkpoint, loaded by plain transformers as the family's class
    export = run_root / "export"
    assert_consumer_rules(export)
    v = json.loads((export / PROVENANCE_DIR / "verification.json").read_text())
    assert v["weights_bitwise"]["tensors"] == v["tensors"] == len(table)
    assert v["fingerprint_match"] and v["top1_disagreements_beyond_tolerance"] == 0
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
    assert type(model).__name__ == FLOWS[family][2]
    last = max((run_root / "sft").glob("step-*"))
    logits, reference = model_logits(model, model.config.vocab_size), load_fingerprint(last)
    assert float((logits - reference).abs().max()) <= v["fingerprint_rtol"] * v["fingerprint_max_abs_logit"]
