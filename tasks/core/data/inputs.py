"""Resolve `data.uri` to the exact list of input files, each with its size and a content checksum.

    python -m tasks.core.data.inputs 'data/sample/*.jsonl'

`data.uri` is one file, a glob, a directory, or a list of those, on any fsspec URI. A directory is
read by one explicit rule: every file below it of the formats `data.formats` names (default
.jsonl and .parquet, optionally compressed: `records.FOLDER_FORMATS`; plain .txt only when listed
there), names starting with "." or "_" never (Hadoop/Spark markers, .DS_Store). Everything else in
it is not data: `resolve_inputs(..., skipped=[])` names it, and pre-flight says it in one line. A
file or a glob the user wrote is read whatever its (known) format. Within a glob or directory the files are sorted by path; a list keeps
the order it was given in, so the user decides which corpus comes first.

The checksum is what makes the skip rule exact: a shard is reused only when its input's checksum
matches. Local (and any filesystem without a content hash): sha256 of the bytes, streamed. sha256
reads at ~1 GB/s, two orders of magnitude faster than tokenizing, so hashing first costs ~1 % of
the stage and an edited file with an unchanged size and mtime is never mistaken for the old one.
S3: the ETag, which changes whenever the object's bytes change (MD5 of the content, or of its
parts for multipart uploads), and costs no read.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import fsspec

from tasks.core.config.paths import missing_hint
from tasks.core.data.records import COMPRESSIONS, FOLDER_FORMATS, FORMATS, format_of

_GLOB_CHARS = "*?["
_CHUNK = 1 << 20


@dataclass(frozen=True)
class InputFile:
    uri: str  # as the user will recognise it in messages: a plain path for local files
    size: int
    checksum: str  # "sha256:<hex>" or "etag:<value>"
    fmt: str  # ".jsonl", ".txt" or ".parquet" (compression is inferred from the name when read)

    def to_json(self) -> dict:
        return asdict(self)


class InputError(ValueError):
    """data.uri names no usable file; the message says which entry and how to fix it."""


def _supported(name: str, formats: Sequence[str] = FORMATS) -> bool:
    base = name.rsplit("/", 1)[-1]
    if base.startswith((".", "_")):
        return False
    try:
        return format_of(base) in formats
    except ValueError:
        return False


def _display(fs, path: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else fs.unstrip_protocol(path)


def _checksum(fs, path: str, info: dict) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    etag = info.get("ETag") or info.get("etag")
    if protocol in ("s3", "s3a") and etag:
        return "etag:" + str(etag).strip('"')
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _expand(
    entry: str, label: str = "data.uri", formats: Sequence[str] = FOLDER_FORMATS, skipped: list[str] | None = None
) -> tuple[object, list[str]]:
    fs, path = fsspec.core.url_to_fs(entry)
    # fsspec reuses filesystem instances and s3fs caches listings in them: a file added or
    # rewritten since the last call in this process must not be missed (or keep its old ETag).
    fs.invalidate_cache()
    if any(c in path for c in _GLOB_CHARS):
        found = sorted(p for p in fs.glob(path) if fs.isfile(p))
        if not found:
            raise InputError(f"{label}: the glob {entry!r} matches no file; check the pattern and that the files exist")
        bad = [p for p in found if not _supported(p)]
        if bad:
            raise InputError(
                f"{label}: the glob {entry!r} matches {_display(fs, bad[0])!r}, which is not {', '.join(FORMATS)} "
                f"(optionally {', '.join(COMPRESSIONS)}); narrow the pattern"
            )
        return fs, found
    if fs.isdir(path):
        every = sorted(fs.find(path))
        found = [p for p in every if _supported(p, formats)]
        others = [p[len(path.rstrip("/")) + 1 :] for p in every if p not in found]
        if skipped is not None:
            skipped += others
        if not found:
            txt = [o for o in others if _supported(o, (".txt",))]
            field = f"{label.split('.', 1)[0]}.data.formats" if label.startswith(("cpt.", "sft.")) else "data.formats"
            hint = (
                f"; its {len(txt)} .txt file(s) are read from a folder only when {field} lists txt (or name them: a "
                "glob such as '<dir>/*.txt')"
                if txt
                else ""
            )
            raise InputError(
                f"{label}: the directory {entry!r} holds no {', '.join(formats)} file (optionally {', '.join(COMPRESSIONS)}){hint}; "
                f"point {label} at the corpus files"
            )
        return fs, found
    if not fs.exists(path):
        alike = missing_hint(fs, path)
        raise InputError(
            f"{label}: {entry} does not exist (no such file or directory){alike or '; fix the path or URI'}"
        )
    format_of(path)  # an unknown format is refused here, naming the supported ones
    return fs, [path]


def _readable(fs, path: str, info: dict) -> str:
    with fs.open(path, "rb") as f:
        f.read(1)
    return ""


def resolve_inputs(
    uri: str | Sequence[str],
    checksums: bool = True,
    label: str = "data.uri",
    formats: Sequence[str] = FOLDER_FORMATS,
    skipped: list[str] | None = None,
) -> list[InputFile]:
    """The input files of `data.uri`, each with size and checksum, in a deterministic order.

    checksums=False (pre-flight): every file is still opened, so an unreadable one is refused, but
    not hashed; the checksum is then empty. `label`: the config field every message names (one
    source of a mixture: `data.sources[1] (general).uri`). `formats`: what a directory is read for
    (data.formats); `skipped`: when given, every file of a directory that is not read is appended
    (its path below the directory)."""
    entries = [uri] if isinstance(uri, str) else list(uri)
    if not entries:
        raise InputError(f"{label} is an empty list: name at least one file, glob or directory")
    out: list[InputFile] = []
    seen: dict[str, str] = {}
    for entry in entries:
        fs, paths = _expand(str(entry), label, formats, skipped)
        for p in paths:
            shown = _display(fs, p)
            if shown in seen:
                raise InputError(
                    f"{label}: {shown!r} is named twice (by {seen[shown]!r} and {entry!r}); each file may appear once"
                )
            seen[shown] = str(entry)
            try:
                info = fs.info(p)
                checksum = (_checksum if checksums else _readable)(fs, p, info)
            except PermissionError as e:
                raise InputError(
                    f"{label}: {shown!r} is not readable ({e}); fix its permissions or credentials"
                ) from None
            out.append(InputFile(uri=shown, size=int(info.get("size") or 0), checksum=checksum, fmt=format_of(p)))
    if all(f.size == 0 for f in out):
        which = out[0].uri if len(out) == 1 else f"every one of its {len(out)} files"
        raise InputError(f"{label}: {which} holds no records (0 bytes); point {label} at the corpus")
    return out


if __name__ == "__main__":
    for f in resolve_inputs(sys.argv[1:] if len(sys.argv) > 2 else sys.argv[1]):
        print(f"{f.size:>14,d}  {f.checksum[:23]}  {f.uri}")
