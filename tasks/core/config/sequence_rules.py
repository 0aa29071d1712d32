"""The layout rules of `<phase>.plugin.sequence_parallelism`, registered in `tasks.core.config.layout.RULES`.

    python -c "from tasks.core.config.sequence_rules import SP_RULES; print([(t, r.__name__) for t, r in SP_RULES])"

Each rule reads the mode's `SP_MODES` row (tasks/core/config/sequence.py), never a mode's name, and
returns `Refusal`s whose fixes are the settings (or the other modes) that would run. Which families'
shardformer policies support a mode is checked against the family registry by pre-flight and the
engine (`tasks.core.models.families.sp_family_problem`): this package imports nothing above it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tasks.core.config.fixes import Refusal
from tasks.core.config.phases import PHASES
from tasks.core.config.plugins import PLUGINS
from tasks.core.config.sequence import SP_MODES, SequenceParallelConfig, SpModeSpec

Problem = tuple[str, str]
_OFF: dict[str, Any] = {"plugin.sequence_parallelism": None}


def _sp(x: Any) -> tuple[SequenceParallelConfig, SpModeSpec] | None:
    sp = x.phase_cfg.plugin.sequence_parallelism
    if isinstance(sp, dict):  # a fix's value, applied unvalidated
        sp = SequenceParallelConfig.model_validate(sp)
    if sp is None or sp.mode not in SP_MODES:
        return None
    return sp, SP_MODES[sp.mode]


def _field(x: Any, leaf: str = "") -> str:
    return f"{x.f}.sequence_parallelism" + (f".{leaf}" if leaf else "")


def _own_group_fixes(x: Any, sizes: list[int], *, cuda: bool | None = None) -> list[dict[str, Any]]:
    """Each own-group mode at each size: the modes that would run instead."""
    return [
        {"plugin.sequence_parallelism.mode": n, "plugin.sequence_parallelism.size": s}
        for n, spec in SP_MODES.items()
        if not spec.shares_tp and not spec.refused and not (cuda is False and spec.cuda_reason)
        for s in sizes
    ]


def _sizes(x: Any) -> list[int]:
    """Group sizes > 1 the world leaves room for beside tp x pp."""
    p, world = x.phase_cfg.plugin, x.phase_cfg.launch.world_size
    rest = world // (p.tp_size * p.pp_size) if world % (p.tp_size * p.pp_size) == 0 else 1
    return [d for d in range(2, rest + 1) if rest % d == 0]


# -- static ---------------------------------------------------------------------------------------


def _sp_needs_plugin(x: Any) -> list[Problem]:
    if x.phase_cfg.plugin.sequence_parallelism is None or x.spec.sequence_parallel:
        return []
    names = [n for n, s in PLUGINS.items() if s.sequence_parallel]
    why = f"sequence parallelism needs plugin {', '.join(names)} (its shardformer policies split the sequence)"
    return [Refusal(_field(x), f"{why}, not {x.spec.name}", [_OFF, *({"plugin.name": n} for n in names)])]


def _sp_mode_refused(x: Any) -> list[Problem]:
    got = _sp(x)
    if got is None or not got[1].refused:
        return []
    sp, spec = got
    others = [
        {"plugin.sequence_parallelism.mode": n, **({"plugin.sequence_parallelism.size": None} if s.shares_tp else {})}
        for n, s in SP_MODES.items()
        if n != sp.mode and not s.refused
    ]
    return [Refusal(_field(x, "mode"), f"sequence-parallel mode {sp.mode} is refused: {spec.refused}", [*others, _OFF])]


def _sp_on_blocks_only(x: Any) -> list[Problem]:
    phase = PHASES.get(x.where)
    if phase is None or phase.blocks or _sp(x) is None:
        return []
    why = (
        f"sequence parallelism splits the seq_len blocks of a stream (CPT); in {phase.title} a record is a row, "
        "padded to its own width with a padding mask, which the sequence split is not checked against here"
    )
    return [Refusal(_field(x), why, [_OFF])]


def _sp_inside_tp(x: Any) -> list[Problem]:
    got = _sp(x)
    if got is None or not got[1].shares_tp:
        return []
    sp, p = got[0], x.phase_cfg.plugin
    if p.tp_size < 2:
        why = (
            f"sequence-parallel mode {sp.mode} runs inside tensor parallelism (its group is the tp group) and "
            "tp_size is 1"
        )
        tps = [{"plugin.tp_size": d} for d in _sizes(x)]
        return [Refusal(_field(x, "mode"), why, [*tps, *_own_group_fixes(x, _sizes(x), cuda=x.cuda), _OFF])]
    if sp.size is not None and sp.size != p.tp_size:
        why = (
            f"sequence-parallel mode {sp.mode} splits over the tp group: size must equal tp_size={p.tp_size} "
            "or be unset"
        )
        return [
            Refusal(
                _field(x, "size"),
                why,
                [{"plugin.sequence_parallelism.size": None}, {"plugin.sequence_parallelism.size": p.tp_size}],
            )
        ]
    return []


def _sp_own_group_size(x: Any) -> list[Problem]:
    got = _sp(x)
    if got is None or got[1].shares_tp:
        return []
    sp, p, world = got[0], x.phase_cfg.plugin, x.phase_cfg.launch.world_size
    size = sp.size or 1
    if size >= 2 and world % (p.tp_size * p.pp_size * size) == 0:
        return []
    why = (
        f"sequence-parallel mode {sp.mode} is its own group: world size {world} = dp x pp x tp x size needs a size "
        f">= 2 dividing world / (tp_size x pp_size) = {world / (p.tp_size * p.pp_size):g}, got size {sp.size}"
    )
    fixes = [{"plugin.sequence_parallelism.size": s} for s in _sizes(x)]
    if x.phase_cfg.launch.nnodes == 1:
        fixes.append({"launch.nproc_per_node": p.tp_size * p.pp_size * max(2, size)})
    return [Refusal(_field(x, "size"), why, [*fixes, _OFF])]


def _sp_divides_seq_len(x: Any) -> list[Problem]:
    got = _sp(x)
    if got is None:
        return []
    sp, spec = got
    n = spec.size(sp.size, x.phase_cfg.plugin.tp_size)
    if n < 2 or x.phase_cfg.seq_len % n == 0:
        return []
    why = (
        f"seq_len={x.phase_cfg.seq_len} must be a multiple of the sequence-parallel size {n}: each rank holds "
        f"seq_len/{n} tokens"
    )
    down, up = x.phase_cfg.seq_len // n * n, -(-x.phase_cfg.seq_len // n) * n
    return [Refusal(f"{x.where}.seq_len", why, [{"seq_len": v} for v in (up, down) if v > 0])]


# -- model ----------------------------------------------------------------------------------------


def _sp_divides_heads(x: Any) -> list[Problem]:
    got = _sp(x)
    if got is None or not got[1].divides_heads or x.model is None:
        return []
    sp, spec = got
    tp = x.phase_cfg.plugin.tp_size
    n = spec.size(sp.size, tp)
    heads = x.model.get("num_attention_heads")
    kv = x.model.get("num_key_value_heads") or heads
    if not isinstance(heads, int) or (heads % (n * tp) == 0 and kv % (n * tp) == 0):
        return []
    why = (
        f"sequence-parallel mode {sp.mode} gives each rank heads / size of the attention: size {n} x tp_size {tp} "
        f"must divide num_attention_heads={heads} and num_key_value_heads={kv} of the base model"
    )
    ok = [d for d in range(2, math.gcd(heads, kv) // tp + 1) if (heads // tp) % d == 0 and (kv // tp) % d == 0]
    fixes = [{"plugin.sequence_parallelism.size": d} for d in ok]
    fixes += [
        {"plugin.sequence_parallelism.mode": m, "plugin.sequence_parallelism.size": None}
        for m, s in SP_MODES.items()
        if s.shares_tp and tp > 1 and not s.refused
    ]
    return [Refusal(_field(x, "size"), why, [*fixes, _OFF])]


# -- device ---------------------------------------------------------------------------------------


def _sp_mode_needs_cuda(x: Any) -> list[Problem]:
    got = _sp(x)
    if got is None or x.cuda is not False or not got[1].cuda_reason:
        return []
    sp, spec = got
    why = f"sequence-parallel mode {sp.mode} needs CUDA ({spec.cuda_reason}) and this stage runs on CPU"
    others = [
        {"plugin.sequence_parallelism.mode": n, **({"plugin.sequence_parallelism.size": None} if s.shares_tp else {})}
        for n, s in SP_MODES.items()
        if n != sp.mode and not s.cuda_reason and not s.refused
    ]
    return [Refusal(_field(x, "mode"), why, [*others, _OFF])]


SP_RULES: tuple[tuple[str, Callable[[Any], list[Problem]]], ...] = (
    ("static", _sp_needs_plugin),
    ("static", _sp_mode_refused),
    ("static", _sp_on_blocks_only),
    ("static", _sp_inside_tp),
    ("static", _sp_own_group_size),
    ("static", _sp_divides_seq_len),
    ("model", _sp_divides_heads),
    ("device", _sp_mode_needs_cuda),
)
