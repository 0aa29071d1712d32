"""`export-adapter/`: a LoRA run's adapter alone, in peft's layout, proven to be the merged export.

    python -c "from tasks.core.models.adapter import build_adapter_dir; help(build_adapter_dir)"

The folder holds `adapter_config.json` and `adapter_model.safetensors` (the SFT checkpoint's
adapter, bytes unchanged) and nothing a weight loader reads as a model (no config.json, no
model*.safetensors), so it lives in its own artifact beside `export/`, never inside it.

`base_model_name_or_path` is what peft's AutoPeftModel loads the adapter onto. The base an
adapter fits is the run's `cpt/hf` artifact (the CPT model, not the Hub model the run started
from), and the flow never pushes cpt/hf, so it is a LOCAL reference: the URI of `cpt/hf` under the
run root (`base_is: "local"` in the verification record). Its manifest digest is recorded beside
it, the same one the SFT checkpoints carry. A Hub repo id is written instead only when the caller
passes one that holds that model.

The proof: peft loads the folder as shipped onto `cpt/hf` in fp32, and its logits on the probe
batch are compared with plain transformers' logits of `export/` relative to their magnitude, with
the export's own tolerance (`compare_logits`); a mismatch fails the stage.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tasks.core.errors import ConversionError
from tasks.core.models.fingerprint import compare_logits, hf_dir_logits, model_logits

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
)  # everything peft reads, and all the artifact holds besides its provenance


PEFT_PREFIX = "base_model.model."  # what peft puts before the wrapped model's own names


def base_key(name: str) -> str:
    """The base folder's key of a peft model's parameter name: peft wraps the model
    (`base_model.model.`), a targeted layer (`.base_layer.`) and a module trained in full
    (`.original_module.`, the frozen original beside its trained copy)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".").replace(".original_module.", ".")


def peft_meta_model(base_dir: Path, adapter_dir: Path):
    """peft's model of the adapter on `base_dir` with the base's parameters on the meta device (no
    memory) and the adapter's real, in fp32, eval mode: what `PeftModel.from_pretrained` builds on
    the base loaded whole, without the base. peft's own loader reads and renames the adapter's
    tensors (low_cpu_mem_usage: assigned, not copied into meta ones); only its last step, moving
    each adapter to its base layer's device, is held back, since that device is meta here."""
    from unittest import mock

    import torch
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    from tasks.core.models.stream import meta_model

    base = meta_model(base_dir, torch.float32)
    with mock.patch.object(BaseTunerLayer, "_move_adapter_to_device_of_base_layer", lambda self, *a, **k: None):
        model = PeftModel.from_pretrained(base, str(adapter_dir), low_cpu_mem_usage=True)
    still_meta = [n for n, p in model.named_parameters() if p.is_meta and ".lora_" in n]
    if still_meta:
        raise ConversionError(
            f"{adapter_dir}: peft left adapter tensors unloaded ({still_meta[:3]}): the adapter does not fit {base_dir}"
        )
    for p in model.parameters():  # assigned in the file's dtype; loaded into the fp32 model they are cast, exactly
        if not p.is_meta and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.to(torch.float32)
    # An adapter on the embedding saves the embedding too (peft's save_embedding_layers); assigned,
    # it replaces the tensor a tied head shares, where loaded into the whole model it is copied into
    # it. The head gets the embedding's tensor back.
    plain = model.get_base_model()
    head, embed = plain.get_output_embeddings(), plain.get_input_embeddings()
    head = head.get_base_layer() if hasattr(head, "get_base_layer") else head
    if (
        getattr(plain.config, "tie_word_embeddings", False)
        and head is not None
        and embed is not None
        and head.weight.is_meta
        and not embed.weight.is_meta
    ):
        head.weight = embed.weight
    return model.eval()


def adapter_logits(adapter_dir: Path, base_dir: Path, verify_memory_gb: float | None = None):
    """Logits of `base_dir` (fp32) with the adapter in `adapter_dir` applied through peft. A base
    whose fp32 weights exceed `verify_memory_gb` (None: never) is streamed a decoder layer at a time
    through peft's own forward (tasks/core/models/stream.py): bitwise the same logits, in the
    memory of one layer and the adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tasks.core.models.stream import model_bytes, streaming

    if verify_memory_gb is not None:
        model = peft_meta_model(base_dir, adapter_dir)
        if model_bytes(model.get_base_model()) > verify_memory_gb * 1e9:
            with streaming(model, base_dir, rename=base_key):
                return model_logits(model, model.config.vocab_size, device=torch.device("cpu"))
        del model
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, use_safetensors=True)
    return model_logits(PeftModel.from_pretrained(base, str(adapter_dir)).eval(), base.config.vocab_size)


def build_adapter_dir(
    adapter_src: Path,
    dst: Path,
    base_dir: Path,
    export_dir: Path,
    *,
    base_ref: dict[str, str],
    rtol: float,
    verify_memory_gb: float | None = None,
) -> dict[str, Any]:
    """`dst` = the adapter of `adapter_src` (a checkpoint's adapter/) with `base_model_name_or_path`
    set to `base_ref["name_or_path"]`; returns its verification record against `export_dir`.

    `base_ref`: `name_or_path` (cpt/hf's URI: what AutoPeftModel loads) and `digest` (its manifest digest).
    `verify_memory_gb`: above it, both sides stream (hf_dir_logits, adapter_logits).
    """
    missing = [n for n in ADAPTER_FILES if not (adapter_src / n).is_file()]
    if missing:
        raise ConversionError(
            f"{adapter_src}: no {', '.join(missing)}: not a peft adapter saved as safetensors; re-run train_sft"
        )
    config = json.loads((adapter_src / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = base_ref["name_or_path"]
    (dst / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(adapter_src / ADAPTER_WEIGHTS, dst / ADAPTER_WEIGHTS)
    c = compare_logits(
        hf_dir_logits(export_dir, verify_memory_gb=verify_memory_gb),
        adapter_logits(dst, base_dir, verify_memory_gb),
        rtol,
    )
    if not c["fingerprint_match"]:
        raise ConversionError(
            f"{dst}: peft's logits of this adapter on {base_dir} differ from the merged export {export_dir} "
            f"(relative {c['fingerprint_rel_diff']:.3g} > {rtol:g}, {c['top1_disagreements_beyond_tolerance']} top-1 "
            "flips): "
            "the adapter and the merged model are not the same model; delete both and re-run the export"
        )
    return {
        "against": str(export_dir),
        "base_model_name_or_path": base_ref["name_or_path"],
        "base_is": "local",
        "base_digest": base_ref["digest"],
        "r": config.get("r"),
        "lora_alpha": config.get("lora_alpha"),
        "target_modules": _targets(config.get("target_modules")),
        **c,
    }


def _targets(value: Any) -> list[str] | str:
    """adapter_config.json's target_modules: the names peft adapted (a list), or the regex it matched."""
    return value if isinstance(value, str) else sorted(value or [])
