"""Per-node staging for an `s3://` run root on several nodes (`Job.nodes`, set by tasks/stages/train.py
when the stage's launch backend runs ranks on other nodes, e.g. Slurm).

    python -m pytest -m "" tests/test_slurm_s3.py      # two Slurm nodes, a real S3 server

No node sees another's disk, nor the Prefect worker's. So:

- `prepare` (after the process group is up): local rank 0 of every node stages into its own
  directory (`NodeStaging.dir` with `{node}` replaced by the node's name) what its ranks need:
  the model artifact, the stage's training data, and (train) the newest checkpoint whose remote
  manifest verifies, each sha256-checked; every other local step directory is removed, so every
  node resumes from the same step. Every rank then gets the job with those node-local paths.
- `publish_parts` (inside a checkpoint save, after every rank wrote its part locally): rank 0
  removes a stale remote manifest of that step; then local rank 0 of every node uploads its
  node's files (CRC32 on the wire, sha256 recorded) and the file tables are all-gathered, so rank
  0 can write one manifest covering every node's files.
- `publish_manifest`: rank 0 uploads that manifest last, after a barrier that every node's upload
  has returned, so a remote checkpoint with a manifest is whole.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tasks.core.run.job import Job
from tasks.core.run.manifest import MANIFEST, build_file_table
from tasks.core.run.stages import STEP_RE
from tasks.core.storage.fs import RunStore, filesystem
from tasks.core.storage.s3 import S3Transfers, all_or_nothing, b64, crc32, run_transfer


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def store_of(job: Job) -> RunStore:
    ns = job.nodes
    assert ns is not None
    return RunStore(ns.run_uri, staging_dir=ns.dir.replace("{node}", node_name()))


def _log(msg: str) -> None:
    print(f"node {node_name()}: {msg}", flush=True)


def _stage_in_newest(store: RunStore, stage_rel: str) -> str | None:
    names = sorted((n for n in store.listdir(stage_rel) if STEP_RE.match(n)), reverse=True)
    for name in names:
        try:
            store.stage_in(f"{stage_rel}/{name}")
            return name
        except Exception as exc:
            _log(f"not resuming from {store.uri(f'{stage_rel}/{name}')}: {exc}")
    return None


def prepare(job: Job) -> Job:
    """Stage this node's inputs (local rank 0), then return the job with node-local paths."""
    ns = job.nodes
    assert ns is not None
    store = store_of(job)
    stage_dir = store.local_path(ns.stage_rel)
    if local_rank() == 0:
        store.stage_in(ns.model_rel)
        store.stage_in(ns.data_rel)  # the prepared token shards, sha256-verified
        stage_dir.mkdir(parents=True, exist_ok=True)
        kept = _stage_in_newest(store, ns.stage_rel) if job.verb == "train" else None
        for p in stage_dir.iterdir():
            if p.name != kept and (STEP_RE.match(p.name) or p.name.startswith(".step-")):
                shutil.rmtree(p, ignore_errors=True)
        _log(
            f"staged {ns.model_rel}, {ns.data_rel}"
            + (f", {ns.stage_rel}/{kept}" if kept else "")
            + f" into {store.staging}"
        )
    dist.barrier()
    model = store.local_path(ns.model_rel)
    data = store.local_path(ns.data_rel)
    return job.model_copy(update={"model_dir": model, "tokenizer_dir": model, "data_dir": data, "stage_dir": stage_dir})


def _remote(store: RunStore, rel: str) -> tuple[Any, str]:
    fs, path = filesystem(store.uri(rel))
    return fs, path


def publish_parts(job: Job, tmp: Path, final_name: str) -> dict[str, dict]:
    """Upload this node's files of a checkpoint being saved in `tmp`; every node's file table."""
    store = store_of(job)
    rel = f"{job.nodes.stage_rel}/{final_name}"
    fs, root = _remote(store, rel)
    if dist.get_rank() == 0 and fs.exists(f"{root}/{MANIFEST}"):
        fs.rm_file(f"{root}/{MANIFEST}")  # the remote step stops existing until it is whole again
    dist.barrier()
    table: dict[str, dict] = {}
    if local_rank() == 0:
        table = build_file_table(tmp, exclude=(MANIFEST,))
        xfer = S3Transfers(fs, store.max_workers, store.part_size)

        async def go():
            sem = asyncio.Semaphore(store.max_workers)
            return await all_or_nothing(xfer.put(tmp / n, f"{root}/{n}", e, sem) for n, e in sorted(table.items()))

        run_transfer(
            xfer, go, f"publish of {node_name()}'s part of {store.uri(rel)}", "no manifest was written, safe to retry"
        )
        _log(f"published {len(table)} file(s) of {final_name} to {store.uri(rel)}")
    tables: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(tables, table)
    merged: dict[str, dict] = {}
    for t in tables:
        merged.update(t or {})
    return merged


def publish_manifest(job: Job, final: Path) -> None:
    """Rank 0: the manifest last, once every node's files are up (the caller's barrier)."""
    store = store_of(job)
    fs, root = _remote(store, f"{job.nodes.stage_rel}/{final.name}")
    blob = (final / MANIFEST).read_bytes()
    bucket, key, _ = fs.split_path(f"{root}/{MANIFEST}")
    xfer = S3Transfers(fs, store.max_workers, store.part_size)

    async def go():
        return await xfer.call(
            "put_object",
            Bucket=bucket,
            Key=key,
            Body=blob,
            ChecksumCRC32=b64(crc32(blob)),
            ContentType="application/json",
        )

    run_transfer(
        xfer, go, f"manifest of {store.uri(f'{job.nodes.stage_rel}/{final.name}')}", "the parts are up; safe to retry"
    )
