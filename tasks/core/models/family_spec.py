"""The shapes of the family registry's rows: a tensor rule, an activation term, a family.

    python -c "from tasks.core.models.family_spec import ModelFamily; print(ModelFamily.__doc__)"

Kept apart from the registry (`tasks.core.models.families`) so that a family derived from the model
(`tasks.core.models.derive`) builds the same dataclass without importing the registry that calls it.
Pure: no torch, no transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any


@dataclass(frozen=True)
class TensorRule:
    """One tensor of a model: key (with `{i}` for the layer index), symbolic shape, presence."""

    key: str
    shape: tuple[str | int, ...]  # names from DIMS (a derived family's table: the sizes themselves)
    when: str | None = None  # present only if this config flag is true
    unless: str | None = None  # absent if this config flag is true


@dataclass(frozen=True)
class ActivationTerm:
    """Tensors a decoder layer keeps for its backward, per token: `count` of width `dim` (a DIMS
    name), in the compute dtype, or in fp32 whatever the compute dtype (`fp32`), or int64 indices
    (`index`); `per` (a DIMS name) multiplies the count (a MoE layer's tensors per routed expert);
    `whole`: every tp rank keeps it whole though its dim is one tp splits elsewhere (the experts)."""

    dim: str
    count: int
    fp32: bool = False
    index: bool = False
    per: str = ""
    whole: bool = False


# What one Llama-shaped decoder layer (RMSNorm, sdpa attention, SwiGLU MLP) keeps for its backward,
# counted per token in transformers 4.51 with torch's saved-tensor hooks (tests/test_memory_estimate.py
# re-counts it for every family): each RMSNorm its fp32 input and two compute-dtype tensors (the
# normalized input, the output the next projections read); sdpa its query, key and value (GQA's
# repeat_kv widens key and value to the query heads), its output and a fp32 log-sum-exp per head;
# o_proj its input; the MLP the gate and up projections, the activation and their product.
# (Each RMSNorm's 1-wide inverse RMS and RoPE's per-position cos/sin, under 1 %, are left out.)
# Later transformers (measured: 4.57.6) hand o_proj a view of sdpa's output, not a copy: one q-wide tensor
# fewer. They also build the causal mask as a batch x seq x seq bool tensor (`find_packed_sequence_indices`
# keeps sdpa from its is_causal path), shared by every layer: seq-wide per token, left out like Gemma 3's.
def _sdpa_q_tensors() -> int:
    try:  # read without importing transformers (this module is pure data)
        release = version("transformers")
    except PackageNotFoundError:
        return 5
    return 5 if release.startswith("4.51.") else 4


LLAMA_LAYER_ACTIVATIONS: tuple[ActivationTerm, ...] = (
    ActivationTerm("hidden", 2, fp32=True),
    ActivationTerm("hidden", 4),
    ActivationTerm("q", _sdpa_q_tensors()),
    ActivationTerm("heads", 1, fp32=True),
    ActivationTerm("inter", 4),
)
# Qwen3's RMSNorms on the query and key heads keep the same three tensors each, q- and kv-wide.
QK_NORM_ACTIVATIONS: tuple[ActivationTerm, ...] = (
    ActivationTerm("q", 1, fp32=True),
    ActivationTerm("q", 1),
    ActivationTerm("kv", 1, fp32=True),
    ActivationTerm("kv", 1),
)
# Gemma 3 (counted the same way): its RMSNorm multiplies the fp32 normalized input by (1 + weight)
# before casting, so each of the four norms keeps its input and the normalized input in fp32, and the
# two before a projection (input, pre-feedforward) their compute-dtype output; the q/k norms keep
# their input and normalized input in fp32; sdpa and the GELU MLP keep what Llama's do. (The sliding
# window's additive mask, s-wide per token, is left out with the inverse RMS: ~1.5 % at s=32.)
GEMMA3_LAYER_ACTIVATIONS: tuple[ActivationTerm, ...] = (
    ActivationTerm("hidden", 8, fp32=True),
    ActivationTerm("hidden", 2),
    ActivationTerm("q", 2, fp32=True),
    ActivationTerm("kv", 2, fp32=True),
    ActivationTerm("q", _sdpa_q_tensors()),
    ActivationTerm("heads", 1, fp32=True),
    ActivationTerm("inter", 4),
)
# Phi-3: Llama's, with the fused gate_up output kept once (2 x inter wide: silu reads its gate half,
# the product its up half) beside the activation and the product; its o_proj input is a copy of sdpa's
# output on 4.57.6 too (five q-wide tensors)
PHI3_LAYER_ACTIVATIONS: tuple[ActivationTerm, ...] = (
    *LLAMA_LAYER_ACTIVATIONS[:2],
    ActivationTerm("q", 5),
    LLAMA_LAYER_ACTIVATIONS[3],
    ActivationTerm("inter2", 1),
    ActivationTerm("inter", 2),
)
# Mixtral's sparse MoE block in place of the MLP (counted the same way; tests/test_families.py re-measures
# it): the router's fp32 softmax over the experts, its top-k indices (int64) and renormalized fp32
# weights; for each of a token's num_experts_per_tok experts, run on its gathered hidden state: SwiGLU's
# four inter-wide tensors, the w2 output the routing weight scales, the product index_add_ keeps, the
# routing weight (compute dtype) and the (token, expert) index pair torch.where returns (int64). Without
# expert parallelism every tp rank runs every expert whole. (The weights' 1-wide sum is left out.)
MOE_LAYER_ACTIVATIONS: tuple[ActivationTerm, ...] = (
    *LLAMA_LAYER_ACTIVATIONS[:4],
    ActivationTerm("experts", 1, fp32=True),
    ActivationTerm("routed", 1, index=True),
    ActivationTerm("routed", 1, fp32=True),
    ActivationTerm("hidden", 3, per="routed", whole=True),
    ActivationTerm("inter", 4, per="routed", whole=True),
    ActivationTerm("routed", 1),
    ActivationTerm("routed", 2, index=True),
)
# The final RMSNorm, once per token (the LM head and the loss are vocabulary-wide: the estimate
# counts them from vocab_size).
FINAL_NORM_ACTIVATIONS: tuple[ActivationTerm, ...] = (
    ActivationTerm("hidden", 1, fp32=True),
    ActivationTerm("hidden", 2),
)


@dataclass(frozen=True)
class ModelFamily:
    """How a decoder-only family lays out its state dict, in module (= save) order."""

    head: tuple[TensorRule, ...]
    layer: tuple[TensorRule, ...]
    tail: tuple[TensorRule, ...]
    config_defaults: Mapping[str, Any]  # the family's config class defaults for omitted fields
    # transformers class names (strings: importing transformers here would slow pre-flight down)
    config_class: str
    model_class: str
    # config fields the demo builder sets beyond the common dimensions
    demo_config: Mapping[str, Any] = field(default_factory=dict)
    # key -> the key it is a copy of when tie_word_embeddings is true
    tied: Mapping[str, str] = field(default_factory=lambda: {"lm_head.weight": "model.embed_tokens.weight"})
    # key -> dim that indexes the vocabulary (to tell padded vocab rows from other mismatches)
    vocab_dims: Mapping[str, int] = field(default_factory=lambda: {"model.embed_tokens.weight": 0, "lm_head.weight": 0})
    # what one decoder layer keeps for its backward, and the final norm (memory estimate)
    layer_activations: tuple[ActivationTerm, ...] = LLAMA_LAYER_ACTIVATIONS
    final_activations: tuple[ActivationTerm, ...] = FINAL_NORM_ACTIVATIONS
    # The sequence-parallel modes (tasks/core/config/sequence.py SP_MODES) ColossalAI 0.5.0's shardformer
    # policy for this family runs, and why the others do not (`sp_family_problem` names it)
    sp_modes: tuple[str, ...] = ()
    sp_note: str = ""
    # The shardformer policy hybrid_parallel shards this family with (dotted class path): ColossalAI
    # 0.5.0's from its auto_policy mapping (tests/test_families.py compares every row with it), or the
    # project's own; "" = none, so only the plugins that do not slice tensors run it (`policy_problem`)
    shardformer_policy: str = ""
    layer_prefix: str = "model.layers.{i}."
    # read from the model transformers builds (tasks.core.models.derive), not a row of FAMILIES
    derived: bool = False
    # ColossalAI has a policy for the class, but it does not run with the installed transformers: the
    # first failure and its cause (benchmarks/shardformer_policies.py); hybrid_parallel is refused
    policy_refused: str = ""
    # For a table whose shapes are sizes, not DIMS names (a row over a derived table,
    # tasks.core.models.policy_rows): the modules tensor parallelism splits, read from the policy:
    # column-parallel (weight and bias split), row-parallel (weight split, bias replicated); the
    # vocabulary-indexed keys (`vocab_dims`) are split too
    tp_column: tuple[str, ...] = ()
    tp_row: tuple[str, ...] = ()
    # Why the family trains with transformers' default attention (sdpa) where transformers advises another in a
    # warning of its own at the first training step: the engine logs it beside that warning (`attention_note`)
    attention_note: str = ""

    def tp_splits(self, key: str) -> bool:
        """Whether tensor parallelism splits this key of a table with sizes (by `tp_column`/`tp_row`)."""
        if key in self.vocab_dims and (self.tp_column or self.tp_row):
            return True
        module, _, leaf = key.rpartition(".")
        return any(module.endswith(m) for m in self.tp_column) or (
            leaf == "weight" and any(module.endswith(m) for m in self.tp_row)
        )
