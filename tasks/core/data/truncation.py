"""What became of the training records longer than seq_len, counted per file, per source and in all.

    python -m tasks.core.data.truncation data/sft      # the counts of a prepared stage, as the log says them

SFT: a chat longer than `sft.seq_len` is treated by `sft.truncation` (`samples.training_rows`), the
same for every batching mode because the rows are made here, in prepare_data, before any batching:
`drop` (the default: nothing is trained that the user did not see fit), `cut` (the first seq_len
tokens; the reply the cut goes through is not labelled, so no reply is trained as if it ended where
it was cut) or `split_turns` (rows of whole exchanges). The shard's summary counts them
(`shard.tokenize_file`). CPT: documents longer than a block are split across blocks, as packing
does by design; they are counted from each shard's offsets, which need no second read of the corpus.
`describe` is the one sentence the stage's log line, the UI's tables and the model card show.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tasks.core.config.phases import PHASES, Phase

# exchanges_left_out: under split_turns, the exchanges (a reply included) longer than seq_len by
# themselves, of split chats and of chats no exchange of which fits.
SFT_KEYS = ("over_seq_len", "dropped", "cut", "split", "split_rows", "exchanges_left_out")
CPT_RULE = "split"  # a CPT document longer than a block continues in the next block


def cpt_counts(shard: Path, seq_len: int) -> dict[str, int]:
    """Training documents of one CPT shard (eos included) longer than a block."""
    offsets = np.fromfile(shard / "train.offsets", np.int64)
    lengths = np.diff(offsets)
    return {"documents": int(lengths.size), "over_seq_len": int((lengths > seq_len).sum())}


def file_counts(summary: dict[str, Any], shard: Path, kind: Phase, seq_len: int) -> dict[str, int]:
    """One input file's counts: its shard summary's (a record a row: SFT), or from its offsets (blocks: CPT)."""
    if PHASES[kind].blocks:
        return cpt_counts(shard, seq_len)
    got = summary.get("truncation") or {}
    return {k: int(got.get(k, 0)) for k in SFT_KEYS} | {
        "chats": int(summary["records"])
        - int(summary["dropped_in_heldout_set"])
        - int(summary["heldout"]["records"]) // PHASES[kind].rows_per_record
    }


def total(rows: list[dict[str, int]]) -> dict[str, int]:
    keys = sorted({k for r in rows for k in r})
    return {k: sum(int(r.get(k, 0)) for r in rows) for k in keys}


def describe(counts: dict[str, int] | None, kind: Phase, rule: str | None, seq_len: int) -> str:
    """One sentence: '3 of 200 training chats longer than seq_len=128: 3 dropped (sft.truncation: drop)'."""
    if not counts:
        return ""
    if PHASES[kind].blocks:
        n, docs = counts.get("over_seq_len", 0), counts.get("documents", 0)
        return f"{n:,} of {docs:,} training documents longer than seq_len={seq_len}: split across blocks" if n else ""
    n = counts.get("over_seq_len", 0)
    if not n:
        return ""
    rule = rule or "drop"
    parts = [
        {
            "drop": f"{counts.get('dropped', 0):,} dropped",
            "cut": f"{counts.get('cut', 0):,} cut (the reply the cut goes through unlabelled)",
            "split_turns": f"{counts.get('split', 0):,} split into {counts.get('split_rows', 0):,} rows of whole turns",
        }[rule]
    ]
    if rule == "split_turns" and counts.get("dropped"):
        parts.append(f"{counts['dropped']:,} dropped (no exchange fits)")
    if rule == "split_turns" and counts.get("exchanges_left_out"):
        n_out = counts["exchanges_left_out"]
        parts.append(f"{n_out:,} exchange{'s' if n_out != 1 else ''} longer than seq_len by itself left out")
    return (
        f"{n:,} of {counts.get('chats', n):,} training {PHASES[kind].record_noun} longer than seq_len={seq_len}: "
        f"{', '.join(parts)} ({kind}.truncation: {rule})"
    )


def main(argv: list[str]) -> None:
    for d in argv:
        index = json.loads((Path(d) / "index.json").read_text())
        tr = index.get("truncation") or {}
        for src in index.get("sources") or []:
            line = describe(src.get("truncation"), index["kind"], tr.get("rule"), index["seq_len"])
            print(f"{d} {src['name']}: {line or 'nothing longer than seq_len'}")


if __name__ == "__main__":
    main(sys.argv[1:])
