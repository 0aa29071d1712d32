"""The merged export of a LoRA checkpoint: cpt/hf + the adapter, merged in fp32, proven two ways.

    python -c "from tasks.core.models.merge import build_merged_dir; help(build_merged_dir)"

A LoRA SFT checkpoint holds `adapter/` only (tasks/engine/lora.py); its base is the stage's
`cpt/hf`. `booster.save_model` on the peft model would write the base keys with lora_A/lora_B beside
them, which a plain loader reads as the base model, so the export is made here instead:
1. the base is loaded in fp32 and peft applies the adapter (`PeftModel.from_pretrained`); its
   logits on the probe batch are the reference, the model the adapter defines;
2. `merge_and_unload` folds every adapter into its weight in fp32 (a merge in bf16 changes the
   loss, peft#1388); the merged fp32 model is written to a work folder with that reference as its
   fingerprint, and `build_hf_dir` makes the export from it exactly as from any checkpoint: cast
   to export.dtype, every tensor proven bitwise the merged one's cast, plain transformers' logits
   compared with the peft reference relative to their magnitude;
3. every tensor the adapter does not touch is proven bitwise cpt/hf's, cast to export.dtype.
Tied embeddings: when the merge leaves the LM head different from the input embedding (a trained
`lm_head` in modules_to_save), the export is written untied (`tie_word_embeddings: false`, both
tensors saved), so no loader re-ties it onto the embedding and discards the trained head.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from tasks.core.errors import ConversionError
from tasks.core.models.fingerprint import model_logits, save_fingerprint
from tasks.core.models.hf_artifact import build_hf_dir

ADAPTER = "adapter"  # the checkpoint's adapter folder (tasks/engine/lora.py writes it)
_PEFT_PREFIX = "base_model.model."
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def touched_keys(peft_model) -> set[str]:
    """Base state-dict keys the merge changes: the weight (and bias) of every module holding an
    adapter, and every tensor of a module trained in full (modules_to_save)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    out: set[str] = set()
    for name, module in peft_model.named_modules():
        plain = name.removeprefix(_PEFT_PREFIX)
        if isinstance(module, LoraLayer):
            out |= {f"{plain}.weight", f"{plain}.bias"}
        elif isinstance(module, ModulesToSaveWrapper):
            out |= {f"{plain}.{k}" for k in module.original_module.state_dict()}
    return out


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def prove_untouched(base_dir: Path, export_dir: Path, touched: set[str], dtype: str) -> dict[str, Any]:
    """Raise ConversionError unless every export tensor the adapter does not touch is bitwise the
    base's cast to `dtype`."""
    base, export = _tensors(base_dir), _tensors(export_dir)
    untouched = sorted(k for k in export if k not in touched)
    missing = [k for k in untouched if k not in base]
    bad = [k for k in untouched if k in base and not torch.equal(base[k].to(_TORCH[dtype]), export[k])]
    if missing or bad:
        raise ConversionError(f"{export_dir}: tensors the adapter does not touch are not the base's ({base_dir}) cast to {dtype}: "
                              f"differ {bad[:5]}, not in the base {missing[:5]}")
    return {"untouched_bitwise": len(untouched), "touched": len([k for k in export if k in touched])}


def build_merged_dir(checkpoint_dir: Path, dst: Path, base_dir: Path, *, dtype: str, max_shard_size: str, rtol: float | None = None,
                     align_stop_tokens: bool | None = None, work_dir: str | None = None,
                     verify_memory_gb: float | None = None) -> dict[str, Any]:
    """`dst` = the merged model of `checkpoint_dir`'s adapter on `base_dir`; returns build_hf_dir's
    record with `verification.lora` added (the untouched-tensor proof, the tie decision)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32, use_safetensors=True)
    tied = bool(getattr(base.config, "tie_word_embeddings", False))
    peft_model = PeftModel.from_pretrained(base, str(checkpoint_dir / ADAPTER)).eval()
    reference = model_logits(peft_model, base.config.vocab_size)  # base + adapter, through peft, fp32
    touched = touched_keys(peft_model)
    merged = peft_model.merge_and_unload()
    head, embed = merged.get_output_embeddings(), merged.get_input_embeddings()
    untie = tied and head is not None and not (head.weight is embed.weight or torch.equal(head.weight, embed.weight))
    updates = {"tie_word_embeddings": False} if untie else {}
    if untie:
        merged.config.tie_word_embeddings = False
    with tempfile.TemporaryDirectory(prefix="lora-merge-", dir=work_dir) as tmp:
        staged = Path(tmp)
        merged.save_pretrained(staged / "model", safe_serialization=True, max_shard_size="100GB")
        save_fingerprint(reference, staged, dtype="fp32")
        built = build_hf_dir(staged, dst, base_dir, dtype=dtype, max_shard_size=max_shard_size, weights_dtype="fp32", rtol=rtol,
                             align_stop_tokens=align_stop_tokens, config_updates=updates, verify_memory_gb=verify_memory_gb)
    built["verification"]["lora"] = {**prove_untouched(base_dir, dst, touched, dtype), "merged_in": "fp32", "untied_head": untie}
    return built
