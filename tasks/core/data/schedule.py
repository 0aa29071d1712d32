"""Running the tokenize work of a plan: whole files and chunks on some workers, chunks merged per file.

    python -m tasks.core.data.prepare --uri big.jsonl --tokenizer runs/demo/base-model --kind cpt --out /tmp/prep --workers 2

`drive` is the one loop every runner shares (this module's process pool, and prepare_data's
Prefect task runners: a process pool or Dask): it pulls work from `chunks.work` only when a worker
is free (so a compressed file is decompressed no further ahead than the workers), merges a file's
chunks as soon as its last one is done, and on the first error hands out nothing new, lets what
runs finish (their shards stay for the retry) and raises the first error in corpus order.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from tasks.core.data import chunks as ck
from tasks.core.data.inputs import InputFile
from tasks.core.data.shard import ShardSpec, tokenize_file


class Runner(Protocol):
    def submit(self, item: ck.Chunk | ck.Whole) -> Any: ...

    def wait(self, handles: list[Any]) -> Iterable[Any]:
        """Some finished handles among `handles` (blocks until there is one)."""

    def result(self, handle: Any) -> dict[str, Any]:
        """The summary, or the worker's exception raised."""


def run_item(item: ck.Chunk | ck.Whole, spec: ShardSpec, tokenizer_dir: str, out_dir: str) -> dict[str, Any]:
    """A worker's unit: a whole file (tokenize_file) or one chunk of one."""
    if isinstance(item, ck.Chunk):
        return ck.tokenize_chunk(item, spec, tokenizer_dir, out_dir)
    return tokenize_file(item.inp, spec, tokenizer_dir, out_dir)


def drive(
    work: Iterator[ck.Chunk | ck.Whole | ck.FileChunks],
    runner: Runner,
    width: int,
    spec: ShardSpec,
    out_dir: str | Path,
    progress: Callable[[dict], None] | None = None,
) -> dict[int, dict]:
    """Run `work` with at most `width` items in flight; the file summaries by input index.

    `progress` gets each whole file's summary and each chunk's (which carries `chunk`, and
    `file_done` when it completed its file)."""
    out: dict[int, dict] = {}
    errors: dict[tuple[int, int], BaseException] = {}
    running: dict[Any, ck.Chunk | ck.Whole] = {}
    pending: dict[int, int] = {}  # chunks of a file in flight
    ends: dict[int, ck.FileChunks] = {}
    exhausted = False

    def merge_ready(i: int) -> bool:
        if i not in ends or pending.get(i) or any(o[0] == i for o in errors):
            return False
        try:
            out[i] = ck.merge(ends.pop(i), spec, out_dir)
        except Exception as e:
            errors[(i, 1 << 62)] = e
            return False
        return True

    it = iter(work)
    while True:
        while not exhausted and not errors and len(running) < width:
            try:
                item = next(it, None)
            except Exception as e:  # a file that cannot be split or decompressed: after the errors before it
                errors[(1 << 62, 0)] = e
                break
            if item is None:
                exhausted = True
            elif isinstance(item, ck.FileChunks):
                ends[item.file] = item
                if merge_ready(item.file) and progress:  # every chunk was cached: a file, no new records
                    progress(
                        {
                            "input": item.inp.to_json(),
                            "chunk": {"bytes": 0},
                            "file_done": True,
                            "records": 0,
                            "skipped": 0,
                            "train": {"tokens": 0},
                            "heldout": {"tokens": 0},
                        }
                    )
            else:
                if isinstance(item, ck.Chunk):
                    pending[item.file] = pending.get(item.file, 0) + 1
                running[runner.submit(item)] = item
        if not running:
            break
        for h in runner.wait(list(running)):
            item = running.pop(h)
            try:
                s = runner.result(h)
            except Exception as e:
                errors[item.order] = e
                continue
            finally:
                if isinstance(item, ck.Chunk):
                    pending[item.file] -= 1
                    if item.path:
                        Path(item.path).unlink(missing_ok=True)
            if isinstance(item, ck.Whole):
                out[item.file] = s
                if progress:
                    progress(s)
                continue
            done = merge_ready(item.file)
            if progress:
                progress({**s, "file_done": done})
    shutil.rmtree(ck.spill_dir(Path(out_dir)), ignore_errors=True)  # nothing runs: every spilled chunk is done
    if errors:
        raise errors[min(errors)]
    return out


def _init_worker() -> None:
    # One worker = one core: the tokenizer's own thread pool would oversubscribe the machine.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


class _Ran:
    def __init__(self, summary: dict | None, error: Exception | None):
        self.summary, self.error = summary, error


class InProcess:
    """Each item run here, at submit: in corpus order, so the first problem is the first in the corpus."""

    def __init__(self, spec: ShardSpec, tokenizer_dir: str, out_dir: str):
        self.args = spec, tokenizer_dir, out_dir

    def submit(self, item):
        try:
            return _Ran(run_item(item, *self.args), None)
        except Exception as e:
            return _Ran(None, e)

    def wait(self, handles):
        return handles

    def result(self, h):
        if h.error is not None:
            raise h.error
        return h.summary


class Pool:
    """A spawn process pool (a caller's threads and CUDA state never leak into a worker)."""

    def __init__(self, workers: int, spec: ShardSpec, tokenizer_dir: str, out_dir: str):
        import multiprocessing as mp

        self.args = spec, tokenizer_dir, out_dir
        self.pool = mp.get_context("spawn").Pool(workers, initializer=_init_worker)

    def submit(self, item):
        return self.pool.apply_async(run_item, (item, *self.args))

    def wait(self, handles):
        while True:
            done = [h for h in handles if h.ready()]
            if done:
                return done
            handles[0].wait(0.05)

    def result(self, h):
        return h.get()

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def run(
    inputs: list[InputFile],
    todo: list[int],
    spec: ShardSpec,
    tokenizer_dir: str,
    out_dir: str | Path,
    workers: int,
    chunk_bytes: int,
    progress: Callable[[dict], None] | None = None,
) -> dict[int, dict]:
    """Tokenize inputs[todo] (chunked where larger than the chunk size) on `workers` processes (1: here)."""
    sizes = [inputs[i].size for i in todo]
    c = ck.chunk_size(sizes, workers, chunk_bytes)
    width = min(workers, ck.units(sizes, c))
    work = ck.work(inputs, todo, spec, Path(out_dir), c, largest_first=width > 1)
    if width <= 1:
        return drive(work, InProcess(spec, tokenizer_dir, str(out_dir)), 1, spec, out_dir, progress)
    pool = Pool(width, spec, tokenizer_dir, str(out_dir))
    try:  # one item queued beyond the workers: a worker finishing never waits for the next to be cut
        return drive(work, pool, width + 1, spec, out_dir, progress)
    finally:
        pool.close()
