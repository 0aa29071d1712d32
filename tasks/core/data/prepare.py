"""Prepare a stage's data: resolve the inputs, tokenize the files not yet tokenized, write the index.

    python -m tasks.core.data.prepare --tokenizer runs/demo/base-model --uri data/sample/cpt.jsonl \
        --kind cpt --seq-len 256 --heldout-fraction 0.05 --out /tmp/prep --workers 2

Output (`out_dir`): `shards/<key>/` per input file (see shard.py) and `index.json`, written last,
listing the files in input order with their shard, counts and the split, and `sources`: each
source's files, weight and training samples and tokens. A mixture (more than one source, with a
`BlendPlan`) also gets `blend.items`, the blended stream of the planned steps (tasks/core/data/blend.py),
and each source's realized share and epochs in `sources`; held-out-only sources (CPT) their checked
records in `heldout-sources/` and a row each in `heldout_sources` (tasks/core/data/heldout_only.py). The index is a pure
function of the inputs, the tokenizer and the spec (no times, no host names), so its digest can be
the stage's skip rule. Shards of files that left the corpus stay in `shards/` (a cache keyed by
content) until `prune=True`. A cached shard is reused only when every file of it still has the
sha256 recorded when it was made (`shard.verified_summary`); one that does not is deleted and its
input tokenized again, and `Plan.dropped` says which and why (the caller warns).

Files are tokenized by a process pool (`workers` > 1; spawn, so a caller's threads and CUDA state
never leak into a worker) or in this process (`workers` <= 1), a file larger than `chunk_mb` a chunk
at a time, so one large file keeps every worker busy (tasks/core/data/chunks.py; the shards are the
same bytes). A Prefect task runner can drive the same work instead (tasks/core/data/schedule.py
`drive`); `plan` and `finalize` are the two halves around it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tasks.core.config.phases import PHASES
from tasks.core.data import chunks, heldout_only, schedule, truncation
from tasks.core.data.blend import BLEND_FILE, BlendPlan, Source, blend
from tasks.core.data.index import INDEX, PrepareError, special_tokens, tokenizer_fingerprint
from tasks.core.data.inputs import InputError, InputFile, resolve_inputs
from tasks.core.data.records import FOLDER_FORMATS, BadRecord, iter_file_records
from tasks.core.data.shard import (
    KEEP_BAD,
    ShardSpec,
    freeze_encoder,
    load_tokenizer,
    read_summary,
    shard_dir,
    verified_summary,
)
from tasks.core.data.spec import MAIN_SOURCE, PrepareSpec
from tasks.core.data.split import record_id

INDEX_VERSION = 1


@dataclass
class Plan:
    out_dir: Path
    tokenizer_dir: str
    spec: ShardSpec
    inputs: list[InputFile]
    keys: list[str]
    todo: list[int]  # indices into inputs whose shards do not exist yet (or failed their check)
    heldout_inputs: list[InputFile] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # cached shards deleted as damaged: file and why
    sources: list[Source] = field(default_factory=list)
    ranges: list[tuple[int, int]] = field(default_factory=list)  # each source's inputs[a:b]
    blend: BlendPlan | None = None  # the planned steps a mixture is blended for
    heldout_only: list[Source] = field(default_factory=list)  # eval.heldout_sources: evaluated, never trained on
    heldout_only_inputs: list[list[InputFile]] = field(default_factory=list)
    not_data: list[str] = field(
        default_factory=list
    )  # files of a source's directory that are not data.formats (never read)
    chunk_bytes: int = int(
        chunks.DEFAULT_CHUNK_MB * 2**20
    )  # data.tokenize.chunk_mb: a larger file is split (chunks.py)


@dataclass
class Result:
    index: dict[str, Any]
    tokenized: list[str]  # input uris tokenized by this call
    reused: list[str]  # input uris whose shards already existed
    seconds: float
    dropped: list[str] = field(default_factory=list)  # Plan.dropped


def _heldout_ids(files: list[InputFile], max_record_chars: int) -> frozenset[str]:
    ids = set()
    for f in files:
        for _, rec in iter_file_records(f.uri, f.fmt, max_record_chars):
            if isinstance(rec, BadRecord):
                raise PrepareError(f"eval.heldout_uri: {rec}; the held-out set must be clean")
            ids.add(record_id(rec))
    if not ids:
        raise PrepareError(f"eval.heldout_uri: the held-out set ({', '.join(f.uri for f in files)}) has no records")
    return frozenset(ids)


def resolve_sources(
    sources: list[Source], formats: Sequence[str] = FOLDER_FORMATS, skipped: list[str] | None = None
) -> tuple[list[InputFile], list[tuple[int, int]]]:
    """Every source's files, in source order, and each source's range of them. A file may feed one
    source only; every message names the source's field. `formats`, `skipped`: resolve_inputs's."""
    inputs: list[InputFile] = []
    ranges: list[tuple[int, int]] = []
    owner: dict[str, str] = {}
    for i, src in enumerate(sources):
        label = "data.uri" if len(sources) == 1 and src.name == MAIN_SOURCE else f"data.sources[{i}] ({src.name}).uri"
        files = resolve_inputs(src.uri, label=label, formats=formats, skipped=skipped)
        for f in files:
            if f.uri in owner:
                raise InputError(
                    f"{label}: {f.uri!r} is also a file of source {owner[f.uri]!r}; a file may feed one source only"
                )
            owner[f.uri] = src.name
        ranges.append((len(inputs), len(inputs) + len(files)))
        inputs += files
    return inputs, ranges


def plan(spec: PrepareSpec, tokenizer_dir: str | Path, out_dir: str | Path) -> Plan:
    """What is to be tokenized of `spec`'s corpus into `out_dir`, and the ShardSpec it is tokenized with."""
    kind, field, seq_len = spec.kind, spec.field, spec.seq_len
    heldout_fraction, heldout_uri, max_record_chars = spec.heldout_fraction, spec.heldout_uri, spec.max_record_chars
    blend_plan_, heldout_sources, formats = spec.blend_plan, spec.heldout_sources, spec.formats
    out = Path(out_dir)
    sources = list(spec.sources)
    if len(sources) > 1 and blend_plan_ is None:
        raise PrepareError(
            f"{len(sources)} sources ({', '.join(s.name for s in sources)}) need a BlendPlan: the steps their blend "
            "is made for"
        )
    if heldout_sources and not PHASES[kind].heldout_sources:
        raise PrepareError(
            "eval.heldout_sources: held-out-only sources are evaluated by perplexity, a CPT stage's; remove them from "
            f"the {PHASES[kind].title} stage"
        )
    skipped: list[str] = []
    inputs, ranges = resolve_sources(sources, formats, skipped)
    owner = {inputs[j].uri: s.name for s, (a, b) in zip(sources, ranges) for j in range(a, b)}
    only_inputs = heldout_only.resolve(heldout_sources, owner, formats)
    if heldout_fraction and heldout_uri:
        raise PrepareError(
            "give eval.heldout_uri or eval.heldout_fraction, not both (set heldout_fraction: 0 when heldout_uri is set)"
        )
    held_inputs = resolve_inputs(heldout_uri) if heldout_uri else []
    shard_spec = ShardSpec(
        kind=kind,
        field=field,
        seq_len=seq_len,
        tokenizer_sha256=tokenizer_fingerprint(tokenizer_dir),
        heldout_fraction=heldout_fraction,
        heldout_ids=_heldout_ids(held_inputs, max_record_chars) if held_inputs else frozenset(),
        on_bad_record=spec.on_bad_record,
        max_bad_records=spec.max_bad_records,
        max_record_chars=max_record_chars,
        truncation=spec.truncation_rule,
    )
    keys = [shard_spec.key(f) for f in inputs]
    todo, dropped = [], []
    for i, k in enumerate(keys):
        summary, damaged = verified_summary(shard_dir(out, k))
        if damaged:
            shutil.rmtree(shard_dir(out, k), ignore_errors=True)
            dropped.append(f"{inputs[i].uri}: its cached shard is dropped and tokenized again: {damaged}")
        if summary is None:
            todo.append(i)
    if todo and PHASES[kind].record == "text":  # workers then need no transformers
        freeze_encoder(str(tokenizer_dir), out, shard_spec.tokenizer_sha256)
    return Plan(
        out,
        str(tokenizer_dir),
        shard_spec,
        inputs,
        keys,
        todo,
        held_inputs,
        dropped,
        sources,
        ranges,
        blend_plan_ if len(sources) > 1 else None,
        list(heldout_sources),
        only_inputs,
        skipped,
    )


