"""A resume's AdamW state and fp32 masters, read as this rank's pieces on a few threads.

    python -c "from tasks.engine.state_read import read_threads; print(read_threads())"   # this process's threads

ColossalAI 0.5.0's optimizer loaders (low_level_zero, hybrid_parallel, torch_ddp) `torch.load` every
file of `optimizer/` whole on every rank, then cut each parameter's whole state to the rank's share:
each rank reads the whole optimizer state, one file at a time, on one thread. Here, where the
checkpoint has the layout-neutral records (`tasks/engine/masters.py`) and the optimizer is AdamW
under one of those plugins, each rank reads only its own pieces of `exp_avg` and `exp_avg_sq`
(`CheckpointState.read_piece`: `pread` at the byte offsets the pickles hold them at, a covering
read and a strided copy for a tensor-parallel cut along a later dim) straight into the state
tensors it keeps, `read_threads()` reads in flight; `step` and the parameter groups are what the
files hold; the result is the state ColossalAI's loader builds, bitwise (the same cut: `local_piece`).
The fp32 masters (`masters.restore`) go through the same pool. Under any layout, the same one included.
Gemini (its chunks) and LoRA (a small trainable share) keep ColossalAI's loader.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.core.models.convert.state_view import ADAM_KEYS, OPTIM_INDEX, CheckpointState

__all__ = ["Read", "load_optimizer", "read_threads", "run"]

MAX_THREADS = 8


def read_threads() -> int:
    """Reads in flight on a rank: its node's cores shared among torchrun's local ranks, 2 to 8. From the
    page cache a read is a copy on one core; from cold storage a second read in flight hides the latency."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(2, min(MAX_THREADS, len(os.sched_getaffinity(0)) // max(1, local)))


@dataclass
class Read:
    """One piece into its tensor: `fill` writes `length` fp32 elements into a flat CPU buffer; the first
    `into.numel()` of them land in `into` (any dtype, any device). A CPU fp32 `into` of `length`
    elements is filled in place, else through a buffer of its own held only while it is copied."""

    into: torch.Tensor
    length: int
    fill: Callable[[torch.Tensor], object]

    def __call__(self) -> int:
        # detached: a parameter's storage (a weight that is its own master) written in place; grad mode is
        # per thread, so a pool thread would otherwise track it
        dst = self.into.detach().view(-1)
        if dst.device.type == "cpu" and dst.dtype == torch.float32 and dst.numel() == self.length:
            self.fill(dst)
        else:
            buf = torch.empty(self.length, dtype=torch.float32)
            self.fill(buf)
            dst.copy_(buf[: dst.numel()])
        return self.length * 4


def run(reads: list[Read], threads: int | None = None) -> int:
    """Every read, on `threads` threads (`read_threads()`), largest first; the bytes read."""
    threads = read_threads() if threads is None else threads
    reads = sorted(reads, key=lambda r: -r.length)  # the long ones first: no thread left with the embedding at the end
    if threads <= 1 or len(reads) <= 1:
        return sum(r() for r in reads)
    with cf.ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(Read.__call__, reads))


def _eligible(eng, held) -> bool:
    opt = eng.optimizer
    inner = getattr(opt, "optim", opt)
    return (
        eng.cfg.lora is None
        and not hasattr(opt, "param_to_chunk16")  # Gemini: its fp32 chunks, not tensors per parameter
        and isinstance(inner, torch.optim.AdamW)
        and not any(g.get("amsgrad") for g in inner.param_groups)
        and all(loc.param is not None and loc.state_piece is not None for loc in held)
    )


@torch.no_grad()
def load_optimizer(eng, ckpt: Path, view: CheckpointState, held) -> str:
    """This rank's AdamW state and parameter groups from `ckpt/optimizer`, read as its pieces; a sentence
    for the log, or "" where this path does not apply (the caller loads through ColossalAI instead)."""
    if not _eligible(eng, held):
        return ""
    opt = eng.optimizer
    inner = getattr(opt, "optim", opt)
    index = json.loads((ckpt / "optimizer" / OPTIM_INDEX).read_text())
    groups_file = (index.get("metadata") or {}).get("param_groups")
    by_param = {id(loc.param): loc for loc in held}
    params = [q for g in inner.param_groups for q in g["params"]]
    if not groups_file or any(id(q) not in by_param or by_param[id(q)].piece.name not in view.ids for q in params):
        return ""
    saved = view.saved_states([by_param[id(q)].piece.name for q in params])
    if any(set(keys) != {"step", *ADAM_KEYS} for keys, _ in saved.values()):
        return ""  # another optimizer's state (amsgrad's max_exp_avg_sq, ...): ColossalAI's loader
    groups = torch.load(ckpt / "optimizer" / groups_file, map_location="cpu", weights_only=True)
    if not isinstance(groups, list) or len(groups) != len(inner.param_groups):
        return ""
    t0 = time.monotonic()
    reads, states = [], {}
    for q in params:
        loc = by_param[id(q)]
        name, piece = loc.piece.name, loc.state_piece
        keys, step = saved[name]
        state = {}
        for k in keys:
            if k == "step":  # as the file holds it (ColossalAI's loaders never cast or move it)
                state[k] = step
                continue
            view.extents(name, k)  # the pickle's offsets found here, before the threads share the view
            state[k] = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            reads.append(Read(state[k], piece.length, lambda buf, n=name, k=k, p=piece: view.read_piece(n, k, p, buf)))
        states[q] = state
    threads = read_threads()
    nbytes = run(reads, threads)
    new_groups = []
    for old, group in zip(inner.param_groups, groups):
        group = copy.deepcopy(group)
        group["params"] = old["params"]  # the saved hyperparameters (lr, betas, ...) over this rank's tensors
        new_groups.append(group)
    inner.__dict__.update({"param_groups": new_groups})
    inner.state.update(states)
    # what ColossalAI's loaders end with (sharded_optimizer_loading_epilogue), so as not to import it for two lines
    inner._patch_step_function()
    inner.defaults.setdefault("differentiable", False)
    return (
        f"read this rank's AdamW state of {ckpt.name} as its pieces: {len(reads)} tensors, {nbytes / 1e6:.1f} MB "
        f"on {threads} threads in {time.monotonic() - t0:.2f}s"
    )
