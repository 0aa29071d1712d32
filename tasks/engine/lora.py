"""LoRA inside a rank: the adapter enabled before boost, saved as a checkpoint's part, its base checked.

    torchrun --nproc_per_node=2 -m tasks.engine train --config JOB.json   # a job whose phase_cfg.lora is set

Both verbs build the base from the job's model_dir (the stage's immutable `cpt/hf` artifact) and
call `booster.enable_lora` before `boost` (ColossalAI asserts it): the shard verb with a fresh
adapter from the phase's `lora` (sft.lora, dpo.lora), the train verb with the checkpoint's `adapter/` (peft's
PeftModel.from_pretrained, trainable). A LoRA checkpoint holds `adapter/` (peft layout, safetensors:
`booster.save_lora_as_pretrained` writes `.bin` unless told otherwise), the optimizer (the adapter's
parameters only: the frozen base gets no Adam state), the scheduler, the RNG and the data position;
never the base weights, which the manifest references by `cpt/hf`'s manifest digest. Resuming onto
another base would train an adapter against weights it was not made for, so `check_base` refuses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tasks.core.config.lora import LoraConfig
from tasks.core.errors import ManifestError
from tasks.core.run.manifest import manifest_digest

ADAPTER = "adapter"  # a LoRA checkpoint's adapter folder: adapter_config.json, adapter_model.safetensors
ADAPTER_WEIGHTS = f"{ADAPTER}/adapter_model.safetensors"


def peft_config(lora: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules),
        modules_to_save=list(lora.modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _kind(module: torch.nn.Module) -> str:
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, (torch.nn.Linear, Conv1D)):
        return "linear"
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    return "container" if any(True for _ in module.children()) else "other"


def check_targets(model: torch.nn.Module, lora: LoraConfig, phase: str = "sft") -> None:
    """Refuse target_modules that adapt nothing or a module LoRA cannot wrap, on the real model
    (pre-flight decided the same from the family table): peft would drop the first silently."""
    from tasks.core.errors import ConfigError
    from tasks.core.models import lora_targets

    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    modules = {n: _kind(m) for n, m in model.named_modules()}
    problems = lora_targets.problems(lora.target_modules, modules, "the base model", head_name)
    if problems:
        raise ConfigError([(lora_targets.field(phase), p) for p in problems], header="LoRA targets refused")


def record_adapted(model: torch.nn.Module) -> list[str]:
    """The last name parts of the modules peft adapted (sorted), written back into the adapter's
    config when target_modules is a list, so adapter_config.json names exactly what was trained."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)})
    for config in getattr(model, "peft_config", {}).values():
        if not isinstance(config.target_modules, str):
            config.target_modules = set(names)
    return names


def enable(booster, model: torch.nn.Module, lora: LoraConfig, adapter_dir: Path | None = None) -> torch.nn.Module:
    """The peft model booster.enable_lora makes of `model` (before boost): a fresh adapter, or the
    one saved in `adapter_dir` (trainable)."""
    if adapter_dir is None:
        return booster.enable_lora(model, lora_config=peft_config(lora), quantize=lora.quantize)
    return booster.enable_lora(model, pretrained_dir=str(adapter_dir), quantize=lora.quantize)


def param_counts(model: torch.nn.Module) -> dict[str, Any]:
    """Trainable and total parameters (before boost: plugins shard them); the share in percent."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "trainable_params": trainable,
        "total_params": total,
        "trainable_pct": round(100.0 * trainable / max(1, total), 4),
    }


def base_ref(model_dir: Path) -> dict[str, str]:
    """The base an adapter is trained on: the model_dir artifact and its manifest digest."""
    return {"uri": str(model_dir), "digest": manifest_digest(model_dir)}


def meta(lora: LoraConfig, model_dir: Path, counts: dict[str, Any]) -> dict[str, Any]:
    """The `lora` entry of a LoRA checkpoint's manifest meta."""
    return {"config": lora.model_dump(mode="json"), "base": base_ref(model_dir), **counts}


def check_base(manifest: dict[str, Any], checkpoint: Path, model_dir: Path) -> None:
    """Refuse to resume an adapter onto a base other than the one it was trained on."""
    recorded = ((manifest.get("meta") or {}).get("lora") or {}).get("base") or {}
    now = manifest_digest(model_dir)
    if recorded.get("digest") != now:
        raise ManifestError(
            f"{checkpoint}: its adapter was trained on the base {recorded.get('uri')} with manifest digest "
            f"{str(recorded.get('digest'))[:12]}, "
            f"but {model_dir} now has {now[:12]}: an adapter only fits the weights it was trained against; rebuild "
            f"{model_dir} as it was, "
            "or start the stage again from its shard verb (reboost)"
        )


def save_adapter(booster, model, dst: Path) -> None:
    # safetensors explicitly: ColossalAI's default is a pickled adapter_model.bin.
    booster.save_lora_as_pretrained(model, str(dst), use_safetensors=True)
