"""The plugin factory: a validated `PluginConfig` -> a ColossalAI booster plugin.

This module is the only import of `colossalai.booster.plugin` in the project. It runs inside a
torchrun rank after `colossalai.launch_from_torch` (plugins build process groups in __init__).
`check_supported` is pure and runs before anything heavy is loaded:

    python -c "from tasks.engine.builders import check_supported; from tasks.core.config.schema import PluginConfig; check_supported(PluginConfig(name='gemini'), 'sft', cuda=False)"

What works on CPU (gloo, with `tasks.engine.cpu_compat`), measured with colossalai 0.5.0:
hybrid_parallel tp=2 / pp=2 (fp32, bf16), hybrid_parallel zero_stage=1 (bf16),
low_level_zero stage 1/2 (bf16), torch_ddp (fp32, bf16 via torch.autocast). Gemini boosts and
saves on CPU, but every forward asserts that its chunks live on CUDA, so it is refused up front.

A plugin is its `BUILDERS` row (`Builder`: the class, and a function of the config giving its
arguments) plus the flags of the kernels that are on (`tasks.core.config.kernels`, via "plugin");
`plugin_kwargs` computes them all without constructing the plugin:

    python -c "from tasks.engine.builders import plugin_kwargs; from tasks.core.config.kernels import Facts, resolve; \
from tasks.core.config.layout import ParallelLayout; from tasks.core.config.schema import PhaseConfig, PluginConfig; \
phase_cfg = PhaseConfig.model_construct(plugin=PluginConfig(name='hybrid_parallel'), kernels={}, activation_checkpointing=False, grad_accum_steps=1); \
print(plugin_kwargs(phase_cfg.plugin, phase_cfg, ParallelLayout('hybrid_parallel', 1, 1, 1, 1, 0, 'bf16', 1), True, resolve(phase_cfg, 'cpt', Facts(cuda=True))))"
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tasks.core.config.kernels import Facts, KernelState, passed, resolve
from tasks.core.config.layout import ParallelLayout, layout_problems, num_microbatches
from tasks.core.config.phases import Phase
from tasks.core.config.plugins import LOSS_SCALE, PRECISION_SPECS, spec_of
from tasks.core.config.schema import PhaseConfig, PluginConfig
from tasks.core.config.sequence import SP_MODES, sp_size
from tasks.core.errors import ConfigError
from tasks.core.models.families import policy_problem, sp_family_problem
from tasks.core.models.policy_rows import shard_settings
from tasks.core.models.tp_plan import PLAN_ROWS
from tasks.engine import lean_save, solo_ddp

__all__ = [
    "BUILDERS",
    "Builder",
    "Layout",
    "booster_mixed_precision",
    "build_plugin",
    "can_no_sync",
    "check_model",
    "check_supported",
    "layout_of",
    "loss_scale_kwargs",
    "make_plugin",
    "num_microbatches",
    "offload_kwargs",
    "phase_kernels",
    "plugin_kwargs",
    "plugin_meta",
    "sequence_kwargs",
    "uses_autocast",
]


def _phase_cfg_of(plugin_cfg: PluginConfig) -> PhaseConfig:
    """A PhaseConfig around a lone PluginConfig, for the rules that read only the plugin."""
    return PhaseConfig.model_construct(plugin=plugin_cfg)


def check_supported(plugin_cfg: PluginConfig, phase: Phase, cuda: bool | None = None) -> None:
    """Refuse layouts that cannot run on this machine, naming the config field and the fix."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    problems = layout_problems(_phase_cfg_of(plugin_cfg), phase, cuda=cuda, tiers=("device",))
    if problems:
        raise ConfigError(problems, header=f"phase {phase} cannot run on this machine")


def check_model(phase_cfg: PhaseConfig, model_config: dict[str, Any], phase: Phase) -> None:
    """The layout rules that need the model (tp divides heads and the vocabulary, pp <= layers),
    against the model actually built: the same rules pre-flight ran on config.json."""
    problems = layout_problems(phase_cfg, phase, model_config=model_config, tiers=("model",))
    problems += [
        p
        for p in (policy_problem(model_config, phase_cfg, phase), sp_family_problem(model_config, phase_cfg, phase))
        if p
    ]
    if problems:
        raise ConfigError(problems, header=f"phase {phase} cannot shard this model")


