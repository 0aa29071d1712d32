"""A layout-neutral view of a training checkpoint's state: per HF parameter name, the whole fp32
master (or fp32 weight) and AdamW's exp_avg, exp_avg_sq and step, whatever plugin wrote it.

    python -m tasks.core.models.convert.state_view CKPT_DIR [NAME ...]   # shapes, dtypes, norms

The optimizer-state twin of the weights' unshard (`tasks.core.models.convert.convert_checkpoint`).
What it reads from a `step-NNNNNN/` directory (tasks/engine/masters.py writes the first two):

- `masters/rank-NNNNN.json`: each rank's pieces: for every parameter it trains, its HF name, its
  optimizer id (the index ColossalAI's optimizer files key it by), its whole shape, the shape this
  rank's copy has (a tensor-parallel slice: `tp_dim`, `tp_rank`, `tp_size`), and which flat range
  `[start, start + length)` of that slice its fp32 master covers (a ZeRO or Gemini shard; the tail
  past the slice's numel is the optimizer's padding). `saved`: the piece is in this rank's file
  (a data-parallel replica without ZeRO saves nothing: rank dp 0 holds the same values).
- `masters/rank-NNNNN.safetensors`: those fp32 pieces, flat, keyed by name.
- `optimizer/`: ColossalAI's sharded optimizer save: whole (gathered, unpadded) states keyed by id,
  in torch pickles read with `weights_only=True` and memory-mapped.
- `model/`: the weights, for a checkpoint that keeps no masters (fp32 training: the weights are them);
  under LoRA `adapter/adapter_model.safetensors`, whose keys are the parameter names under peft's
  `base_model.model.` without its adapter name (`.default`), as peft saves them.

Memory: one whole tensor (the assembled master, or one state memory-mapped) at a time; a master's
pieces are read with `pread` straight into the whole tensor. `read_piece` reads just one target
rank's piece of a state (`local_piece`'s bytes) from where the source stores it flat (masters not
cut by tensor parallelism, fp32 AdamW states: their offsets from a `map_location="meta"` load), no
whole tensor; `segments` says where those bytes lie, for a writer that copies file to file.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tasks.core.errors import ManifestError
from tasks.core.models.convert.dtypes import ST_TO_TORCH
from tasks.core.models.convert.source import read_safetensors_header

MASTERS = "masters"
OPTIM_INDEX = "pytorch_optim.bin.index.json"
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
ADAPTER_WEIGHTS = "adapter/adapter_model.safetensors"  # a LoRA checkpoint's weights (tasks/engine/lora.py)
PEFT_PREFIX = "base_model.model."  # a PeftModel's names before the model's own
PEFT_ADAPTER_NAME = "default"  # the adapter name peft puts in parameter names and strips from saved keys

STATE_KEYS = ("master", *ADAM_KEYS)  # the fp32 states `read_piece` reads
GATHER_RUNS = 16  # a piece in more runs than this (a cut along a later dim) is read as one covering range

__all__ = [
    "MASTERS",
    "STATE_KEYS",
    "CheckpointState",
    "Piece",
    "local_piece",
    "piece_runs",
    "rank_record_name",
    "rank_tensor_name",
]


def rank_record_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def rank_tensor_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True)
class Piece:
    """What one rank holds of one parameter (see the module docstring)."""

    name: str
    id: int
    shape: tuple[int, ...]  # the whole parameter
    local_shape: tuple[int, ...]  # this rank's tensor-parallel slice (the whole shape without tp)
    tp_dim: int | None = None
    tp_rank: int = 0
    tp_size: int = 1
    start: int = 0  # first element of the slice's flat view its master covers
    length: int = 0  # elements of the master piece (padding included)
    saved: bool = False  # in this rank's masters file
    rank: int = 0

    @classmethod
    def of(cls, d: dict[str, Any], rank: int) -> Piece:
        return cls(
            d["name"],
            int(d["id"]),
            tuple(d["shape"]),
            tuple(d["local_shape"]),
            d.get("tp_dim"),
            d.get("tp_rank", 0),
            d.get("tp_size", 1),
            d.get("start", 0),
            d.get("length", 0),
            bool(d.get("saved")),
            rank,
        )

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "id": self.id,
            "shape": list(self.shape),
            "local_shape": list(self.local_shape),
            "tp_dim": self.tp_dim,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "start": self.start,
            "length": self.length,
            "saved": self.saved,
        }

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)


def local_piece(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    """This piece of a whole parameter: its tensor-parallel slice (vocabulary padding filled with
    zeros), flattened, elements [start, start + length) with the padding past the slice's end zero.
    The inverse of `CheckpointState.master`'s assembly: how a resume under any layout fills a master."""
    t = full
    if piece.tp_dim is not None and piece.tp_size > 1:
        d = piece.tp_dim
        want = piece.local_shape[d] * piece.tp_size
        if want > t.shape[d]:  # a padded vocabulary: the pad rows are zeros
            pad = [0, 0] * (t.dim() - 1 - d) + [0, want - t.shape[d]]
            t = torch.nn.functional.pad(t, pad)
        t = t.narrow(d, piece.tp_rank * piece.local_shape[d], piece.local_shape[d])
    flat = t.reshape(-1)
    out = torch.empty(piece.length, dtype=full.dtype)
    n = max(0, min(piece.start + piece.length, flat.numel()) - piece.start)
    out[:n].copy_(flat[piece.start : piece.start + n])
    out[n:].zero_()
    return out


