"""Reading sources: strict header validation, layout discovery and chunked reads of an input checkpoint.

    python -c "import sys; from pathlib import Path; from tasks.core.models.convert.source import scan_source; print(scan_source(Path(sys.argv[1]), False).layout)" CKPT_DIR

Layouts: ColossalAI 0.5.0's sharded save (pp == 1, `model-0000K.safetensors` plus an index) and
its pipeline save (`model-stage-0000S-shard-0000K.safetensors`), an HF directory (one
`model.safetensors`, or shards plus an index), and pickles only when allowed. Nothing here trusts
an index or a header: shard names must stay inside the directory, every header must tile its
file exactly, and the reference parser gets a second look. Bytes are read with `pread` into the
caller's buffers, never through a memory map (see `tasks.core.models.convert`).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from tasks.core.errors import ConversionError
from tasks.core.models.convert import dtypes
from tasks.core.models.convert.dtypes import (
    PICKLE_INDEX_NAME,
    PICKLE_WEIGHTS_NAME,
    SAFE_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    ST_TO_TORCH,
    TORCH_TO_ST,
    itemsize,
)

_MAX_HEADER = 100 << 20  # the safetensors reference parser refuses larger headers too


@dataclass
class Entry:
    """One tensor as stored in one input file."""

    key: str
    file: str  # relative to the source directory
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file (safetensors); unused for pickles
    nbytes: int
    tensor: torch.Tensor | None = None  # pickled inputs only


def read_safetensors_header(path: str | Path, name: str | None = None) -> tuple[int, dict[str, Entry], dict]:
    """(data start, {key: entry}, __metadata__) of a safetensors file, validated strictly.

    Catches what a truncated copy or a flipped byte does to a file: a header length past the
    end, a header that is not JSON, offsets that do not tile the data, data shorter than the
    header says. Every error names the file.
    """
    path = Path(path)
    name = name or path.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ConversionError(f"{name}: file is missing") from None
    if size < 8:
        raise ConversionError(f"{name}: {size} bytes, too short for a safetensors header (truncated)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(size - 8, _MAX_HEADER):
            raise ConversionError(
                f"{name}: header length field says {header_len} bytes but the file has {size} (truncated or corrupted "
                "header)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{name}: safetensors header is not valid JSON ({exc}): corrupted file") from None
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    entries: dict[str, Entry] = {}
    for key, info in header.items():
        try:
            code, shape = info["dtype"], tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
            if not isinstance(code, str):
                raise TypeError(code)
        except (KeyError, TypeError, ValueError):
            raise ConversionError(f"{name}: header entry for {key!r} is malformed (corrupted header)") from None
        if code not in ST_TO_TORCH:
            raise ConversionError(f"{name}: tensor {key!r} has dtype {code!r}, which the converter does not handle")
        nbytes = math.prod(shape) * itemsize(code)
        if end - begin != nbytes or begin < 0:
            raise ConversionError(
                f"{name}: tensor {key!r} spans bytes [{begin}, {end}) but shape {list(shape)} {code} needs {nbytes} "
                "(corrupted header)"
            )
        entries[key] = Entry(key, name, code, shape, data_start + begin, nbytes)
    cursor = 0
    for e in sorted(entries.values(), key=lambda e: e.offset):
        if e.offset - data_start != cursor:
            raise ConversionError(
                f"{name}: tensor {e.key!r} does not start where the previous one ends (corrupted header)"
            )
        cursor += e.nbytes
    if data_start + cursor != size:
        raise ConversionError(
            f"{name}: header describes {cursor} data bytes but the file holds {size - data_start} "
            f"({'truncated' if data_start + cursor > size else 'trailing garbage'})"
        )
    return data_start, entries, metadata


def _check_with_reference(path: Path, name: str) -> None:
    """Second opinion from the reference parser (it only reads the header; tensors stay unmapped)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            f.keys()
    except Exception as exc:  # SafetensorError is not importable in a stable place across versions
        raise ConversionError(f"{name}: safetensors refuses the file ({exc}): corrupted or truncated") from None


