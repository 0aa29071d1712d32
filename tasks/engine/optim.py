"""The stage's optimizer and learning-rate schedule, as every plugin gets them.

    python -c "from tasks.engine.optim import lr_factor; print([round(lr_factor(s, warmup=2, max_steps=10, schedule='cosine', min_ratio=0.1), 3) for s in range(10)])"

AdamW for every plugin that takes a torch optimizer (with the fused kernel's arguments where it is
on, tasks/engine/accel.py), ColossalAI's HybridAdam where the plugin accepts nothing else (Gemini);
a LambdaLR of `lr_factor`: linear warm-up, then constant, cosine or linear decay to min_lr.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tasks.core.config.plugins import spec_of


def lr_factor(step: int, *, warmup: int, max_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step + 1` (LambdaLR counts from 0)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup) / max(1, max_steps - warmup)))
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * (1.0 - progress)


def make_scheduler(optimizer, phase_cfg):
    kw = dict(
        warmup=phase_cfg.warmup_steps,
        max_steps=phase_cfg.max_steps,
        schedule=phase_cfg.lr_schedule,
        min_ratio=phase_cfg.min_lr / phase_cfg.lr,
    )

    def factor(step: int) -> float:  # a plain function: LambdaLR stores nothing of it
        return lr_factor(step, **kw)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_optimizer(model: torch.nn.Module, phase_cfg, plugin_name: str, **kernels: Any) -> torch.optim.Optimizer:
    """`kernels`: AdamW arguments of the kernels that are on (accel.optimizer_kwargs: fused=True)."""
    kw = dict(lr=phase_cfg.lr, betas=tuple(phase_cfg.betas), weight_decay=phase_cfg.weight_decay)
    # Frozen weights (a LoRA base) get no Adam state; under full fine-tuning this is every parameter.
    params = [p for p in model.parameters() if p.requires_grad]
    if spec_of(plugin_name).optimizer == "hybrid_adam":
        # GeminiOptimizer accepts only ColossalAI's own Adam kernels (CUDA nodes build them).
        from colossalai.nn.optimizer import HybridAdam

        return HybridAdam(params, adamw_mode=True, **kw)
    return torch.optim.AdamW(params, **kw, **kernels)
