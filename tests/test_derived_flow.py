"""A family with no row, end to end: a tiny random OLMo 2 (model_type olmo2, built offline from
transformers' Olmo2Config) through the whole flow, CPT under torch_ddp and SFT under low_level_zero
ZeRO-2, every logits check streamed a layer at a time (e2e tier: one flow run).

    .venv/bin/python -m pytest -q -m "" tests/test_derived_flow.py -p no:cacheprovider

Pre-flight derives the family's tensor table from the model transformers builds on the meta device
(`tasks/core/models/derive.py`); the unshard, the export's bitwise weight proof and fingerprint,
and the evaluations run from it. The export loads in plain transformers as Olmo2ForCausalLM and
gives the logits the SFT checkpoint recorded. (hybrid_parallel for the same model is refused before
launch: tests/test_families.py, unit tier.)
"""

from __future__ import annotations

import json

import pytest
import torch

from tasks.core.run.manifest import PROVENANCE_DIR, verify_artifact
from tests._consumer_rules import assert_consumer_rules
from tests.conftest import tiny_config_raw, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

STAGES = ("load_from_hf", "boost_and_shard", "train_cpt", "unshard", "evaluate_cpt", "reboost", "train_sft", "export")


@pytest.fixture(scope="module")
def olmo2_run(prefect_harness, tmp_path_factory):
    from flows.cli import flow_main as main
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    tmp = tmp_path_factory.mktemp("olmo2-flow")
    base = build_tiny_model(tmp / "olmo2", build_tokenizer(DEFAULT_CORPUS, vocab_size=512), family="olmo2")
    raw = tiny_config_raw(base, tmp / "run")
    raw["cpt"]["plugin"] = {"name": "torch_ddp", "precision": "fp32"}
    raw["sft"]["plugin"] = {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"}
    raw["verify_memory_gb"] = 1e-6  # every logits check streams the model a layer at a time
    raw["gate"] = {"enabled": False}  # 8 steps of a random model: what is proven here is the plumbing
    rc = main(["--config", str(write_config(tmp / "olmo2.yaml", raw))])
    return rc, tmp / "run", base


def test_a_derived_family_runs_the_whole_flow_and_its_export_loads_in_plain_transformers(olmo2_run):
    from transformers import AutoModelForCausalLM

    from tasks.core.models.families import expected_tensors
    from tasks.core.models.fingerprint import load_fingerprint, model_logits

    rc, run_root, base = olmo2_run
    summary = json.loads((run_root / "run.json").read_text())
    status = {s["stage"]: s["status"] for s in summary["stages"]}
    assert rc == 0 and summary["complete"], status
    assert all(status[s] == "completed" for s in STAGES), status
    for rel in ("cpt/hf", "export"):
        verify_artifact(run_root / rel)
    export = run_root / "export"
    assert_consumer_rules(export)
    v = json.loads((export / PROVENANCE_DIR / "verification.json").read_text())
    n = len(expected_tensors(json.loads((base / "config.json").read_text())))
    assert v["weights_bitwise"]["tensors"] == v["tensors"] == n
    assert v["fingerprint_match"] and v["top1_disagreements_beyond_tolerance"] == 0
    model = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.bfloat16)
    assert type(model).__name__ == "Olmo2ForCausalLM"
    last = max((run_root / "sft").glob("step-*"))
    logits, reference = model_logits(model, model.config.vocab_size), load_fingerprint(last)
    assert float((logits - reference).abs().max()) <= v["fingerprint_rtol"] * v["fingerprint_max_abs_logit"]
    # the CPT bridge holds every tensor of the derived table, trained (not the base's)
    from tasks.core.models.convert import load_state_dict_from_dir

    bridge, start = load_state_dict_from_dir(run_root / "cpt/hf"), load_state_dict_from_dir(base)
    assert list(bridge) == list(start) or sorted(bridge) == sorted(start)
    assert not all(torch.equal(bridge[k], start[k]) for k in start)
