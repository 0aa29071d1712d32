"""Planning: check every key, shape and dtype of a source against the model family, then lay out output shards.

    python -c "from tasks.core.models.convert.plan import plan_shards; print(plan_shards([4, 4, 4, 10, 1], 8))"

Nothing is written until the whole plan is valid, and every problem is collected before raising,
so one run reports them all. The keys and shapes come from the family registry
(`tasks.core.models.families`), which is the only place a family's layout is spelled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tasks.core.errors import ConversionError
from tasks.core.models.convert.dtypes import FLOATING, SAFE_WEIGHTS_NAME, itemsize
from tasks.core.models.convert.source import Entry, Reader, Source, bitwise_equal
from tasks.core.models.families import expected_tensors, family_config, shape_cause, tied_keys

_MAX_PROBLEMS_SHOWN = 25


@dataclass
class Planned:
    entry: Entry
    out_dtype: str
    out_nbytes: int


def validate_and_order(
    source: Source, model_config: Mapping[str, Any], out_code: str | None, reader: Reader
) -> tuple[list[Planned], list[str]]:
    """Output tensors in model order plus the keys dropped as tied duplicates.

    Collects every problem before raising so one run reports them all; nothing is written until
    the whole plan is valid.
    """
    family, config = family_config(model_config)
    expected = expected_tensors(model_config)
    tied = tied_keys(model_config)
    problems = list(source.problems)
    dropped: list[str] = []

    for key, entries in source.by_key.items():
        if len(entries) > 1:
            problems.append(
                f"duplicated key {key!r} in {' and '.join(e.file for e in entries)} (overlapping shards or stages)"
            )
    for key in source.by_key:
        if key in expected:
            continue
        if key in tied:
            original = source.by_key.get(tied[key])
            if original and len(original) == 1 and len(source.by_key[key]) == 1:
                if bitwise_equal(reader, source.by_key[key][0], original[0]):
                    dropped.append(key)  # the pp > 1 (or DDP-on-GPU) copy of a tied weight
                else:
                    problems.append(
                        f"{key!r} in {source.by_key[key][0].file} differs from {tied[key]!r} but config.json ties them "
                        f"(tie_word_embeddings=true): the tie was broken in training, or the config is wrong"
                    )
            continue
        hint = " (config.json has tie_word_embeddings=true, so no separate lm_head is expected)" if key in tied else ""
        problems.append(
            f"unexpected key {key!r} in {source.by_key[key][0].file}: not in the {config['model_type']} model "
            f"config.json describes{hint}"
        )
    for key in expected:
        if key not in source.by_key:
            hint = ""
            if key in family.tied and not config.get("tie_word_embeddings"):
                hint = " (config.json has tie_word_embeddings=false; was the model trained with tied embeddings?)"
            problems.append(f"missing key {key!r}: no input file holds it{hint}")

    planned: list[Planned] = []
    floating: dict[str, list[str]] = {}
    for key, want in expected.items():
        entries = source.by_key.get(key)
        if not entries:
            continue
        e = entries[0]
        if e.shape != want:
            cause = shape_cause(key, e.shape, want, family)
            problems.append(f"{key!r} in {e.file} has shape {list(e.shape)}, config.json implies {list(want)}: {cause}")
            continue
        code = e.dtype
        if e.dtype in FLOATING:
            floating.setdefault(e.dtype, []).append(key)
            code = out_code or e.dtype
        planned.append(Planned(e, code, math.prod(e.shape) * itemsize(code)))
    if out_code is None and len(floating) > 1:
        mix = "; ".join(f"{c}: {len(ks)} tensors, e.g. {ks[0]!r}" for c, ks in sorted(floating.items()))
        problems.append(f"mixed floating dtypes ({mix}): pass dtype= to cast them to one")

    if problems:
        shown = problems[:_MAX_PROBLEMS_SHOWN]
        more = len(problems) - len(shown)
        lines = [f"cannot convert {source.root} ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"]
        lines += [f"  - {p}" for p in shown] + ([f"  ... and {more} more"] if more else [])
        raise ConversionError("\n".join(lines))
    return planned, dropped


def plan_shards(sizes: Iterable[int], budget: int) -> list[list[int]]:
    """Group consecutive item indexes into shards of at most `budget` bytes (a bigger item alone)."""
    shards: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        if current and used + size > budget:
            shards.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        shards.append(current)
    return shards


def shard_name(k: int, n: int) -> str:
    """transformers' naming: one shard is `model.safetensors`, else `model-0000K-of-0000N.safetensors`."""
    return SAFE_WEIGHTS_NAME if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
