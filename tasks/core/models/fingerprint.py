"""Fingerprints: a model's logits on a fixed probe batch, stored with the artifact's provenance.

The probe batch depends only on the vocabulary size, so a fingerprint taken under a plugin at
save time can be compared with one taken by plain `transformers` on an export. Logits are kept
in fp32 in `.cpt-to-sft/fingerprint.npy` (numpy's format, read with allow_pickle=False): not a
`.safetensors` file, so no weight loader mistakes it for a shard. The manifest carries a summary.

    python -c "from tasks.core.models.fingerprint import load_fingerprint as f; print(f('runs/demo/export').shape)"

The comparison (`compare_logits`) is a sanity check of the loading path, not the weight proof
(that is `tasks.core.weight_proof`, bitwise): its tolerance is relative to the logits' magnitude,
because rounding error in bf16/fp16 grows with it as training proceeds, and top-1 must agree
wherever the reference's own margin is wider than that tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.core.run.manifest import PROVENANCE_DIR

if TYPE_CHECKING:
    import torch

FINGERPRINT_FILE = f"{PROVENANCE_DIR}/fingerprint.npy"
PROBE_SEED = 20240607
PROBE_SHAPE = (2, 16)


def probe_batch(vocab_size: int, seed: int = PROBE_SEED, shape: tuple[int, int] = PROBE_SHAPE) -> torch.LongTensor:
    import torch  # here, not at the top: the flow process imports this module for its tasks, and a run that skips them never needs torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, shape, generator=g, dtype=torch.long)


def probe_forward(
    model: torch.nn.Module, vocab_size: int, device: torch.device | None = None, as_trained: bool = False
) -> torch.Tensor:
    """The model's raw output logits on the probe batch, in eval mode, where the model lives
    (`device`: where the batch goes when the parameters are on the meta device, streamed). `as_trained`:
    with an all-ones attention_mask and the ids as labels, as a training batch (transformers' logits are
    the same; shardformer's GPT-2 forward reads the mask's size and the loss unconditionally)."""
    import torch

    device = device or next(model.parameters()).device
    ids = probe_batch(vocab_size).to(device)
    batch = {"attention_mask": torch.ones_like(ids), "labels": ids} if as_trained else {}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, **batch)
    if was_training:
        model.train()
    return (out.logits if hasattr(out, "logits") else out[0]).contiguous()


def model_logits(
    model: torch.nn.Module, vocab_size: int, device: torch.device | None = None, as_trained: bool = False
) -> torch.Tensor:
    """Logits of a plain (unwrapped or HF) causal LM on the probe batch, fp32 on CPU."""
    return probe_forward(model, vocab_size, device, as_trained)[..., :vocab_size].float().cpu()


def save_fingerprint(logits: torch.Tensor, directory: str | Path, dtype: str) -> dict[str, Any]:
    path = Path(directory) / FINGERPRINT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.save(f, logits.detach().contiguous().float().cpu().numpy(), allow_pickle=False)
    return {
        "file": FINGERPRINT_FILE,
        "probe_seed": PROBE_SEED,
        "probe_shape": list(PROBE_SHAPE),
        "dtype": dtype,
        "shape": list(logits.shape),
        "mean_abs": float(logits.abs().mean()),
    }


def load_fingerprint(directory: str | Path) -> torch.Tensor:
    import torch

    return torch.from_numpy(np.load(Path(directory) / FINGERPRINT_FILE, allow_pickle=False))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise ValueError(
            f"fingerprint shapes differ: {tuple(a.shape)} vs {tuple(b.shape)} (vocabulary or probe changed)"
        )
    return float((a.float() - b.float()).abs().max())


# max|Δ| / max|reference logits|: a few units in the last place of the dtype, accumulated
# over a forward pass computed by different kernels on each side (plugin vs plain transformers).
DEFAULT_RTOL = {"fp32": 1e-5, "bf16": 0.04, "fp16": 0.005}


def default_rtol(*dtypes: str) -> float:
    """The tolerance of the coarsest precision the weights passed through."""
    return max(DEFAULT_RTOL.get(d, 1e-5) for d in dtypes)


def compare_logits(logits: torch.Tensor, reference: torch.Tensor, rtol: float) -> dict:
    """Relative max difference and top-1 agreement of `logits` against `reference`.

    A top-1 disagreement counts only where the reference's margin between its own choice and
    the other side's choice exceeds the allowed error: a near-tie may flip under rounding.
    """
    a, b = logits.float(), reference.float()
    diff = max_abs_diff(a, b)
    scale = float(b.abs().max()) or 1.0
    allowed = rtol * scale
    top_a, top_b = a.argmax(-1), b.argmax(-1)
    margin = b.gather(-1, top_b.unsqueeze(-1)) - b.gather(-1, top_a.unsqueeze(-1))
    flips = int(((top_a != top_b) & (margin.squeeze(-1) > allowed)).sum())
    rel = diff / scale
    return {
        "fingerprint_max_abs_diff": diff,
        "fingerprint_max_abs_logit": scale,
        "fingerprint_rel_diff": rel,
        "fingerprint_rtol": rtol,
        "top1_agreement": float((top_a == top_b).float().mean()),
        "top1_disagreements_beyond_tolerance": flips,
        "fingerprint_match": rel <= rtol and flips == 0,
    }


# The config's dtype names as torch and config.json's `torch_dtype` spell them.
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name (fp32, bf16, fp16)."""
    import torch

    return getattr(torch, TORCH_DTYPE_NAMES[name])


def hf_dir_logits(
    model_dir: str | Path,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    verify_memory_gb: float | None = None,
    say: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """Logits of plain `transformers` on an HF directory: what a user of the artifact will see.

    Loads with safetensors only, in the artifact's own dtype unless told. A model whose weights in
    that dtype exceed `verify_memory_gb` (the run config's; None: never) is not loaded whole
    but streamed a decoder layer at a time through its own forward (`tasks.core.models.stream`),
    which gives bitwise the same logits in bounded memory. `say`, when given, is told that it streams.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tasks.core.models.stream import meta_model, model_bytes, streaming

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    weights_dtype = torch_dtype(dtype) if dtype else (getattr(config, "dtype", None) or torch.float32)
    if verify_memory_gb is not None:
        meta = meta_model(model_dir, weights_dtype, trust_remote_code)
        if model_bytes(meta) > verify_memory_gb * 1e9:
            if say is not None:
                say(
                    f"logits of {model_dir}: streamed a decoder layer at a time ({model_bytes(meta) / 1e9:.3g} GB of "
                    "weights "
                    f"over verify_memory_gb {verify_memory_gb:g})"
                )
            with streaming(meta, model_dir):
                return model_logits(meta, config.vocab_size, device=torch.device("cpu"))
        del meta
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=weights_dtype,
        use_safetensors=True,
        trust_remote_code=trust_remote_code,
        low_cpu_mem_usage=True,
    )
    try:
        return model_logits(model, config.vocab_size)
    finally:
        del model
