"""LoRA SFT end to end after hybrid_parallel CPT, under low_level_zero and torch_ddp, pushed to the test Hub.

    .venv/bin/python -m pytest -q -m "" tests/test_lora_flow.py -p no:cacheprovider

No CPT is trained here: each flow run goes over a copy of the session's demo run (tests/conftest.py
`demo_run`: hybrid_parallel tp=2 CPT, the same tiny config), whose CPT stages are skipped because
sft.lora and the SFT plugin are in none of their digests. So the two flow runs cost the SFT half
only (reboost, train_sft, export, evaluate_sft, gate, push):
  1. low_level_zero ZeRO-2 bf16 LoRA, `hub.push_adapter: true` without adapter_repo_id: the merged
     model and the adapter in the subfolder adapter/ of one repo, in one commit;
  2. the push task again with `hub.adapter_repo_id`: the adapter in a repo of its own (with its
     card), and the model repo's adapter/ removed in the same commit as the re-push;
  3. torch_ddp fp32 LoRA over the same run root, pushed without the adapter.
Each export passes the consumer rules and the gate; no adapter file ever sits beside merged weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.core.run.manifest import PROVENANCE_DIR, verify_artifact
from tests._consumer_rules import assert_consumer_rules, served_files
from tests.conftest import write_config

pytest_plugins = ["tests.conftest_servers"]
pytestmark = [pytest.mark.e2e, pytest.mark.integration]

CPT_STAGES = ("load_from_hf", "prepare_cpt", "prepare_sft", "boost_and_shard", "train_cpt", "unshard", "evaluate_cpt")
SFT_STAGES = ("reboost", "train_sft", "export", "evaluate_sft", "push_to_hub")
# A higher learning rate than full fine-tuning's (the adapter starts at zero); more steps than the
# demo's 8 so the tiny model learns to end its replies (the gate's generation check).
LORA_SFT = {"lora": {"r": 16, "alpha": 32}, "max_steps": 16, "lr": 5.0e-3}


def _flow(raw: dict, path: Path) -> tuple[int, dict]:
    from flows.cli import flow_main as main

    rc = main(["--config", str(write_config(path, raw))])
    return rc, json.loads((Path(raw["run_root"]) / "run.json").read_text())


def _tree(api, repo_id: str) -> set[str]:
    return {f.path for f in api.list_repo_tree(repo_id, recursive=True) if hasattr(f, "size")}


def _no_adapter_beside_weights(tree: set[str]) -> None:
    top = {p for p in tree if "/" not in p}
    assert not top & {"adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"}, sorted(top)


def _checked_run(rc: int, summary: dict, export_dir) -> None:
    st = {s["stage"]: s["status"] for s in summary["stages"]}
    assert rc == 0 and summary["complete"], st
    assert all(st[s] == "skipped" for s in CPT_STAGES), st  # the demo run's CPT, reused
    assert all(st[s] == "completed" for s in SFT_STAGES) and st["gate"] == "passed", st
    assert_consumer_rules(export_dir)


def test_lora_sft_after_hybrid_parallel_cpt_exports_merged_and_adapter_and_pushes_both(
    demo_run, prefect_harness, hub_env, tmp_path, monkeypatch
):
    from huggingface_hub import HfApi, ModelCard
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tasks.core.config.load import load_config
    from tasks.core.models.fingerprint import compare_logits, hf_dir_logits, model_logits
    from tasks.stages.push import push_to_hub

    monkeypatch.setenv("HF_TOKEN", hub_env.token)
    api = HfApi(token=hub_env.token)
    copy = demo_run.copy_to(tmp_path / "lora")
    root, raw = copy.run_root, {**copy.raw, "name": "lora-tiny"}
    raw["sft"] = {**raw["sft"], **LORA_SFT}

    # 1. low_level_zero ZeRO-2 bf16: the merged model and the adapter in its subfolder, one commit.
    raw["hub"] = {"repo_id": "org/lora-tiny", "private": True, "push_adapter": True}
    rc, summary = _flow(raw, tmp_path / "llz.yaml")
    _checked_run(rc, summary, root / "export")
    adapter = verify_artifact(root / "export-adapter", deep=True)
    assert adapter["kind"] == "lora-adapter" and sorted(adapter["files"]) == [
        f"{PROVENANCE_DIR}/verification.json",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    proof = adapter["meta"]["verification"]
    assert (
        proof["fingerprint_match"]
        and proof["base_is"] == "local"
        and proof["base_model_name_or_path"] == str(root / "cpt" / "hf")
    )
    assert json.loads((root / "export-adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        root / "cpt" / "hf"
    )
    assert json.loads((root / "export" / PROVENANCE_DIR / "verification.json").read_text())["adapter"][
        "fingerprint_match"
    ]
    tree = _tree(api, "org/lora-tiny")
    _no_adapter_beside_weights(tree)
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= tree
    assert sorted(p for p in tree if p.endswith(".safetensors") and "/" not in p) == served_files(root / "export")
    assert "## LoRA adapter" in ModelCard.load("org/lora-tiny", token=hub_env.token).text
    # The adapter as the Hub serves it, through peft onto cpt/hf: the merged export's model.
    pulled_dir = (
        Path(api.snapshot_download("org/lora-tiny", allow_patterns=["adapter/*"], local_dir=tmp_path / "pulled"))
        / "adapter"
    )
    base = AutoModelForCausalLM.from_pretrained(root / "cpt" / "hf", dtype=torch.float32)
    pulled = PeftModel.from_pretrained(base, pulled_dir)
    assert compare_logits(
        hf_dir_logits(root / "export"), model_logits(pulled.eval(), base.config.vocab_size), proof["fingerprint_rtol"]
    )["fingerprint_match"]

    # 2. The adapter in a repo of its own: the model repo's adapter/ goes in the same re-push.
    raw["hub"] = {**raw["hub"], "adapter_repo_id": "org/lora-tiny-adapter"}
    pushed = push_to_hub.with_options(retries=0)(load_config(write_config(tmp_path / "own-repo.yaml", raw)), {})
    assert pushed.detail["adapter"]["repo_id"] == "org/lora-tiny-adapter"
    own = _tree(api, "org/lora-tiny-adapter")
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= own and not {
        "config.json",
        "model.safetensors",
    } & own
    assert ModelCard.load("org/lora-tiny-adapter", token=hub_env.token).data.library_name == "peft"
    assert not any(p.startswith("adapter/") for p in _tree(api, "org/lora-tiny"))

    # 3. torch_ddp fp32 over the same run root (the CPT stages still skip), pushed without the adapter,
    # and with a verification budget under the model: the merge and both proofs stream (tasks/core/models/merge.py).
    raw["sft"] = {**raw["sft"], "plugin": {"name": "torch_ddp", "precision": "fp32"}}
    raw["hub"] = {"repo_id": "org/lora-tiny", "private": True}
    raw["verify_memory_gb"] = 1e-6
    rc, summary = _flow(raw, tmp_path / "ddp.yaml")
    _checked_run(rc, summary, root / "export")
    assert (
        json.loads((root / "export" / PROVENANCE_DIR / "verification.json").read_text())["lora"]["merge"] == "streamed"
    )
    assert verify_artifact(root / "export-adapter", deep=True)["meta"]["verification"][
        "fingerprint_match"
    ]  # rebuilt for this adapter
    tree = _tree(api, "org/lora-tiny")
    _no_adapter_beside_weights(tree)
    assert not any("adapter" in p for p in tree), sorted(tree)
