"""The resumable order of training rows: which rows each dp rank takes at each optimizer step.

Used by the training loop inside each torchrun rank (`tasks/engine/loop.py`); the rows themselves
come from `tasks/core/data/samples.py`. To see the order a stage would take:

    python -c "from tasks.engine.sampler import ResumableSampler as S; s = S(10, 0, 2, seed=0); print([s.next_indices(4) for _ in range(3)])"
"""

from __future__ import annotations

import hashlib
import logging

import torch

log = logging.getLogger(__name__)


def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash, not seed + epoch: (seed=1, epoch=0) and (seed=0, epoch=1) must not collide.
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


_GROUP_SALT = 0x5EED_6A0F  # the grouping's own stream: the epoch permutation above stays what it was


class LengthGroups:
    """Length-grouped order of one epoch (the `grouped` batching, tasks/core/config/batching.py).

    The epoch's random permutation is cut into chunks of `megabatch` global batches; each chunk is
    sorted by length (longest first, ties in permutation order) and cut into global batches, whose
    order inside the chunk is shuffled with the epoch's seed; a short last batch stays last, so every
    batch boundary stays a multiple of `global_batch` from the epoch's start. A pure function of
    (seed, epoch, lengths, global_batch): the sampler's (epoch, offset) state resumes it bitwise.
    """

    def __init__(self, lengths, global_batch: int, megabatch: int = 64):
        if global_batch < 1:
            raise ValueError(f"global batch {global_batch} must be positive")
        self.lengths = torch.as_tensor(lengths, dtype=torch.int64)
        self.global_batch, self.megabatch = global_batch, megabatch

    def order(self, perm: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if len(self.lengths) != len(perm):
            raise ValueError(f"{len(self.lengths)} lengths for {len(perm)} items")
        chunk = self.global_batch * self.megabatch
        out = []
        for start in range(0, len(perm), chunk):
            part = perm[start : start + chunk]
            part = part[torch.sort(self.lengths[part], descending=True, stable=True).indices]
            batches = list(part.split(self.global_batch))
            tail = [batches.pop()] if len(batches[-1]) < self.global_batch else []
            out += [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()] + tail
        return torch.cat(out) if out else perm


class ResumableSampler:
    """Deterministic, resumable order of item indices, the same global stream on every rank.

    Epoch e is torch.randperm(num_items) under a generator seeded from (seed, e). Each optimizer
    step takes the next `global_batch` indices of that stream (continuing into epoch e+1 when e
    runs out) and each dp rank keeps its contiguous slice. The state is a position in the global
    stream, independent of dp_rank/dp_size, so a restore continues bitwise-identically.
    """

    def __init__(self, num_items: int, dp_rank: int, dp_size: int, seed: int, group: LengthGroups | None = None):
        if num_items < 1:
            raise ValueError(f"num_items={num_items}: the dataset is empty")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.num_items, self.dp_rank, self.dp_size, self.seed = num_items, dp_rank, dp_size, seed
        self.group = group
        self.epoch, self.offset = 0, 0
        self._perm: torch.Tensor | None = None
        self._perm_key: tuple[int, int] | None = None

    def _permutation(self) -> torch.Tensor:
        # Kept as an int64 tensor (8 bytes an item), not a Python list (~36): on a corpus of tens of
        # millions of blocks that is hundreds of MB per rank instead of GBs. Same values either way.
        key = (self.seed, self.epoch)
        if self._perm_key != key:
            g = torch.Generator().manual_seed(_epoch_seed(*key))
            perm = torch.randperm(self.num_items, generator=g)
            if self.group is not None:
                perm = self.group.order(perm, torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch) ^ _GROUP_SALT))
            self._perm, self._perm_key = perm, key
        return self._perm

    def next_global(self, n_global: int) -> list[int]:
        """The next n_global indices of the global stream (all ranks' shares, in rank order)."""
        out: list[int] = []
        while len(out) < n_global:
            perm = self._permutation()
            take = min(n_global - len(out), self.num_items - self.offset)
            out += perm[self.offset : self.offset + take].tolist()
            self.offset += take
            if self.offset == self.num_items:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def next_indices(self, n_global: int) -> list[int]:
        """This rank's share of the next global batch of n_global items."""
        if n_global < 1 or n_global % self.dp_size:
            raise ValueError(f"global batch {n_global} must be a positive multiple of dp_size={self.dp_size} (micro_batch_size * grad_accum_steps * dp_size)")
        per = n_global // self.dp_size
        return self.next_global(n_global)[self.dp_rank * per : (self.dp_rank + 1) * per]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed}

    def load_state_dict(self, d: dict[str, int]) -> None:
        missing = {"epoch", "offset", "seed"} - set(d)
        if missing:
            raise ValueError(f"sampler state is missing {sorted(missing)}; it must come from ResumableSampler.state_dict()")
        if not 0 <= d["offset"] < self.num_items or d["epoch"] < 0:
            raise ValueError(f"sampler state {d} does not fit a dataset of {self.num_items} items: was the data changed since the checkpoint?")
        if d["seed"] != self.seed:
            # The checkpoint is the truth about data order: resuming must replay the interrupted run.
            log.warning("sampler seed %d from the checkpoint replaces the configured %d", d["seed"], self.seed)
        self.epoch, self.offset, self.seed = int(d["epoch"]), int(d["offset"]), int(d["seed"])
