"""The plugin factory: a validated `PluginConfig` -> a ColossalAI booster plugin.

This module is the only import of `colossalai.booster.plugin` in the project. It runs inside a
torchrun rank after `colossalai.launch_from_torch` (plugins build process groups in __init__).
`check_supported` is pure and runs before anything heavy is loaded:

    python -c "from tasks.engine.plugins import check_supported; from tasks.core.config import PluginConfig; check_supported(PluginConfig(name='gemini'), 'sft', cuda=False)"

What works on CPU (gloo, with `tasks.engine.cpu_compat`), measured with colossalai 0.5.0:
hybrid_parallel tp=2 / pp=2 (fp32, bf16), hybrid_parallel zero_stage=1 (bf16),
low_level_zero stage 1/2 (bf16), torch_ddp (fp32, bf16 via torch.autocast). Gemini boosts and
saves on CPU, but every forward asserts that its chunks live on CUDA, so it is refused up front.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tasks.core.config import PluginConfig, StageConfig
from tasks.core.errors import ConfigError

def check_supported(plugin_cfg: PluginConfig, stage: str, cuda: bool | None = None) -> None:
    """Refuse layouts that cannot run on this machine, naming the config field and the fix."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    problems: list[tuple[str, str]] = []
    field = f"{stage}.plugin"
    if plugin_cfg.name == "gemini" and not cuda:
        problems.append((
            f"{field}.name",
            "gemini needs CUDA (ColossalAI asserts in every forward that Gemini's chunks live on a GPU) and no GPU "
            "is visible here; on CPU use low_level_zero (zero_stage 1 or 2, precision bf16) or hybrid_parallel, "
            "or run this stage on a CUDA node",
        ))
    if plugin_cfg.name == "torch_ddp" and plugin_cfg.precision == "fp16" and not cuda:
        problems.append((
            f"{field}.precision",
            "torch_ddp runs fp16 through torch.cuda.amp (GradScaler), which needs CUDA; use precision bf16 or fp32 on CPU",
        ))
    if problems:
        raise ConfigError(problems, header=f"stage {stage} cannot run on this machine")


def check_vocab(plugin_cfg: PluginConfig, vocab_size: int, stage: str) -> None:
    """Tensor parallelism splits the vocabulary evenly or not at all (see make_plugin)."""
    tp = plugin_cfg.tp_size if plugin_cfg.name == "hybrid_parallel" else 1
    if tp > 1 and vocab_size % tp:
        raise ConfigError([(
            f"{stage}.plugin.tp_size",
            f"the model's vocab_size {vocab_size} is not a multiple of tp_size {tp}: ColossalAI would pad the embedding "
            "and LM head and then fail to checkpoint their optimizer state; use a tp_size that divides the vocabulary or "
            "resize the embeddings first (model.resize_token_embeddings(n, pad_to_multiple_of=tp_size))",
        )], header=f"stage {stage} cannot shard this model")


def num_microbatches(plugin_cfg: PluginConfig, stage_cfg: StageConfig) -> int:
    return plugin_cfg.num_microbatches or stage_cfg.grad_accum_steps


def make_plugin(plugin_cfg: PluginConfig, stage_cfg: StageConfig, stage: str = "stage", cuda: bool | None = None):
    """Build the ColossalAI plugin for this stage. Needs an initialized process group."""
    from colossalai.booster.plugin import GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin

    cuda = torch.cuda.is_available() if cuda is None else cuda
    check_supported(plugin_cfg, stage, cuda)
    p = plugin_cfg
    name = p.name
    if name == "hybrid_parallel":
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
            # which check_vocab refuses up front.
            make_vocab_size_divisible_by=1,
        )
        if p.pp_size > 1:
            nmb = num_microbatches(p, stage_cfg)
            rows = stage_cfg.micro_batch_size * stage_cfg.grad_accum_steps
            if rows % nmb:
                raise ConfigError([(
                    f"{stage}.plugin.num_microbatches",
                    f"a pipeline step splits micro_batch_size*grad_accum_steps = {rows} sequences per data-parallel rank "
                    f"into {nmb} micro-batches, which does not divide; set num_microbatches to a divisor of {rows}",
                )])
            kwargs.update(num_microbatches=nmb, pp_style="1f1b")
        return HybridParallelPlugin(**kwargs)
    if name == "low_level_zero":
        return LowLevelZeroPlugin(
            stage=p.zero_stage,
            precision=p.precision,
            max_norm=p.max_norm,
            overlap_communication=cuda,  # record_stream again
        )
    if name == "torch_ddp":
        return TorchDDPPlugin()
    if name == "gemini":
        return GeminiPlugin(
            precision=p.precision,
            placement_policy=p.placement_policy,
            max_norm=p.max_norm,
            enable_gradient_accumulation=stage_cfg.grad_accum_steps > 1,
        )
    raise ConfigError([(f"{stage}.plugin.name", f"unknown plugin {name!r}")])


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
    if plugin_cfg.name == "hybrid_parallel":
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


def uses_autocast(plugin_cfg: PluginConfig) -> torch.dtype | None:
    """torch_ddp does not cast the model: bf16 there means fp32 weights under torch.autocast."""
    if plugin_cfg.name == "torch_ddp" and plugin_cfg.precision == "bf16":
        return torch.bfloat16
    return None


def booster_mixed_precision(plugin_cfg: PluginConfig) -> str | None:
    # torch_ddp fp16 (CUDA only, see check_supported): ColossalAI's torch.cuda.amp wrapper.
    if plugin_cfg.name == "torch_ddp" and plugin_cfg.precision == "fp16":
        return "fp16"
    return None


def can_no_sync(plugin_cfg: PluginConfig) -> bool:
    """Whether gradient accumulation may skip the all-reduce of intermediate micro-batches.

    ZeRO-2 partitions gradients as they are reduced, so it must reduce every micro-batch
    (ColossalAI asserts this); Gemini accumulates inside its chunks.
    """
    if plugin_cfg.name == "low_level_zero":
        return plugin_cfg.zero_stage == 1
    if plugin_cfg.name == "gemini":
        return False
    return True


def plugin_meta(plugin_cfg: PluginConfig, stage_cfg: StageConfig) -> dict[str, Any]:
    p = plugin_cfg
    meta = {"name": p.name, "tp": p.tp_size, "pp": p.pp_size, "zero": p.zero_stage, "precision": p.precision, "max_norm": p.max_norm}
    if p.pp_size > 1:
        meta["num_microbatches"] = num_microbatches(p, stage_cfg)
    if p.name == "gemini":
        meta["placement_policy"] = p.placement_policy
    return meta
