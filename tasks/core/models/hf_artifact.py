"""Build an HF-format artifact from a ColossalAI checkpoint, without torchrun or a GPU.

Shared by the unshard stage (the plugin-A -> plugin-B bridge) and the export stage. The weights go
through the streaming converter (`tasks.core.models.convert`); config, generation config and tokenizer
files come from the model the stage started from; then the proof: every tensor bitwise the checkpoint's (`tasks.core.models.convert.proof`), then plain
`transformers` loads the result and its logits on the probe batch must match the checkpoint's
fingerprint within a tolerance relative to their magnitude, with top-1 agreeing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.core.errors import ConversionError
from tasks.core.models.convert import convert_checkpoint
from tasks.core.models.convert.proof import prove_weights
from tasks.core.models.fingerprint import (
    TORCH_DTYPE_NAMES,
    compare_logits,
    default_rtol,
    hf_dir_logits,
    load_fingerprint,
    save_fingerprint,
)
from tasks.core.models.folder import is_code, misnamed, set_config_dtype, strip_auto_map
from tasks.core.models.stop_tokens import align_generation_config
from tasks.core.run.manifest import VERIFICATION  # noqa: F401 (where the proof goes: callers import it from here too)

if TYPE_CHECKING:
    from tasks.core.config.outputs import ExportConfig

TOKENIZER_GLOBS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "vocab.*",
    "merges.txt",
    "*.model",
)


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """The tokenizer files of `src` into `dst`, but never one that is not what its name says
    (folder.misnamed), nor code (`tokenizer_x.py`); build_hf_dir removes any `auto_map` after."""
    copied, left_out = [], misnamed(src)
    for pattern in TOKENIZER_GLOBS:
        for path in sorted(src.glob(pattern)):
            if (
                path.is_file()
                and not (dst / path.name).exists()
                and path.name not in left_out
                and not is_code(path.name)
            ):
                shutil.copy2(path, dst / path.name)
                copied.append(path.name)
    return copied


def build_hf_dir(
    checkpoint_dir: Path,
    dst: Path,
    source_model_dir: Path,
    export: ExportConfig,
    *,
    weights_dtype: str,
    bridge: bool = False,
    config_updates: dict[str, Any] | None = None,
    verify_memory_gb: float | None = None,
) -> dict[str, Any]:
    """checkpoint_dir holds `model/` and its fingerprint; returns the verification record.

    Proof first (every tensor bitwise the checkpoint's cast to the output dtype), then the
    logits sanity check, scale-aware. `export`: the run's export section (dtype, shard size, logits
    tolerance, stop-token rule `tasks.core.models.stop_tokens`). `bridge` (the unshard's cpt/hf): only
    the shard size applies; the checkpoint's own dtype, the source's generation config as is, the
    default tolerance. `config_updates`: config.json fields the weights change (a merged LoRA head:
    tie_word_embeddings false). `verify_memory_gb`: above it, the logits check streams the folder a
    layer at a time (bitwise the same).
    """
    dtype, rtol, align_stop_tokens = (
        (None, None, None) if bridge else (export.dtype, export.fingerprint_rtol, export.align_stop_tokens)
    )
    max_shard_size = export.max_shard_size
    model_config = {**json.loads((source_model_dir / "config.json").read_text()), **(config_updates or {})}
    report = convert_checkpoint(
        checkpoint_dir / "model",
        dst,
        model_config=model_config,
        dtype=dtype,
        max_shard_size=max_shard_size,
        write_config=False,
    )
    out_dtype = dtype or weights_dtype
    proof = prove_weights(checkpoint_dir / "model", dst, dtype, dropped=report.dropped)
    # Private keys like `_attn_implementation_autoset` would change the attention kernel on load.
    model_config = {k: v for k, v in model_config.items() if not k.startswith("_")}
    set_config_dtype(model_config, TORCH_DTYPE_NAMES.get(out_dtype, out_dtype))
    (dst / "config.json").write_text(json.dumps(model_config, indent=2, sort_keys=True) + "\n")
    tokenizer_files = copy_tokenizer(source_model_dir, dst)
    # A base/ made before load_from_hf removed them still holds the model's auto_map: it never goes on.
    removed_auto_map = strip_auto_map(dst)
    gen_path = source_model_dir / "generation_config.json"
    stop_tokens = None
    if align_stop_tokens is None:
        if gen_path.is_file():
            shutil.copy2(gen_path, dst / "generation_config.json")
    else:
        from transformers import AutoTokenizer

        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        gen, stop_tokens = align_generation_config(
            gen, model_config, AutoTokenizer.from_pretrained(dst), align=align_stop_tokens
        )
        (dst / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")

    removed_auto_map += strip_auto_map(dst)  # generation_config.json's, if it had one
    logits = hf_dir_logits(dst, verify_memory_gb=verify_memory_gb)
    check = compare_logits(
        logits, load_fingerprint(checkpoint_dir), rtol if rtol is not None else default_rtol(out_dtype, weights_dtype)
    )
    fingerprint = save_fingerprint(logits, dst, out_dtype)
    verification = {
        "tensors": report.num_tensors,
        "bytes": report.total_bytes,
        "dtype": out_dtype,
        "weights_bitwise": proof,
        "shapes": {k: list(v) for k, v in sorted(report.shapes.items())},
        "tokenizer_files": tokenizer_files,
        **check,
        "convert_seconds": report.seconds,
    }
    if stop_tokens is not None:
        verification["stop_tokens"] = stop_tokens
    if removed_auto_map:
        verification["removed_auto_map"] = removed_auto_map
    if not check["fingerprint_match"]:
        raise ConversionError(
            f"{dst}: the weights are bitwise the checkpoint's, but plain transformers' logits on the probe batch "
            "differ from the "
            f"checkpoint's fingerprint by {check['fingerprint_rel_diff']:.3g} of their magnitude (> "
            f"{check['fingerprint_rtol']:g}; "
            f"max |Δ| {check['fingerprint_max_abs_diff']:.3g}, max |logit| {check['fingerprint_max_abs_logit']:.3g}) "
            "with "
            f"{check['top1_disagreements_beyond_tolerance']} top-1 disagreements beyond it: the folder loads "
            "differently from "
            "what was trained (config.json, tied weights or dtype); export.fingerprint_rtol sets the tolerance"
        )
    return {"verification": verification, "fingerprint": fingerprint, "known_hashes": report.files}
