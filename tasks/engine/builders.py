"""The plugin factory: a validated `PluginConfig` -> a ColossalAI booster plugin.

This module is the only import of `colossalai.booster.plugin` in the project. It runs inside a
torchrun rank after `colossalai.launch_from_torch` (plugins build process groups in __init__).
`check_supported` is pure and runs before anything heavy is loaded:

    python -c "from tasks.engine.builders import check_supported; from tasks.core.config.schema import PluginConfig; check_supported(PluginConfig(name='gemini'), 'sft', cuda=False)"

What works on CPU (gloo, with `tasks.engine.cpu_compat`), measured with colossalai 0.5.0:
hybrid_parallel tp=2 / pp=2 (fp32, bf16), hybrid_parallel zero_stage=1 (bf16),
low_level_zero stage 1/2 (bf16), torch_ddp (fp32, bf16 via torch.autocast). Gemini boosts and
saves on CPU, but every forward asserts that its chunks live on CUDA, so it is refused up front.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tasks.core.config.layout import ParallelLayout, layout_problems, num_microbatches
from tasks.core.config.plugins import LOSS_SCALE, PRECISION_SPECS, spec_of
from tasks.core.config.schema import PluginConfig, StageConfig
from tasks.core.errors import ConfigError

__all__ = [
    "BUILDERS",
    "Layout",
    "booster_mixed_precision",
    "can_no_sync",
    "check_model",
    "check_supported",
    "layout_of",
    "loss_scale_kwargs",
    "make_plugin",
    "num_microbatches",
    "plugin_meta",
    "uses_autocast",
]


def _stage_of(plugin_cfg: PluginConfig) -> StageConfig:
    """A StageConfig around a lone PluginConfig, for the rules that read only the plugin."""
    return StageConfig.model_construct(plugin=plugin_cfg)


def check_supported(plugin_cfg: PluginConfig, stage: str, cuda: bool | None = None) -> None:
    """Refuse layouts that cannot run on this machine, naming the config field and the fix."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    problems = layout_problems(_stage_of(plugin_cfg), stage, cuda=cuda, tiers=("device",))
    if problems:
        raise ConfigError(problems, header=f"stage {stage} cannot run on this machine")


def check_model(stage_cfg: StageConfig, model_config: dict[str, Any], stage: str) -> None:
    """The layout rules that need the model (tp divides heads and the vocabulary, pp <= layers),
    against the model actually built: the same rules pre-flight ran on config.json."""
    problems = layout_problems(stage_cfg, stage, model_config=model_config, tiers=("model",))
    if problems:
        raise ConfigError(problems, header=f"stage {stage} cannot shard this model")


# -- builders: one per registry row (tasks/core/config/plugins.py) ---------------------------------------


def loss_scale_kwargs(p: PluginConfig) -> dict[str, Any]:
    """ColossalAI's DynamicGradScaler settings for a precision that scales the loss (fp16), else none."""
    if not PRECISION_SPECS[p.precision].loss_scaling:
        return {}
    return dataclasses.asdict(LOSS_SCALE)


def _hybrid_parallel(p: PluginConfig, stage_cfg: StageConfig, layout: ParallelLayout, cuda: bool):
    from colossalai.booster.plugin import HybridParallelPlugin

    kwargs: dict[str, Any] = dict(
        tp_size=p.tp_size,
        pp_size=p.pp_size,
        zero_stage=p.zero_stage,
        precision=p.precision,
        max_norm=p.max_norm,
        # ZeRO's overlapped reduction calls Tensor.record_stream, which CPU tensors lack.
        overlap_communication=cuda,
        # Fused kernels and flash attention need CUDA builds; the plain HF modules are exact.
        enable_all_optimization=False,
        # No vocabulary padding: ColossalAI 0.5.0 pads embeddings/LM head to a multiple of
        # 64*tp by default, and then cannot save the optimizer state of the padded rows
        # (AssertionError in checkpoint_io.utils.search_tp_partition_dim); its PaddingLMHead
        # would also pad without tp. 1 pads only when tp does not divide the vocabulary,
        # which the layout rules refuse up front.
        make_vocab_size_divisible_by=1,
        **loss_scale_kwargs(p),
    )
    if p.pp_size > 1:
        kwargs.update(num_microbatches=layout.num_microbatches, pp_style="1f1b")
    return HybridParallelPlugin(**kwargs)


def _low_level_zero(p: PluginConfig, stage_cfg: StageConfig, layout: ParallelLayout, cuda: bool):
    from colossalai.booster.plugin import LowLevelZeroPlugin

    return LowLevelZeroPlugin(stage=p.zero_stage, precision=p.precision, max_norm=p.max_norm, overlap_communication=cuda, **loss_scale_kwargs(p))  # record_stream again