def _checked_relpath(rel: Any, index_name: str) -> str:
    """Index entries are untrusted: a shard name must stay inside the checkpoint directory."""
    if not isinstance(rel, str) or not rel or "\\" in rel or rel.startswith("/"):
        raise ConversionError(f"{index_name}: weight_map names file {rel!r}, which is not a relative path")
    parts = PurePosixPath(rel).parts
    if any(p in ("..", ".") for p in parts):
        raise ConversionError(f"{index_name}: weight_map names file {rel!r}, which leaves the checkpoint directory")
    return rel


@dataclass
class Source:
    """Everything known about the input before a byte of tensor data is read."""

    root: Path
    layout: str  # colossalai-sharded | colossalai-pipeline | hf-sharded | hf-single | pickle
    files: list[str]
    by_key: dict[str, list[Entry]]  # key -> every file that holds it (more than one = duplicate)
    problems: list[str]


def _layout_name(files: list[str], index: dict | None) -> str:
    if index is None:
        return "hf-single"
    if any(re.fullmatch(r".*-stage-\d{5}-shard-\d{5}\.safetensors", f) for f in files):
        return "colossalai-pipeline"
    if all(re.fullmatch(r".*-\d{5}\.safetensors", f) and "-of-" not in f for f in files):
        return "colossalai-sharded"
    return "hf-sharded"


def scan_source(src: Path, allow_pickle: bool) -> Source:
    if not src.is_dir():
        raise ConversionError(f"{src}: checkpoint directory does not exist")
    index_path = src / SAFE_INDEX_NAME
    if index_path.is_file() and (src / SAFE_WEIGHTS_NAME).is_file():
        # transformers would load model.safetensors and ignore the index: one of them is stale
        raise ConversionError(f"{src}: both {SAFE_WEIGHTS_NAME} and {SAFE_INDEX_NAME}; remove the stale one")
    if index_path.is_file():
        return _scan_safetensors(src, index_path)
    if (src / SAFE_WEIGHTS_NAME).is_file():
        return _scan_safetensors(src, None)
    pickles = [PICKLE_INDEX_NAME, PICKLE_WEIGHTS_NAME]
    if any((src / p).is_file() for p in pickles):
        if not allow_pickle:
            found = next(p for p in pickles if (src / p).is_file())
            raise ConversionError(
                f"{src / found}: refusing a pickled checkpoint (unpickling can run arbitrary code); save it with "
                f"use_safetensors=True, or pass allow_pickle=True for a checkpoint from your own storage"
            )
        return _scan_pickle(src)
    stray = sorted(p.name for p in src.glob("*.safetensors"))
    if (src / "tmp_index_files").is_dir():
        raise ConversionError(
            f"{src}: no {SAFE_INDEX_NAME} but a tmp_index_files/ folder: a pipeline-parallel save stopped before "
            f"rank 0 merged the per-stage indexes (incomplete checkpoint)"
        )
    if stray:
        raise ConversionError(
            f"{src}: shards {stray[:3]} but no {SAFE_INDEX_NAME} (ColossalAI writes the index after the "
            f"shards: the save is incomplete)"
        )
    raise ConversionError(
        f"{src}: no {SAFE_INDEX_NAME}, {SAFE_WEIGHTS_NAME} or {PICKLE_WEIGHTS_NAME}: not a checkpoint"
    )