# -- builders: one per registry row (tasks/core/config/plugins.py) ---------------------------------------


def loss_scale_kwargs(p: PluginConfig) -> dict[str, Any]:
    """ColossalAI's DynamicGradScaler settings for a precision that scales the loss (fp16), else none."""
    if not PRECISION_SPECS[p.precision].loss_scaling:
        return {}
    return dataclasses.asdict(LOSS_SCALE)


def _hybrid_parallel(p: PluginConfig, phase_cfg: PhaseConfig, layout: ParallelLayout, cuda: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        tp_size=p.tp_size,
        pp_size=p.pp_size,
        zero_stage=p.zero_stage,
        precision=p.precision,
        max_norm=p.max_norm,
        # ZeRO's overlapped reduction calls Tensor.record_stream, which CPU tensors lack.
        overlap_communication=cuda,
        # Each shardformer kernel is its own flag, set from the kernel registry (kernel_kwargs):
        # enable_all_optimization would also switch on sequence overlap and ignore what is installed.
        enable_all_optimization=False,
        # No vocabulary padding: ColossalAI 0.5.0 pads embeddings/LM head to a multiple of
        # 64*tp by default, and then cannot save the optimizer state of the padded rows
        # (AssertionError in checkpoint_io.utils.search_tp_partition_dim); its PaddingLMHead
        # would also pad without tp. 1 pads only when tp does not divide the vocabulary,
        # which the layout rules refuse up front.
        make_vocab_size_divisible_by=1,
        **loss_scale_kwargs(p),
        **sequence_kwargs(p),
    )
    if p.pp_size > 1:
        kwargs.update(num_microbatches=layout.num_microbatches, pp_style="1f1b")
        if phase_cfg.activation_checkpointing:
            # Shardformer's Llama/Qwen2 forwards checkpoint the decoder layers when the HF model's
            # gradient_checkpointing flag is set (accel.checkpoint_activations); with a pipeline this
            # config says how many of each stage's layers: all. Without a pipeline the forward reads
            # it through the stage manager, which is None there (AttributeError in 0.5.0), so it is
            # passed only with pp > 1; every layer is checkpointed either way.
            from colossalai.shardformer import PipelineGradientCheckpointConfig

            kwargs["gradient_checkpoint_config"] = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=1.0)
    return kwargs


def sequence_kwargs(p: PluginConfig) -> dict[str, Any]:
    """HybridParallelPlugin's sequence-parallel arguments from the SP_MODES row: sp_size 1 for a mode that
    splits over the tp group (the plugin warns when it is given another and uses tp_size).

    Shardformer's sequence-parallel attention without flash attention adds the mask it is handed and nothing
    else, and transformers' sdpa model hands it None (causality left to sdpa's is_causal): attention would see
    the future. With enable_flash_attention it goes through ColoAttention's causal path instead (on CUDA
    flash-attn or torch SDPA; on CPU torch SDPA through tasks/engine/cpu_compat.py)."""
    sp = p.sequence_parallelism
    if sp is None:
        return {}
    spec = SP_MODES[sp.mode]
    return dict(
        enable_sequence_parallelism=True,
        sequence_parallelism_mode=sp.mode,
        sp_size=1 if spec.shares_tp else spec.size(sp.size, p.tp_size),
        enable_flash_attention=True,
    )


def _low_level_zero(p: PluginConfig, phase_cfg: PhaseConfig, layout: ParallelLayout, cuda: bool) -> dict[str, Any]:
    return dict(
        stage=p.zero_stage,
        precision=p.precision,
        max_norm=p.max_norm,
        overlap_communication=cuda,
        **loss_scale_kwargs(p),
    )  # record_stream again


def _torch_ddp(p: PluginConfig, phase_cfg: PhaseConfig, layout: ParallelLayout, cuda: bool) -> dict[str, Any]:
    return {}


def _gemini(p: PluginConfig, phase_cfg: PhaseConfig, layout: ParallelLayout, cuda: bool) -> dict[str, Any]:
    return dict(
        precision=p.precision,
        max_norm=p.max_norm,
        enable_gradient_accumulation=phase_cfg.grad_accum_steps > 1,
        **loss_scale_kwargs(p),
    )


