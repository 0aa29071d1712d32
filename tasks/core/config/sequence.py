"""Sequence parallelism as data: `<phase>.plugin.sequence_parallelism` and one `SpModeSpec` per mode.

    python -c "from tasks.core.config.sequence import SP_MODES; [print(m, '-', s.summary) for m, s in SP_MODES.items()]"

A sequence-parallel group splits each block of `seq_len` tokens over its ranks, so the longest trainable
context grows with the group instead of being bounded by one rank's activation memory. ColossalAI 0.5.0's
HybridParallelPlugin (`booster/plugin/hybrid_parallel_plugin.py`, `SUPPORT_SP_MODE`) has four modes, read
from its source and its shardformer policies (`shardformer/policies/llama.py`, `qwen2.py`, `mistral.py`):

- `split_gather` and `ring` run inside tensor parallelism: the plugin uses the tp group as the sequence
  group (sp = tp, the world factors as dp x pp x tp) and asserts tp_size > 1; a given sp_size is ignored
  with a warning. The activations between the tensor-parallel regions (norms, residuals) are split, but
  in 0.5.0 each column-parallel linear keeps its gathered input for the backward, which costs more than that
  saves: measured, split_gather trains no longer a context than tp alone (benchmarks/long_context.py).
  `ring` is registered but refused: its weight gradients are wrong in 0.5.0 (the row's `refused`).
- `all_to_all` (DeepSpeed-Ulysses) is its own group (world = dp x pp x tp x sp): each rank holds
  seq_len / sp tokens, and attention swaps that for all tokens of heads / sp heads, so the attention and
  the KV heads must divide by the size. Gradients are reduced over dp x sp together (the plugin's
  mixed_dp_group), and every rank of one sequence group reads the same rows.
- `ring_attn` is its own group too, forces flash attention (the plugin sets enable_flash_attention) and
  needs a causal model (the policy raises otherwise); its ring passes K/V blocks on CUDA streams.

Which families' policies support which mode is the family registry's (`tasks.core.models.families`
`ModelFamily.sp_modes`); the layout rules that refuse what cannot run are `tasks.core.config.sequence_rules`.
Adding a mode is one `SP_MODES` row (a test registers a dummy one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, WithJsonSchema

from tasks.core.config.base import Frozen


@dataclass(frozen=True)
class SpModeSpec:
    """One ColossalAI sequence-parallel mode: what it needs and how the world size factors."""

    name: str
    summary: str
    # The sequence group is the tensor-parallel group: size = tp_size, world = dp x pp x tp.
    # Otherwise it is its own group: world = dp x pp x tp x sp.
    shares_tp: bool
    # Attention trades the sequence split for a head split: heads and KV heads must divide by the size.
    divides_heads: bool = False
    # Why it runs on CUDA only (None: it runs on CPU ranks too, gloo with tasks/engine/cpu_compat.py).
    cuda_reason: str | None = None
    # The model's attention must be causal (ColossalAI's policy raises otherwise).
    causal_only: bool = False
    # What of a decoder layer's activations the group splits (the memory estimate): "outside_tp"
    # (the hidden-wide tensors tp leaves whole) or "sequence" (every per-token tensor).
    splits: Literal["outside_tp", "sequence"] = "sequence"
    # Column-parallel linears per decoder layer that keep their gathered, whole-sequence input for the backward
    # (the estimate adds them: what split_gather saves on the norms it spends here).
    gathered_inputs: int = 0
    # Non-empty: why this mode is refused wherever it runs (a measured defect of the library).
    refused: str = ""

    def size(self, sp_size: int | None, tp_size: int) -> int:
        """The group's size under this mode: tp_size when it shares the tp group, else sp_size."""
        return tp_size if self.shares_tp else (sp_size or 1)

    def own_group(self, sp_size: int | None, tp_size: int) -> int:
        """The factor the sequence group adds to the world size (1 when it is the tp group)."""
        return 1 if self.shares_tp else (sp_size or 1)


