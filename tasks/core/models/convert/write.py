"""Writing: each output file once, hashed on the way out, several shards at a time.

    python -m tasks.core.models.convert SRC_DIR DST_DIR --workers 2   # drives this module

Every file goes to a `.tmp` name and is renamed only once complete (and fsynced, with `fsync`),
so a crash never leaves a truncated shard under its final name. The sha256 of each file is
computed on the very bytes written, in a helper thread per shard, and up to `workers` shards are
written at once, each with its own 4 x 16 MiB buffer ring; the output bytes do not depend on the
number of workers.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import mmap
import os
import queue
import struct
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from tasks.core.models.convert import dtypes
from tasks.core.models.convert.dtypes import ST_TO_TORCH
from tasks.core.models.convert.plan import Planned
from tasks.core.models.convert.source import Reader
from tasks.core.run import meter

_RING = 4  # write buffers in flight while the hasher thread catches up
MAX_WORKERS = 4  # output shards written at once by default (memory: 64 MiB of ring each)


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # Linux (glibc, musl)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait
_WRITEBACK_STEP = 64 << 20


class _HashingWriter:
    """Writes one file under a temporary name, hashing the same bytes in a helper thread.

    hashlib releases the GIL on large updates, so with a ring of buffers the hash of chunk i
    runs while chunk i+1 is read and written. A buffer is reused only after its hash finished.
    With `fsync`, writeback of every 64 MiB written is started at once (sync_file_range), so the
    disk writes while the rest is converted and the final fsync waits only for the tail, instead
    of the whole file sitting dirty in the page cache until then.
    """

    def __init__(self, path: Path, hasher: ThreadPoolExecutor, ring: list[memoryview], fsync: bool):
        self.path = path
        self._tmp = path.with_name(path.name + ".tmp")
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._hash = hashlib.sha256()
        self._hasher = hasher
        self._ring = ring
        self._pending: list[Future | None] = [None] * len(ring)
        self._slot = 0
        self._fsync = fsync
        self._writeback = _SYNC_FILE_RANGE if fsync else None
        self._written_back = 0
        self.size = 0

    def buffer(self) -> memoryview:
        """The next ring buffer, once the hasher is done with its previous contents."""
        self._slot = (self._slot + 1) % len(self._ring)
        fut = self._pending[self._slot]
        if fut is not None:
            fut.result()
        return self._ring[self._slot]

    def write(self, data: memoryview | bytes, slot: bool = True) -> None:
        """Write `data` (a slice of the last `buffer()` if `slot`, else immutable bytes)."""
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])
        fut = self._hasher.submit(self._hash.update, view)  # one worker: updates stay in order
        if slot:
            self._pending[self._slot] = fut
        self.size += len(view)
        if self._writeback is not None and self.size - self._written_back >= _WRITEBACK_STEP:
            if (
                self._writeback(self._fd, self._written_back, self.size - self._written_back, _SYNC_FILE_RANGE_WRITE)
                != 0
            ):
                self._writeback = None  # not supported here (some FUSE/network filesystems): fsync alone
            self._written_back = self.size

    def close(self) -> str:
        """Finish the hash, make the file durable and give it its final name; returns sha256."""
        self._hasher.submit(lambda: None).result()
        self._pending = [None] * len(self._ring)
        if self._fsync:
            os.fsync(self._fd)
        os.close(self._fd)
        os.replace(self._tmp, self.path)
        return self._hash.hexdigest()

    def abort(self) -> None:
        self._hasher.submit(lambda: None).result()
        os.close(self._fd)
        self._tmp.unlink(missing_ok=True)


def shard_workers(requested: int | None, shards: int) -> int:
    """Output shards written at once: each has its own sha256 stream, the one part that does
    not parallelise within a file (about 1.4 GB/s a core), and its own 4 x 16 MiB ring."""
    auto = min(MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return max(1, min(requested or auto, shards))


def _buffer(size: int) -> memoryview:
    """A zeroed buffer the kernel backs with huge pages where it can: faulting in 4 x 16 MiB of
    4 KiB pages costs ~30 ms a ring, 2 MiB pages almost nothing."""
    buf = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return memoryview(buf)


class _ShardContext:
    """One shard writer's ring, cast scratch and sha256 thread, reused for every shard it writes."""

    def __init__(self) -> None:
        self.ring = [_buffer(dtypes.CHUNK) for _ in range(_RING)]
        self.scratch: list[memoryview] = []
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")

    def close(self) -> None:
        self.hasher.shutdown(wait=True)


