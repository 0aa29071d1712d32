"""Context extension for CPT: the RoPE settings a stage trains with, and attention kept inside documents.

    python -c "from tasks.core.config.context import ROPE_TYPES; print({k: v.required for k, v in ROPE_TYPES.items()})"

`cpt.context` sets the base model's `rope_theta`, `rope_scaling` and `max_position_embeddings` for
CPT: the engine builds the model from base/'s config.json with them (`config_changes`), so every
CPT checkpoint's config.json holds them, the bridge writes them into cpt/hf/config.json, and SFT,
which starts from cpt/hf, and the export carry them on. Pre-flight checks `seq_len` against the
new `max_position_embeddings`.

`rope_scaling` is checked against what transformers 4.51.3 builds (`ROPE_TYPES`, transformers'
`modeling_rope_utils.ROPE_VALIDATION_FUNCTIONS`: tests/test_long_context.py holds the table to it).
transformers only warns about most mistakes (an unknown key, a factor below 1) and trains on; here
each is refused before a launch, naming the field and what it takes.

`cpt.attention: document` keeps each packed CPT block's attention and position ids inside each
document (the SFT packing's machinery, `tasks.engine.packing`); refused under a plugin whose
attention cannot isolate documents (`PluginSpec.packing_refused`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from tasks.core.config.base import Frozen
from tasks.core.config.fixes import Refusal, shown
from tasks.core.config.phases import PHASES
from tasks.core.config.plugins import PLUGINS

Attention = Literal["causal", "document"]


@dataclass(frozen=True)
class RopeType:
    """One `rope_scaling.rope_type` transformers builds: the keys it needs and those it also reads."""

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    summary: str = ""


# transformers 4.57.6 modeling_rope_utils: each _validate_*_parameters' required and optional keys.
ROPE_TYPES: dict[str, RopeType] = {
    "default": RopeType((), summary="plain RoPE (rope_theta only)"),
    "linear": RopeType(("factor",), summary="position interpolation: positions divided by factor"),
    "dynamic": RopeType(
        ("factor",), ("original_max_position_embeddings",), summary="dynamic NTK: theta grows past the trained length"
    ),
    "yarn": RopeType(
        ("factor",),
        (
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "original_max_position_embeddings",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ),
        summary="YaRN",
    ),
    "longrope": RopeType(
        ("short_factor", "long_factor"),
        ("attention_factor", "factor", "original_max_position_embeddings"),
        summary="LongRoPE (Phi-3): a factor per frequency",
    ),
    "llama3": RopeType(
        ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
        summary="Llama 3.1's: low frequencies divided by factor",
    ),
}

# What each key takes: a float (at least the bound, where one is given), an integer >= 1, or a list of floats.
_FLOATS = {
    "factor": 1.0,
    "attention_factor": 0.0,
    "beta_fast": None,
    "beta_slow": None,
    "mscale": None,
    "mscale_all_dim": None,
    "low_freq_factor": None,
    "high_freq_factor": None,
}
_INTS = ("original_max_position_embeddings",)
_LISTS = ("short_factor", "long_factor")
_BOOLS = ("truncate",)  # YaRN's: whether the correction range is rounded to whole dimensions (default true)


class ContextConfig(Frozen):
    """config.json fields of the base model CPT trains with instead of the base's (context extension)."""

    rope_theta: float | None = Field(
        default=None,
        gt=0,
        description="RoPE base frequency, e.g. 500000.0 (Llama 3) from 10000.0: longer wavelengths for longer "
        "contexts. null: the base's.",
    )
    rope_scaling: dict[str, Any] | None = Field(
        default=None,
        description="RoPE scaling as transformers 4.57.6 reads it from config.json: {rope_type: ..., ...}; rope_type "
        + "; ".join(
            f"{k} ({v.summary}; keys: {', '.join(v.required + v.optional) or 'none'})" for k, v in ROPE_TYPES.items()
        )
        + ". Checked in pre-flight; {rope_type: default} removes the base's. null: the base's.",
    )
    max_position_embeddings: int | None = Field(
        default=None,
        ge=1,
        description="The context length the model is trained for and declares; cpt.seq_len and sft.seq_len must fit "
        "it. null: the base's.",
    )


def config_changes(ctx: ContextConfig | None) -> dict[str, Any]:
    """The config.json fields `ctx` sets, as transformers reads them (the scaling's floats as floats)."""
    if ctx is None:
        return {}
    out: dict[str, Any] = {}
    if ctx.rope_theta is not None:
        out["rope_theta"] = float(ctx.rope_theta)
    if ctx.rope_scaling is not None:
        scaling = dict(ctx.rope_scaling)
        for k, v in scaling.items():
            if k in _FLOATS and isinstance(v, int) and not isinstance(v, bool):
                scaling[k] = float(v)
            elif k in _LISTS and isinstance(v, list):
                scaling[k] = [float(x) for x in v]
        out["rope_scaling"] = None if scaling.get("rope_type") == "default" and len(scaling) == 1 else scaling
    if ctx.max_position_embeddings is not None:
        out["max_position_embeddings"] = int(ctx.max_position_embeddings)
    return out


def applied(model_config: dict[str, Any], ctx: ContextConfig | None) -> dict[str, Any]:
    """The base's config.json with the stage's context settings in place."""
    return {**model_config, **config_changes(ctx)}