SP_MODES: dict[str, SpModeSpec] = {}


def register(spec: SpModeSpec) -> SpModeSpec:
    SP_MODES[spec.name] = spec
    return spec


register(
    SpModeSpec(
        "split_gather",
        "Megatron-style: inside tensor parallelism (size = tp_size), the sequence split between the tp regions",
        shares_tp=True,
        splits="outside_tp",
        # ColossalAI 0.5.0's _LinearWithGatherForwardReduceScatterBackward keeps ctx.gathered_input: q, k, v,
        # gate and up each hold the whole sequence's input (measured on CPU, tp=2, 4k tokens: 263 MiB of
        # training memory a rank against 252 without it)
        gathered_inputs=5,
    )
)
register(
    SpModeSpec(
        "ring",
        "split_gather with the all-gather overlapped by ring exchanges inside the tp linears (size = tp_size)",
        shares_tp=True,
        splits="outside_tp",
        refused=(
            "ColossalAI 0.5.0's _ring_as_gather (shardformer/layer/_operation.py) saves the tensor it sent where the "
            "one it received belongs in the gathered input of the weight gradient: the forward is right, the "
            "gradients are not (measured on the tiny Llama at tp=2: the loss after one step differs from tp=2 "
            "without it by 0.018; split_gather's equals it bitwise)"
        ),
    )
)
register(
    SpModeSpec(
        "all_to_all",
        "DeepSpeed-Ulysses: its own group, each rank seq_len/size tokens, attention over heads/size heads",
        shares_tp=False,
        divides_heads=True,
    )
)
register(
    SpModeSpec(
        "ring_attn",
        "ring attention: its own group, K/V blocks passed around a ring (flash attention, causal models, CUDA)",
        shares_tp=False,
        cuda_reason=(
            "ColossalAI's RingAttention runs flash attention kernels and overlaps its exchanges on CUDA streams "
            "(torch.cuda.Stream, torch.cuda.Event)"
        ),
        causal_only=True,
    )
)


def _registered_mode(name: str) -> str:
    if name not in SP_MODES:
        raise ValueError(f"unknown sequence-parallel mode {name!r}; registered modes: {', '.join(SP_MODES)}")
    return name


# The registry's keys, read at validation and when the JSON schema is rendered (a later row is accepted).
SpModeName = Annotated[str, AfterValidator(_registered_mode), WithJsonSchema({"type": "string", "enum": None})]


def _schema(schema: dict[str, Any]) -> None:
    prop = schema["properties"]["mode"]
    prop["enum"] = list(SP_MODES)
    prop["description"] = "Sequence-parallel mode: " + "; ".join(f"{n} ({s.summary})" for n, s in SP_MODES.items())


class SequenceParallelConfig(Frozen):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, json_schema_extra=_schema)

    mode: SpModeName = Field(description="Sequence-parallel mode (tasks/core/config/sequence.py SP_MODES).")
    size: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Ranks one sequence is split over. split_gather and ring: the tensor-parallel group (leave unset or "
            "equal to tp_size); all_to_all and ring_attn: their own group, world size = dp x pp x tp x size."
        ),
    )


def sp_size(plugin: Any) -> int:
    """The size of a PluginConfig's sequence-parallel group (1 without sequence parallelism)."""
    sp = getattr(plugin, "sequence_parallelism", None)
    if sp is None or sp.mode not in SP_MODES:
        return 1
    return SP_MODES[sp.mode].size(sp.size, plugin.tp_size)


def sp_factor(plugin: Any) -> int:
    """What the sequence group adds to tp x pp in the world size: dp = world / (tp x pp x this)."""
    sp = getattr(plugin, "sequence_parallelism", None)
    if sp is None or sp.mode not in SP_MODES:
        return 1
    return SP_MODES[sp.mode].own_group(sp.size, plugin.tp_size)