def piece_runs(piece: Piece) -> list[tuple[int, int, int]]:
    """`local_piece`'s elements as runs of the whole tensor's flat view: (offset in the piece, first
    element in the whole, elements); what no run covers is zero (padded vocabulary rows, ZeRO's tail)."""
    shape, end = piece.shape, piece.start + piece.length
    if piece.tp_dim is None or piece.tp_size <= 1:
        n = max(0, min(end, math.prod(shape)) - piece.start)
        return [(0, piece.start, n)] if n else []
    d, rows = piece.tp_dim, piece.local_shape[piece.tp_dim]
    inner = math.prod(shape[d + 1 :])
    block = rows * inner  # the slice's elements per index of the dims before d
    valid = max(0, min(rows, shape[d] - piece.tp_rank * rows)) * inner  # the rest of a block is vocabulary padding
    runs = []
    for o in range(piece.start // block, min(-(-end // block), math.prod(shape[:d]))):
        lo, hi = max(piece.start, o * block), min(end, o * block + valid)
        if hi > lo:
            runs.append((lo - piece.start, o * shape[d] * inner + piece.tp_rank * block + lo - o * block, hi - lo))
    return runs


def _regular(runs: list[tuple[int, int, int]]):
    """Consecutive runs of one length at constant strides, grouped: (count, first run, (strides))."""
    i = 0
    while i < len(runs):
        j, step = i + 1, None
        if j < len(runs) and runs[j][2] == runs[i][2]:
            step = (runs[j][0] - runs[i][0], runs[j][1] - runs[i][1])
            while (
                j < len(runs)
                and runs[j][2] == runs[i][2]
                and (runs[j][0] - runs[j - 1][0], runs[j][1] - runs[j - 1][1]) == step
            ):
                j += 1
        yield j - i, runs[i], step or (0, 0)
        i = j


def _where(t: torch.Tensor) -> tuple[int, int, torch.dtype, tuple[int, ...]] | None:
    """A meta-loaded tensor's bytes in its file: (byte offset, elements, dtype, shape), None where unknown."""
    off = getattr(t.untyped_storage(), "_checkpoint_offset", None)
    if off is None or not t.is_contiguous():
        return None
    return (off + t.storage_offset() * t.element_size(), t.numel(), t.dtype, tuple(t.shape))


@dataclass
class _Rank:
    rank: int
    record: dict[str, Any]
    pieces: list[Piece] = field(default_factory=list)


class CheckpointState:
    """The layout-neutral view of one checkpoint directory (`step-NNNNNN/`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        mdir = self.path / MASTERS
        files = sorted(mdir.glob("rank-*.json")) if mdir.is_dir() else []
        if not files:
            raise ManifestError(
                f"{self.path}: no {MASTERS}/rank-*.json: a checkpoint written before the layout-neutral records; "
                "it resumes only under the layout that wrote it"
            )
        self.ranks: list[_Rank] = []
        for f in files:
            rec = json.loads(f.read_text())
            r = _Rank(int(rec["rank"]), rec)
            r.pieces = [Piece.of(p, r.rank) for p in rec["params"]]
            self.ranks.append(r)
        self.by_name: dict[str, list[Piece]] = {}
        self.ids: dict[str, int] = {}
        for r in self.ranks:
            for p in r.pieces:
                self.by_name.setdefault(p.name, []).append(p)
                self.ids.setdefault(p.name, p.id)
        self.has_masters = any(p.saved for ps in self.by_name.values() for p in ps)
        self._headers: dict[int, tuple[int, dict]] = {}
        self._optim: tuple[str, dict] | None = None  # the one optimizer file kept open
        self._optim_map: dict[str, str] | None = None
        self._extents: dict[tuple[str, str], list[tuple[int, int, str, int]] | None] = {}
        self._offsets: dict[str, dict] = {}  # optimizer file -> {id: {key: (byte offset, elements, dtype, shape)}}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """Every trained parameter, in optimizer-id order."""
        return sorted(self.by_name, key=lambda n: self.ids[n])

    def pieces(self, name: str) -> list[Piece]:
        return self.by_name[name]

    # -- masters ----------------------------------------------------------------------------

    def master(self, name: str) -> torch.Tensor:
        """The whole fp32 master of `name` (the fp32 weight where the checkpoint keeps no masters)."""
        pieces = [p for p in self.by_name[name] if p.saved]
        if not pieces:
            if self.has_masters:
                raise ManifestError(f"{self.path}: {name} has no saved master piece on any rank")
            return self._weight(name).float()
        full = torch.empty(pieces[0].shape, dtype=torch.float32)
        filled = 0
        slice_of = lambda p: p.tp_rank if p.tp_dim is not None and p.tp_size > 1 else 0  # a replica: one slice
        for tp_rank in sorted({slice_of(p) for p in pieces}):
            mine = [p for p in pieces if slice_of(p) == tp_rank]
            local = mine[0]
            whole = local.tp_dim is None or local.tp_size == 1
            flat = full.reshape(-1) if whole else torch.empty(local.local_numel, dtype=torch.float32)
            covered: set[int] = set()
            for p in mine:
                if p.start in covered:  # the same piece twice (a weight shared by two pipeline stages)
                    continue
                covered.add(p.start)
                stop = min(p.start + p.length, p.local_numel)
                if stop > p.start:
                    self._read_piece(p, flat[p.start : stop])
                    filled += stop - p.start
            if not whole:
                d = local.tp_dim
                lo = min(full.shape[d], tp_rank * local.local_shape[d])
                rows = min(full.shape[d], lo + local.local_shape[d]) - lo  # fewer where the vocabulary is padded
                full.narrow(d, lo, rows).copy_(flat.view(local.local_shape).narrow(d, 0, rows))
                filled -= local.local_numel - full.narrow(d, lo, rows).numel()
        if filled != full.numel():
            raise ManifestError(
                f"{self.path}: the master pieces of {name} cover {filled} of its {full.numel()} elements"
            )
        return full

    def _read_piece(self, p: Piece, dst: torch.Tensor) -> None:
        """Elements [p.start, p.start + dst.numel()) of the slice, from this piece's file, into `dst` (contiguous)."""
        _, entries = self._header(p.rank)
        e = entries[p.name]
        where = f"{self.path}/{MASTERS}/{rank_tensor_name(p.rank)}"
        if ST_TO_TORCH[e.dtype] != torch.float32 or tuple(e.shape) != (p.length,):
            raise ManifestError(f"{where}: {p.name} is {e.dtype}{list(e.shape)}, the record says F32[{p.length}]")
        with open(self.path / MASTERS / rank_tensor_name(p.rank), "rb") as f:
            got = os.preadv(f.fileno(), [memoryview(dst.numpy()).cast("B")], e.offset)
        if got != dst.numel() * 4:
            raise ManifestError(f"{where}: {p.name} is truncated")

    def _header(self, rank: int):
        if rank not in self._headers:
            data_start, entries, _ = read_safetensors_header(self.path / MASTERS / rank_tensor_name(rank))
            self._headers[rank] = (data_start, entries)
        return self._headers[rank]

    def _weight_source(self, name: str) -> tuple[Path, str]:
        """The safetensors file holding the weight of `name`, and its key there."""
        index = self.path / "model" / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            if name not in weight_map:
                raise ManifestError(f"{index}: no weight {name}")
            return self.path / "model" / weight_map[name], name
        adapter = self.path / ADAPTER_WEIGHTS
        if adapter.is_file():
            # peft's get_peft_model_state_dict drops ".<adapter name>" from every key and keeps the PeftModel's
            # prefix, which the engine's names (the model under it) lack
            key = name.replace(f".{PEFT_ADAPTER_NAME}", "")
            keys = read_safetensors_header(adapter)[1]
            for k in (key, f"{PEFT_PREFIX}{key}"):
                if k in keys:
                    return adapter, k
            raise ManifestError(f"{adapter}: no weight {key} (the adapter's {name})")
        raise ManifestError(f"{self.path}: neither model/ nor {ADAPTER_WEIGHTS} holds the weights")

    def weights_dtype(self, name: str) -> torch.dtype:
        """The dtype `model/` (or the adapter) holds `name` in (without reading its bytes)."""
        path, key = self._weight_source(name)
        _, entries, _ = read_safetensors_header(path)
        return ST_TO_TORCH[entries[key].dtype]

    def _weight(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path, key = self._weight_source(name)
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)

    # -- AdamW ------------------------------------------------------------------------------

    def adam(self, name: str) -> dict[str, Any]:
        """AdamW's whole state of `name`: exp_avg and exp_avg_sq (fp32, the parameter's shape) and step."""
        pid = str(self.ids[name])
        fname = self._optim_file(name)
        if self._optim is None or self._optim[0] != fname:
            self._optim = None  # drop the previous file's map first
            self._optim = (
                fname,
                torch.load(self.path / "optimizer" / fname, map_location="cpu", mmap=True, weights_only=True),
            )
        state = self._optim[1][int(pid)]
        shape = self.by_name[name][0].shape
        out = {k: state[k].reshape(shape) for k in ADAM_KEYS}
        step = state.get("step")
        out["step"] = float(step.item()) if isinstance(step, torch.Tensor) else float(step)
        return out

    def saved_states(self, names: list[str]) -> dict[str, tuple[list[str], Any]]:
        """Per name, the keys of its saved optimizer state in the file's order and its `step` as saved (a
        tensor read from its bytes): from the same pickle-only load `extents` makes, no state's bytes read."""
        out = {}
        for name in names:
            fname = self._optim_file(name)
            state = self._optim_meta(fname).get(self.ids[name])
            if not isinstance(state, dict):
                raise ManifestError(
                    f"{self.path}/optimizer/{fname}: no state for parameter id {self.ids[name]} ({name})"
                )
            step = state.get("step")
            if isinstance(step, tuple):  # a tensor: its bytes where the file holds them
                at, numel, dtype, shape = step
                nbytes = numel * torch.empty((), dtype=dtype).element_size()
                raw = bytearray(os.pread(self._fd(str(self.path / "optimizer" / fname)), nbytes, at))
                if len(raw) != nbytes:
                    raise ManifestError(f"{self.path}/optimizer/{fname}: {name}'s step is truncated")
                step = torch.frombuffer(raw, dtype=dtype).reshape(shape).clone()
            elif step is None and "step" in state:  # a tensor not stored flat: the state loaded as torch saved it
                step = self.adam(name)["step"]
                step = torch.tensor(step)
            out[name] = (list(state), step)
        return out

    def _optim_meta(self, fname: str) -> dict:
        """One optimizer file's states without their bytes (a `map_location="meta"` load reads the pickle
        alone, once a file): {id: {key: (byte offset, elements, dtype, shape) of a contiguous tensor with
        a known offset (torch >= 2.6), None for another tensor, else the value}}."""
        if fname not in self._offsets:
            meta = torch.load(self.path / "optimizer" / fname, map_location="meta", weights_only=True)
            self._offsets[fname] = {
                pid: {k: _where(t) if isinstance(t, torch.Tensor) else t for k, t in st.items()}
                for pid, st in meta.items()
                if isinstance(st, dict)
            }
        return self._offsets[fname]

    # -- one target piece, without the whole tensor ---------------------------------------------

    def extents(self, name: str, key: str) -> list[tuple[int, int, str, int]] | None:
        """Where the flat whole fp32 `key` (one of STATE_KEYS) of `name` lies: (first element, elements,
        file, byte offset) runs in order covering it; None where it is not stored so (a master cut by
        tensor parallelism, or rebuilt from the weights; a non-fp32 state): read it whole."""
        if key not in STATE_KEYS:
            raise ValueError(f"state {key!r}: one of {', '.join(STATE_KEYS)}")
        if (name, key) not in self._extents:
            self._extents[name, key] = self._find_extents(name, key)
        return self._extents[name, key]

    def _find_extents(self, name: str, key: str) -> list[tuple[int, int, str, int]] | None:
        numel = math.prod(self.by_name[name][0].shape)
        if key != "master":
            fname = self._optim_file(name)
            off = self._optim_meta(fname).get(self.ids[name], {}).get(key)
            if not isinstance(off, tuple) or off[2] != torch.float32:
                return None
            path = str(self.path / "optimizer" / fname)
            return [(0, numel, path, off[0])] if off is not None and off[1] == numel else None
        pieces = sorted({p.start: p for p in self.by_name[name] if p.saved}.values(), key=lambda p: p.start)
        if not pieces or any(p.tp_dim is not None and p.tp_size > 1 for p in pieces):
            return None
        out, at = [], 0
        for p in pieces:
            n = min(p.start + p.length, numel) - p.start
            if p.start != at or n <= 0:
                return None  # a gap or an overlap: `master` assembles it (and names what is missing)
            e = self._header(p.rank)[1].get(p.name)
            if e is None or ST_TO_TORCH.get(e.dtype) != torch.float32 or tuple(e.shape) != (p.length,):
                return None  # `master` names what its file holds instead
            out.append((at, n, str(self.path / MASTERS / rank_tensor_name(p.rank)), e.offset))
            at += n
        return out if at == numel else None

    def _optim_file(self, name: str) -> str:
        if self._optim_map is None:
            self._optim_map = json.loads((self.path / "optimizer" / OPTIM_INDEX).read_text())["weight_map"]
        pid = str(self.ids[name])
        if pid not in self._optim_map:
            raise ManifestError(f"{self.path}/optimizer/{OPTIM_INDEX}: no state for parameter id {pid} ({name})")
        return self._optim_map[pid]

    def _fd(self, path: str) -> int:
        with self._lock:  # writer threads share the view: one descriptor a file
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def segments(self, name: str, key: str, piece: Piece) -> list[tuple[int, int, int]] | None:
        """`local_piece`'s bytes of `key` in order, as (bytes, file descriptor, byte offset) reads (fd -1:
        zeros), or None where the state is not stored flat (`extents`)."""
        ext = self.extents(name, key)
        if ext is None:
            return None
        out, at = [], 0
        for off, first, n in piece_runs(piece):
            if off > at:
                out.append(((off - at) * 4, -1, 0))
            for s, m, path, byte in ext:
                lo, hi = max(first, s), min(first + n, s + m)
                if hi > lo:
                    out.append(((hi - lo) * 4, self._fd(path), byte + (lo - s) * 4))
            at = off + n
        if piece.length > at:
            out.append(((piece.length - at) * 4, -1, 0))
        return out

    def read_piece(self, name: str, key: str, piece: Piece, out: torch.Tensor | None = None) -> torch.Tensor:
        """`local_piece(whole key state of name, piece)`, read from the source files without the whole
        tensor where `extents` knows where it lies (else cut from the whole); into `out` when given."""
        out = torch.empty(piece.length, dtype=torch.float32) if out is None else out[: piece.length]
        runs = piece_runs(piece)
        if self.extents(name, key) is None:
            with self._lock:  # `adam` keeps one optimizer file mapped: one thread at a time
                whole = self.master(name) if key == "master" else self.adam(name)[key]
                return out.copy_(local_piece(whole.float(), piece))
        if len(runs) > GATHER_RUNS:  # many short runs: one read of the range they span, then a strided copy
            lo, hi = runs[0][1], runs[-1][1] + runs[-1][2]
            span = Piece(name, 0, (hi,), (hi,), start=lo, length=hi - lo)
            buf = self.read_piece(name, key, span)
            out.zero_()
            for k, (off, first, n), (doff, dfirst) in _regular(runs):  # k runs a stride apart: one copy each
                out.as_strided((k, n), (doff, 1), off).copy_(buf.as_strided((k, n), (dfirst, 1), first - lo))
            return out
        view, at = memoryview(out.numpy()).cast("B"), 0
        for nbytes, fd, byte in self.segments(name, key, piece):
            if fd < 0:
                out[at // 4 : (at + nbytes) // 4].zero_()
            elif os.preadv(fd, [view[at : at + nbytes]], byte) != nbytes:
                raise ManifestError(f"{self.path}: {name}'s {key} is truncated")
            at += nbytes
        return out

    def close(self) -> None:
        self._optim = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tasks.core.models.convert.state_view CKPT_DIR [NAME ...]", file=sys.stderr)
        return 2
    view = CheckpointState(argv[0])
    for name in argv[1:] or view.names():
        m, a = view.master(name), view.adam(name)
        print(
            f"{name}: master {list(m.shape)} |{m.norm():.6g}|  exp_avg |{a['exp_avg'].norm():.6g}|  "
            f"exp_avg_sq |{a['exp_avg_sq'].norm():.6g}|  step {a['step']:g}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