@dataclass(frozen=True)
class Builder:
    """How one registry row's plugin is built: its class and its arguments, apart, so the arguments
    can be computed (and tested) without constructing the plugin or a process group."""

    factory: str | Callable[..., Any]  # "module:Class", imported when the plugin is built; or a callable
    kwargs: Callable[[PluginConfig, PhaseConfig, ParallelLayout, bool], dict[str, Any]]
    # Run before the plugin is built: a fix to the library's plugin module (idempotent; returns
    # what it patched, for the log), e.g. hybrid_parallel's DDP over one rank (tasks/engine/solo_ddp.py).
    patch: Callable[[], list[str]] | None = None


def _hybrid_parallel_patches() -> list[str]:
    return solo_ddp.apply() + lean_save.apply()


BUILDERS: dict[str, Builder] = {
    "hybrid_parallel": Builder(
        "colossalai.booster.plugin:HybridParallelPlugin", _hybrid_parallel, patch=_hybrid_parallel_patches
    ),
    "low_level_zero": Builder("colossalai.booster.plugin:LowLevelZeroPlugin", _low_level_zero, patch=lean_save.apply),
    "torch_ddp": Builder("colossalai.booster.plugin:TorchDDPPlugin", _torch_ddp),
    "gemini": Builder("colossalai.booster.plugin:GeminiPlugin", _gemini),
}


def phase_kernels(
    phase_cfg: PhaseConfig, phase: str, cuda: bool, model_type: str | None = None
) -> dict[str, KernelState]:
    """The registry's decision for this stage on this machine (installed packages looked up, nothing loaded)."""
    return resolve(phase_cfg, phase, Facts.detect(cuda=cuda, model_type=model_type))


def plugin_kwargs(
    plugin_cfg: PluginConfig,
    phase_cfg: PhaseConfig,
    layout: ParallelLayout,
    cuda: bool,
    kernels: Mapping[str, KernelState],
    phase: str = "phase",
    model_type: str | None = None,
) -> dict[str, Any]:
    """Every argument the plugin is built with: its builder's, its memory savers (`PluginSpec.offload`,
    each a PluginConfig field of the plugin argument's name), plus the flags of the kernels that are
    on and pass through the plugin (`tasks.core.config.kernels`, via "plugin"), plus, for a plugin that
    shards with a policy, the shardformer flags the model family's policy row needs whatever the kernels
    say (`policy_rows.shard_settings`: Cohere's and GPT-2's forwards run only with flash attention on)."""
    builder = _builder(plugin_cfg, phase)
    return {
        **builder.kwargs(plugin_cfg, phase_cfg, layout, cuda),
        **offload_kwargs(plugin_cfg),
        **passed(kernels, "plugin"),
        **(shard_settings(model_type)[1] if spec_of(plugin_cfg.name).shardformer else {}),
        **(plan_policy_kwargs(model_type) if spec_of(plugin_cfg.name).shardformer else {}),
    }


def plan_policy_kwargs(model_type: str | None) -> dict[str, Any]:
    """`custom_policy`: the derived tensor-parallel policy, for a family with a row in
    `tasks.core.models.tp_plan.PLAN_ROWS` (read from the model's own plan; ColossalAI has no policy for these)."""
    row = PLAN_ROWS.get(model_type or "")
    if row is None:
        return {}
    from tasks.engine.plan_policy import PlanPolicy

    return {"custom_policy": PlanPolicy(row)}


def offload_kwargs(plugin_cfg: PluginConfig) -> dict[str, Any]:
    """The plugin's own offload arguments, as its registry row lists them (the layout rules refused
    a field set under a plugin without it)."""
    return {o.field: getattr(plugin_cfg, o.field) for o in spec_of(plugin_cfg.name).offload}


def _builder(plugin_cfg: PluginConfig, phase: Phase) -> Builder:
    builder = BUILDERS.get(plugin_cfg.name)
    if builder is None:
        raise ConfigError(
            [
                (
                    f"{phase}.plugin.name",
                    (
                        f"plugin {plugin_cfg.name!r} is registered but the engine has no builder for it "
                        "(tasks/engine/builders.py BUILDERS)"
                    ),
                )
            ]
        )
    return builder


