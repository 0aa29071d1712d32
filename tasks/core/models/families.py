"""The model-family registry: everything this project knows per decoder family, as data.

    python -c "from tasks.core.models.families import FAMILIES, expected_tensors; print(sorted(FAMILIES))"

One `ModelFamily` per config.json `model_type` holds all that differs between families: the
tensor table (key, symbolic shape, presence flag) in module (= save) order, the defaults its
config class applies to omitted fields, which keys are tied or index the vocabulary, and the
transformers classes that build it. Every reader takes it from here (torchtitan keeps its
`from_hf_map` key maps as data the same way):
- the converter (`tasks.core.models.convert`) checks every key and shape of a checkpoint against it;
- pre-flight (`tasks.core.preflight.checks`) refuses a base model whose family has no table, before
  a CPT stage trains for hours and the unshard then fails, and counts parameters from the table;
  it refuses hybrid_parallel for a family without a shardformer policy (`policy_problem`);
- the demo-input builder (`tasks.core.models.demo`) builds a model of any family listed here;
- the memory estimate (`tasks.core.preflight.memory`) shards the table by tensor parallelism
  (`TP_SPLIT_DIMS`) and reads what one decoder layer keeps for its backward (`layer_activations`).
Adding a family is one entry in FAMILIES; nothing else branches on a family name. A model_type
with no entry gets a family derived from the model the installed transformers builds on the meta
device (`family_of` -> `tasks.core.models.derive`): its keys, shapes, tied and vocabulary keys, no
shardformer policy, activation terms read off its layer (`derive.layer_terms`); a named row over a
derived table (`tasks.core.models.policy_rows`) adds a family's ColossalAI policy and its tp split. The docs' table of families x plugins is written
from here (`tasks.core.models.family_table`).

Pure: no torch, no transformers import (class names are strings), so pre-flight stays cheap; only a
model_type with no entry imports them, to derive its family.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from tasks.core.errors import ConversionError
from tasks.core.models.family_spec import (
    FINAL_NORM_ACTIVATIONS,
    GEMMA3_LAYER_ACTIVATIONS,
    LLAMA_LAYER_ACTIVATIONS,
    PHI3_LAYER_ACTIVATIONS,
    QK_NORM_ACTIVATIONS,
    ActivationTerm,
    ModelFamily,
    TensorRule,
)
from tasks.core.models.tp_plan import PLAN_POLICY, PLAN_ROWS, too_old, whole_activations

# the row types live in family_spec (derive.py builds them too); readers take them from here
__all__ = [
    "DIMS",
    "FAMILIES",
    "FINAL_NORM_ACTIVATIONS",
    "LLAMA_LAYER_ACTIVATIONS",
    "QK_NORM_ACTIVATIONS",
    "ActivationTerm",
    "ModelFamily",
    "TensorRule",
]


def _head_dim(c: Mapping[str, Any]) -> int:
    head_dim = c.get("head_dim")
    if head_dim:
        return int(head_dim)
    if c["hidden_size"] % c["num_attention_heads"]:
        raise ConversionError(
            f"config: hidden_size={c['hidden_size']} is not divisible by num_attention_heads="
            f"{c['num_attention_heads']} and head_dim is not set"
        )
    return c["hidden_size"] // c["num_attention_heads"]


def _kv_heads(c: Mapping[str, Any]) -> int:
    return c.get("num_key_value_heads") or c["num_attention_heads"]


DIMS: dict[str, Callable[[Mapping[str, Any]], int]] = {
    "vocab": lambda c: c["vocab_size"],
    "hidden": lambda c: c["hidden_size"],
    "inter": lambda c: c["intermediate_size"],
    "head_dim": _head_dim,
    "q": lambda c: c["num_attention_heads"] * _head_dim(c),
    "kv": lambda c: _kv_heads(c) * _head_dim(c),
    "heads": lambda c: c["num_attention_heads"],
    # fused projections (Phi-3): q, k and v in one weight; gate and up in one
    "qkv": lambda c: (c["num_attention_heads"] + 2 * _kv_heads(c)) * _head_dim(c),
    "inter2": lambda c: 2 * c["intermediate_size"],
    # a MoE layer (Mixtral): the router's experts and each token's routed ones (0 for a dense model)
    "experts": lambda c: c.get("num_local_experts") or 0,
    "routed": lambda c: c.get("num_experts_per_tok") or 0,
}
# Dims that tensor parallelism splits over the tp ranks (shardformer's policies for these families:
# column-parallel q/k/v/gate/up and their biases, row-parallel o/down, vocabulary-parallel embedding
# and LM head, each rank's attention heads); a tensor with none of them (the norms, o_proj's and
# down_proj's biases) is replicated on every tp rank.
TP_SPLIT_DIMS = frozenset({"q", "kv", "inter", "vocab", "heads", "qkv", "inter2"})
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
LAYER_PREFIX = ModelFamily.__dataclass_fields__["layer_prefix"].default


def _attn(q_bias: str | None, o_bias: str | None, qk_norm: bool = False) -> tuple[TensorRule, ...]:
    """Attention projections; `*_bias` is the flag that enables the bias ("always" = always)."""

    def bias(name: str, dim: str, flag: str | None) -> tuple[TensorRule, ...]:
        if flag is None:
            return ()
        return (TensorRule(f"self_attn.{name}.bias", (dim,), when=None if flag == "always" else flag),)

    rules = (
        TensorRule("self_attn.q_proj.weight", ("q", "hidden")), *bias("q_proj", "q", q_bias),
        TensorRule("self_attn.k_proj.weight", ("kv", "hidden")), *bias("k_proj", "kv", q_bias),
        TensorRule("self_attn.v_proj.weight", ("kv", "hidden")), *bias("v_proj", "kv", q_bias),
        TensorRule("self_attn.o_proj.weight", ("hidden", "q")), *bias("o_proj", "hidden", o_bias),
    )  # fmt: skip
    if qk_norm:
        rules += (
            TensorRule("self_attn.q_norm.weight", ("head_dim",)),
            TensorRule("self_attn.k_norm.weight", ("head_dim",)),
        )
    return rules


def _mlp(flag: str | None) -> tuple[TensorRule, ...]:
    out: list[TensorRule] = []
    for name, shape, bias_dim in (("gate_proj", ("inter", "hidden"), "inter"),
                                  ("up_proj", ("inter", "hidden"), "inter"),
                                  ("down_proj", ("hidden", "inter"), "hidden")):  # fmt: skip
        out.append(TensorRule(f"mlp.{name}.weight", shape))
        if flag:
            out.append(TensorRule(f"mlp.{name}.bias", (bias_dim,), when=flag))
    return tuple(out)


_NORMS = (TensorRule("input_layernorm.weight", ("hidden",)), TensorRule("post_attention_layernorm.weight", ("hidden",)))
# Gemma 3: a norm before and after each of attention and the MLP
_FOUR_NORMS = _NORMS + (
    TensorRule("pre_feedforward_layernorm.weight", ("hidden",)),
    TensorRule("post_feedforward_layernorm.weight", ("hidden",)),
)
# Phi-3: q, k and v in one projection, gate and up in another (a tp split would cut each per part)
_PHI3_LAYER = (
    TensorRule("self_attn.o_proj.weight", ("hidden", "q")),
    TensorRule("self_attn.qkv_proj.weight", ("qkv", "hidden")),
    TensorRule("mlp.gate_up_proj.weight", ("inter2", "hidden")),
    TensorRule("mlp.down_proj.weight", ("hidden", "inter")),
)
_HEAD = (TensorRule("model.embed_tokens.weight", ("vocab", "hidden")),)
_TAIL = (
    TensorRule("model.norm.weight", ("hidden",)),
    TensorRule("lm_head.weight", ("vocab", "hidden"), unless="tie_word_embeddings"),
)

_COLOSSALAI = "colossalai.shardformer.policies"
_PLAN_SP = (
    "ColossalAI 0.5.0 has no policy for it: hybrid_parallel shards it with the derived tensor-parallel policy, read "
    "from transformers' own plan (tasks/core/models/tp_plan.py), at tp with ZeRO-1; pipeline and sequence "
    "parallelism are not proven with it"
)
# model_type -> family; transformers 4.51's module definitions are the source of truth (the tests
# compare every table with the state dict of a tiny model built from the entry's classes)
FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily(
        _HEAD, _attn("attention_bias", "attention_bias") + _mlp("mlp_bias") + _NORMS, _TAIL,
        config_defaults={"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
        config_class="LlamaConfig", model_class="LlamaForCausalLM",
        shardformer_policy=f"{_COLOSSALAI}.llama.LlamaForCausalLMPolicy",
        sp_modes=("split_gather", "ring", "all_to_all", "ring_attn"),
    ),
    "mistral": ModelFamily(
        _HEAD, _attn(None, None) + _mlp(None) + _NORMS, _TAIL,
        config_defaults={"tie_word_embeddings": False},
        config_class="MistralConfig", model_class="MistralForCausalLM",
        shardformer_policy=f"{_COLOSSALAI}.mistral.MistralForCausalLMPolicy",
        sp_note="ColossalAI 0.5.0's Mistral policy switches sequence parallelism off with a warning and trains "
        "without it",
    ),
    "qwen2": ModelFamily(
        _HEAD, _attn("always", None) + _mlp(None) + _NORMS, _TAIL,
        config_defaults={"tie_word_embeddings": False},
        config_class="Qwen2Config", model_class="Qwen2ForCausalLM",
        shardformer_policy=f"{_COLOSSALAI}.qwen2.Qwen2ForCausalLMPolicy",
        sp_modes=("split_gather", "ring", "all_to_all"),
        sp_note="ColossalAI 0.5.0's Qwen2 attention forward asserts a mode other than ring_attn",
        # no sliding-window layers: the tiny demo model attends over its whole context
        demo_config={"use_sliding_window": False, "max_window_layers": 0},
    ),
    "qwen3": ModelFamily(
        _HEAD, _attn("attention_bias", "attention_bias", qk_norm=True) + _mlp(None) + _NORMS, _TAIL,
        config_defaults={"tie_word_embeddings": False, "attention_bias": False, "head_dim": 128},
        config_class="Qwen3Config", model_class="Qwen3ForCausalLM",
        shardformer_policy=PLAN_POLICY,
        sp_note=_PLAN_SP,
        layer_activations=LLAMA_LAYER_ACTIVATIONS + QK_NORM_ACTIVATIONS,
    ),
    # Gemma 3 text (Gemma3ForCausalLM: the text half, e.g. gemma-3-270m/1b): the embedding scaled by
    # sqrt(hidden) in the module (Gemma3TextScaledWordEmbedding, no extra tensor), q/k norms per head,
    # four norms a layer, sliding-window layers (same tensors), a tied head by default.
    "gemma3_text": ModelFamily(
        _HEAD, _attn("attention_bias", "attention_bias", qk_norm=True) + _mlp(None) + _FOUR_NORMS, _TAIL,
        config_defaults={"tie_word_embeddings": True, "attention_bias": False, "head_dim": 256,
                         "num_key_value_heads": 4},
        config_class="Gemma3TextConfig", model_class="Gemma3ForCausalLM",
        shardformer_policy=PLAN_POLICY,
        sp_note=_PLAN_SP,
        demo_config={"sliding_window": 32, "sliding_window_pattern": 2},
        layer_activations=GEMMA3_LAYER_ACTIVATIONS,
        # transformers 4.51 warns whenever a Gemma 3 trains without eager attention (modeling_gemma3.py,
        # Gemma3ForCausalLM.forward), a warning carried over from Gemma 2, whose attention soft-capping sdpa does
        # not apply; Gemma 3's configs set none, so eager would compute the same and hold each layer's weights
        attention_note="transformers' advice to train Gemma 3 with eager attention is not taken: it is for attention "
        "soft-capping (attn_logit_softcapping), which sdpa does not apply and this config.json does not set, so sdpa "
        "computes the same attention as eager without holding each layer's seq_len x seq_len attention weights",
    ),
    "phi3": ModelFamily(
        _HEAD, _PHI3_LAYER + _NORMS, _TAIL,
        config_defaults={"tie_word_embeddings": False},
        config_class="Phi3Config", model_class="Phi3ForCausalLM",
        # Phi3Config's pad_token_id=32000 is out of range for a tiny vocabulary (the demo sets its own)
        demo_config={"pad_token_id": None},
        shardformer_policy=PLAN_POLICY,
        sp_note=_PLAN_SP,
        # its plan gathers the fused qkv_proj's and gate_up_proj's outputs (colwise_rep): each tp rank computes
        # the attention and the MLP whole, only the weights are split
        layer_activations=whole_activations(PHI3_LAYER_ACTIVATIONS, attention=True, mlp=True),
    ),
}  # fmt: skip


def attention_note(model_config: Mapping[str, Any]) -> str:
    """The family row's line on the attention it trains with (`ModelFamily.attention_note`), where it holds:
    not for a config.json that sets attention soft-capping, which only eager attention applies."""
    family = FAMILIES.get(model_config.get("model_type"))  # type: ignore[arg-type]
    if family is None or not family.attention_note:
        return ""
    if model_config.get("attn_logit_softcapping") is not None:
        return (
            f"config.json sets attn_logit_softcapping={model_config['attn_logit_softcapping']}: only eager attention "
            "applies it (sdpa and flash attention leave it out), so transformers' warning below holds for this model"
        )
    return f"{model_config.get('model_type')}: {family.attention_note}"


def supported() -> str:
    """The registered model types, for messages: 'llama, mistral, qwen2, qwen3'."""
    return ", ".join(sorted(FAMILIES))


def family_of(model_config: Mapping[str, Any]) -> ModelFamily:
    """The row of config.json's model_type, else the family derived from the model the installed
    transformers builds (`tasks.core.models.derive`: imports torch and transformers, only then).
    Raises ConversionError when neither exists, naming the transformers release a plan row's newer family needs."""
    family = FAMILIES.get(model_config.get("model_type"))  # type: ignore[arg-type]
    if family is not None:
        return family
    if why := too_old(model_config.get("model_type")):  # unknown to this transformers, known to a later one
        raise ConversionError(why)
    from tasks.core.models.derive import derive_family

    derived = derive_family(model_config, registered=supported())
    model_type = str(model_config.get("model_type"))
    plan = PLAN_ROWS.get(model_type)
    if plan is not None and plan.model_class == derived.model_class:
        # a plan row over the derived table: the derived tensor-parallel policy, the modules its plan splits,
        # and the activations its *_rep styles leave whole on every rank
        from tasks.core.models.tp_plan import gathers_attention, plan_split

        col, row_split = plan_split(model_type) or ((), ())
        attention, mlp = gathers_attention(model_type)
        return replace(
            derived,
            shardformer_policy=PLAN_POLICY,
            tp_column=col,
            tp_row=row_split,
            layer_activations=whole_activations(derived.layer_activations, attention, mlp),
            sp_note=_PLAN_SP,
        )
    row = _policy_rows().get(model_config.get("model_type"))  # type: ignore[arg-type]
    if row is None or row.model_class != derived.model_class:
        return derived
    # a named row over the derived table: the policy, its tp split and any refusal are the row's
    return replace(
        derived,
        shardformer_policy=row.shardformer_policy,
        policy_refused=row.policy_refused,
        tp_column=row.tp_column,
        tp_row=row.tp_row,
        layer_activations=row.layer_activations or derived.layer_activations,
        sp_note=row.policy_refused or "no sequence-parallel mode of its policy is measured with transformers 4.51.3",
    )