def run_files(
    p: Plan, indices: list[int], spec: ShardSpec, workers: int, progress: Callable[[dict], None] | None = None
) -> dict[int, dict]:
    """Tokenize inputs[indices] (a file larger than p.chunk_bytes a chunk at a time: tasks/core/data/chunks.py);
    summaries by index. In this process: in input order, so the first problem reported is the first in the
    corpus. On a pool: largest file first, so the workers end together."""
    return schedule.run(p.inputs, indices, spec, p.tokenizer_dir, p.out_dir, workers, p.chunk_bytes, progress)


def _check_corpus(p: Plan, summaries: list[dict]) -> None:
    records = sum(s["records"] for s in summaries)
    skipped = sum(s["skipped"] for s in summaries)
    where = f"{len(p.inputs)} input file{'s' if len(p.inputs) != 1 else ''} ({p.inputs[0].uri}{', ...' if len(p.inputs) > 1 else ''})"
    if records == 0:
        raise PrepareError(
            f"the corpus has no usable record: {where}, {skipped} bad records skipped; check data.uri and "
            f"data.{PHASES[p.spec.kind].field}"
        )
    if skipped > p.spec.max_bad_records:
        first = next(b for s in summaries for b in s["bad_records"])
        raise PrepareError(
            f"{skipped} bad records in {where}, more than data.max_bad_records={p.spec.max_bad_records} (the first: "
            f"{first}); fix the data or raise data.max_bad_records"
        )


