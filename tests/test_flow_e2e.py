"""The whole flow on the tiny config, in-process on an ephemeral Prefect server (e2e tier).

One module-scoped scenario serves every test here, because a flow run costs minutes on 2 cores:
  1. a run whose SFT stage dies (rank 1 SIGKILLed after step 5; the step-4 checkpoint is complete);
  2. the retry over the same run root: the first five stages are skipped without a launch, SFT
     resumes from step 4 and the run completes;
  3. a re-run of the complete run: every stage skipped, no torchrun process at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_config_raw, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

STAGE_DIRS = {
    "load_from_hf": "base",
    "boost_and_shard": "cpt/step-000000",
    "train_cpt": "cpt/step-000008",
    "unshard": "cpt/hf",
    "reboost": "sft/step-000000",
    "train_sft": "sft/step-000008",
    "export": "export",
}


class Launches:
    """Wraps tasks.train.run_engine: records every engine launch and the steps it trained."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, verb, job, *args, **kwargs):
        progress = self.real(verb, job, *args, **kwargs)
        self.calls.append({"verb": verb, "stage": job["stage"], "steps": [int(p["step"]) for p in progress]})
        return progress


@pytest.fixture(scope="module")
def scenario(prefect_harness, tiny_model_dir, tmp_path_factory):
    import tasks.train
    from flows.cpt_to_sft import main

    tmp = tmp_path_factory.mktemp("e2e")
    run_root = tmp / "run"
    cfg = write_config(tmp / "tiny.yaml", tiny_config_raw(tiny_model_dir, run_root))
    mp = pytest.MonkeyPatch()
    runs = []
    try:
        for fault in ("kill@step=5@stage=sft", "", ""):
            launches = Launches(tasks.train.run_engine.__wrapped__ if hasattr(tasks.train.run_engine, "__wrapped__") else tasks.train.run_engine)
            mp.setattr(tasks.train, "run_engine", launches)
            mp.setenv("CPT_TO_SFT_FAULT", fault) if fault else mp.delenv("CPT_TO_SFT_FAULT", raising=False)
            try:
                rc = main(["--config", str(cfg)])
            except Exception as exc:  # the failed run raises the task's error
                rc = exc
            summary = json.loads((run_root / "run.json").read_text())
            runs.append({"rc": rc, "launches": launches.calls, "summary": summary})
            mp.setattr(tasks.train, "run_engine", launches.real)
    finally:
        mp.undo()
    return run_root, runs


@pytest.fixture(scope="module")
def finished_run(scenario):
    return scenario[0], scenario[1]


def statuses(summary):
    return {s["stage"]: s["status"] for s in summary["stages"]}


def test_failed_sft_run_is_recorded(scenario):
    _, runs = scenario
    first = runs[0]
    assert isinstance(first["rc"], Exception) and "exited with status" in str(first["rc"])
    assert first["summary"]["complete"] is False
    st = statuses(first["summary"])
    assert st["train_cpt"] == "completed" and st["train_sft"] == "failed" and st["export"] == "not-run"


def test_retry_skips_done_stages_and_resumes_sft(scenario):
    run_root, runs = scenario
    retry = runs[1]
    assert retry["rc"] == 0 and retry["summary"]["complete"] is True
    st = statuses(retry["summary"])
    for stage in ("load_from_hf", "boost_and_shard", "train_cpt", "unshard", "reboost"):
        assert st[stage] == "skipped", (stage, st)
    assert st["train_sft"] == "completed" and st["export"] == "completed"
    # Only SFT training was launched, and it continued after the step-4 checkpoint.
    assert [(c["verb"], c["stage"]) for c in retry["launches"]] == [("train", "sft")]
    assert retry["launches"][0]["steps"] == [5, 6, 7, 8]


def test_rerun_of_complete_run_launches_nothing(scenario):
    _, runs = scenario
    rerun = runs[2]
    assert rerun["rc"] == 0 and rerun["launches"] == []
    assert set(statuses(rerun["summary"]).values()) <= {"skipped", "not-configured"}


def test_every_stage_has_a_verified_artifact(finished_run):
    from tasks.core.manifest import manifest_digest, verify_artifact

    run_root, _ = finished_run
    summary = json.loads((run_root / "run.json").read_text())
    assert summary["complete"] is True
    by_stage = {s["stage"]: s for s in summary["stages"]}
    for stage, rel in STAGE_DIRS.items():
        verify_artifact(run_root / rel)
        assert by_stage[stage]["status"] in ("completed", "skipped"), by_stage[stage]
        assert by_stage[stage]["digest"] == manifest_digest(run_root / rel)
        assert by_stage[stage]["uri"].endswith(rel)
    assert by_stage["push_to_hub"]["status"] == "not-configured"
    assert summary["export"].endswith("export")


def test_cpt_loss_decreases_and_sft_starts_from_cpt(finished_run):
    from safetensors.torch import load_file

    from tasks.core.convert import load_state_dict_from_dir

    run_root, _ = finished_run
    cpt = json.loads((run_root / "cpt/step-000008/train_state.json").read_text())["losses"]
    assert len(cpt) == 8 and cpt[-1] < cpt[0]
    # The reboost stage loaded exactly the unsharded CPT weights (cast to plugin B's bf16).
    bridge = load_state_dict_from_dir(run_root / "cpt/hf")
    sft0 = load_state_dict_from_dir(run_root / "sft/step-000000/model")
    assert set(sft0) == set(bridge)
    for key, tensor in bridge.items():
        assert torch.equal(sft0[key].float(), tensor.to(sft0[key].dtype).float()), key
    manifest = json.loads((run_root / "sft/step-000000/manifest.json").read_text())
    assert manifest["parent"]["uri"].endswith("cpt/hf")


def test_export_loads_in_transformers_with_matching_logits(finished_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.core.fingerprint import load_fingerprint, model_logits

    run_root, _ = finished_run
    export = run_root / "export"
    names = {p.name for p in export.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert any(n.endswith(".safetensors") and n != "fingerprint.safetensors" for n in names)
    model = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.chat_template and "assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    logits = model_logits(model, model.config.vocab_size)
    reference = load_fingerprint(run_root / "sft/step-000008")
    diff = float((logits - reference).abs().max())
    verification = json.loads((export / "verification.json").read_text())
    assert verification["fingerprint_match"] and diff <= verification["fingerprint_atol"], diff
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_bridge_is_bitwise_the_plugin_a_checkpoint_and_reproduces_its_logits(finished_run):
    from tasks.core.convert import load_state_dict_from_dir

    run_root, _ = finished_run
    saved = load_state_dict_from_dir(run_root / "cpt/step-000008/model")
    bridge = load_state_dict_from_dir(run_root / "cpt/hf")
    assert set(saved) == set(bridge)
    for key in saved:
        assert saved[key].dtype == bridge[key].dtype and torch.equal(saved[key], bridge[key]), key
    # The unshard stage compared plain transformers' logits with the live plugin-A (tp=2) logits.
    meta = json.loads((run_root / "cpt/hf/manifest.json").read_text())["meta"]["verification"]
    assert meta["fingerprint_max_abs_diff"] <= 1e-5 and meta["fingerprint_match"] is True