def family_config(model_config: Mapping[str, Any]) -> tuple[ModelFamily, dict[str, Any]]:
    """The family of a config.json and the config with the family's defaults filled in."""
    model_type = model_config.get("model_type")
    from tasks.core.models.sizes import size_problems

    if sizes := size_problems(model_config):  # a zero, negative or float size: named before any table is built
        raise ConversionError("; ".join(msg for _, msg in sizes))
    family = family_of(model_config)
    config = {**family.config_defaults, **{k: v for k, v in model_config.items() if v is not None}}
    missing = [f for f in REQUIRED_FIELDS if not isinstance(config.get(f), int)]
    if missing:
        raise ConversionError(
            f"config.json ({model_type}) lacks integer field(s) {missing}: cannot derive tensor shapes"
        )
    return family, config


def model_dims(model_config: Mapping[str, Any]) -> dict[str, int]:
    """Every DIMS value of a config.json (the family's defaults filled in)."""
    _, config = family_config(model_config)
    return {name: fn(config) for name, fn in DIMS.items()}


def iter_tensors(model_config: Mapping[str, Any]) -> Iterator[tuple[str, TensorRule, tuple[int, ...], int | None]]:
    """(key, rule, shape, layer index or None) of every tensor the model has, in module order."""
    family, config = family_config(model_config)
    names = {name: fn(config) for name, fn in DIMS.items()}

    def dims(rule: TensorRule) -> tuple[int, ...]:
        return tuple(names[d] if isinstance(d, str) else d for d in rule.shape)

    def present(rule: TensorRule) -> bool:
        return (rule.when is None or bool(config.get(rule.when))) and not (rule.unless and config.get(rule.unless))

    for rule in family.head:
        if present(rule):
            yield rule.key, rule, dims(rule), None
    for i in range(config["num_hidden_layers"]):
        prefix = family.layer_prefix.format(i=i)
        for rule in family.layer:
            if present(rule):
                yield prefix + rule.key, rule, dims(rule), i
    for rule in family.tail:
        if present(rule):
            yield rule.key, rule, dims(rule), None