def empty_files(rows: list[dict]) -> list[str]:
    """The inputs (index files or summaries) that hold no record at all, good or bad: 0 bytes, or blank lines only."""
    return [s["input"]["uri"] for s in rows if s["records"] == 0 and s["skipped"] == 0]


def copy_shard(src: Path, dest: Path) -> None:
    """A cached shard directory copied into an artifact. Never a hard link: an artifact sharing an
    inode with the cache would let a byte flipped in one flip the other, and the cache would then
    rebuild the artifact from the damaged bytes. (Read-only hard links would still share the one
    copy that a disk fault or a tool run as the owner damages.) os.copy_file_range lets the kernel
    share the blocks copy-on-write where the filesystem can (btrfs, XFS: a reflink) and copy in
    the kernel elsewhere; shutil.copyfile where the call is refused."""
    dest.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        with open(f, "rb") as fi, open(dest / f.name, "wb") as fo:
            left = os.fstat(fi.fileno()).st_size
            try:
                while left > 0 and (n := os.copy_file_range(fi.fileno(), fo.fileno(), left)) > 0:
                    left -= n
            except OSError:
                left = -1
        if left != 0:
            shutil.copyfile(f, dest / f.name)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _mixture(p: Plan, rows: list[dict], spec: ShardSpec) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """index.json's `sources` and, for a mixture, its `blend` (the stream is written here, before the index)."""
    table, row = [], PHASES[spec.kind]
    for src, (a, b) in zip(p.sources, p.ranges):
        part = rows[a:b]
        tokens = sum(s["train"]["tokens"] for s in part)
        # a row phase's sample is a record: a pair is two rows of a shard (chosen, rejected), one sample
        samples = (
            tokens // spec.seq_len if row.blocks else sum(s["train"]["records"] for s in part) // row.rows_per_record
        )
        if len(p.sources) > 1 and samples == 0:
            what = (
                f"{tokens} training tokens, fewer than seq_len={spec.seq_len}"
                if row.blocks
                else f"no training {row.unit[:-1]}"
            )
            raise PrepareError(
                f"source {src.name!r} ({part[0]['input']['uri'] if part else 'no file'}{', ...' if len(part) > 1 else ''}) "
                f"has {what}; add data to it or remove it from data.sources"
            )
        table.append(
            {
                "name": src.name,
                "files": [a, b],
                "samples_available": samples,
                "tokens_available": tokens,
                "heldout_records": sum(s["heldout"]["records"] for s in part),
                "heldout_tokens": sum(s["heldout"]["tokens"] for s in part),
                "truncation": truncation.total([s["truncation"] for s in part]),
            }
        )
    if p.blend is None:
        table[0]["weight"] = 1.0
        return table, None
    lengths = None
    if row.rows:  # every row's tokens, from the offsets alone; a pair's are its two rows'
        lengths = np.concatenate(
            [np.diff(np.fromfile(shard_dir(p.out_dir, s["key"]) / "train.offsets", np.int64)) for s in rows]
        )
        lengths = lengths.reshape(-1, row.rows_per_record).sum(1)
    stream, report = blend(
        [s.name for s in p.sources],
        [s.weight for s in p.sources],
        [t["samples_available"] for t in table],
        [t["tokens_available"] for t in table],
        p.blend,
        spec.seq_len,
        lengths,
    )
    data = stream.astype(stream.dtype.newbyteorder("<")).tobytes()
    _write_atomic(p.out_dir / BLEND_FILE, data)
    for t, r in zip(table, report):
        t.update(r)
    meta = {
        "file": BLEND_FILE,
        "dtype": stream.dtype.name,
        "positions": len(stream),
        "sha256": hashlib.sha256(data).hexdigest(),
        "plan": p.blend.to_json(),
        "unit": row.unit,
        "rule": "megatron-greedy",
    }
    return table, meta


