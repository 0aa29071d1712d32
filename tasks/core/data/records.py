"""Record formats and their one reader: streamed records of a file, each with the location the user will find it at.

    python -m tasks.core.data.records data/sample/sft.jsonl     # counts records and problems

`FORMATS` and `COMPRESSIONS` are the file suffixes a corpus may use; `format_of` names a URI's.
`iter_file_records` yields a `BadRecord` in place of a record it cannot read and goes on, so the
caller decides between `on_bad_record: error` and `skip`; `iter_records` / `read_records` /
`head_records` (pre-flight, evaluation, the tokenizing CLI) raise at the first one. Text mode with
universal newlines (CRLF and a last line without a newline read like LF), a UTF-8 byte-order mark
at the start looked through, every line counted, blank lines skipped. Bytes that are not UTF-8 are
read with `surrogateescape` so one bad line does not end the stream, then refused by their line.
A compressed stream is decompressed here, not by fsspec, so that one that is truncated or corrupt
raises `CorruptFileError` naming the file and the compressed byte offset: the file is damaged, not
a record, so `on_bad_record: skip` never applies to it (zstandard's own reader returns a truncated
frame's bytes, or none, without a word).
Parquet records are numbered by row (1-based) and streamed one row group batch at a time. Every
read goes through the storage seam (`tasks.core.storage.fs.open_uri`), so `s3://...` works like a
local path. Deliberately not `datasets`: its cache and fingerprinting would race between ranks and
pull in a large dependency for a list of dicts.
"""

from __future__ import annotations

import bz2
import io
import itertools
import json
import lzma
import sys
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from tasks.core.storage.fs import open_uri

COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
FORMATS = (".jsonl", ".txt", ".parquet")
# What a directory is read for unless `data.formats` says otherwise: records that say what they are.
# Plain text is read from a folder only when the user names it (data.formats, a glob or the file):
# any notes file is a .txt, and one read as training text would be trained on without a word.
FOLDER_FORMATS = (".jsonl", ".parquet")
_PARQUET_BATCH = 1024
_COMPRESSED_CHUNK = 1 << 16  # compressed bytes read at a time (a gzip chunk inflates to at most ~64 MB)


class CorruptFileError(ValueError):
    """A compressed input whose stream is truncated or corrupt: a file error, never a bad record."""


def format_of(uri: str) -> str:
    """The FORMATS entry a URI names (a compression suffix is looked through); ValueError otherwise."""
    name = uri.rsplit("/", 1)[-1].lower()
    for comp in COMPRESSIONS:
        name = name.removesuffix(comp)
    for fmt in FORMATS:
        if name.endswith(fmt):
            return fmt
    raise ValueError(
        f"data uri {uri!r}: unknown format; use one of {', '.join(FORMATS)} (optionally compressed {', '.join(COMPRESSIONS)})"
    )


@dataclass(frozen=True)
class BadRecord:
    uri: str
    line: int  # the line number (text formats) or the 1-based row (parquet)
    reason: str
    parquet: bool = False

    def where(self) -> str:
        return f"{self.uri} row {self.line}" if self.parquet else f"{self.uri}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where()}: {self.reason}"


def _decompressor(comp: str):
    if comp == ".gz":
        return zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # gzip header and trailer (CRC32, size) checked
    if comp == ".bz2":
        return bz2.BZ2Decompressor()
    if comp == ".xz":
        return lzma.LZMADecompressor()
    import zstandard  # only .zst users pay for the import

    return zstandard.ZstdDecompressor().decompressobj()