def expected_tensors(model_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every key the HF model built from `model_config` has, with its shape, in module order."""
    return {key: shape for key, _, shape, _ in iter_tensors(model_config)}


def count_parameters(model_config: Mapping[str, Any]) -> int:
    """Parameters of the model `model_config` describes: the sum over its tensor table, each layer's
    rules counted once and multiplied by the layers (the same sum, in time that does not grow with them)."""
    family, config = family_config(model_config)
    names = {name: fn(config) for name, fn in DIMS.items()}

    def size(rule: TensorRule) -> int:
        if (rule.when is not None and not config.get(rule.when)) or (rule.unless and config.get(rule.unless)):
            return 0
        return math.prod(names[d] if isinstance(d, str) else d for d in rule.shape)

    layer = sum(size(rule) for rule in family.layer)
    return (
        sum(size(r) for r in family.head)
        + max(config["num_hidden_layers"], 0) * layer
        + sum(size(r) for r in family.tail)
    )


def largest_tensor(model_config: Mapping[str, Any]) -> int:
    """Elements of the model's largest whole tensor (the embedding or the LM head, in a decoder LLM)."""
    return max(math.prod(shape) for shape in expected_tensors(model_config).values())


def tied_keys(model_config: Mapping[str, Any]) -> dict[str, str]:
    """{dropped key: key it duplicates} when the config ties embeddings, else {}."""
    family, config = family_config(model_config)
    return dict(family.tied) if config.get("tie_word_embeddings") else {}


# A tensor holding 1/n of config.json's size is one tp rank's shard only for an n a tp group has; beyond
# it config.json's size is simply not these weights' (a config.json that claims a bigger model)
MAX_TP_SHARDS = 64


def shape_cause(key: str, got: tuple[int, ...], want: tuple[int, ...], family: ModelFamily) -> str:
    """Most likely reason a saved shape differs from the config's, for the error message."""
    if len(got) != len(want):
        return "a different architecture, or a fused/flattened tensor"
    dim = next(d for d in range(len(want)) if got[d] != want[d])
    if family.vocab_dims.get(key) == dim and got[dim] > want[dim]:
        return (
            f"padded vocabulary rows: {got[dim] - want[dim]} rows beyond vocab_size={want[dim]} (the saver did not "
            f"strip the padding ColossalAI adds for tensor parallelism, or config.json's vocab_size is stale)"
        )
    if got[dim] < want[dim] and want[dim] % got[dim] == 0 and want[dim] // got[dim] <= MAX_TP_SHARDS:
        return (
            f"ungathered tensor-parallel shard: holds 1/{want[dim] // got[dim]} of dim {dim} "
            f"(saved from one tp rank without gathering)"
        )
    if got[dim] < want[dim]:
        return (
            f"config.json claims {want[dim]:,} where the weights hold {got[dim]:,}: a config.json of a bigger model, or "
            "one whose size was edited"
        )
    return "the checkpoint belongs to a model with a different config.json (size, heads or vocabulary)"


def lora_trainable(lora: Any, key: str, shape: tuple[int, ...], layer: int | None) -> int:
    """Parameters LoRA trains for one base tensor: r x (in + out) for a targeted linear weight (peft
    matches a module name's end; `all-linear`: every decoder-layer linear), the whole tensor for a
    module in modules_to_save, else none (frozen: no gradient, master copy or optimizer state)."""
    module = key.rsplit(".", 1)[0] if key.endswith(".weight") else key
    if any(module == m or module.endswith("." + m) for m in lora.modules_to_save):
        return math.prod(shape)
    targeted = any(module == t or module.endswith("." + t) for t in lora.target_modules)
    if "all-linear" in lora.target_modules:
        targeted = layer is not None and len(shape) == 2 and key.endswith(".weight")
    return lora.r * (shape[0] + shape[1]) if targeted and len(shape) == 2 else 0


def sp_family_problem(model_config: Mapping[str, Any], phase_cfg: Any, where: str) -> tuple[str, str] | None:
    """(field, message) when the stage's sequence-parallel mode is not one its model family's policy runs."""
    sp = getattr(phase_cfg.plugin, "sequence_parallelism", None)
    family = FAMILIES.get(str(model_config.get("model_type")))
    if sp is not None and family is None and model_config.get("model_type") in _policy_rows():
        family = family_of(model_config)  # a named row over a derived table: no mode measured
    if sp is None or family is None or sp.mode in family.sp_modes:
        return None
    from tasks.core.config.sequence import SP_MODES

    usable = [m for m in family.sp_modes if m in SP_MODES and not SP_MODES[m].refused]
    these = f"modes {', '.join(usable)} run" if usable else "no mode runs"
    why = (
        f"sequence-parallel mode {sp.mode} does not run on a {model_config.get('model_type')} model "
        f"({family.sp_note or 'its shardformer policy lacks it'}); for this family {these} "
        f"(or set {where}.plugin.sequence_parallelism: null)"
    )
    return f"{where}.plugin.sequence_parallelism.mode", why


def _policy_rows() -> Mapping[str, Any]:
    from tasks.core.models.policy_rows import POLICY_ROWS

    return POLICY_ROWS


def plugins_without_policy() -> list[str]:
    """The plugins that do not slice tensors, so they run a family with no shardformer policy."""
    from tasks.core.config.plugins import PLUGINS

    return [name for name, spec in PLUGINS.items() if not spec.shardformer]


def policy_problem(model_config: Mapping[str, Any], phase_cfg: Any, where: str) -> tuple[str, str] | None:
    """(field, message) when the stage's plugin shards with a shardformer policy its family lacks
    (ColossalAI raises NotImplementedError on a rank in boost_and_shard otherwise)."""
    from tasks.core.config.plugins import PLUGINS

    name = getattr(phase_cfg.plugin, "name", None)
    if name not in PLUGINS or not PLUGINS[name].shardformer:
        return None
    try:
        family = family_of(model_config)
    except ConversionError:
        return None  # no family at all: check_model_family names it
    pp = getattr(phase_cfg.plugin, "pp_size", 1) or 1
    if family.shardformer_policy == PLAN_POLICY:
        return _plan_problem(model_config, phase_cfg, where)
    if family.shardformer_policy and not family.policy_refused:
        row = _policy_rows().get(model_config.get("model_type"))  # type: ignore[arg-type]
        tp = getattr(phase_cfg.plugin, "tp_size", 1) or 1
        config = {**family.config_defaults, **model_config}
        for key, value, why in row.tp_requires if row and tp > 1 else ():
            if config.get(key) != value:
                return f"{where}.plugin.tp_size", (
                    f"ColossalAI 0.5.0's {family.shardformer_policy.rsplit('.', 1)[-1]} assumes {key}={value} at "
                    f"tp_size > 1 ({why}), and config.json has {key}={config.get(key)}; set {where}.plugin.tp_size: 1 "
                    f"(pp_size splits it), or name one of the plugins that run it: {', '.join(plugins_without_policy())}"
                )
        if family.derived and pp > 1 and not (row and row.pp):  # a row's policy measured at tp only
            return f"{where}.plugin.pp_size", (
                f"pipeline parallelism with ColossalAI 0.5.0's {family.shardformer_policy.rsplit('.', 1)[-1]} is not "
                f"measured for model_type {model_config.get('model_type')!r} (benchmarks/shardformer_policies.py "
                f"trains it at tp=2); set {where}.plugin.pp_size: 1 and split it with tp_size"
            )
        return None
    mt = model_config.get("model_type")
    why = (
        f"{name} shards the model with a shardformer policy (tensor, pipeline and sequence parallelism), and "
        + (
            f"ColossalAI 0.5.0's {family.shardformer_policy.rsplit('.', 1)[-1]} for {family.model_class} does not "
            f"run with transformers 4.51.3: {family.policy_refused}"
            if family.policy_refused
            else f"a family derived from {family.model_class} (model_type {mt!r} has no row "
            "in tasks/core/models/families.py) names none"
            if family.derived
            else f"ColossalAI 0.5.0 has none for {family.model_class} (model_type {mt!r})"
        )
        + f"; set {where}.plugin.name to one of the plugins that run it: {', '.join(plugins_without_policy())}"
    )
    return f"{where}.plugin.name", why


def _plan_problem(model_config: Mapping[str, Any], phase_cfg: Any, where: str) -> tuple[str, str] | None:
    """(field, message) when hybrid_parallel's layout is not one the derived tensor-parallel policy runs for this
    family, or the model's plan cannot be mapped at its tp_size (`tp_plan.plan_problem`)."""
    plugin = phase_cfg.plugin
    mt = model_config.get("model_type")
    others = ", ".join(plugins_without_policy())
    runs = (
        f"the derived tensor-parallel policy (tasks/core/models/tp_plan.py) runs model_type {mt!r} at tp with ZeRO-1 "
        "only: pipeline and sequence parallelism are not proven with it"
    )
    if (getattr(plugin, "pp_size", 1) or 1) > 1:
        return f"{where}.plugin.pp_size", f"{runs}; set {where}.plugin.pp_size: 1 and split the model with tp_size"
    if getattr(plugin, "sequence_parallelism", None) is not None:
        return f"{where}.plugin.sequence_parallelism", f"{runs}; set {where}.plugin.sequence_parallelism: null"
    if (getattr(plugin, "zero_stage", 0) or 0) > 1:
        return f"{where}.plugin.zero_stage", f"{runs}; set {where}.plugin.zero_stage: 0 or 1"
    tp = getattr(plugin, "tp_size", 1) or 1
    if tp > 1 and (why := _plan_check(model_config, tp)):
        return f"{where}.plugin.tp_size", (
            f"the derived tensor-parallel policy cannot shard model_type {mt!r} at tp_size={tp}: {why}; set "
            f"{where}.plugin.tp_size to a size it maps, or name one of the plugins that run it: {others}"
        )
    return None


def _plan_check(model_config: Mapping[str, Any], tp: int) -> str:
    from tasks.core.models.tp_plan import plan_problem

    return plan_problem(model_config, tp)
