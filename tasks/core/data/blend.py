"""A weighted mixture, blended once: which source, and which of its samples, feed every position of
the planned steps.

    python -m tasks.core.data.blend --weights 0.6 0.3 0.1 --items 5000 800 90 --positions 6400

prepare_data calls `blend` after the shards exist, when a stage has more than one source
(`data.sources`); the stream goes into the artifact as `BLEND_FILE` (one little-endian item id per
position, memory-mapped by the ranks) and the report into index.json's `sources`. One source
(`data.uri`) has no blend: its epochs are the sampler's permutations.

- Which source feeds position p is Megatron-LM's `BlendedDataset` rule: the source whose count lags
  its weight most, `argmax_s(w_s * (p + 1) - count_s)`, ties to the first source. A prefix of the
  stream is the same whatever its length, and every prefix holds each source within about one
  sample of its weight.
- Which sample of source s its c-th pick is: the item `order_s,e[c mod n_s]` of the source's own
  permutation for pass e = c // n_s, so a source smaller than its share is repeated, a pass at a
  time (no sample twice before every sample once), and a larger one is subsampled at random. The
  permutations are sorts of splitmix64 keys of (seed, source name, pass, item): arithmetic, so the
  blend is the same bytes whatever numpy or torch version computes it.
- Units are what one optimizer step counts: CPT `seq_len` blocks (so weights are token shares
  exactly), SFT conversations (weights are shares of conversations; the report gives the token
  shares beside them), DPO pairs (two rows each, one item: a pair is never split). Under SFT
  `packed` the global batch counts rows: the stream is the fewest conversations whose rows, packed
  by the ranks' own `Packs`, cover the planned rows.
- Cost, measured: the source choice is a Python loop, about 1.2 s per million positions (3
  sources, 2-core machine); the rest is numpy. The stream takes 4 bytes a position (8 beyond 2**32 items).
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

BLEND_FILE = "blend.items"  # at the root of data/<phase>/ beside index.json


@dataclass(frozen=True)
class Source:
    """One source as prepare reads it: its name, its uris (what data.uri accepts) and its weight."""

    name: str
    uri: str | Sequence[str]
    weight: float = 1.0


@dataclass(frozen=True)
class BlendPlan:
    """The steps a blend is made for: max_steps x global_batch units (`tasks.core.config.layout.global_batch`)."""

    max_steps: int
    global_batch: int
    seed: int
    packed_seq_len: int | None = None  # SFT packed: the global batch counts rows of up to this many tokens

    @property
    def units(self) -> int:
        return self.max_steps * self.global_batch

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class BlendError(ValueError):
    """A mixture that cannot be blended; the message names the source and the fix."""


def normalized(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, np.float64)
    if not len(w) or not np.all(w > 0):
        raise BlendError(f"weights {list(weights)}: every weight must be > 0")
    return w / w.sum()


def interleave(weights: Sequence[float], positions: int) -> np.ndarray:
    """The source of each position: Megatron's greedy, the source whose count lags its weight most."""
    w = [float(x) for x in normalized(weights)]
    counts = [0] * len(w)
    out = np.empty(positions, np.uint16)
    rng = range(1, len(w))
    for p in range(positions):
        best, lag = 0, w[0] * (p + 1) - counts[0]
        for s in rng:
            e = w[s] * (p + 1) - counts[s]
            if e > lag:
                best, lag = s, e
        counts[best] += 1
        out[p] = best
    return out


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return z ^ (z >> np.uint64(31))


def source_order(n_items: int, seed: int, name: str, epoch: int) -> np.ndarray:
    """Pass `epoch` over one source's items, a permutation of range(n_items)."""
    salt = int.from_bytes(hashlib.sha256(f"{seed}:{name}:{epoch}".encode()).digest()[:8], "little")
    keys = _splitmix64(np.arange(n_items, dtype=np.uint64) ^ np.uint64(salt))
    return np.argsort(keys, kind="stable").astype(np.int64)