def _too_long(summary: dict[str, Any]) -> int:
    """Training chats of one file that sft.truncation left out whole (longer than seq_len)."""
    return int((summary.get("truncation") or {}).get("dropped", 0))


def finalize(p: Plan, summaries: dict[int, dict], workers: int = 1) -> dict[str, Any]:
    """Corpus-wide checks, split_by_fraction's fallback, then index.json (written last)."""
    spec = p.spec
    rows = [summaries[i] for i in range(len(p.inputs))]
    _check_corpus(p, rows)
    split: dict[str, Any] = {"method": "none"}
    if spec.heldout_fraction > 0:
        lo = min(s["min_record_id"] for s in rows if s["min_record_id"])
        hi = max(s["max_record_id"] for s in rows if s["max_record_id"])
        if lo == hi:
            raise PrepareError(
                f"{sum(s['records'] for s in rows)} records (1 distinct) cannot be split into a training and a "
                "held-out part; add data or give eval.heldout_uri"
            )
        if sum(s["heldout"]["records"] for s in rows) == 0:
            # split_by_fraction's rule: no id below the fraction -> the lowest id is held out.
            # Only the files holding it are tokenized again, with that id forced to the held-out side.
            spec = replace(spec, force_heldout=frozenset({lo}))
            again = [i for i, s in enumerate(rows) if s["min_record_id"] == lo]
            for i in again:
                p.keys[i] = spec.key(p.inputs[i])
            rows_again = run_files(p, again, spec, workers)
            for i, s in rows_again.items():
                rows[i] = s
        # Chats truncation left out were training chats: not the held-out split's doing (the error below says it).
        if sum(s["train"]["records"] + s["dropped_no_labels"] + _too_long(s) for s in rows) == 0:
            raise PrepareError(
                f"heldout_fraction={spec.heldout_fraction} holds out every distinct record; lower it or add data"
            )
        split = {"method": "hash-fraction", "fraction": spec.heldout_fraction, "forced": sorted(spec.force_heldout)}
    elif spec.heldout_ids:
        split = {
            "method": "heldout-uri",
            "heldout": [f.to_json() for f in p.heldout_inputs],
            "heldout_ids": len(spec.heldout_ids),
        }
    tok = load_tokenizer(p.tokenizer_dir)
    train_records = sum(s["train"]["records"] for s in rows)
    train_tokens = sum(s["train"]["tokens"] for s in rows)
    row = PHASES[spec.kind]
    if row.blocks and train_tokens < spec.seq_len:
        raise PrepareError(
            f"the corpus has {train_tokens} training tokens, fewer than seq_len={spec.seq_len}: add data or lower "
            "seq_len"
        )
    if row.rows and train_records == 0:
        dropped = sum(s["dropped_no_labels"] for s in rows)
        too_long = sum(_too_long(s) for s in rows)
        if too_long and not dropped:
            raise PrepareError(
                f"every one of the {too_long} training chats is longer than seq_len={spec.seq_len} and "
                f"sft.truncation: {spec.truncation} leaves each one out, so nothing would train: raise sft.seq_len, "
                "or set sft.truncation: cut or split_turns"
            )
        raise PrepareError(
            f"no SFT record has an assistant token within seq_len={spec.seq_len} ({dropped} dropped without one, "
            f"{too_long} longer than seq_len "
            f"dropped by sft.truncation: {spec.truncation}): raise seq_len, choose sft.truncation: cut or "
            "split_turns, or check the data"
        )
    dtypes = {s["dtype"] for s in rows}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if not p.sources:  # a Plan made by hand: data.uri's one source
        p.sources, p.ranges = [Source(MAIN_SOURCE, [f.uri for f in p.inputs])], [(0, len(p.inputs))]
    # What became of the training records longer than seq_len, per file (then per source and in all).
    rows = [
        {**s, "truncation": truncation.file_counts(s, shard_dir(p.out_dir, s["key"]), spec.kind, spec.seq_len)}
        for s in rows
    ]
    sources, blend_meta = _mixture(p, rows, spec)
    index = {
        "version": INDEX_VERSION,
        "kind": spec.kind,
        "field": spec.field,
        "seq_len": spec.seq_len,
        "tokenizer_sha256": spec.tokenizer_sha256,
        "vocab_size": rows[0]["vocab_size"],
        "dtype": dtypes.pop() if len(dtypes) == 1 else "mixed",
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": pad,
        "special_tokens": special_tokens(tok, spec.kind),  # what pre-flight's special-token check agreed to
        "max_token_id": max(s["max_token_id"] for s in rows),
        "split": split,
        "on_bad_record": spec.on_bad_record,
        "truncation": {"rule": spec.truncation if row.rows else truncation.CPT_RULE, "seq_len": spec.seq_len},
        "sources": sources,
        "blend": blend_meta,
        "files": [
            {
                "input": s["input"],
                "shard": f"shards/{s['key']}",
                "records": s["records"],
                "skipped": s["skipped"],
                "dropped_in_heldout_set": s["dropped_in_heldout_set"],
                "dropped_no_labels": s["dropped_no_labels"],
                "train": s["train"],
                "heldout": s["heldout"],
                "bad_records": s["bad_records"][:5],
                "truncation": s["truncation"],
            }
            for s in rows
        ],
        "totals": {
            "files": len(rows),
            "bytes": sum(f.size for f in p.inputs),
            "records": sum(s["records"] for s in rows),
            "skipped": sum(s["skipped"] for s in rows),
            "dropped_no_labels": sum(s["dropped_no_labels"] for s in rows),
            "truncation": truncation.total([s["truncation"] for s in rows]),
            "empty_files": len(empty_files(rows)),
            "train_records": train_records,
            "train_tokens": train_tokens,
            "heldout_records": sum(s["heldout"]["records"] for s in rows),
            "heldout_tokens": sum(s["heldout"]["tokens"] for s in rows),
            "cpt_blocks": sum(t["samples_available"] for t in sources)
            if row.blocks
            else None,  # blocks never straddle two sources
        },
    }
    over_at = [at for s in rows for at in s.get("over_seq_len_at") or ()]  # a pair encoder names its long pairs
    if over_at:  # only then, as below: a CPT or SFT index keeps the bytes (and digest) it had
        index["over_seq_len_at"] = over_at[:KEEP_BAD]
    if p.heldout_only:  # only then: an index without them keeps the bytes (and digest) it had before they existed
        index["heldout_sources"] = heldout_only.write(
            p.out_dir, p.heldout_only, p.heldout_only_inputs, tok, spec.field, spec.seq_len, spec.max_record_chars
        )
    _write_atomic(p.out_dir / INDEX, (json.dumps(index, indent=1, sort_keys=True) + "\n").encode())
    return index


