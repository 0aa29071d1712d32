"""The engine verb `shard-train`: shard, then train in the same ranks when the train stage adopts the launch.

    torchrun --nproc_per_node=2 -m tasks.engine shard-train --config jobs/cpt-shard.json

`shard` runs as it does alone and commits step-000000 manifest-last; after a barrier rank 0 emits
`@@sharded`, the boost_and_shard (or reboost) task verifies the artifact and ends, and the ranks
wait for the hand-off file (tasks/core/run/handoff.py). A `job` there is the train stage's own job
file, read and checked as the `train` verb reads it, with the train stage's fault specs (never the
launch's environment: the shard part runs with none, as a shard launch does); training then
resumes from the newest complete checkpoint exactly as a fresh `train` launch would (step 0, or a
later one). A `stop`, or no word within WAIT_S, ends the launch with the shard's result.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch.distributed as dist

from tasks.core.run import handoff
from tasks.core.run.events import SHARDED
from tasks.engine.boosted import emit, log
from tasks.engine.faults import Injector
from tasks.engine.preconditions import Job, check_inputs, load_job

POLL_S = 0.05
# The part of the shared launch running now: a failure is reported as the verb's own (`engine train failed: ...`).
running = ["shard"]


def _await(job_path: str | Path) -> dict:
    """Rank 0 polls the hand-off file; every rank gets the same record."""
    box: list = [None]
    if dist.get_rank() == 0:
        deadline = time.monotonic() + handoff.WAIT_S
        while (rec := handoff.read(job_path)) is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        box[0] = rec or {"stop": f"no train stage adopted this launch within {handoff.WAIT_S:g}s"}
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard_then_train(job: Job, faults: Injector, job_path: str | Path) -> Path | None:
    """The shard verb, then the train verb on the job the hand-off file names; the last checkpoint written."""
    from tasks.engine import loop

    result = loop.shard(job, faults)
    gc.collect()  # the shard's model and optimizer: gone before the training's are built
    dist.barrier()  # every rank's part of step-000000 written and its manifest committed by rank 0
    emit(SHARDED, {"phase": job.phase, "checkpoint": str(result)})
    t0 = time.monotonic()
    rec = _await(job_path)
    if "stop" in rec:
        log(f"shared launch of {job.phase}: not training ({rec['stop']})", detail=True)
        return result
    train_job = load_job(rec["job"], verb="train")
    why = handoff.mismatch(job, train_job)
    if why:
        raise ValueError(f"{rec['job']}: the train job cannot run in this shared launch: {why}")
    check_inputs(train_job)
    rank, world = dist.get_rank(), dist.get_world_size()
    train_faults = Injector(train_job.phase, train_job.stage_dir, rank, world, value=rec.get("fault") or "")
    dist.barrier()  # every rank read which faults already fired before any of them fires one
    running[0] = "train"
    log(f"shared launch of {job.phase}: training adopted {time.monotonic() - t0:.2f}s after step 0", detail=True)
    return loop.train(train_job, train_faults)