def build_plugin(
    plugin_cfg: PluginConfig,
    phase_cfg: PhaseConfig,
    layout: ParallelLayout,
    cuda: bool,
    kernels: Mapping[str, KernelState] | None = None,
    phase: str = "phase",
    model_type: str | None = None,
):
    """The plugin object from `plugin_kwargs`. Needs an initialized process group."""
    builder = _builder(plugin_cfg, phase)
    if builder.patch is not None:
        builder.patch()
    factory = builder.factory
    if isinstance(factory, str):
        module, _, name = factory.partition(":")
        factory = getattr(importlib.import_module(module), name)
    return factory(**plugin_kwargs(plugin_cfg, phase_cfg, layout, cuda, kernels or {}, phase, model_type))


def make_plugin(
    plugin_cfg: PluginConfig,
    phase_cfg: PhaseConfig,
    phase: str = "phase",
    cuda: bool | None = None,
    kernels: Mapping[str, KernelState] | None = None,
    model_type: str | None = None,
):
    """Build the ColossalAI plugin for this stage. Needs an initialized process group. `kernels`:
    the stage's kernels as the engine loaded them (`tasks.engine.accel`); None resolves them here.
    `model_type`: config.json's, for the shardformer flags its policy row needs."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    check_supported(plugin_cfg, phase, cuda)
    layout = ParallelLayout.of(phase_cfg, phase, cuda=cuda, tiers=("static", "batch", "device"))
    _builder(plugin_cfg, phase)
    if kernels is None:
        kernels = phase_kernels(phase_cfg, phase, cuda)
    return build_plugin(plugin_cfg, phase_cfg, layout, cuda, kernels, phase, model_type)


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
    sp_rank: int = 0  # in a sequence group of its own (all_to_all, ring_attn); 0 otherwise

    @property
    def holds_loss(self) -> bool:
        # One loss per data-parallel replica: the last pipeline stage, tensor- and sequence-parallel rank 0
        # (every rank of a sequence group computes the same loss, reduced over the group).
        return self.is_last_stage and self.tp_rank == 0 and self.sp_rank == 0


def layout_of(plugin, plugin_cfg: PluginConfig) -> Layout:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if spec_of(plugin_cfg.name).supports_tp_pp:
        sm = plugin.stage_manager
        # Under a sequence group of its own the plugin's dp_size counts dp x sp (its gradients' group); the
        # data's replicas are the dp group alone: every rank of one sequence group reads the same rows.
        sp = plugin_cfg.sequence_parallelism
        own_sp = sp is not None and not SP_MODES[sp.mode].shares_tp
        return Layout(
            world_size=world,
            rank=rank,
            dp_size=dist.get_world_size(plugin.dp_group),
            dp_rank=dist.get_rank(plugin.dp_group),
            tp_rank=dist.get_rank(plugin.tp_group),
            is_last_stage=sm is None or sm.is_last_stage(),
            tp_group=plugin.tp_group if plugin.tp_size > 1 else None,
            sp_rank=dist.get_rank(plugin.sp_group) if own_sp else 0,
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
    return FP16TorchMixedPrecision(
        init_scale=s.initial_scale,
        growth_factor=s.growth_factor,
        backoff_factor=s.backoff_factor,
        growth_interval=s.growth_interval,
    )


def can_no_sync(plugin_cfg: PluginConfig) -> bool:
    """Whether gradient accumulation may skip the all-reduce of intermediate micro-batches."""
    return spec_of(plugin_cfg.name).can_no_sync(plugin_cfg.zero_stage)


def plugin_meta(plugin_cfg: PluginConfig, phase_cfg: PhaseConfig) -> dict[str, Any]:
    p = plugin_cfg
    meta = {
        "name": p.name,
        "tp": p.tp_size,
        "pp": p.pp_size,
        "zero": p.zero_stage,
        "precision": p.precision,
        "max_norm": p.max_norm,
    }
    if p.pp_size > 1:
        meta["num_microbatches"] = num_microbatches(phase_cfg)
    if p.sequence_parallelism is not None:
        meta["sp"] = {"mode": p.sequence_parallelism.mode, "size": sp_size(p)}
    spec = spec_of(p.name)
    for extra in (*spec.extra_meta, *(o.field for o in spec.offload)):
        meta[extra] = getattr(p, extra)
    return meta