def _picks(count: int, n_items: int, seed: int, name: str) -> np.ndarray:
    """The local items of a source's first `count` picks: whole passes, each its own permutation."""
    passes = -(-count // n_items)
    return (
        np.concatenate([source_order(n_items, seed, name, e) for e in range(passes)])[:count]
        if count
        else np.zeros(0, np.int64)
    )


def blend_stream(
    names: Sequence[str], weights: Sequence[float], items: Sequence[int], seed: int, positions: int
) -> tuple[np.ndarray, np.ndarray]:
    """(global item id, source) of each position; global ids are source-major (source 0's items first)."""
    src = interleave(weights, positions)
    base = np.concatenate([[0], np.cumsum(items)[:-1]]).astype(np.int64)
    out = np.empty(positions, np.int64)
    for s, (name, n) in enumerate(zip(names, items)):
        at = np.flatnonzero(src == s)
        if len(at) and n < 1:
            raise BlendError(
                f"source {name!r} has no training sample to draw from; give it data or remove it from data.sources"
            )
        out[at] = base[s] + _picks(len(at), int(n), seed, name)
    return out, src


def _packed_positions(names, weights, items, plan: BlendPlan, lengths: np.ndarray) -> int:
    """The fewest conversations whose rows, packed as the ranks pack them, cover the planned rows.

    The ranks pack the stream in chunks of `Packs.chunk` from its start, so the rows of a prefix
    are those of its whole chunks plus its last, partial one; the stream is made just long enough
    that the planned steps take (nearly) all of it, and the report over it is what they train on.
    """
    import torch  # the ranks' own packing; never imported by a tokenizing worker

    from tasks.core.data.order import Packs

    packs = Packs(lengths, plan.packed_seq_len)

    def rows(stream: torch.Tensor, full: list[int], n: int) -> int:
        whole = n // packs.chunk
        tail = stream[whole * packs.chunk : n]
        return sum(full[:whole]) + (len(packs.pack(tail)) if len(tail) else 0)

    guess = plan.units  # a row holds at least one conversation
    while True:
        stream = torch.from_numpy(blend_stream(names, weights, items, plan.seed, guess)[0])
        full = [len(packs.pack(stream[a : a + packs.chunk])) for a in range(0, guess - packs.chunk + 1, packs.chunk)]
        if rows(stream, full, guess) >= plan.units:
            break
        guess *= 2
    lo, hi = 1, guess  # rows() grows with n (best-fit decreasing may, rarely, not): search, then step up
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if rows(stream, full, mid) < plan.units else (lo, mid)
    while rows(stream, full, lo) < plan.units:
        lo += 1
    return lo


def blend(
    names: Sequence[str],
    weights: Sequence[float],
    items: Sequence[int],
    tokens: Sequence[int],
    plan: BlendPlan,
    seq_len: int,
    lengths: np.ndarray | None = None,
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """The stream of the planned steps and its report per source.

    `items`: training samples of each source (CPT blocks, SFT conversations); `tokens`: its training
    tokens; `lengths` (SFT): every item's tokens, in global item order.
    """
    w = normalized(weights)
    positions = plan.units if plan.packed_seq_len is None else _packed_positions(names, w, items, plan, lengths)
    stream, src = blend_stream(names, w, items, plan.seed, positions)
    picked = np.bincount(src, minlength=len(names))
    seen = (
        picked * seq_len
        if lengths is None
        else np.bincount(src, weights=lengths[stream], minlength=len(names)).astype(np.int64)
    )
    report = [
        {
            "name": name,
            "weight": round(float(w[s]), 6),
            "samples_available": int(items[s]),
            "tokens_available": int(tokens[s]),
            "samples": int(picked[s]),
            "tokens": int(seen[s]),
            "token_share": round(float(seen[s] / max(1, seen.sum())), 6),
            "sample_share": round(float(picked[s] / positions), 6),
            "epochs": round(float(picked[s] / max(1, items[s])), 4),
        }
        for s, name in enumerate(names)
    ]
    dtype = np.uint32 if int(sum(items)) <= 1 << 32 else np.int64
    return stream.astype(dtype), report


def check_plan(index: dict[str, Any], plan: BlendPlan | None, data_dir: Any, phase: str) -> None:
    """Refuse training a mixture for other steps than its blend was made for (the flow cannot: the
    plan is part of prepare_data's digest; a job written by hand can)."""
    meta = index.get("blend")
    have = BlendPlan(**meta["plan"]) if meta else None
    if have != plan:
        fields = "max_steps, micro_batch_size, grad_accum_steps, the data-parallel size, seed, batching"
        raise BlendError(
            f"{data_dir} was blended for {have} but {phase} trains {plan}; prepare the data again for this stage "
            f"(prepare_{phase} re-runs when {phase}.{{{fields}}} change)"
        )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m tasks.core.data.blend",
        description="The report of a blend of sources of the given sizes (CPT blocks).",
    )
    ap.add_argument("--weights", type=float, nargs="+", required=True)
    ap.add_argument("--items", type=int, nargs="+", required=True, help="training samples of each source")
    ap.add_argument("--positions", type=int, required=True, help="planned samples: max_steps x global batch")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)
    names = [f"s{i}" for i in range(len(a.weights))]
    _, report = blend(names, a.weights, a.items, a.items, BlendPlan(a.positions, 1, a.seed), seq_len=1)
    for r in report:
        print(
            f"{r['name']:>6}  weight {r['weight']:.3f}  share {r['token_share']:.4f}  epochs {r['epochs']:8.3f}  of "
            f"{r['samples_available']:,} samples"
        )


if __name__ == "__main__":
    main()