class _Decompressed(io.RawIOBase):
    """The decompressed bytes of `raw`, every member/frame in turn; CorruptFileError, naming the
    file and the compressed bytes read so far, when a stream is corrupt or ends before its
    end-of-stream marker."""

    def __init__(self, raw, uri: str, comp: str):
        self.raw, self.uri, self.comp = raw, uri, comp
        self.d = _decompressor(comp)
        self.consumed = 0
        self.buf, self.off, self.done = b"", 0, False

    def readable(self) -> bool:
        return True

    def _corrupt(self, detail: str) -> CorruptFileError:
        return CorruptFileError(
            f"{self.uri}: the {self.comp} stream is truncated or corrupt at compressed byte {self.consumed:,} "
            f"({detail}); "
            "the file is damaged, not a record (data.on_bad_record does not apply): re-create or re-download it"
        )

    def _fill(self) -> None:
        chunk = self.raw.read(_COMPRESSED_CHUNK)
        if not chunk:
            if self.consumed and not self.d.eof:
                raise self._corrupt("the stream ends before its end-of-stream marker")
            self.done = True
            return
        self.consumed += len(chunk)
        out = []
        try:
            data = chunk
            while data:
                if self.d.eof:  # the next gzip member / bz2 stream / zstd frame
                    self.d = _decompressor(self.comp)
                out.append(self.d.decompress(data))
                data = self.d.unused_data if self.d.eof else b""
        except Exception as e:  # zlib.error, OSError, EOFError, lzma.LZMAError, zstandard.ZstdError
            raise self._corrupt(f"{type(e).__name__}: {e}") from None
        self.buf, self.off = b"".join(out), 0

    def readinto(self, b) -> int:
        while self.off >= len(self.buf) and not self.done:
            self._fill()
        n = min(len(b), len(self.buf) - self.off)
        b[:n] = self.buf[self.off : self.off + n]
        self.off += n
        return n


def compression_of(uri: str) -> str | None:
    name = uri.rsplit("/", 1)[-1].lower()
    return next((c for c in COMPRESSIONS if name.endswith(c)), None)


def check_stream(uri: str) -> None:
    """CorruptFileError when `uri` is compressed and its stream is truncated or corrupt (read to the end).

    A damaged stream can inflate to garbage before its decompressor notices: a bad record found in a
    compressed file is first put to this check, so the damage is named, not the garbage."""
    comp = compression_of(uri)
    if comp:
        with open_uri(uri, "rb") as raw:
            stream = _Decompressed(raw, uri, comp)
            while stream.read(1 << 20):
                pass


@contextmanager
def open_decompressed(uri: str) -> Iterator[io.BufferedIOBase]:
    """The bytes of `uri`, decompressed when its name says so (CorruptFileError on a damaged stream)."""
    comp = compression_of(uri)
    with open_uri(uri, "rb") as raw:
        yield io.BufferedReader(_Decompressed(raw, uri, comp), 1 << 16) if comp else raw


def _text_records(uri: str, fmt: str, max_chars: int) -> Iterator[tuple[int, dict | BadRecord]]:
    with open_decompressed(uri) as stream:
        yield from text_records(stream, uri, fmt, max_chars)


def text_records(
    stream, uri: str, fmt: str, max_chars: int, first_line: int = 1
) -> Iterator[tuple[int, dict | BadRecord]]:
    """The records of a binary stream of .jsonl/.txt lines; `first_line`: the stream's first line's
    number in `uri` (a chunk of a file starts past line 1, and is not where a byte-order mark can be)."""
    # utf-8-sig: a byte-order mark at the start (what Windows tools write) is not part of line 1.
    f = io.TextIOWrapper(
        stream, encoding="utf-8-sig" if first_line == 1 else "utf-8", errors="surrogateescape", newline=None
    )
    lineno = first_line - 1
    while True:
        # A size limit on readline keeps a runaway line (a binary file, a missing newline
        # in a 10 GB dump) from being read into memory whole before it can be refused.
        line = f.readline(max_chars + 1)
        if not line:
            return
        lineno += 1
        if len(line) > max_chars and not line.endswith("\n"):
            n = len(line)
            while line and not line.endswith("\n"):
                line = f.readline(max_chars + 1)
                n += len(line)
            yield (
                lineno,
                BadRecord(
                    uri,
                    lineno,
                    f"the line has over {max_chars:,} characters ({n:,}); raise data.max_record_chars or split the "
                    "record",
                ),
            )
            continue
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        if not line.isascii():
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as e:
                byte = ord(line[e.start]) - 0xDC00
                yield (
                    lineno,
                    BadRecord(
                        uri,
                        lineno,
                        f"bytes that are not UTF-8 (0x{byte:02x} at character {e.start + 1}); save the file as UTF-8",
                    ),
                )
                continue
        if fmt == ".txt":
            yield lineno, {"text": line}
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            yield (
                lineno,
                BadRecord(
                    uri, lineno, f"malformed JSON ({e.msg} at column {e.colno}); every line must be one JSON object"
                ),
            )
            continue
        if not isinstance(rec, dict):
            yield lineno, BadRecord(uri, lineno, f"expected a JSON object per line, got {type(rec).__name__}")
            continue
        yield lineno, rec