def _read_index(index_path: Path) -> dict:
    try:
        index = json.loads(index_path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{index_path.name}: not valid JSON ({exc})") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict) or not index["weight_map"]:
        raise ConversionError(f"{index_path.name}: has no weight_map (not a sharded checkpoint index)")
    return index


def _scan_safetensors(src: Path, index_path: Path | None) -> Source:
    problems: list[str] = []
    index = _read_index(index_path) if index_path else None
    if index is not None:
        weight_map = {k: _checked_relpath(v, index_path.name) for k, v in index["weight_map"].items()}
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (src / f).is_file()]
        if missing:
            keys = {f: next(k for k, v in weight_map.items() if v == f) for f in missing}
            raise ConversionError(
                "; ".join(
                    f"{index_path.name} names {f} (e.g. for {keys[f]!r}) but the file is missing" for f in missing
                )
                + " (incomplete copy or an interrupted save)"
            )
    else:
        weight_map, files = None, [SAFE_WEIGHTS_NAME]

    by_key: dict[str, list[Entry]] = {}
    for name in files:
        _, entries, _ = read_safetensors_header(src / name, name)
        _check_with_reference(src / name, name)
        for key, entry in entries.items():
            by_key.setdefault(key, []).append(entry)
    if weight_map is not None:
        # the index and the headers must agree: a disagreement is a stale index or a rewritten shard
        for key, name in weight_map.items():
            if not any(e.file == name for e in by_key.get(key, ())):
                problems.append(
                    f"{index_path.name} maps {key!r} to {name}, but {name} does not contain it (stale index)"
                )
        for key, entries in by_key.items():
            if key not in weight_map:
                problems.append(f"{entries[0].file} holds {key!r}, which {index_path.name} does not list (stale index)")
    return Source(src, _layout_name(files, index), files, by_key, problems)


def _scan_pickle(src: Path) -> Source:
    index_path = src / PICKLE_INDEX_NAME
    if index_path.is_file():
        files = sorted({_checked_relpath(v, PICKLE_INDEX_NAME) for v in _read_index(index_path)["weight_map"].values()})
    else:
        files = [PICKLE_WEIGHTS_NAME]
    by_key: dict[str, list[Entry]] = {}
    for name in files:
        path = src / name
        if not path.is_file():
            raise ConversionError(f"{PICKLE_INDEX_NAME} names {name} but the file is missing")
        try:
            try:  # mmap keeps the loaded file out of anonymous memory (zip format only)
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:
                state = torch.load(path, map_location="cpu", weights_only=True)
        except (
            Exception
        ) as exc:  # unpickling a damaged file raises anything (UnpicklingError, EOFError, RuntimeError, ...)
            raise ConversionError(
                f"{name}: cannot load with torch.load(weights_only=True) ({exc}): corrupted or not a state dict"
            ) from None
        for key, t in state.items():
            if not isinstance(t, torch.Tensor) or t.dtype not in TORCH_TO_ST:
                raise ConversionError(f"{name}: entry {key!r} is not a supported tensor ({type(t).__name__})")
            t = t.detach().contiguous()
            by_key.setdefault(key, []).append(
                Entry(key, name, TORCH_TO_ST[t.dtype], tuple(t.shape), 0, t.numel() * t.element_size(), tensor=t)
            )
    return Source(src, "pickle", files, by_key, [])


class Reader:
    """Reads an entry's bytes, chunk by chunk, into caller-owned buffers (no mmap: see module doc)."""

    def __init__(self, root: Path):
        self.root = root
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()  # shard writers share one reader (pread itself is thread-safe)

    def readinto(self, entry: Entry, pos: int, out: memoryview) -> None:
        """Fill `out` with entry bytes [pos, pos + len(out))."""
        if entry.tensor is not None:
            flat = entry.tensor.reshape(-1).view(torch.uint8).numpy()
            out[:] = memoryview(flat)[pos : pos + len(out)]
            return
        fd = self._fds.get(entry.file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(entry.file)
                if fd is None:
                    fd = self._fds[entry.file] = os.open(self.root / entry.file, os.O_RDONLY)
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], entry.offset + pos + done)
            if n == 0:
                raise ConversionError(
                    f"{entry.file}: ended while reading {entry.key!r} (file shrank during conversion)"
                )
            done += n

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def bitwise_equal(reader: Reader, a: Entry, b: Entry) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    buf_a, buf_b = memoryview(bytearray(dtypes.CHUNK)), memoryview(bytearray(dtypes.CHUNK))
    for pos in range(0, a.nbytes, dtypes.CHUNK):
        n = min(dtypes.CHUNK, a.nbytes - pos)
        reader.readinto(a, pos, buf_a[:n])
        reader.readinto(b, pos, buf_b[:n])
        if buf_a[:n] != buf_b[:n]:
            return False
    return True