def _torch_ddp(p: PluginConfig, stage_cfg: StageConfig, layout: ParallelLayout, cuda: bool):
    from colossalai.booster.plugin import TorchDDPPlugin

    return TorchDDPPlugin()


def _gemini(p: PluginConfig, stage_cfg: StageConfig, layout: ParallelLayout, cuda: bool):
    from colossalai.booster.plugin import GeminiPlugin

    return GeminiPlugin(
        precision=p.precision, placement_policy=p.placement_policy, max_norm=p.max_norm,
        enable_gradient_accumulation=stage_cfg.grad_accum_steps > 1, **loss_scale_kwargs(p),
    )


Builder = Callable[[PluginConfig, StageConfig, ParallelLayout, bool], Any]
BUILDERS: dict[str, Builder] = {
    "hybrid_parallel": _hybrid_parallel,
    "low_level_zero": _low_level_zero,
    "torch_ddp": _torch_ddp,
    "gemini": _gemini,
}


def make_plugin(plugin_cfg: PluginConfig, stage_cfg: StageConfig, stage: str = "stage", cuda: bool | None = None):
    """Build the ColossalAI plugin for this stage. Needs an initialized process group."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    check_supported(plugin_cfg, stage, cuda)
    layout = ParallelLayout.of(stage_cfg, stage, cuda=cuda, tiers=("static", "batch", "device"))
    builder = BUILDERS.get(plugin_cfg.name)
    if builder is None:
        raise ConfigError([(f"{stage}.plugin.name", f"plugin {plugin_cfg.name!r} is registered but the engine has no builder for it (tasks/engine/builders.py BUILDERS)")])
    return builder(plugin_cfg, stage_cfg, layout, cuda)


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: which data it reads and whether it holds the loss."""

    world_size: int
    rank: int
    dp_size: int
    dp_rank: int
    tp_rank: int
    is_last_stage: bool
    tp_group: Any = None

    @property
    def holds_loss(self) -> bool:
        # One loss per data-parallel replica: the last pipeline stage, tensor-parallel rank 0.
        return self.is_last_stage and self.tp_rank == 0


def layout_of(plugin, plugin_cfg: PluginConfig) -> Layout:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if spec_of(plugin_cfg.name).supports_tp_pp:
        sm = plugin.stage_manager
        return Layout(
            world_size=world,
            rank=rank,
            dp_size=plugin.dp_size,
            dp_rank=dist.get_rank(plugin.dp_group),
            tp_rank=dist.get_rank(plugin.tp_group),
            is_last_stage=sm is None or sm.is_last_stage(),
            tp_group=plugin.tp_group if plugin.tp_size > 1 else None,
        )
    return Layout(world_size=world, rank=rank, dp_size=world, dp_rank=rank, tp_rank=0, is_last_stage=True)


_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def uses_autocast(plugin_cfg: PluginConfig) -> torch.dtype | None:
    """A plugin that does not cast the model (torch_ddp): bf16 means fp32 weights under torch.autocast."""
    name = spec_of(plugin_cfg.name).autocast(plugin_cfg.precision)
    return _TORCH_DTYPES[name] if name else None


def booster_mixed_precision(plugin_cfg: PluginConfig):
    """fp16 on a plugin that does not cast the model (CUDA only, see the layout rules): ColossalAI's
    torch.cuda.amp wrapper, its GradScaler set from LOSS_SCALE like every other fp16 plugin."""
    name = spec_of(plugin_cfg.name).booster_mixed_precision(plugin_cfg.precision)
    if name != "fp16":
        return name
    from colossalai.booster.mixed_precision import FP16TorchMixedPrecision

    s = LOSS_SCALE
    return FP16TorchMixedPrecision(init_scale=s.initial_scale, growth_factor=s.growth_factor, backoff_factor=s.backoff_factor, growth_interval=s.growth_interval)


def can_no_sync(plugin_cfg: PluginConfig) -> bool:
    """Whether gradient accumulation may skip the all-reduce of intermediate micro-batches."""
    return spec_of(plugin_cfg.name).can_no_sync(plugin_cfg.zero_stage)


def plugin_meta(plugin_cfg: PluginConfig, stage_cfg: StageConfig) -> dict[str, Any]:
    p = plugin_cfg
    meta = {"name": p.name, "tp": p.tp_size, "pp": p.pp_size, "zero": p.zero_stage, "precision": p.precision, "max_norm": p.max_norm}
    if p.pp_size > 1:
        meta["num_microbatches"] = num_microbatches(stage_cfg)
    for extra in spec_of(p.name).extra_meta:
        meta[extra] = getattr(p, extra)
    return meta
