"""Backpressure of checkpoint uploads, as every torchrun rank sees it.

With a remote (s3://) run root the task publishes each committed checkpoint beside training and
marks it `.published` (tasks/core/storage/publisher.py, tasks/core/storage/handshake.py). Before a save, rank 0
counts the committed checkpoints still unmarked; while `max_pending_publishes` of them wait, a new
one would exceed the bound, so every rank waits here. Rank 0 re-counts every `poll_s` and
broadcasts the answer: each collective is short, so a long wait never trips the process group's
timeout. The wait is logged (how long, and why) and reported with an `@@backpressure` line the
task shows in the UI. Nothing is dropped and nothing unpublished is deleted.

Called from `Engine.save` (tasks/engine/boosted.py):

    torchrun --nproc_per_node=2 -m tasks.engine train --config JOB.json   # JOB.json: "remote_run_root": true
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tasks.core.run.events import BACKPRESSURE
from tasks.engine import checkpoint as ckpt


def wait_for_publishes(
    stage_dir: Path,
    step: int,
    max_pending: int,
    keep_last: int,
    log: Callable[[str], None],
    emit: Callable[[str, dict[str, Any]], None],
    poll_s: float = 0.5,
    remind_s: float = 60.0,
) -> float:
    """Block every rank until fewer than `max_pending` committed checkpoints await upload.
    Returns the seconds waited (0.0 when uploads kept up)."""
    rank0 = dist.get_rank() == 0
    t0 = time.monotonic()
    announced, reminded = False, t0
    while True:
        box: list[Any] = [None]
        if rank0:
            pending = ckpt.unpublished(stage_dir)
            box[0] = pending if len(pending) >= max_pending else []
        dist.broadcast_object_list(box, src=0)
        pending = box[0]
        if not pending:
            break
        now = time.monotonic()
        if rank0 and (not announced or now - reminded >= remind_s):
            log(
                f"backpressure: {len(pending)} committed checkpoint(s) still uploading ({', '.join(sorted(pending))}), "
                f"max_pending_publishes={max_pending}: waiting before saving step {step} "
                f"({now - t0:.0f}s so far; raise max_pending_publishes or use faster storage to wait less)"
            )
            emit(
                BACKPRESSURE,
                {
                    "step": step,
                    "state": "waiting",
                    "pending": sorted(pending),
                    "max_pending_publishes": max_pending,
                    "waited_s": round(now - t0, 3),
                },
            )
            announced, reminded = True, now
        time.sleep(poll_s)
    waited = time.monotonic() - t0
    if announced and rank0:
        log(f"backpressure: waited {waited:.1f}s for uploads before saving step {step}")
        emit(
            BACKPRESSURE,
            {"step": step, "state": "resumed", "max_pending_publishes": max_pending, "waited_s": round(waited, 3)},
        )
        # The uploads that ended the wait made older checkpoints deletable now, not one save later.
        removed = ckpt.retain(stage_dir, keep_last, require_published=True)
        if removed:
            log(f"retention keep_last={keep_last}: removed {', '.join(removed)}")
    return waited if announced else 0.0
