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

A base whose fp32 weights exceed `verify_memory_gb` is never loaded whole (a 70B cpt/hf is 280 GB
in fp32): peft builds its model with the base on the meta device and the adapter real
(`tasks.core.models.adapter.peft_meta_model`), the reference logits stream a decoder layer at a
time through peft's forward, and the merged weights are written one tensor at a time: each
targeted weight is read from cpt/hf in fp32 into its layer and merged there by peft's own
`merge()` (what `merge_and_unload` calls on every layer), then the layer is given its meta weight
back. Both paths write bitwise the same export (tests/test_lora_merge.py); the streamed one holds
the adapter, one decoder layer for the logits and about two of the model's largest tensors.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tasks.core.errors import ConversionError
from tasks.core.models.adapter import PEFT_PREFIX, base_key, peft_meta_model
from tasks.core.models.fingerprint import model_logits, save_fingerprint
from tasks.core.models.hf_artifact import build_hf_dir
from tasks.core.models.stream import weight_files

if TYPE_CHECKING:
    from tasks.core.config.outputs import ExportConfig

ADAPTER = "adapter"  # the checkpoint's adapter folder (tasks/engine/lora.py writes it)
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def touched_keys(peft_model) -> set[str]:
    """Base state-dict keys the merge changes: the weight (and bias) of every module holding an
    adapter, and every tensor of a module trained in full (modules_to_save)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    out: set[str] = set()
    for name, module in peft_model.named_modules():
        plain = name.removeprefix(PEFT_PREFIX)
        if isinstance(module, LoraLayer):
            out |= {f"{plain}.weight", f"{plain}.bias"}
        elif isinstance(module, ModulesToSaveWrapper):
            out |= {f"{plain}.{k}" for k in module.original_module.state_dict()}
    return out


def _read(files: dict[str, Path], key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(files[key]), framework="pt") as f:  # closed at once: no mapped pages stay resident
        return f.get_tensor(key)


def prove_untouched(base_dir: Path, export_dir: Path, touched: set[str], dtype: str) -> dict[str, Any]:
    """Raise ConversionError unless every export tensor the adapter does not touch is bitwise the
    base's cast to `dtype`; one tensor of each at a time."""
    base, export = weight_files(base_dir), weight_files(export_dir)
    untouched = sorted(k for k in export if k not in touched)
    missing = [k for k in untouched if k not in base]
    bad = [k for k in untouched if k in base and not torch.equal(_read(base, k).to(_TORCH[dtype]), _read(export, k))]
    if missing or bad:
        raise ConversionError(
            f"{export_dir}: tensors the adapter does not touch are not the base's ({base_dir}) cast to {dtype}: "
            f"differ {bad[:5]}, not in the base {missing[:5]}"
        )
    return {"untouched_bitwise": len(untouched), "touched": len([k for k in export if k in touched])}


def _write_safetensors(
    path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], tensor_of: Callable[[str], torch.Tensor]
) -> None:
    """One safetensors file of the keys in `specs` (shape, dtype), each tensor made by `tensor_of`
    only when its bytes are due: the header (every shape and offset) is known before any tensor exists."""
    from tasks.core.models.convert.dtypes import TORCH_TO_ST
    from tasks.core.models.convert.write import safetensors_header

    with path.open("wb") as out:
        out.write(
            safetensors_header(
                [(k, TORCH_TO_ST[dt], shape, math.prod(shape) * dt.itemsize) for k, (shape, dt) in specs.items()]
            )
        )
        for key, (shape, dtype) in specs.items():
            t = tensor_of(key).contiguous()
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ConversionError(
                    f"merged {key}: {t.dtype} {tuple(t.shape)}, the staged header says {dtype} {shape}"
                )
            out.write(t.view(-1).view(torch.uint8).numpy().data)


