"""Build an HF-format artifact from a ColossalAI checkpoint, without torchrun or a GPU.

Shared by the unshard stage (the plugin-A -> plugin-B bridge) and the export stage. The weights go
through the streaming converter (`tasks.core.convert`); config, generation config and tokenizer
files come from the model the stage started from; then plain `transformers` loads the result and
its logits on the probe batch must match the checkpoint's fingerprint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tasks.core.convert import convert_checkpoint
from tasks.core.errors import ConversionError
from tasks.core.fingerprint import DEFAULT_ATOL, hf_dir_logits, load_fingerprint, max_abs_diff, save_fingerprint

TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "chat_template*", "vocab.*", "merges.txt", "*.model")
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for pattern in TOKENIZER_GLOBS:
        for path in sorted(src.glob(pattern)):
            if path.is_file() and not (dst / path.name).exists():
                shutil.copy2(path, dst / path.name)
                copied.append(path.name)
    return copied


def build_hf_dir(
    checkpoint_dir: Path,
    dst: Path,
    source_model_dir: Path,
    *,
    dtype: str | None,
    max_shard_size: str,
    weights_dtype: str,
    atol: float | None = None,
) -> dict[str, Any]:
    """checkpoint_dir holds `model/` and `fingerprint.safetensors`; returns the verification record."""
    model_config = json.loads((source_model_dir / "config.json").read_text())
    report = convert_checkpoint(checkpoint_dir / "model", dst, model_config=model_config, dtype=dtype, max_shard_size=max_shard_size, write_config=False)
    out_dtype = dtype or weights_dtype
    # Private keys like `_attn_implementation_autoset` would change the attention kernel on load.
    model_config = {k: v for k, v in model_config.items() if not k.startswith("_")}
    model_config["torch_dtype"] = _DTYPE_NAMES.get(out_dtype, out_dtype)
    (dst / "config.json").write_text(json.dumps(model_config, indent=2, sort_keys=True) + "\n")
    gen = source_model_dir / "generation_config.json"
    if gen.is_file():
        shutil.copy2(gen, dst / "generation_config.json")
    tokenizer_files = copy_tokenizer(source_model_dir, dst)

    logits = hf_dir_logits(dst)
    reference = load_fingerprint(checkpoint_dir)
    diff = max_abs_diff(logits, reference)
    # The tolerance follows the coarsest precision the weights passed through.
    tol = atol if atol is not None else max(DEFAULT_ATOL.get(out_dtype, 1e-5), DEFAULT_ATOL.get(weights_dtype, 1e-5))
    fingerprint = save_fingerprint(logits, dst, out_dtype)
    verification = {
        "tensors": report.num_tensors,
        "bytes": report.total_bytes,
        "dtype": out_dtype,
        "shapes": {k: list(v) for k, v in sorted(report.shapes.items())} if hasattr(report, "shapes") else {},
        "tokenizer_files": tokenizer_files,
        "fingerprint_max_abs_diff": diff,
        "fingerprint_atol": tol,
        "fingerprint_match": diff <= tol,
        "convert_seconds": getattr(report, "seconds", None),
    }
    if diff > tol:
        raise ConversionError(
            f"{dst}: logits of the converted model differ from the checkpoint's fingerprint by {diff:.3g} (> {tol:g}); "
            "the weights did not survive the conversion"
        )
    return {"verification": verification, "fingerprint": fingerprint, "known_hashes": report.files}
