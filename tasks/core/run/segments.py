"""The layout a training stage ran under, segment by segment, and the one rule a new layout must keep.

    python -c "from tasks.core.run.segments import describe; print(describe({'plugin': 'hybrid_parallel', 'tp': 2, 'pp': 1, 'zero': 0, 'dp': 1, 'world_size': 2}))"

A checkpoint's manifest meta `layout` and train_state.json's `segments` (one entry per stretch of
steps that ran under one layout, `from_step` its first checkpoint) hold `record(...)`. How a stage
runs (plugin, tp/pp/ZeRO, world size, the micro-batch x accumulation split) may change between
segments; the global batch may not: the sampler's position is counted in samples, and the next
global batch is the one the old layout would have drawn only at the same size.
"""

from __future__ import annotations

from typing import Any

LAYOUT_KEYS = ("plugin", "tp", "pp", "zero", "dp", "world_size", "micro_batch_size", "grad_accum_steps")


def record(
    plugin_meta: dict[str, Any], world_size: int, dp: int, micro_batch_size: int, grad_accum_steps: int
) -> dict[str, Any]:
    """How a stage runs, as a segment and a checkpoint record it."""
    return {
        "plugin": plugin_meta["name"],
        "tp": plugin_meta.get("tp", 1),
        "pp": plugin_meta.get("pp", 1),
        "zero": plugin_meta.get("zero", 0),
        "dp": dp,
        "world_size": world_size,
        "micro_batch_size": micro_batch_size,
        "grad_accum_steps": grad_accum_steps,
        "global_batch": micro_batch_size * grad_accum_steps * dp,
    }


def same_layout(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in LAYOUT_KEYS)


def describe(rec: dict[str, Any]) -> str:
    """'hybrid_parallel tp=2 pp=2 dp=2 on 8 ranks' (ZeRO where on, the split where known)."""
    parts = [str(rec.get("plugin"))]
    parts += [f"{k}={rec[k]}" for k in ("tp", "pp") if rec.get(k, 1) != 1]
    if rec.get("zero"):
        parts.append(f"zero={rec['zero']}")
    parts.append(f"dp={rec.get('dp')}")
    split = f" ({rec['micro_batch_size']} x {rec['grad_accum_steps']} a rank)" if rec.get("micro_batch_size") else ""
    return " ".join(parts) + f" on {rec.get('world_size')} rank{'s' if rec.get('world_size') != 1 else ''}{split}"


def summary(segments: list[dict[str, Any]]) -> str:
    """'from step 0: ...; from step 4: ...' for a stage that ran under more than one layout, else ""."""
    if len(segments) < 2:
        return ""
    return "; ".join(f"from step {s['from_step']}: {describe(s)}" for s in segments)


def keeping(global_batch: int, micro_batch_size: int, dp: int) -> list[tuple[str, int]]:
    """(field, value) pairs that make the global batch `global_batch` again under data-parallel size
    `dp`: grad_accum_steps at this micro-batch, or micro_batch_size at one accumulation step."""
    out = []
    if global_batch % (micro_batch_size * dp) == 0:
        out.append(("grad_accum_steps", global_batch // (micro_batch_size * dp)))
    if global_batch % dp == 0:
        out.append(("micro_batch_size", global_batch // dp))
    return out


def global_batch_problem(was: int, now: dict[str, Any]) -> str | None:
    """Why a checkpoint of global batch `was` cannot continue under layout `now`, naming values that
    would (None when it can)."""
    if now["global_batch"] == was:
        return None
    fixes = keeping(was, now["micro_batch_size"], now["dp"])
    how = " or ".join(f"{f}: {v}" for f, v in fixes) if fixes else f"a data-parallel size that divides {was}"
    return (
        f"its checkpoints were trained at a global batch of {was} sequences; {describe(now)} makes "
        f"{now['micro_batch_size']} x {now['grad_accum_steps']} x dp {now['dp']} = {now['global_batch']}: set {how} "
        "to continue them (or move the stage's directory aside to start it over)"
    )
