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
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)  # everything peft reads, and all the artifact holds besides its provenance


def adapter_logits(adapter_dir: Path, base_dir: Path):
    """Logits of `base_dir` (fp32) with the adapter in `adapter_dir` applied through peft."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32, use_safetensors=True)
    return model_logits(PeftModel.from_pretrained(base, str(adapter_dir)).eval(), base.config.vocab_size)


def build_adapter_dir(adapter_src: Path, dst: Path, base_dir: Path, export_dir: Path, *, base_ref: dict[str, str], rtol: float,
                      verify_memory_gb: float | None = None) -> dict[str, Any]:
    """`dst` = the adapter of `adapter_src` (a checkpoint's adapter/) with `base_model_name_or_path`
    set to `base_ref["name_or_path"]`; returns its verification record against `export_dir`.

    `base_ref`: `name_or_path` (cpt/hf's URI: what AutoPeftModel loads) and `digest` (its manifest digest).
    `verify_memory_gb`: the merged export's logits are streamed above it (hf_dir_logits); peft's
    side holds the fp32 base whole, as the merge itself does.
    """
    missing = [n for n in ADAPTER_FILES if not (adapter_src / n).is_file()]
    if missing:
        raise ConversionError(f"{adapter_src}: no {', '.join(missing)}: not a peft adapter saved as safetensors; re-run train_sft")
    config = json.loads((adapter_src / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = base_ref["name_or_path"]
    (dst / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(adapter_src / ADAPTER_WEIGHTS, dst / ADAPTER_WEIGHTS)
    c = compare_logits(hf_dir_logits(export_dir, budget_gb=verify_memory_gb), adapter_logits(dst, base_dir), rtol)
    if not c["fingerprint_match"]:
        raise ConversionError(
            f"{dst}: peft's logits of this adapter on {base_dir} differ from the merged export {export_dir} "
            f"(relative {c['fingerprint_rel_diff']:.3g} > {rtol:g}, {c['top1_disagreements_beyond_tolerance']} top-1 flips): "
            "the adapter and the merged model are not the same model; delete both and re-run the export"
        )
    return {"against": str(export_dir), "base_model_name_or_path": base_ref["name_or_path"], "base_is": "local",
            "base_digest": base_ref["digest"], "r": config.get("r"), "lora_alpha": config.get("lora_alpha"),
            "target_modules": sorted(config.get("target_modules") or []), **c}
