"""The LoRA export merged without loading the base whole: the same export, bitwise.

    .venv/bin/pytest -q tests/test_lora_merge.py

`build_merged_dir` with `verify_memory_gb` under the base's fp32 bytes (here 0) takes the streamed
path of tasks/core/models/merge.py: peft's model built on a meta base, peft's forward streamed a
layer at a time for the reference logits, each targeted weight merged by peft's own `merge()` one
tensor at a time. Without a budget it loads the base whole and calls `merge_and_unload`. Both must
write the same tensors, config and fingerprint, for untied and tied models, adapters on the
projections, on the tied embedding, and a head trained in full.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

CASES = {
    # name: (family, tied, peft LoraConfig keywords)
    "llama-projections": ("llama", False, dict(target_modules=["q_proj", "v_proj", "down_proj"])),
    "llama-trained-head": ("llama", False, dict(target_modules=["q_proj", "o_proj"], modules_to_save=["lm_head"])),
    "qwen2-tied-projections": ("qwen2", True, dict(target_modules=["q_proj", "o_proj", "up_proj"])),
    "qwen2-tied-trained-head": ("qwen2", True, dict(target_modules=["q_proj"], modules_to_save=["lm_head"])),
    "qwen2-tied-embedding-adapter": ("qwen2", True, dict(target_modules=["embed_tokens", "k_proj"])),
}
# peft's forward applies an embedding adapter to the input side only, while its merge changes the
# one tensor the tied head shares: the merged model is another model, and both paths refuse it.
REFUSED = {"qwen2-tied-embedding-adapter"}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    work = tmp_path_factory.mktemp("merge-bases")
    tok = build_tokenizer(DEFAULT_CORPUS, vocab_size=512)
    return {
        (fam, tied): build_tiny_model(work / f"{fam}-{tied}", tok, family=fam, tie_word_embeddings=tied)
        for fam, tied in {(f, t) for f, t, _ in CASES.values()}
    }


def _checkpoint(base_dir: Path, out: Path, lora: dict) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora),
    )  # B random too: every adapter changes its weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "modules_to_save" in name:  # a head trained apart from the embedding it was tied to
                p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(out / "adapter", safe_serialization=True)
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_streamed_merge_writes_the_export_the_whole_model_merge_writes(case, bases, tmp_path, monkeypatch):
    import transformers
    from peft.tuners.lora import LoraModel

    from tasks.core.config.outputs import ExportConfig
    from tasks.core.models.fingerprint import FINGERPRINT_FILE
    from tasks.core.models.merge import build_merged_dir

    family, tied, lora = CASES[case]
    base = bases[(family, tied)]
    ckpt = _checkpoint(base, tmp_path / "ckpt", lora)
    if case in REFUSED:
        from tasks.core.errors import ConversionError

        for budget in (None, 0.0):
            with pytest.raises(ConversionError, match="the folder loads differently from what was trained"):
                build_merged_dir(
                    ckpt, tmp_path / f"out-{budget}", base, ExportConfig(dtype="fp32"), verify_memory_gb=budget
                )
        return
    whole = build_merged_dir(ckpt, tmp_path / "whole", base, ExportConfig(dtype="fp32"))

    # The streamed path never loads a model whole nor unloads peft's: either would hold every weight.
    def whole_model(*a, **k):
        raise AssertionError("the streamed merge loaded a model whole")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", whole_model)
    monkeypatch.setattr(LoraModel, "merge_and_unload", whole_model)
    streamed = build_merged_dir(ckpt, tmp_path / "streamed", base, ExportConfig(dtype="fp32"), verify_memory_gb=0.0)
    monkeypatch.undo()

    w, s = whole["verification"], streamed["verification"]
    assert (w["lora"]["merge"], s["lora"]["merge"]) == ("whole", "streamed")
    assert {**w["lora"], "merge": None} == {**s["lora"], "merge": None}
    assert w["lora"]["untied_head"] is (case.endswith("trained-head") and tied)
    assert w["fingerprint_match"] and s["fingerprint_match"] and w["fingerprint_rel_diff"] == s["fingerprint_rel_diff"]
    a, b = _tensors(tmp_path / "whole"), _tensors(tmp_path / "streamed")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), [
        k for k in a if k in b and not torch.equal(a[k], b[k])
    ]
    for name in ("config.json", "generation_config.json", FINGERPRINT_FILE):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "streamed" / name).read_bytes(), name
    before = _tensors(base)
    touched = [k for k in a if k not in before or not torch.equal(a[k], before[k])]
    assert touched, "the adapter changed no weight: the case tests nothing"
    assert json.loads((tmp_path / "streamed" / "config.json").read_text())["tie_word_embeddings"] is (
        tied and not w["lora"]["untied_head"]
    )


def test_peft_logits_streamed_are_bitwise_the_whole_model_ones(bases, tmp_path):
    from tasks.core.models.adapter import adapter_logits

    base = bases[("qwen2", True)]
    ckpt = _checkpoint(base, tmp_path / "ckpt", CASES["qwen2-tied-trained-head"][2])
    whole = adapter_logits(ckpt / "adapter", base)
    streamed = adapter_logits(ckpt / "adapter", base, verify_memory_gb=0.0)
    assert torch.equal(whole, streamed)