def _merge_streamed(
    checkpoint_dir: Path, base_dir: Path, staged: Path, plain: torch.nn.Module
) -> tuple[torch.Tensor, set[str], bool]:
    """(peft's reference logits, the touched keys, whether the head is untied) with the merged fp32
    model written to `staged`/model, in the memory of a decoder layer and about two tensors.
    `plain`: the base built on the meta device (its own module names, and whether it ties its head)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    from tasks.core.models.convert.dtypes import ST_TO_TORCH
    from tasks.core.models.convert.source import read_safetensors_header
    from tasks.core.models.stream import streaming

    model = peft_meta_model(base_dir, checkpoint_dir / ADAPTER)
    with streaming(model, base_dir, rename=base_key):
        reference = model_logits(model, model.config.vocab_size, device=torch.device("cpu"))
    touched = touched_keys(model)
    layers = {f"{n.removeprefix(PEFT_PREFIX)}.weight": m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    trained = {
        f"{n.removeprefix(PEFT_PREFIX)}.{k}": t
        for n, m in model.named_modules()
        if isinstance(m, ModulesToSaveWrapper)
        for k, t in m.modules_to_save[m.active_adapter].state_dict().items()
    }
    files = weight_files(base_dir)
    head, embed = plain.get_output_embeddings(), plain.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    names = {id(m): n for n, m in plain.named_modules()}
    head_key, embed_key = (f"{names[id(head)]}.weight", f"{names[id(embed)]}.weight") if tied else (None, None)

    def merged(key: str) -> torch.Tensor:
        if key in trained:  # a module trained in full: merge_and_unload puts the trained copy in its place
            t = trained[key].detach()
            return t.to(torch.float32) if t.is_floating_point() else t
        # A tied head and embedding are one tensor, stored once: an adapter on either merges into it,
        # in module order, as merge_and_unload's in-place merges do.
        group = [k for k in layers if k in (head_key, embed_key)] if key in (head_key, embed_key) else [key]
        t = _read(files, next(k for k in (key, head_key, embed_key) if k in files))
        t = t.to(torch.float32) if t.is_floating_point() else t  # as from_pretrained(dtype=float32) reads it
        for k in group:
            if k in layers:
                t = _merge_into(layers[k], t)
        return t

    entries = {
        k: e for path in sorted(set(files.values())) for k, e in read_safetensors_header(path)[1].items()
    }  # one header read per file
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key in sorted(files):
        dtype = ST_TO_TORCH[entries[key].dtype]
        specs[key] = (entries[key].shape, torch.float32 if dtype.is_floating_point else dtype)  # as merged() reads it
    # merge_and_unload unties them only where a trained copy replaced one of the two modules
    untie = (
        tied and (head_key in trained or embed_key in trained) and not torch.equal(merged(head_key), merged(embed_key))
    )
    if untie:  # both saved, as save_pretrained saves an untied model
        stored = specs[head_key] if head_key in specs else specs[embed_key]
        specs.setdefault(head_key, stored)
        specs.setdefault(embed_key, stored)
    (staged / "model").mkdir(parents=True)
    _write_safetensors(staged / "model" / "model.safetensors", specs, merged)
    return reference, touched, untie


def _merge_into(layer, weight: torch.Tensor) -> torch.Tensor:
    """`weight` with the active adapter of the peft `layer` merged by peft's own `merge()`: the
    weight is lent to the layer's (meta) base layer for the call, then the meta one is put back."""
    from torch import nn

    base_layer = layer.get_base_layer()
    meta = base_layer.weight
    base_layer.weight = nn.Parameter(weight, requires_grad=False)
    try:
        layer.merge()  # in place: W += scaling * (B @ A), as merge_and_unload does on every layer
        return base_layer.weight.data
    finally:
        base_layer.weight, layer.merged_adapters = meta, []


def build_merged_dir(
    checkpoint_dir: Path,
    dst: Path,
    base_dir: Path,
    export: ExportConfig,
    *,
    work_dir: str | None = None,
    verify_memory_gb: float | None = None,
    bridge: bool = False,
) -> dict[str, Any]:
    """`dst` = the merged model of `checkpoint_dir`'s adapter on `base_dir`, written as `export` says;
    returns build_hf_dir's record with `verification.lora` added (the untouched-tensor proof, the tie decision).
    `bridge` (unshard_sft's sft/hf, the model DPO starts from): fp32 as merged, the source's generation config
    as is (build_hf_dir's bridge), so the next phase trains from the merged weights without a rounding."""
    from tasks.core.models.stream import meta_model, model_bytes

    plain = meta_model(base_dir, torch.float32)  # no memory: the base's size, names and tie
    streamed = verify_memory_gb is not None and model_bytes(plain) > verify_memory_gb * 1e9
    with tempfile.TemporaryDirectory(prefix="lora-merge-", dir=work_dir) as tmp:
        staged = Path(tmp)
        if streamed:
            reference, touched, untie = _merge_streamed(checkpoint_dir, base_dir, staged, plain)
        else:
            reference, touched, untie = _merge_whole(checkpoint_dir, base_dir, staged)
        save_fingerprint(reference, staged, dtype="fp32")
        built = build_hf_dir(
            staged,
            dst,
            base_dir,
            export,
            weights_dtype="fp32",
            config_updates={"tie_word_embeddings": False} if untie else {},
            verify_memory_gb=verify_memory_gb,
            bridge=bridge,
        )
    built["verification"]["lora"] = {
        **prove_untouched(base_dir, dst, touched, "fp32" if bridge else export.dtype),
        "merged_in": "fp32",
        "untied_head": untie,
        "merge": "streamed" if streamed else "whole",
    }
    return built


def _merge_whole(checkpoint_dir: Path, base_dir: Path, staged: Path) -> tuple[torch.Tensor, set[str], bool]:
    """As _merge_streamed, with the base loaded whole in fp32 and peft's merge_and_unload."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, use_safetensors=True)
    tied = bool(getattr(base.config, "tie_word_embeddings", False))
    peft_model = PeftModel.from_pretrained(base, str(checkpoint_dir / ADAPTER)).eval()
    reference = model_logits(peft_model, base.config.vocab_size)  # base + adapter, through peft, fp32
    touched = touched_keys(peft_model)
    merged = peft_model.merge_and_unload()
    head, embed = merged.get_output_embeddings(), merged.get_input_embeddings()
    untie = tied and head is not None and not (head.weight is embed.weight or torch.equal(head.weight, embed.weight))
    if untie:
        merged.config.tie_word_embeddings = False
    merged.save_pretrained(staged / "model", safe_serialization=True, max_shard_size="100GB")
    return reference, touched, untie
