"""Fingerprints: a model's logits on a fixed probe batch, stored beside the weights.

The probe batch depends only on the vocabulary size, so a fingerprint taken under a plugin at
save time can be compared with one taken by plain `transformers` on an export. Logits are kept
in fp32 in `fingerprint.safetensors`; the manifest carries a small summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FINGERPRINT_FILE = "fingerprint.safetensors"
PROBE_SEED = 20240607
PROBE_SHAPE = (2, 16)


def probe_batch(vocab_size: int, seed: int = PROBE_SEED, shape: tuple[int, int] = PROBE_SHAPE) -> torch.LongTensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, shape, generator=g, dtype=torch.long)


@torch.no_grad()
def probe_forward(model: torch.nn.Module, vocab_size: int) -> torch.Tensor:
    """The model's raw output logits on the probe batch, in eval mode, where the model lives."""
    device = next(model.parameters()).device
    ids = probe_batch(vocab_size).to(device)
    was_training = model.training
    model.eval()
    out = model(input_ids=ids, use_cache=False)
    if was_training:
        model.train()
    return (out.logits if hasattr(out, "logits") else out[0]).contiguous()


def model_logits(model: torch.nn.Module, vocab_size: int) -> torch.Tensor:
    """Logits of a plain (unwrapped or HF) causal LM on the probe batch, fp32 on CPU."""
    return probe_forward(model, vocab_size)[..., :vocab_size].float().cpu()


def save_fingerprint(logits: torch.Tensor, directory: str | Path, dtype: str) -> dict[str, Any]:
    path = Path(directory) / FINGERPRINT_FILE
    save_file({"logits": logits.contiguous().float()}, str(path))
    return {
        "file": FINGERPRINT_FILE,
        "probe_seed": PROBE_SEED,
        "probe_shape": list(PROBE_SHAPE),
        "dtype": dtype,
        "shape": list(logits.shape),
        "mean_abs": float(logits.abs().mean()),
    }


def load_fingerprint(directory: str | Path) -> torch.Tensor:
    return load_file(str(Path(directory) / FINGERPRINT_FILE))["logits"]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise ValueError(f"fingerprint shapes differ: {tuple(a.shape)} vs {tuple(b.shape)} (vocabulary or probe changed)")
    return float((a.float() - b.float()).abs().max())


DEFAULT_ATOL = {"fp32": 1e-5, "bf16": 0.1, "fp16": 0.02}


_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def hf_dir_logits(model_dir: str | Path, dtype: str | None = None, trust_remote_code: bool = False) -> torch.Tensor:
    """Logits of plain `transformers` on an HF directory: what a user of the artifact will see.

    Loads with safetensors only (`use_safetensors=True`), in the artifact's own dtype unless told.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    torch_dtype = _TORCH_DTYPES[dtype] if dtype else (getattr(config, "torch_dtype", None) or torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch_dtype, use_safetensors=True, trust_remote_code=trust_remote_code, low_cpu_mem_usage=True
    )
    try:
        return model_logits(model, config.vocab_size)
    finally:
        del model