def prune(out_dir: Path, index: dict[str, Any]) -> int:
    """Remove shards the index does not name (files that left the corpus); returns how many."""
    keep = {f["shard"].rsplit("/", 1)[-1] for f in index["files"]}
    chunks.prune(out_dir, keep)
    n = 0
    for d in (out_dir / "shards").iterdir():
        if d.name not in keep:
            shutil.rmtree(d, ignore_errors=True)
            n += 1
    return n


def prepare(
    uri: str | Sequence[str],
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    *,
    workers: int = 1,
    progress: Callable[[dict], None] | None = None,
    prune_unused: bool = False,
    chunk_mb: float = chunks.DEFAULT_CHUNK_MB,
    **spec: Any,
) -> Result:
    """`prepare_spec_into` of the PrepareSpec that `uri` and the keywords `spec` make (PrepareSpec.of)."""
    return prepare_spec_into(
        PrepareSpec.of(uri, **spec),
        tokenizer_dir,
        out_dir,
        workers=workers,
        progress=progress,
        prune_unused=prune_unused,
        chunk_mb=chunk_mb,
    )


def prepare_spec_into(
    spec: PrepareSpec,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    *,
    workers: int = 1,
    progress: Callable[[dict], None] | None = None,
    prune_unused: bool = False,
    chunk_mb: float = chunks.DEFAULT_CHUNK_MB,
) -> Result:
    """Resolve, tokenize what is missing (a failure keeps every file and chunk already done), index."""
    started = time.monotonic()
    p = plan(spec, tokenizer_dir, out_dir)
    p.chunk_bytes = max(1, int(chunk_mb * 2**20))
    (p.out_dir / "shards").mkdir(parents=True, exist_ok=True)
    chunks.clean_stale(p.out_dir)  # a worker killed mid-file or mid-chunk; its summary never landed
    done = run_files(p, p.todo, p.spec, workers, progress)
    summaries = {i: done.get(i) or read_summary(shard_dir(p.out_dir, p.keys[i])) for i in range(len(p.inputs))}
    index = finalize(p, summaries, workers)
    if prune_unused:
        prune(p.out_dir, index)
    return Result(
        index,
        [p.inputs[i].uri for i in p.todo],
        [f.uri for i, f in enumerate(p.inputs) if i not in p.todo],
        time.monotonic() - started,
        p.dropped,
    )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m tasks.core.data.prepare", description="Tokenize a corpus into memory-mapped token shards."
    )
    ap.add_argument("--uri", required=True, nargs="+", help="file(s), glob(s) or directory(ies), any fsspec URI")
    ap.add_argument("--tokenizer", required=True, help="directory holding the tokenizer (an HF model dir)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kind", choices=list(PHASES), required=True)
    ap.add_argument("--field", default=None)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--heldout-fraction", type=float, default=0.0)
    ap.add_argument("--on-bad-record", choices=["error", "skip"], default="error")
    ap.add_argument(
        "--truncation", choices=["drop", "cut", "split_turns"], default="drop", help="SFT: a chat longer than seq_len"
    )
    ap.add_argument("--max-bad-records", type=int, default=100)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument(
        "--chunk-mb",
        type=float,
        default=chunks.DEFAULT_CHUNK_MB,
        help="a file larger than this is tokenized in chunks, spread over the workers",
    )
    a = ap.parse_args(argv)
    try:
        r = prepare(
            a.uri if len(a.uri) > 1 else a.uri[0],
            a.tokenizer,
            a.out,
            workers=a.workers,
            chunk_mb=a.chunk_mb,
            kind=a.kind,
            field=a.field or PHASES[a.kind].default_field,
            seq_len=a.seq_len,
            heldout_fraction=a.heldout_fraction,
            on_bad_record=a.on_bad_record,
            max_bad_records=a.max_bad_records,
            truncation_rule=a.truncation,
        )
    except (InputError, PrepareError, ValueError) as e:
        raise SystemExit(f"prepare: {e}") from None
    for d in r.dropped:
        print(f"warning: {d}", file=sys.stderr)
    print(
        json.dumps(
            {
                "tokenized": len(r.tokenized),
                "reused": len(r.reused),
                "seconds": round(r.seconds, 2),
                **r.index["totals"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
