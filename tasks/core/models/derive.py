"""A family derived from the model: the tensor table of a model_type with no row in FAMILIES, read
from the model the installed transformers builds on the meta device from config.json.

    python -c "from tasks.core.models.derive import derive_family; print(derive_family({'model_type': 'olmo2'}).model_class)"

`tasks.core.models.families.family_config` calls this only when config.json's model_type has no row,
so torch and transformers are imported then and only then (a registered family stays pure data).
Derived means "built by the installed transformers": the config class is transformers' own for the
model_type (`CONFIG_MAPPING`), the model `AutoModelForCausalLM.from_config` without
trust_remote_code, and config.json's `auto_map` is dropped before either sees it, so no code from the
model folder runs. Nothing is allocated: the parameters are meta tensors.

What the table holds, read off the built module: every state-dict key and shape in module (= save)
order; the decoder layers, found as the one `<prefix><i>.` that numbers `num_hidden_layers` identical
layers; the input and output embeddings (the keys that index the vocabulary); the output embedding
that shares the input's parameter (tied: absent from the table when config.json ties them). What it
cannot know is left to a named row: tensor-parallel split dims (a derived family has no shardformer
policy, so hybrid_parallel refuses it). The activation terms are read off the layer's tensor names where
the layer is Llama's shape (`layer_terms`: extra norms, query/key norms); another layout gets Llama's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from tasks.core.errors import ConversionError
from tasks.core.models.family_spec import (
    FINAL_NORM_ACTIVATIONS,
    LLAMA_LAYER_ACTIVATIONS,
    QK_NORM_ACTIVATIONS,
    ActivationTerm,
    ModelFamily,
    TensorRule,
)

# config.json fields a derived table never passes to transformers: auto_map names code in the model
# folder (never run), and the bookkeeping fields are transformers' own to set
_DROPPED = ("auto_map", "transformers_version", "_name_or_path")
# the DIMS names of tasks.core.models.families, read through the config object (its attribute_map
# answers for families that spell them otherwise)
_DIM_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "head_dim",
)
_LAYER_KEY = re.compile(r"^(.*?\.)(\d+)\.(.+)$")


def derive_family(model_config: Mapping[str, Any], registered: str = "") -> ModelFamily:
    """The ModelFamily of a config.json whose model_type has no row (cached per config).
    Raises ConversionError naming why it cannot be derived."""
    from tasks.core.models.sizes import size_problems

    if sizes := size_problems(model_config):  # named here, never through transformers' own exception
        raise ConversionError("; ".join(msg for _, msg in sizes))
    try:
        return _derive(json.dumps(dict(model_config), sort_keys=True, default=str), registered)
    except ConversionError:
        raise
    except Exception as exc:  # a module this reader does not understand: refused, never half-read
        raise ConversionError(
            f"config.json model_type={model_config.get('model_type')!r}: cannot derive a tensor table from the model "
            f"transformers builds ({type(exc).__name__}: {exc}); add the family's row to FAMILIES in "
            "tasks/core/models/families.py"
        ) from exc


@lru_cache(maxsize=16)
def _derive(config_json: str, registered: str) -> ModelFamily:
    raw = {k: v for k, v in json.loads(config_json).items() if k not in _DROPPED}
    model_type = raw.get("model_type")
    config, model = build_meta_model(model_type, raw, registered)
    params = dict(model.named_parameters(remove_duplicate=False))
    state = model.state_dict()
    first_of: dict[int, str] = {}
    tied: dict[str, str] = {}
    for key, p in params.items():
        if id(p) in first_of:
            tied[key] = first_of[id(p)]
        else:
            first_of[id(p)] = key
    if tied and not getattr(config, "tie_word_embeddings", False):
        raise ConversionError(
            f"config.json model_type={model_type!r}: {model.__class__.__name__} shares {sorted(tied)} with "
            f"{sorted(set(tied.values()))} although tie_word_embeddings is false; a derived table cannot say which "
            "key a checkpoint holds (add the family's row to FAMILIES in tasks/core/models/families.py)"
        )
    vocab_dims = {}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        weight = getattr(module, "weight", None)
        for key, p in params.items():
            if p is weight:
                vocab_dims[key] = 0
    layers = int(config.num_hidden_layers)
    prefix, head, layer, tail = _split(model_type, list(state.items()), layers)

    def rules(items: list[tuple[str, Any]]) -> tuple[Any, ...]:
        return tuple(
            TensorRule(k, tuple(int(d) for d in t.shape), unless="tie_word_embeddings" if k in tied else None)
            for k, t in items
        )

    dims = {f: getattr(config, f, None) for f in _DIM_FIELDS}
    if not isinstance(dims["intermediate_size"], int):
        # GPT-2, GPT-J, OPT, Bloom, Falcon name it otherwise or leave it to 4 x hidden: the MLP's width
        # is the widest dim of a layer matrix that is not the hidden size (fused qkv is at most 3 x hidden)
        widths = [d for _, t in layer if t.dim() == 2 for d in t.shape if d != dims["hidden_size"]]
        dims["intermediate_size"] = int(max(widths)) if widths else None
    defaults = {**config.to_dict(), **{k: v for k, v in dims.items() if isinstance(v, int)}}
    return ModelFamily(
        rules(head),
        rules(layer),
        rules(tail),
        config_defaults=defaults,
        config_class=config.__class__.__name__,
        model_class=model.__class__.__name__,
        tied=tied,
        vocab_dims=vocab_dims,
        layer_activations=layer_terms([k for k, _ in layer]),
        final_activations=FINAL_NORM_ACTIVATIONS,
        layer_prefix=prefix + "{i}.",
        derived=True,
    )


# Llama's decoder layer, as a derived table names its tensors: q/k/v/o projections and a SwiGLU MLP
_LLAMA_LAYOUT = ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight")
_NORM = re.compile(r"^(?!self_attn\.)[^.]*(?:norm|ln)[^.]*\.weight$")


def layer_terms(keys: list[str]) -> tuple[ActivationTerm, ...]:
    """What one decoder layer keeps for its backward, read off its tensor names where the layer is
    Llama's shape (OLMo 2, Granite, Cohere...): Llama's terms, plus each RMSNorm beyond Llama's two
    (fp32 input, two compute-dtype tensors) and query/key norms (Qwen3's terms, the same whole-width
    or per head). Another layout (GPT-2's Conv1D, Bloom's fused qkv, experts) keeps Llama's terms,
    which the families table says are not its own (tests/test_families.py measures both)."""
    if not all(k in keys for k in _LLAMA_LAYOUT):
        return LLAMA_LAYER_ACTIVATIONS
    norms = sum(1 for k in keys if _NORM.match(k))
    extra = (
        (ActivationTerm("hidden", norms - 2, fp32=True), ActivationTerm("hidden", 2 * (norms - 2))) if norms > 2 else ()
    )
    qk = QK_NORM_ACTIVATIONS if {"self_attn.q_norm.weight", "self_attn.k_norm.weight"} <= set(keys) else ()
    return LLAMA_LAYER_ACTIVATIONS + extra + qk


def build_meta_model(model_type: Any, raw: dict[str, Any], registered: str):
    """transformers' config object and the causal LM built from it on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    fix = f"use a base model of a family it builds (registered: {registered})"
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ConversionError(
            f"config.json model_type={model_type!r} is neither in the family registry nor a model type the installed "
            f"transformers knows (its code would have to come from the model folder, which is never run); {fix}"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        raise ConversionError(
            f"config.json model_type={model_type!r}: the installed transformers has no decoder-only causal LM for it "
            f"(AutoModelForCausalLM without a masked-LM encoder), so it is not a decoder this project trains; {fix}"
        )
    try:
        config = CONFIG_MAPPING[model_type].from_dict(raw)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
    except Exception as exc:  # a config transformers cannot build: say so with its words
        raise ConversionError(
            f"config.json model_type={model_type!r}: transformers could not build its model on the meta device "
            f"({type(exc).__name__}: {exc}); {fix}"
        ) from exc
    return config, model


def _split(model_type: Any, items: list[tuple[str, Any]], layers: int):
    """(layer prefix, head, one layer's items without the prefix, tail) of a state dict in module order."""
    indexed = [(m.group(1), int(m.group(2)), m.group(3)) if (m := _LAYER_KEY.match(k)) else None for k, _ in items]
    prefixes = {}
    for hit in indexed:
        if hit:
            prefixes.setdefault(hit[0], set()).add(hit[1])
    found = [p for p, idx in prefixes.items() if idx == set(range(layers))]
    why = ""
    if len(found) != 1:
        why = f"no single '<prefix><i>.' numbers its num_hidden_layers={layers} layers (found {sorted(prefixes)})"
    else:
        prefix = found[0]
        at = [i for i, hit in enumerate(indexed) if hit and hit[0] == prefix]
        start, end = at[0], at[-1] + 1
        body = [(indexed[i][1], indexed[i][2], tuple(items[i][1].shape)) for i in range(start, end) if indexed[i]]
        one = [(rest, shape) for li, rest, shape in body if li == 0]
        want = [(li, rest, shape) for li in range(layers) for rest, shape in one]
        if len(at) != end - start or body != want:
            why = f"its layers under {prefix!r} are not {layers} identical ones in order"
        else:
            layer = [(rest, items[at[j]][1]) for j, (rest, _) in enumerate(one)]
            return prefix, items[:start], layer, items[end:]
    raise ConversionError(
        f"config.json model_type={model_type!r}: cannot derive a tensor table from the model transformers builds: "
        f"{why}; add the family's row to FAMILIES in tasks/core/models/families.py"
    )
