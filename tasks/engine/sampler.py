"""The resumable order of training rows: which rows each dp rank takes at each optimizer step.

Used by the training loop inside each torchrun rank (`tasks/engine/loop.py`); the rows themselves
come from `tasks/core/data/samples.py`. To see the order a stage would take:

    python -c "from tasks.engine.sampler import ResumableSampler as S; s = S(10, 0, 2, seed=0); print([s.next_indices(4) for _ in range(3)])"
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import torch

from tasks.core.data.order import LengthGroups, Packs

log = logging.getLogger(__name__)


def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash, not seed + epoch: (seed=1, epoch=0) and (seed=0, epoch=1) must not collide.
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


_GROUP_SALT = 0x5EED_6A0F  # the grouping's own stream: the epoch permutation above stays what it was


class ResumableSampler:
    """Deterministic, resumable order of item indices, the same global stream on every rank.

    Epoch e is torch.randperm(num_items) under a generator seeded from (seed, e), reordered by
    `group` when one is given (`LengthGroups`: still item indices; `Packs`: rows of item indices,
    the stream's units then). Each optimizer step takes the next `global_batch` units of that
    stream (continuing into epoch e+1 when e runs out) and each dp rank keeps its contiguous slice.
    The state is a position in the global stream, independent of dp_rank/dp_size, so a restore
    continues bitwise-identically.

    A mixture (`stream`, the blended item stream prepare_data wrote, `tasks/core/data/blend.py`)
    replaces the permutation: the blend already decided which source and which item feed every
    position of the planned steps, each source shuffled on its own, so the stream is walked as it
    is, and `group` (length groups, packs) reorders it exactly as it reorders a permutation, inside
    the same chunks. A pass beyond the plan (never reached by a stage that trains the steps its data
    was blended for) walks the same stream again, reordered by that epoch's seed.
    """

    def __init__(
        self,
        num_items: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        group: LengthGroups | Packs | None = None,
        stream: np.ndarray | None = None,
    ):
        if num_items < 1:
            raise ValueError(f"num_items={num_items}: the dataset is empty")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.num_items, self.dp_rank, self.dp_size, self.seed = num_items, dp_rank, dp_size, seed
        self.group = group
        if stream is not None and len(stream) == 0:
            raise ValueError("the blended stream is empty: prepare the data again")
        self.stream = stream
        self.epoch, self.offset = 0, 0
        self._perm: torch.Tensor | list | None = None
        self._perm_key: tuple[int, int] | None = None

    def _permutation(self) -> torch.Tensor | list:
        # Kept as an int64 tensor (8 bytes an item), not a Python list (~36): on a corpus of tens of
        # millions of blocks that is hundreds of MB per rank instead of GBs. Same values either way.
        key = (self.seed, self.epoch)
        if self._perm_key != key:
            if self.stream is not None:
                # Ungrouped, the memory-mapped stream itself: nothing is read at start-up.
                perm = self.stream if self.group is None else torch.from_numpy(np.asarray(self.stream, np.int64))
            else:
                perm = torch.randperm(self.num_items, generator=torch.Generator().manual_seed(_epoch_seed(*key)))
            if self.group is not None:
                perm = self.group.order(
                    perm, torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch) ^ _GROUP_SALT)
                )
            self._perm, self._perm_key = perm, key
        return self._perm

    def units(self) -> int:
        """Units in the current epoch's stream: items, or rows under `Packs`."""
        return len(self._permutation())

    def next_global(self, n_global: int) -> list:
        """The next n_global units of the global stream (all ranks' shares, in rank order): item
        indices, or under `Packs` tuples of them."""
        out: list = []
        while len(out) < n_global:
            perm = self._permutation()
            take = min(n_global - len(out), len(perm) - self.offset)
            part = perm[self.offset : self.offset + take]
            out += part.tolist() if isinstance(part, (torch.Tensor, np.ndarray)) else part
            self.offset += take
            if self.offset == len(perm):
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def next_indices(self, n_global: int) -> list:
        """This rank's share of the next global batch of n_global items."""
        if n_global < 1 or n_global % self.dp_size:
            raise ValueError(
                f"global batch {n_global} must be a positive multiple of dp_size={self.dp_size} (micro_batch_size * "
                "grad_accum_steps * dp_size)"
            )
        per = n_global // self.dp_size
        return self.next_global(n_global)[self.dp_rank * per : (self.dp_rank + 1) * per]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed}

    def load_state_dict(self, d: dict[str, int]) -> None:
        missing = {"epoch", "offset", "seed"} - set(d)
        if missing:
            raise ValueError(
                f"sampler state is missing {sorted(missing)}; it must come from ResumableSampler.state_dict()"
            )
        if d["seed"] != self.seed:
            # The checkpoint is the truth about data order: resuming must replay the interrupted run.
            log.warning("sampler seed %d from the checkpoint replaces the configured %d", d["seed"], self.seed)
        before = (self.epoch, self.offset, self.seed)
        self.epoch, self.offset, self.seed = int(d["epoch"]), int(d["offset"]), int(d["seed"])
        n = self.units() if self.epoch >= 0 else 0  # under Packs an epoch's length is its row count
        if not 0 <= self.offset < n:
            self.epoch, self.offset, self.seed = before
            raise ValueError(
                f"sampler state {d} does not fit a dataset of {self.num_items} items ({n} units in epoch "
                f"{d['epoch']}): was the data changed since the checkpoint?"
            )