def _write_shard(
    path: Path, items: list[Planned], reader: Reader, fsync: bool, cancel: threading.Event, ctx: _ShardContext
) -> dict[str, Any]:
    """Write one output shard (header, then its tensors in order); returns its size and sha256."""
    out = _HashingWriter(path, ctx.hasher, ctx.ring, fsync)
    try:
        out.write(_safetensors_header(items), slot=False)
        for p in items:
            _copy_tensor(p, reader, out, ctx.scratch, cancel)
        sha = out.close()
    except BaseException:
        out.abort()
        raise
    return {"size": out.size, "sha256": sha}


def write_shards(
    jobs: list[tuple[Path, list[Planned]]], reader: Reader, fsync: bool, workers: int
) -> dict[str, dict[str, Any]]:
    """Write every shard, `workers` at a time; on the first failure the others stop and remove
    their partial files, and that failure is raised. Returns {file name: {size, sha256}}."""
    cancel = threading.Event()
    contexts: queue.SimpleQueue[_ShardContext] = queue.SimpleQueue()
    owned = [_ShardContext() for _ in range(workers)]
    for ctx in owned:
        contexts.put(ctx)

    progress = meter.meter(f"safetensors shards of {jobs[0][0].parent.name}" if jobs else "shards", len(jobs), "shards")

    def one(path: Path, items: list[Planned]) -> dict[str, Any]:
        ctx = contexts.get()  # as many contexts as threads: never waits
        try:
            out = _write_shard(path, items, reader, fsync, cancel, ctx)
            progress.add()
            return out
        finally:
            contexts.put(ctx)

    try:
        if workers == 1:
            return {path.name: one(path, items) for path, items in jobs}
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard") as pool:
            futures = [pool.submit(one, path, items) for path, items in jobs]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                cancel.set()
                for f in futures:
                    f.cancel()
                wait(futures)
                raise failed.exception()
        return {path.name: f.result() for (path, _), f in zip(jobs, futures)}
    finally:
        progress.finish()
        for ctx in owned:
            ctx.close()


def _safetensors_header(items: list[Planned]) -> bytes:
    return safetensors_header([(p.entry.key, p.out_dtype, p.entry.shape, p.out_nbytes) for p in items])


def safetensors_header(tensors: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """The length prefix and JSON header of a safetensors file holding `tensors` (key, dtype code,
    shape, bytes) in that order: known before any tensor's bytes are, so a writer can stream them."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, code, shape, nbytes in tensors:
        header[key] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the reference writer pads to 8 so tensor data stays aligned
    return struct.pack("<Q", len(blob)) + blob


class _Cancelled(Exception):
    """Another shard writer failed; this one stops and removes its partial file."""


def _copy_tensor(
    p: Planned, reader: Reader, out: _HashingWriter, scratch: list[memoryview], cancel: threading.Event
) -> None:
    e = p.entry
    if p.out_dtype == e.dtype:
        for pos in range(0, e.nbytes, dtypes.CHUNK):
            if cancel.is_set():
                raise _Cancelled()
            n = min(dtypes.CHUNK, e.nbytes - pos)
            buf = out.buffer()[:n]
            reader.readinto(e, pos, buf)
            out.write(buf)
        return
    # cast chunk by chunk: read source elements into scratch, cast-copy straight into the ring buffer
    if not scratch:  # allocated on the first cast only: a plain copy never needs it
        scratch.append(_buffer(dtypes.CHUNK))
    src_dt, dst_dt = ST_TO_TORCH[e.dtype], ST_TO_TORCH[p.out_dtype]
    step = dtypes.CHUNK // max(src_dt.itemsize, dst_dt.itemsize)  # elements per chunk
    numel = math.prod(e.shape)
    for first in range(0, numel, step):
        if cancel.is_set():
            raise _Cancelled()
        count = min(step, numel - first)
        src_view = scratch[0][: count * src_dt.itemsize]
        reader.readinto(e, first * src_dt.itemsize, src_view)
        buf = out.buffer()[: count * dst_dt.itemsize]
        torch.frombuffer(buf, dtype=dst_dt).copy_(torch.frombuffer(src_view, dtype=src_dt))
        out.write(buf)


def write_small(path: Path, blob: bytes, fsync: bool) -> dict[str, Any]:
    """A small file (index, config) written whole under a temporary name; its size and sha256."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(blob)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
