"""One large input file -> chunks at record boundaries, tokenized on their own, merged back into the file's shard.

    python -m tasks.core.data.chunks data/big.jsonl --chunk-mb 16      # the chunks a file splits into

A file larger than the chunk size is tokenized a chunk at a time, so every worker of a pool or a
Dask cluster has work even when the corpus is one file:
- .jsonl/.txt: byte ranges on a fixed grid of `chunk_bytes`, each boundary moved to just after the
  next newline; a chunk reads its range only (the worker never holds more than its batch).
- .parquet: consecutive row groups of about `chunk_bytes` (compressed column bytes).
- compressed (.gz, .bz2, .xz, .zst): the stream is decompressed once, in the scheduling process,
  and cut into chunks of decompressed lines written to `chunks/.tmp-spill-*/`, each deleted once
  tokenized (the directory when the run ends); the scheduler pulls the next one only when a worker
  is free, so the disk holds at most a chunk per worker.

Every chunk knows the line (row) number of its first record in the file (a text chunk counts the
line ends of the bytes before it, read once as its sha256 is taken), so a bad record is named by
file and line as in a whole file. A chunk's shards go to `chunks/<chunk key>/` (shard.py's layout, summary
last, reused only while its sha256 table holds); `merge` then concatenates a file's chunks into
`shards/<file key>/`, byte for byte the directory tokenize_file writes for the whole file, so the
index, the blend, the reader and the artifact never see the chunking or the number of workers.
A chunk's key is its content (the sha256 of its bytes, or the file's checksum and its row groups),
its first line and the spec: a file that grows at its end keeps the chunks before its old last
one, and a prepare killed after some chunks re-runs only the missing ones. `chunks/<file key>.json`
lists a file's chunks, so `prune` keeps the chunks of the files in the index only.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import itertools
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tasks.core.data.inputs import InputFile, resolve_inputs
from tasks.core.data.records import compression_of, open_decompressed, parquet_records, text_records
from tasks.core.data.shard import (
    KEEP_BAD,
    BadRecordError,
    ShardSpec,
    file_table,
    read_summary,
    shard_dir,
    tokenize_records,
    verified_summary,
)
from tasks.core.storage.fs import open_uri

CHUNKS = "chunks"
DEFAULT_CHUNK_MB = 64.0
MIN_SPLIT = 1 << 20  # finer chunks than this only when the user asks for them
PER_WORKER = 4  # chunks per worker, at least, before the chunk size stops halving: the workers end together
_READ = 1 << 20
_COMPRESSION_RATIO = 4  # a compressed file's text is taken to be this many times its size when choosing to split it


def chunk_dir(out_dir: Path, key: str) -> Path:
    return Path(out_dir) / CHUNKS / key


def spill_dir(out_dir: Path) -> Path:
    """Where this process spills decompressed chunks (removed by schedule.drive once nothing runs)."""
    return Path(out_dir) / CHUNKS / f".tmp-spill-{os.getpid()}"


def units(sizes: list[int], c: int) -> int:
    """How many files and chunks files of `sizes` give at chunk size `c` (about: a chunk ends at a newline)."""
    return sum(max(1, -(-size // c)) for size in sizes)


def chunk_size(sizes: list[int], workers: int, chunk_bytes: int) -> int:
    """`chunk_bytes`, halved (not below 1 MiB) while the files to tokenize (their `sizes`) give fewer than
    PER_WORKER files and chunks per worker. A large corpus keeps the fixed grid, so a grown file re-uses its chunks."""
    c = max(int(chunk_bytes), 1)
    while workers > 1 and c // 2 >= MIN_SPLIT and units(sizes, c) < PER_WORKER * workers:
        c //= 2
    return c


@dataclass(frozen=True)
class Chunk:
    file: int  # the file's index in the plan's inputs
    n: int  # its number within the file
    inp: InputFile
    mode: str  # "bytes": [start, end) of the file; "rows": parquet row groups [start, end); "spill": decompressed text at `path`
    start: int
    end: int
    first_line: int  # the line (row) number of its first line (row) in the file
    digest: str  # what its records are a function of
    size: int  # bytes, for scheduling and progress
    path: str = ""

    @property
    def order(self) -> tuple[int, int]:
        return self.file, self.n

    @property
    def label(self) -> str:
        return f"{self.inp.uri} chunk {self.n} ({'row' if self.mode == 'rows' else 'line'} {self.first_line:,})"

    def key(self, spec: ShardSpec) -> str:
        what = [self.inp.uri, self.inp.fmt, self.first_line, self.digest]
        return hashlib.sha256(json.dumps({"chunk": what, **spec.key_fields()}, sort_keys=True).encode()).hexdigest()[
            :32
        ]

    def records(self, max_chars: int) -> Iterator[tuple[int, Any]]:
        if self.mode == "rows":
            yield from parquet_records(self.inp.uri, list(range(self.start, self.end)), self.first_line)
            return
        if self.mode == "spill":
            with open(self.path, "rb") as f:
                yield from text_records(f, self.inp.uri, self.inp.fmt, max_chars, self.first_line)
            return
        with open_uri(self.inp.uri, "rb") as f:
            f.seek(self.start)
            yield from text_records(
                io.BufferedReader(_Range(f, self.end - self.start), 1 << 16),
                self.inp.uri,
                self.inp.fmt,
                max_chars,
                self.first_line,
            )


@dataclass(frozen=True)
class Whole:
    """A file tokenized in one piece (tokenize_file): no larger than a chunk, or not splittable."""

    file: int
    inp: InputFile

    @property
    def order(self) -> tuple[int, int]:
        return self.file, 0

    @property
    def label(self) -> str:
        return self.inp.uri


@dataclass(frozen=True)
class FileChunks:
    """Every chunk of a file has been handed out (or was cached): once they are done, merge them."""

    file: int
    inp: InputFile
    keys: list[str] = field(default_factory=list)


class _Range(io.RawIOBase):
    """The next `n` bytes of a binary file, as a raw stream (the file itself stays open)."""

    def __init__(self, f, n: int):
        self.f, self.left = f, n

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.f.read(min(len(b), self.left)) if self.left else b""
        self.left -= len(data)
        b[: len(data)] = data
        return len(data)


class _Count:
    """sha256 and line ends (\\n, \\r\\n, a lone \\r: the reader's universal newlines) of bytes fed in order."""

    def __init__(self):
        self.h, self.size, self.lines, self.cr_last = hashlib.sha256(), 0, 0, False

    def update(self, b: bytes) -> None:
        if not b:
            return
        self.h.update(b)
        self.size += len(b)
        self.lines += b.count(b"\n") + b.count(b"\r") - b.count(b"\r\n") - (self.cr_last and b[:1] == b"\n")
        self.cr_last = b[-1:] == b"\r"


def _text_bounds(inp: InputFile, c: int) -> list[int]:
    """Chunk starts, then the file's size: grid point k*c moved to just after the newline at or past byte k*c - 1."""
    bounds = [0]
    with open_uri(inp.uri, "rb") as f:
        k = 1
        while k * c < inp.size:
            f.seek(k * c - 1)
            pos, cut = k * c - 1, None
            while cut is None:
                block = f.read(_READ)
                if not block:
                    break
                j = block.find(b"\n")
                cut = None if j < 0 else pos + j + 1
                pos += len(block)
            if cut is None or cut >= inp.size:
                break
            if cut > bounds[-1]:
                bounds.append(cut)
            k = max(k + 1, cut // c + (1 if cut % c else 0))
    return bounds + [inp.size]


def _text_chunks(i: int, inp: InputFile, bounds: list[int]) -> Iterator[Chunk]:
    line = 1
    with open_uri(inp.uri, "rb") as f:
        for n, (a, b) in enumerate(itertools.pairwise(bounds)):
            f.seek(a)
            cnt, left = _Count(), b - a
            while left:
                block = f.read(min(_READ, left))
                if not block:
                    break
                cnt.update(block)
                left -= len(block)
            yield Chunk(i, n, inp, "bytes", a, b, line, "sha256:" + cnt.h.hexdigest(), b - a)
            line += cnt.lines


def _parquet_chunks(i: int, inp: InputFile, c: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    with open_uri(inp.uri, "rb") as f:
        meta = pq.ParquetFile(f).metadata
    groups = [
        (
            meta.row_group(g).num_rows,
            sum(meta.row_group(g).column(j).total_compressed_size for j in range(meta.num_columns)),
        )
        for g in range(meta.num_row_groups)
    ]
    n, start, first, row, size = 0, 0, 1, 1, 0
    for g, (rows, nbytes) in enumerate(groups):
        size, row = size + nbytes, row + rows
        if size >= c or g == len(groups) - 1:
            yield Chunk(i, n, inp, "rows", start, g + 1, first, f"{inp.checksum}:row-groups:{start}-{g + 1}", size)
            n, start, first, size = n + 1, g + 1, row, 0


def _spill_chunks(i: int, inp: InputFile, c: int, spill: Path) -> Iterator[Chunk]:
    """The decompressed stream cut after the first newline at or past every c bytes, each piece
    written to a file of `spill` just before it is handed out."""
    spill.mkdir(parents=True, exist_ok=True)
    n, line, carry, eof = 0, 1, b"", False
    with open_decompressed(inp.uri) as stream:
        while not eof:
            path, cnt = spill / f"{i}-{n}.txt", _Count()
            with open(path, "wb") as out:
                while True:
                    block, carry = carry or stream.read(_READ), b""
                    if not block:
                        eof = True
                        break
                    j = block.find(b"\n", max(c - 1 - cnt.size, 0)) if cnt.size + len(block) >= c else -1
                    if j >= 0:
                        block, carry = block[: j + 1], block[j + 1 :]
                    out.write(block)
                    cnt.update(block)
                    if j >= 0:
                        break
            if cnt.size == 0:
                path.unlink()
                break
            yield Chunk(i, n, inp, "spill", 0, cnt.size, line, "sha256:" + cnt.h.hexdigest(), cnt.size, str(path))
            n, line = n + 1, line + cnt.lines


def split(i: int, inp: InputFile, c: int, spill: Path) -> Iterator[Chunk] | None:
    """The chunks of input `i` (lazily: a text chunk is hashed, a compressed one decompressed, when
    its turn comes), or None when the file is tokenized whole."""
    if compression_of(inp.uri):
        return _spill_chunks(i, inp, c, spill) if inp.size * _COMPRESSION_RATIO > c else None
    if inp.size <= c:
        return None
    if inp.fmt == ".parquet":
        chunks = list(_parquet_chunks(i, inp, c))
        return iter(chunks) if len(chunks) > 1 else None
    bounds = _text_bounds(inp, c)
    return _text_chunks(i, inp, bounds) if len(bounds) > 2 else None


def work(
    inputs: list[InputFile], todo: list[int], spec: ShardSpec, out_dir: Path, c: int, largest_first: bool
) -> Iterator[Chunk | Whole | FileChunks]:
    """What the workers do for inputs[todo], in order: Whole files and the Chunks not cached yet, each
    file's FileChunks after its last chunk. Largest file first on a pool (the workers end together)."""
    order = sorted(todo, key=lambda i: -inputs[i].size) if largest_first else sorted(todo)
    spill = spill_dir(out_dir)
    for i in order:
        chunks = split(i, inputs[i], c, spill)
        if chunks is None:
            yield Whole(i, inputs[i])
            continue
        keys = []
        for ch in chunks:
            k = ch.key(spec)
            keys.append(k)
            done, damaged = verified_summary(chunk_dir(out_dir, k))
            if damaged:
                shutil.rmtree(chunk_dir(out_dir, k), ignore_errors=True)
            if done is None:
                yield ch
            elif ch.path:
                os.unlink(ch.path)
        yield FileChunks(i, inputs[i], keys)


def tokenize_chunk(ch: Chunk, spec: ShardSpec, tokenizer_dir: str, out_dir: str | Path) -> dict[str, Any]:
    """One chunk into chunks/<key>/; its summary (shard.py's, plus `chunk`) keeps enough bad-record
    messages for the merge to report the file's as a whole-file pass would."""
    out, k = Path(out_dir), ch.key(spec)
    info = {"n": ch.n, "first_line": ch.first_line, "bytes": ch.size, "mode": ch.mode}
    return tokenize_records(
        ch.records(spec.max_record_chars),
        ch.inp,
        spec,
        tokenizer_dir,
        out,
        chunk_dir(out, k),
        k,
        extra={"chunk": info},
        keep_bad=max(KEEP_BAD, spec.max_bad_records + 1),
    )


def merge(fc: FileChunks, spec: ShardSpec, out_dir: str | Path) -> dict[str, Any]:
    """The file's chunks concatenated into shards/<file key>/: the bytes tokenize_file writes for the whole file."""
    out, key = Path(out_dir), spec.key(fc.inp)
    final = shard_dir(out, key)
    done, damaged = verified_summary(final)
    if done is not None:
        return done
    if damaged:
        shutil.rmtree(final, ignore_errors=True)
    parts = [read_summary(chunk_dir(out, k)) for k in fc.keys]
    if any(s is None for s in parts):
        raise RuntimeError(f"{fc.inp.uri}: a chunk's shards are missing from {out / CHUNKS}; run the preparation again")
    bad = [b for s in parts for b in s["bad_records"]]
    skipped = sum(s["skipped"] for s in parts)
    if skipped > spec.max_bad_records:
        raise BadRecordError(
            f"{fc.inp.uri}: more than data.max_bad_records={spec.max_bad_records} bad records (the latest: "
            f"{bad[spec.max_bad_records]}; "
            f"the first: {bad[0]}); fix the data or raise data.max_bad_records"
        )
    tmp = final.parent / f".tmp-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        names = sorted(n for n in parts[0]["files"])
        for side in ("train", "heldout"):
            base = 0
            with open(tmp / f"{side}.offsets", "wb") as fo:
                fo.write(np.zeros(1, np.int64).tobytes())
                for k in fc.keys:
                    fo.write((np.fromfile(chunk_dir(out, k) / f"{side}.offsets", np.int64)[1:] + base).tobytes())
                    base += read_summary(chunk_dir(out, k))[side]["tokens"]
        for name in names:
            if name.endswith(".offsets"):
                continue
            with open(tmp / name, "wb") as fo:
                for k in fc.keys:
                    with open(chunk_dir(out, k) / name, "rb") as fi:
                        shutil.copyfileobj(fi, fo, _READ)
        ids = (
            [s["min_record_id"] for s in parts if s["min_record_id"]],
            [s["max_record_id"] for s in parts if s["max_record_id"]],
        )
        sides = {side: {f: sum(s[side][f] for s in parts) for f in parts[0][side]} for side in ("train", "heldout")}
        summary = {
            **{f: parts[0][f] for f in ("version", "dtype", "vocab_size")},
            "key": key,
            "input": fc.inp.to_json(),
            "spec": spec.key_fields(),
            "max_token_id": max(s["max_token_id"] for s in parts),
            "lines": max(s["lines"] for s in parts),
            **{
                f: sum(s[f] for s in parts)
                for f in ("records", "skipped", "dropped_in_heldout_set", "dropped_no_labels")
            },
            # SFT: the chats longer than seq_len and what sft.truncation made of them, summed like the counts above
            **(
                {"truncation": {f: sum(s["truncation"][f] for s in parts) for f in parts[0]["truncation"]}}
                if "truncation" in parts[0]
                else {}
            ),
            **sides,
            "min_record_id": min(ids[0], default=None),
            "max_record_id": max(ids[1], default=None),
            "bad_records": bad[:KEEP_BAD],
            "files": file_table(tmp),
        }
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
        listing = out / CHUNKS / f"{key}.json"
        listing.write_text(json.dumps({"input": fc.inp.uri, "chunks": fc.keys}))
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return read_summary(final) or summary


def prune(out_dir: Path, file_keys: set[str]) -> int:
    """Remove the chunks (and chunk lists) of files whose shard is not in `file_keys`; returns how many chunks."""
    root = Path(out_dir) / CHUNKS
    if not root.is_dir():
        return 0
    keep: set[str] = set()
    for listing in root.glob("*.json"):
        if listing.stem in file_keys:
            keep |= set(json.loads(listing.read_text())["chunks"])
        else:
            listing.unlink()
    n = 0
    for d in root.iterdir():
        if d.is_dir() and not d.name.startswith(".") and d.name not in keep:
            shutil.rmtree(d, ignore_errors=True)
            n += 1
    return n


def clean_stale(out_dir: Path) -> None:
    """Chunks and spills a killed worker or scheduler left half-written (their summary never landed)."""
    for parent in (Path(out_dir) / "shards", Path(out_dir) / CHUNKS):
        for stale in parent.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m tasks.core.data.chunks", description="The chunks a corpus file splits into."
    )
    ap.add_argument("uri")
    ap.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_MB)
    a = ap.parse_args(argv)
    import tempfile

    inp = resolve_inputs(a.uri)[0]
    with tempfile.TemporaryDirectory() as tmp:
        chunks = split(0, inp, int(a.chunk_mb * 2**20), Path(tmp))
        for ch in chunks or []:
            print(f"chunk {ch.n}: {ch.mode} [{ch.start:,}, {ch.end:,}) first line {ch.first_line:,}, {ch.size:,} bytes")
        if chunks is None:
            print(f"{inp.uri}: tokenized whole ({inp.size:,} bytes)")


if __name__ == "__main__":
    main()