def _shown(value: Any) -> str:
    """A value as YAML flow style says it, a mapping's keys sorted: the same text from the config as
    loaded and as read back from run.json (whose keys are sorted), so a card renders alike."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shown(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_shown, value)) + "]"
    return shown(value)


def changes_text(before: dict[str, Any], ctx: ContextConfig | None) -> list[str]:
    """'rope_theta 10000.0 → 500000.0' for each field the settings change (the log, the card)."""
    out = []
    for k, v in config_changes(ctx).items():
        if k not in before:
            out.append(f"{k} (its config class's default) → {_shown(v)}")
        elif before[k] != v:
            out.append(f"{k} {_shown(before[k])} → {_shown(v)}")
    return out


def position_limit(model_config: dict[str, Any], ctx: ContextConfig | None) -> Any:
    """The max_position_embeddings the trained model has (None where config.json has none)."""
    return applied(model_config, ctx).get("max_position_embeddings")


def _is_float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def scaling_problems(scaling: dict[str, Any], model_config: dict[str, Any] | None = None) -> list[str]:
    """What transformers 4.57.6 would refuse, warn about or silently ignore in `scaling`; with the
    (already overridden) model config, also what depends on the model's dimensions."""
    if "type" in scaling:
        return ["'type' is the old name of 'rope_type' (transformers renames it); write rope_type"]
    kind = scaling.get("rope_type")
    if kind not in ROPE_TYPES:
        return [f"rope_type {kind!r} is not one transformers 4.57.6 builds; use one of {', '.join(ROPE_TYPES)}"]
    spec, out = ROPE_TYPES[kind], []
    keys = set(scaling) - {"rope_type"}
    missing = [k for k in spec.required if k not in keys]
    if missing:
        out.append(f"rope_type {kind} needs {', '.join(missing)}")
    unknown = sorted(keys - set(spec.required) - set(spec.optional))
    if unknown:
        known = ", ".join(spec.required + spec.optional) or "no other key"
        out.append(f"rope_type {kind} does not read {', '.join(unknown)} (it takes {known})")
    for k in keys & set(spec.required + spec.optional):
        v = scaling[k]
        if k in _FLOATS and (not _is_float(v) or (_FLOATS[k] is not None and v < _FLOATS[k])):
            bound = _FLOATS[k]
            out.append(f"{k} must be a number" + (f" >= {bound:g}" if bound is not None else "") + f", got {v!r}")
        if k in _INTS and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            out.append(f"{k} must be an integer >= 1, got {v!r}")
        if k in _LISTS and (not isinstance(v, list) or not v or not all(map(_is_float, v))):
            out.append(f"{k} must be a list of numbers, got {v!r}")
        if k in _BOOLS and not isinstance(v, bool):
            out.append(f"{k} must be true or false, got {v!r}")
    if out:
        return out
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        out.append("high_freq_factor must be greater than low_freq_factor")
    if kind == "yarn" and (scaling.get("beta_fast") or 32) < (scaling.get("beta_slow") or 1):
        out.append("beta_fast (default 32) must be at least beta_slow (default 1)")
    if model_config is None:
        return out
    limit, original = model_config.get("max_position_embeddings"), scaling.get("original_max_position_embeddings")
    if kind == "llama3" and isinstance(limit, int) and original >= limit:
        out.append(
            f"original_max_position_embeddings={original} must be below max_position_embeddings={limit} "
            "(set cpt.context.max_position_embeddings to the extended length)"
        )
    if kind == "longrope":
        heads, hidden = model_config.get("num_attention_heads"), model_config.get("hidden_size")
        head_dim = model_config.get("head_dim") or (hidden // heads if heads and hidden else None)
        if head_dim:
            want = int(head_dim * model_config.get("partial_rotary_factor", 1.0)) // 2
            for k in _LISTS:
                if len(scaling[k]) != want:
                    out.append(f"{k} needs {want} numbers (half the rotary head dimension), got {len(scaling[k])}")
    return out


# -- layout rules (tasks/core/config/layout.py RULES): each takes its _Facts -----------------


def _context_in_cpt_only(x: Any) -> list[Refusal]:
    # SFT starts from cpt/hf, whose config.json carries the CPT's settings; packed SFT rows are
    # kept apart by sft.batching: packed. (A job file's section is `phase_cfg`: checked as the flow's was.)
    row = PHASES.get(x.where)  # `where` may be any label of a phase section: not a phase, no refusal
    if row is None or row.context_refused is None:
        return []
    out = []
    if x.phase_cfg.context is not None:
        out.append(Refusal(f"{x.where}.context", row.context_refused, [{"context": None}]))
    if x.phase_cfg.attention != "causal":
        out.append(
            Refusal(
                f"{x.where}.attention",
                "attention document is for CPT blocks; SFT keeps conversations apart with batching packed",
                [{"attention": "causal"}],
            )
        )
    return out


def _document_attention_isolates(x: Any) -> list[Refusal]:
    row = PHASES.get(x.where)
    if (row is not None and row.rows) or x.phase_cfg.attention != "document" or not x.spec.packing_refused:
        return []
    fixes = [{"plugin.name": n} for n, s in PLUGINS.items() if not s.packing_refused] + [{"attention": "causal"}]
    return [
        Refusal(
            f"{x.where}.attention",
            f"attention document is refused under plugin {x.spec.name}: {x.spec.packing_refused}",
            fixes,
        )
    ]


def _rope_scaling_valid(x: Any) -> list[Refusal]:
    ctx = x.phase_cfg.context
    if ctx is None or ctx.rope_scaling is None:
        return []
    model = applied(x.model, ctx) if x.model is not None else None
    return [Refusal(f"{x.where}.context.rope_scaling", p) for p in scaling_problems(ctx.rope_scaling, model)]


CONTEXT_RULES = (
    ("static", _context_in_cpt_only),
    ("static", _document_attention_isolates),
    ("static", _rope_scaling_valid),
    ("model", _rope_scaling_valid),
)
