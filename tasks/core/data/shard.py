"""One input file -> one self-contained directory of memory-mappable token shards.

    python -m tasks.core.data.prepare ...     # runs this worker over every input file

Layout of `shards/<key>/` (every array a raw little-endian file that `numpy.memmap` opens):
    train.tokens   CPT: every training document's tokens followed by eos, concatenated.
                   SFT: every kept conversation's rendered tokens (truncated to seq_len).
    train.offsets  int64, records + 1 entries: record r is tokens[offsets[r]:offsets[r+1]].
    train.mask     a chat record kind's (SFT), uint8 per token: 1 where the token is a label (encode_chat's
                   labels are the token itself or -100, so one bit per token says it all).
    heldout.*      the same for the held-out side, plus heldout.jsonl, the held-out records
                   themselves (evaluation's generation check needs the conversations).
    summary.json   counts, dtype, the input's checksum, the spec and the size and sha256 of
                   every other file here; written last, so a directory without it is never read.

The shards directory is a cache, and a cache is not trusted: `verified_summary` reuses a shard
directory only while every file in it still has the sha256 its summary recorded when it was made.

The key is sha256(input uri + checksum, tokenizer fingerprint, the spec fields that change the
bytes). Adding a file to a corpus therefore tokenizes that file only, and a changed tokenizer,
field, split or (SFT) seq_len gives new keys instead of stale shards. CPT shards do not depend on
seq_len: packing into blocks is arithmetic over the concatenated stream, done by the reader.

The held-out side is decided here, in the one streaming pass, by `tasks.core.data.split`'s record id:
held out when the id's unit value falls below heldout_fraction (split_by_fraction's rule), or,
with eval.heldout_uri, dropped from training when the id is in the held-out set
(split_by_heldout's rule). `force_heldout` carries split_by_fraction's corpus-wide fallback (no id
below the fraction: the lowest id is held out), which prepare.py resolves after a first pass.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from tasks.core.config.phases import PHASES, Phase
from tasks.core.data.inputs import InputFile
from tasks.core.data.records import BadRecord, check_stream, iter_file_records
from tasks.core.data.samples import TRUNCATION
from tasks.core.data.split import canonical_id, canonical_json, unit

SHARD_VERSION = 1
KEEP_BAD = 20  # bad-record messages kept in a summary (all are counted)
_TOKENIZERS: dict[str, Any] = {}


class BadRecordError(ValueError):
    """A record the stage cannot use, named by the user's file and line."""