def parquet_records(
    uri: str, row_groups: Sequence[int] | None = None, first_row: int = 1
) -> Iterator[tuple[int, dict | BadRecord]]:
    """`row_groups` (all when None): a chunk of the file, whose first row is `first_row`."""
    import pyarrow.parquet as pq  # only parquet users pay for the import

    with open_uri(uri, "rb", compression="infer") as f:
        row = first_row - 1
        for batch in pq.ParquetFile(f).iter_batches(batch_size=_PARQUET_BATCH, row_groups=row_groups):
            for rec in batch.to_pylist():
                row += 1
                yield row, rec


def text_problem(rec: object, field: str, setting: str = "data.text_field", record_fix: bool = True) -> str | None:
    """Why a CPT record gives no text, with the fix that fits: a field missing from the record is
    the config's (`setting`); a field present with another type is the record's (`record_fix`:
    say so; False where the caller says it)."""
    fix = ": fix the record, or set data.on_bad_record: skip to leave such records out" if record_fix else ""
    if not isinstance(rec, dict):
        return f"the record is a JSON {type(rec).__name__}, not an object{fix}"
    if field not in rec:
        return f"no field {field!r} (fields: {sorted(rec)}); set {setting} to the field holding the text"
    value = rec[field]
    if isinstance(value, str):
        return None
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"field {field!r} holds a {type(value).__name__} ({shown}), not text{fix}"


def iter_file_records(uri: str, fmt: str, max_record_chars: int) -> Iterator[tuple[int, dict | BadRecord]]:
    """(line or row, record or BadRecord) of one .jsonl/.txt/.parquet file, optionally compressed."""
    if fmt == ".parquet":
        return parquet_records(uri)
    return _text_records(uri, fmt, max_record_chars)


def iter_records(uri: str, fmt: str | None = None) -> Iterator[tuple[int, dict]]:
    """(line or row, record) of one file, streamed; the first bad record raises, naming the file and line."""
    for lineno, rec in iter_file_records(uri, fmt or format_of(uri), max_record_chars=1 << 40):
        if isinstance(rec, BadRecord):
            raise ValueError(str(rec))
        yield lineno, rec


def read_records(uri: str) -> list[dict]:
    """All records of a .jsonl, .txt (one {"text": line} per non-empty line) or .parquet file."""
    return [rec for _, rec in iter_records(uri)]


def head_records(uri: str, n: int = 64) -> list[tuple[int, dict]]:
    """(line or row, record) of the first n records, without reading the whole file."""
    return list(itertools.islice(iter_records(uri), n))


def main(argv: list[str]) -> None:
    for uri in argv:
        good, bad = 0, []
        for _, rec in iter_file_records(uri, format_of(uri), 1 << 24):
            if isinstance(rec, BadRecord):
                bad.append(rec)
            else:
                good += 1
        print(f"{uri}: {good} records, {len(bad)} bad")
        for b in bad[:10]:
            print(f"  {b}")


if __name__ == "__main__":
    main(sys.argv[1:])
