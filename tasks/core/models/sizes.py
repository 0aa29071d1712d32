"""config.json's size fields and the rule every reader applies to them before building anything: a
size present is a whole number >= 1. Kept apart from `tasks.core.models.claims` (which compares them
with the weight files) so that the family registry and the derived families apply it without importing
that comparison.

    python -c "from tasks.core.models.sizes import size_problems; print(size_problems({'num_hidden_layers': 0}))"
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# config.json's size fields, in the spellings the families use (GPT-2's n_*, OPT's ffn_dim, ...): a
# value present and not null must be a whole number >= 1
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
WIDTH_FIELDS = (
    "hidden_size",
    "n_embd",
    "d_model",
    "vocab_size",
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "head_dim",
)
POSITION_FIELDS = ("max_position_embeddings", "n_positions")  # RoPE positions need no tensor: not bounded by one
SIZE_FIELDS = LAYER_FIELDS + WIDTH_FIELDS + POSITION_FIELDS
FIX = "correct it in config.json from the model's source, or point base_model.uri at the folder these weights belong to"


def is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def size_problems(config: Mapping[str, Any], where: str = "config.json") -> list[tuple[str, str]]:
    """(field, sentence) for each size field of config.json that is not a whole number >= 1: from
    config.json alone, so a Hub model's too, before transformers' config class ever sees it."""
    out = []
    for name in SIZE_FIELDS:
        value = config.get(name)
        if value is None or is_size(value):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            what = f"a {type(value).__name__}, not a number"
        elif isinstance(value, float) and value.is_integer() and value >= 1:
            what = f"a float: write it as the integer {int(value)}"
        elif isinstance(value, float):
            what = "not a whole number"
        else:
            what = "zero: a model has at least one" if value == 0 else "negative"
        out.append(
            (
                name,
                (
                    f"{where} {name}={value!r} is {what}; a size is a whole number >= 1 (no model of that shape can be "
                    f"built): {FIX}"
                ),
            )
        )
    return out


def layer_count(config: Mapping[str, Any]) -> tuple[str, int] | None:
    """(field, value) of config.json's layer count, in the first spelling present."""
    for name in LAYER_FIELDS:
        if is_size(config.get(name)):
            return name, config[name]
    return None
