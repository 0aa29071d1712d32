"""The layout rules of the `model` tier: a stage's tp and pp against the base model's config.json,
registered in `tasks.core.config.layout.RULES`.

    python -c "from tasks.core.config.model_rules import MODEL_RULES; print([(t, r.__name__) for t, r in MODEL_RULES])"

The rules that read the base's shape: tp divides the attention heads, the KV heads, the MLP width
and the vocabulary (ColossalAI would pad a vocabulary it does not divide and then fail to checkpoint
its optimizer state); pp is at most the layer count. They run where config.json is known (pre-flight
and the engine), never in the loader, and each offers the tp or pp values that divide. `x` is the
layout's facts (`tasks.core.config.layout`): `x.phase_cfg`, `x.model` (config.json), `x.f` (the
stage's plugin field prefix).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tasks.core.config.fixes import Refusal
from tasks.core.config.sequence_rules import Problem


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _head_dims(mc: dict[str, Any]) -> dict[str, int]:
    n_heads = mc.get("num_attention_heads")
    dims = (
        ("num_attention_heads", n_heads),
        ("num_key_value_heads", mc.get("num_key_value_heads") or n_heads),
        ("intermediate_size", mc.get("intermediate_size")),
    )
    return {k: v for k, v in dims if isinstance(v, int)}


def _tp_divides_heads(x: Any) -> list[Problem]:
    tp = x.phase_cfg.plugin.tp_size
    if x.model is None or tp <= 1:
        return []
    dims = _head_dims(x.model)
    bad = {k: v for k, v in dims.items() if v % tp}
    if not bad:
        return []
    valid = _divisors(math.gcd(*dims.values()))
    return [
        Refusal(
            f"{x.f}.tp_size",
            (
                f"tp_size={tp} does not divide {' and '.join(f'{k}={v}' for k, v in bad.items())} of the base model: "
                f"every rank needs whole attention/KV heads and MLP columns. Valid tp_size: {valid}"
            ),
            [{"plugin.tp_size": v} for v in reversed(valid)],
        )
    ]


def _tp_divides_vocab(x: Any) -> list[Problem]:
    tp = x.phase_cfg.plugin.tp_size
    vocab = x.model.get("vocab_size") if x.model else None
    if not isinstance(vocab, int) or tp <= 1 or vocab % tp == 0:
        return []
    valid = _divisors(math.gcd(vocab, *_head_dims(x.model).values()))
    return [
        Refusal(
            f"{x.f}.tp_size",
            (
                f"tp_size={tp} does not divide the base model's vocab_size={vocab}: "
                "ColossalAI would pad the embedding and LM head and then fail to checkpoint their optimizer state. "
                f"Valid tp_size: {valid} "
                "(or resize the vocabulary to a multiple of tp_size: model.resize_token_embeddings(n, "
                "pad_to_multiple_of=tp_size))"
            ),
            [{"plugin.tp_size": v} for v in reversed(valid)],
        )
    ]


def _pp_within_layers(x: Any) -> list[Problem]:
    pp = x.phase_cfg.plugin.pp_size
    layers = x.model.get("num_hidden_layers") if x.model else None
    if pp > 1 and isinstance(layers, int) and pp > layers:
        why = f"pp_size={pp} exceeds num_hidden_layers={layers} of the base model: a pipeline stage would hold no layer"
        return [Refusal(f"{x.f}.pp_size", why, [{"plugin.pp_size": layers}, {"plugin.pp_size": 1}])]
    return []


MODEL_RULES: tuple[tuple[str, Callable[[Any], list[Problem]]], ...] = (
    ("model", _tp_divides_heads),
    ("model", _tp_divides_vocab),
    ("model", _pp_within_layers),
)
