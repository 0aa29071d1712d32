"""Model FLOPs per token and the peak FLOP/s of common accelerators: what MFU is measured against.

    python -m tasks.core.models.flops "NVIDIA H100 80GB HBM3" bf16     # prints the peak FLOP/s it knows

MFU = achieved model FLOP/s / (peak FLOP/s of one device x devices). The model FLOPs of one
trained token are 6*N (forward + backward over every parameter, embeddings included, as in the
PaLM paper's appendix B) plus the attention term 12 * layers * hidden * seq_len, which the
parameter count does not see. Peaks are the vendors' dense (no 2:4 sparsity) tensor-core figures
for bf16/fp16 and the plain FP32 (non-tensor-core) figure for fp32. A device not in the table gets
no MFU rather than a guessed one; CPUs never get one.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

# Substring of torch.cuda.get_device_name() -> peak FLOP/s per precision. Order matters: the first
# matching substring wins, so the more specific names (H100 PCIe) come before the general ones.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}),
    ("H100 PCIe", {"bf16": 756.0e12, "fp16": 756.0e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}),
    ("A100", {"bf16": 312.0e12, "fp16": 312.0e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362.05e12, "fp16": 362.05e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121.0e12, "fp16": 121.0e12, "fp32": 30.3e12}),
    ("A10G", {"bf16": 70.0e12, "fp16": 70.0e12, "fp32": 31.2e12}),
    ("A10", {"bf16": 125.0e12, "fp16": 125.0e12, "fp32": 31.2e12}),
    ("V100", {"fp16": 125.0e12, "fp32": 15.7e12}),
)


def peak_flops(device_name: str | None, precision: str) -> float | None:
    """Peak FLOP/s of one device at `precision`, or None when the device is not in the table."""
    if not device_name:
        return None
    for key, peaks in PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return peaks.get(precision)
    return None


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs (forward + backward) of one token: 6N + 12 * layers * hidden * seq_len."""
    return 6.0 * n_params + 12.0 * n_layers * hidden * seq_len


def config_flops_per_token(model_config: Mapping[str, Any], seq_len: int) -> float:
    """`flops_per_token` of the model a config.json describes, N from its family's tensor table: what the
    engine computes from the built model, for a caller that has only the config (benchmarks/gpu_check.py)."""
    from tasks.core.models.families import count_parameters

    layers, hidden = int(model_config["num_hidden_layers"]), int(model_config["hidden_size"])
    return flops_per_token(count_parameters(model_config), layers, hidden, seq_len)


def mfu(tokens_per_s: float, per_token: float, peak_per_device: float | None, devices: int) -> float | None:
    if not peak_per_device or devices < 1:
        return None
    return tokens_per_s * per_token / (peak_per_device * devices)


if __name__ == "__main__":
    name, precision = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "bf16")
    print(peak_flops(name, precision))
