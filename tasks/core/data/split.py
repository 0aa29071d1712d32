"""Held-out splits: which records a stage trains on and which it is evaluated on, never both.

    python -m tasks.core.data.split data/sample/sft.jsonl --fraction 0.05     # counts and digests

A record's identity is the sha256 of its canonical JSON (sorted keys, no whitespace), so the split
depends on nothing but the records themselves: the same record lands on the same side whatever
the file order, identical records land on the same side, and appending data never moves an old
record across. With a fraction, a record is held out when the first 8 bytes of its id, read as a
number in [0, 1), fall below the fraction (at least one record: the lowest id, when none does).
With a held-out file, every training record identical to a held-out record is dropped from
training. Pure functions: no torch, no I/O beyond the CLI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_SCALE = float(1 << 64)


def canonical_json(record: Any) -> str:
    # default=str: parquet rows may hold dates or decimals; their text is their identity here.
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def record_id(record: Any) -> str:
    return canonical_id(canonical_json(record))


def canonical_id(text: str) -> str:
    """record_id from the record's canonical JSON, for a caller that has made it already (shard.py)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def unit(rid: str) -> float:
    """A record id as a number in [0, 1): below heldout_fraction means held out."""
    return int(rid[:16], 16) / _SCALE


def ids_digest(ids: Sequence[str]) -> str:
    """sha256 over the sorted unique record ids of one side: equal sets give equal digests."""
    h = hashlib.sha256()
    for rid in sorted(set(ids)):
        h.update(rid.encode())
        h.update(b"\n")
    return h.hexdigest()


@dataclass
class Split:
    train: list[Any]
    heldout: list[Any]
    info: dict[str, Any] = field(default_factory=dict)


def _info(method: str, train_ids: list[str], heldout_ids: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "method": method,
        **extra,
        "train_records": len(train_ids),
        "heldout_records": len(heldout_ids),
        "train_unique": len(set(train_ids)),
        "heldout_unique": len(set(heldout_ids)),
        "train_ids_sha256": ids_digest(train_ids),
        "heldout_ids_sha256": ids_digest(heldout_ids),
    }


def split_by_fraction(records: Sequence[Any], fraction: float) -> Split:
    """Hold out ~`fraction` of the records by id hash; order within each side is file order."""
    if not 0 < fraction < 1:
        raise ValueError(f"heldout_fraction={fraction} must be in (0, 1)")
    ids = [record_id(r) for r in records]
    unique = set(ids)
    if len(unique) < 2:
        raise ValueError(
            f"{len(records)} records ({len(unique)} distinct) cannot be split into a training and a held-out part; "
            "add data or give eval.heldout_uri"
        )
    held = {rid for rid in unique if unit(rid) < fraction}
    if not held:
        held = {min(unique)}  # at least one held-out record, still chosen by hash alone
    if held == unique:
        raise ValueError(
            f"heldout_fraction={fraction} holds out all {len(unique)} distinct records; lower it or add data"
        )
    train = [r for r, rid in zip(records, ids) if rid not in held]
    heldout = [r for r, rid in zip(records, ids) if rid in held]
    return Split(
        train,
        heldout,
        _info("hash-fraction", [i for i in ids if i not in held], [i for i in ids if i in held], fraction=fraction),
    )


def split_by_heldout(records: Sequence[Any], heldout: Sequence[Any], heldout_uri: str) -> Split:
    """Held-out records come from their own file; training drops any record identical to one."""
    if not heldout:
        raise ValueError(f"the held-out set {heldout_uri} has no records")
    held_ids = [record_id(r) for r in heldout]
    held = set(held_ids)
    ids = [record_id(r) for r in records]
    train = [r for r, rid in zip(records, ids) if rid not in held]
    if not train:
        raise ValueError(
            f"every training record also appears in the held-out set {heldout_uri}: nothing left to train on"
        )
    train_ids = [i for i in ids if i not in held]
    return Split(
        train,
        list(heldout),
        _info(
            "heldout-uri", train_ids, held_ids, heldout_uri=heldout_uri, dropped_from_train=len(ids) - len(train_ids)
        ),
    )


def overlap(split: Split) -> set[str]:
    """Ids present on both sides (always empty for a Split made here)."""
    return {record_id(r) for r in split.train} & {record_id(r) for r in split.heldout}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tasks.core.data.split",
        description="Show how a .jsonl file splits into training and held-out records.",
    )
    p.add_argument("path", help="a local .jsonl file")
    p.add_argument("--fraction", type=float, default=0.05)
    a = p.parse_args(argv)
    with open(a.path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    print(json.dumps(split_by_fraction(records, a.fraction).info, indent=2))


if __name__ == "__main__":
    main()