@dataclass(frozen=True)
class ShardSpec:
    kind: Phase  # a PHASES row: its encoder tokenizes the records
    field: str  # the data field of the phase's record kind (data.text_field, data.messages_field)
    seq_len: int
    tokenizer_sha256: str
    heldout_fraction: float = 0.0
    heldout_ids: frozenset[str] = frozenset()  # eval.heldout_uri's record ids: dropped from training
    force_heldout: frozenset[str] = frozenset()
    on_bad_record: str = "error"  # "error" | "skip"
    max_bad_records: int = 100
    max_record_chars: int = 1 << 24
    truncation: str = TRUNCATION[0]  # SFT: what a training chat longer than seq_len becomes (samples.training_rows)

    def __post_init__(self):
        if self.kind not in PHASES:
            raise ValueError(f"kind={self.kind!r}: use one of {', '.join(map(repr, PHASES))}")
        if self.on_bad_record not in ("error", "skip"):
            raise ValueError(
                f"data.on_bad_record={self.on_bad_record!r}: use 'error' (stop at the first bad record) or 'skip' "
                "(count and leave it out)"
            )
        if self.truncation not in TRUNCATION:
            raise ValueError(f"truncation={self.truncation!r}: use one of {', '.join(TRUNCATION)}")

    def key_fields(self) -> dict[str, Any]:
        """What changes the bytes of a shard (max_bad_records only decides whether to stop)."""
        return {
            "version": SHARD_VERSION,
            "kind": self.kind,
            "field": self.field,
            "seq_len": self.seq_len if PHASES[self.kind].rows else None,
            "tokenizer_sha256": self.tokenizer_sha256,
            "heldout_fraction": self.heldout_fraction,
            "heldout_ids_sha256": _set_digest(self.heldout_ids),
            "force_heldout": sorted(self.force_heldout),
            "on_bad_record": self.on_bad_record,
            "max_record_chars": self.max_record_chars,
            "truncation": self.truncation if PHASES[self.kind].rows else None,
        }

    def key(self, inp: InputFile) -> str:
        blob = json.dumps({"input": [inp.uri, inp.size, inp.checksum], **self.key_fields()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _set_digest(ids: frozenset[str]) -> str | None:
    if not ids:
        return None
    return hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def vocab_size_of(tokenizer) -> int:
    if isinstance(tokenizer, _FrozenEncoder):
        return tokenizer.vocab_size
    special = [i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) if i is not None]
    return max([len(tokenizer), *(i + 1 for i in special)])


ENCODERS = "encoders"  # <out_dir>/encoders/<tokenizer fingerprint>.json: see freeze_encoder


def fast_backend(tok):
    """The fast tokenizer's Rust backend, when encoding through it gives what tok(texts,
    add_special_tokens=False) gives: always, unless tokenizer.json configures truncation or padding
    (which tok() switches off per call)."""
    backend = tok.backend_tokenizer if getattr(tok, "is_fast", False) else None
    if backend is not None and (backend.truncation is not None or backend.padding is not None):
        return None
    return backend


def freeze_encoder(tokenizer_dir: str, out_dir: str | Path, fingerprint: str) -> Path | None:
    """Write what a CPT worker needs from the tokenizer: the backend as transformers built it
    (tokenizer.json plus the added tokens transformers put in, serialised by the `tokenizers`
    library itself), the eos id and the vocabulary size.

    A pool or Dask worker then imports `tokenizers` and numpy only (~0.2 s) instead of
    transformers and torch (3-5 s here), which on a 2-core machine is the difference between
    one worker per core paying off at 100 MB or not. The file is keyed by the tokenizer's
    fingerprint and rewritten by every plan, so it never outlives the tokenizer it came from.
    None (and no file) when there is no fast backend: workers then load the tokenizer itself.
    """
    tok = load_tokenizer(tokenizer_dir)
    backend = fast_backend(tok)
    if backend is None:
        return None
    path = Path(out_dir) / ENCODERS / f"{fingerprint}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"eos_token_id": tok.eos_token_id, "vocab_size": vocab_size_of(tok), "backend": backend.to_str()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(blob))
    os.replace(tmp, path)
    return path


class _FrozenEncoder:
    """freeze_encoder's file, loaded: the attributes tokenize_file reads from a tokenizer."""

    is_fast = True

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        blob = json.loads(path.read_text())
        self.eos_token_id = blob["eos_token_id"]
        self.vocab_size = blob["vocab_size"]
        self.backend_tokenizer = Tokenizer.from_str(blob["backend"])


def frozen_or_loaded(tokenizer_dir: str, out_dir: Path, fingerprint: str):
    """freeze_encoder's file when the plan wrote one (cached per process), else the tokenizer."""
    path = out_dir / ENCODERS / f"{fingerprint}.json"
    enc = _TOKENIZERS.get(str(path))
    if enc is None and path.is_file():
        enc = _TOKENIZERS[str(path)] = _FrozenEncoder(path)
    return enc or load_tokenizer(tokenizer_dir)


def load_tokenizer(tokenizer_dir: str):
    """One tokenizer per process and directory (a pool worker tokenizes many files)."""
    tok = _TOKENIZERS.get(tokenizer_dir)
    if tok is None:
        from transformers import AutoTokenizer

        tok = _TOKENIZERS[tokenizer_dir] = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tok


class Side:
    """The growing arrays of one side (train or heldout), appended to files as they come."""

    def __init__(self, tmp: Path, name: str, dtype: np.dtype, masked: bool):
        self.dtype, self.masked = dtype, masked
        # Appended to for the whole file's pass and closed by close(): no one `with` spans that.
        self.tokens = open(tmp / f"{name}.tokens", "wb")  # noqa: SIM115
        self.offsets = open(tmp / f"{name}.offsets", "wb")  # noqa: SIM115
        self.mask = open(tmp / f"{name}.mask", "wb") if masked else None  # noqa: SIM115
        self.offsets.write(np.zeros(1, np.int64).tobytes())
        self.n_tokens = self.n_records = 0
        self.max_id = -1
        self.label_tokens = 0

    def add(self, docs: list[list[int]], masks: list[list[int]] | None = None, eos: int | None = None) -> None:
        """Append records; with `eos`, each document is followed by it (CPT)."""
        if not docs:
            return
        lengths = np.fromiter(map(len, docs), np.int64, len(docs))
        if eos is None:
            flat = np.fromiter(chain.from_iterable(docs), np.int64, int(lengths.sum()))
        else:
            lengths += 1
            flat = np.empty(int(lengths.sum()), np.int64)
            ends = np.cumsum(lengths) - 1
            body = np.ones(flat.size, bool)
            body[ends] = False
            flat[body] = np.fromiter(chain.from_iterable(docs), np.int64, flat.size - len(docs))
            flat[ends] = eos
        if flat.size:
            self.max_id = max(self.max_id, int(flat.max()))
        self.tokens.write(flat.astype(self.dtype).tobytes())
        self.offsets.write((self.n_tokens + np.cumsum(lengths)).tobytes())
        if masks is not None:
            m = np.fromiter((x for mm in masks for x in mm), np.uint8, int(lengths.sum()))
            self.label_tokens += int(m.sum())
            self.mask.write(m.tobytes())
        self.n_tokens += int(lengths.sum())
        self.n_records += len(docs)

    def close(self) -> None:
        for f in (self.tokens, self.offsets, self.mask):
            if f is not None:
                f.close()

    def stats(self) -> dict[str, int]:
        out = {"records": self.n_records, "tokens": self.n_tokens}
        if self.masked:
            out["label_tokens"] = self.label_tokens
        return out


def encoder_class(kind: Phase) -> type:
    """The record encoder its phase's row names (tasks/core/data/encoders.py)."""
    module, _, name = PHASES[kind].encoder.partition(":")
    return getattr(importlib.import_module(module), name)


def shard_dir(out_dir: Path, key: str) -> Path:
    return out_dir / "shards" / key


def read_summary(path: Path) -> dict | None:
    try:
        return json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def file_table(d: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for p in sorted(d.iterdir()):
        if p.name != "summary.json":
            with open(p, "rb") as f:
                out[p.name] = {"size": p.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
    return out


def verified_summary(path: Path) -> tuple[dict | None, str | None]:
    """(summary, None) when shards/<key>/ holds exactly the files its summary recorded, each with
    its recorded sha256; else (None, why not), why being None when there is no finished shard."""
    summary = read_summary(path)
    if summary is None:
        return None, (f"{path}: summary.json is missing or unreadable" if path.is_dir() else None)
    recorded = summary.get("files")
    if not isinstance(recorded, dict):
        return None, f"{path}: summary.json records no file hashes, so its shards cannot be checked"
    have = file_table(path)
    for name in sorted(set(recorded) | set(have)):
        if name not in have:
            return None, f"{path / name} is missing"
        if name not in recorded:
            return None, f"{path / name} was not written with the shard"
        if have[name] != recorded[name]:
            return (
                None,
                (
                    f"{path / name} fails its sha256 check (sha256 {have[name]['sha256'][:16]}…, recorded when made "
                    f"{recorded[name]['sha256'][:16]}…; corrupted)"
                ),
            )
    return summary, None


def tokenize_file(inp: InputFile, spec: ShardSpec, tokenizer_dir: str, out_dir: str | Path) -> dict[str, Any]:
    """Tokenize one input file into shards/<key>/ and return its summary (summary.json)."""
    out_dir, key = Path(out_dir), spec.key(inp)
    return tokenize_records(
        iter_file_records(inp.uri, inp.fmt, spec.max_record_chars),
        inp,
        spec,
        tokenizer_dir,
        out_dir,
        shard_dir(out_dir, key),
        key,
    )


def tokenize_records(
    records: Iterable[tuple[int, dict | BadRecord]],
    inp: InputFile,
    spec: ShardSpec,
    tokenizer_dir: str,
    out_dir: Path,
    final: Path,
    key: str,
    extra: dict[str, Any] | None = None,
    keep_bad: int = KEEP_BAD,
) -> dict[str, Any]:
    """Tokenize `records` (all of `inp`, or a chunk of it: tasks/core/data/chunks.py) into `final`, summary.json
    last (with `extra` in it), and return the summary; `keep_bad`: how many bad-record messages it keeps."""
    done, damaged = verified_summary(final)
    if done is not None:
        return done
    if damaged:  # rebuilt from the input, never from the damaged bytes
        shutil.rmtree(final, ignore_errors=True)
    counts = {"lines": 0, "records": 0, "skipped": 0, "dropped_in_heldout_set": 0, "dropped_no_labels": 0}
    enc = encoder_class(spec.kind)(spec, tokenizer_dir, out_dir, counts)
    vocab = vocab_size_of(enc.tok)
    dtype = token_dtype(vocab)
    tmp = final.parent / f".tmp-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sides = enc.sides = {name: Side(tmp, name, dtype, enc.masked) for name in ("train", "heldout")}
    heldout_jsonl = open(tmp / "heldout.jsonl", "w", encoding="utf-8")  # noqa: SIM115 - closed with the sides, below
    bad: list[str] = []
    min_id = max_id = None

    def reject(b: BadRecord) -> None:
        counts["skipped"] += 1
        if spec.on_bad_record == "error" or counts["skipped"] > spec.max_bad_records:
            check_stream(inp.uri)  # a damaged compressed stream is named as such, not by its garbage
        if spec.on_bad_record == "error":
            raise BadRecordError(
                f"{b}; fix the record, or set data.on_bad_record: skip to leave bad records out (at most "
                "data.max_bad_records of them)"
            )
        if len(bad) < keep_bad:
            bad.append(str(b))
        if counts["skipped"] > spec.max_bad_records:
            raise BadRecordError(
                f"{inp.uri}: more than data.max_bad_records={spec.max_bad_records} bad records (the latest: {b}; the "
                f"first: {bad[0]}); "
                "fix the data or raise data.max_bad_records"
            )

    parquet = inp.fmt == ".parquet"
    locate = hasattr(enc, "where")  # an encoder that names records itself (a pair longer than seq_len)
    try:
        for line, rec in records:
            counts["lines"] = line
            if isinstance(rec, BadRecord):
                reject(rec)
                continue
            value = enc.value(rec)
            why = enc.problem(rec, value)
            if why is not None:
                reject(BadRecord(inp.uri, line, why, parquet))
                continue
            text = canonical_json(rec)
            if len(text) > spec.max_record_chars:
                reject(
                    BadRecord(
                        inp.uri,
                        line,
                        f"the record has over {spec.max_record_chars:,} characters ({len(text):,}); raise "
                        "data.max_record_chars or split the record",
                        parquet,
                    )
                )
                continue
            try:
                encoded = enc.encode(value)
            except ValueError as e:
                reject(BadRecord(inp.uri, line, str(e), parquet))
                continue
            rid = canonical_id(text)  # record_id(rec), from the JSON made above
            counts["records"] += 1
            min_id = rid if min_id is None or rid < min_id else min_id
            max_id = rid if max_id is None or rid > max_id else max_id
            if rid in spec.heldout_ids:
                counts["dropped_in_heldout_set"] += 1
                continue
            held = rid in spec.force_heldout or (spec.heldout_fraction > 0 and unit(rid) < spec.heldout_fraction)
            if held:
                heldout_jsonl.write(json.dumps(rec, ensure_ascii=False, default=str) + "\n")
            if locate:
                enc.where = BadRecord(inp.uri, line, "", parquet).where()
            enc.add("heldout" if held else "train", value, encoded)
        enc.finish()
    except BaseException:
        for s in sides.values():
            s.close()
        heldout_jsonl.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for s in sides.values():
        s.close()
    heldout_jsonl.close()
    summary = {
        "version": SHARD_VERSION,
        "key": key,
        "input": inp.to_json(),
        "spec": spec.key_fields(),
        "dtype": dtype.name,
        "vocab_size": vocab,
        "max_token_id": max(s.max_id for s in sides.values()),
        **counts,
        **enc.extra(),
        "train": sides["train"].stats(),
        "heldout": sides["heldout"].stats(),
        "min_record_id": min_id,
        "max_record_id": max_id,
        "bad_records": bad,
        "files": file_table(tmp),
        **(extra or {}),
    }
    (tmp / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    try:
        os.replace(tmp, final)
    except OSError:
        # Another worker finished the same key first (same input, same spec): its bytes are ours.
        shutil.rmtree(tmp, ignore_errors=True)
    return read_summary(final) or summary
