"""Training steps/s of one CPT stage while its checkpoints go to a slow S3, side by side:

- (a) local run root: checkpoints stay on the local disk, nothing is uploaded;
- (b) s3:// run root, synchronous publish: each checkpoint uploaded by the log reader itself, then
      remote retention (the simplest design, and the baseline the publisher must beat);
- (c) s3:// run root, asynchronous publisher (tasks/core/storage/publisher.py): the reader only enqueues,
      the engine retains only `.published` checkpoints and waits past max_pending_publishes.

The S3 side is a real SeaweedFS server (`weed mini`) behind the bandwidth-limiting proxy of
support/servers/throttle.py at `--rate-mb` MB/s, so each checkpoint takes seconds to upload. The
same tiny random Llama is sharded once; each mode trains from a copy of that step-000000 with
--nproc CPU ranks (torch_ddp, fp32; default 1) through `tasks.core.launch.torchrun.run_engine`, exactly as the
train task launches it. One rank by default: on this 2-core machine two CPU ranks take both cores,
and any upload (s3fs, the proxy, the S3 server, all on the same cores) then slows training
whether it runs in the reader or beside it. On a GPU node the ranks' CPU
cores are mostly idle while the GPU trains. steps/s is the ranks' own count: steps / `elapsed_s` of the last @@progress record (from the
first step to the last, saves and waits included; a failed mode: up to its last step); the wall
time adds launch and the final drain. Mode (c) keeps pace with (a) when one upload takes less than
the training time between two checkpoints; when it takes longer, backpressure slows (c) to the
upload rate instead of failing or deleting anything (try --every 15).

    .venv/bin/python benchmarks/publish.py                         # ~2 min on 2 cores
    .venv/bin/python benchmarks/publish.py --rate-mb 0.5 --steps 60 --every 15 --keep-last 1
    .venv/bin/python benchmarks/publish.py --smoke                 # 6 steps, one run per mode: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support.bench import workdir
from support.engine import run_raw, write_job
from support.servers.seaweed import WeedServer
from support.servers.throttle import MB, ThrottleProxy
from support.tiny import tiny_model
from tasks.core.config.schema import LaunchConfig
from tasks.core.launch.torchrun import run_engine
from tasks.core.run.job import Job, parse_job
from tasks.core.run.stages import step_name, step_rel
from tasks.core.storage.fs import RunStore
from tasks.core.storage.handshake import manifest_sha256, mark_published
from tasks.core.storage.publisher import Publisher, retain_remote

BUCKET = "bench-publish"
log = logging.getLogger("bench")


def _job(path: Path, run: dict, model: Path, stage_dir: Path, verb: str, remote: bool = False) -> Job:
    write_job(path, verb=verb, phase="cpt", phase_cfg=run["cpt"], model_dir=model, stage_dir=stage_dir)
    job = json.loads(path.read_text())
    job["remote_run_root"] = remote
    return parse_job(job, source=str(path))


def _train(mode: str, work: Path, run: dict, model: Path, base: Path, s3_uri: str, nproc: int) -> dict:
    events: list[dict] = []
    staging = work / f"staging-{mode}"
    store = RunStore(s3_uri, staging_dir=str(staging)) if mode != "local" else RunStore(str(work / "local-root"))
    stage_dir = store.local_path("cpt")
    shutil.copytree(base, stage_dir / step_name(0))
    publisher = None
    if mode != "local":
        store.publish(step_rel("cpt", 0))
        mark_published(stage_dir / step_name(0), manifest_sha256(stage_dir / step_name(0)))
    keep_last = run["cpt"]["keep_last"]

    if mode == "sync":

        def on_event(kind, rec):
            if kind == "checkpoint":  # upload inside the reader, then retention: training waits for both
                step = int(rec["step"])
                store.publish(step_rel("cpt", step))
                retain_remote(store, "cpt", keep_last, step)
    elif mode == "async":
        publisher = Publisher(store, "cpt", keep_last, max_queue=16, log=log).start()

        def on_event(kind, rec):
            if kind == "checkpoint":
                publisher.submit(int(rec["step"]))
            elif kind == "backpressure":
                events.append(rec)
    else:
        on_event = None

    t0 = time.monotonic()
    error = None
    progress: list[dict] = []
    try:
        job = _job(work / f"train-{mode}.json", run, model, stage_dir, "train", remote=mode == "async")
        run_engine(
            "train",
            job,
            work / f"train-{mode}.json",
            LaunchConfig(nproc_per_node=nproc),
            f"bench-{mode}",
            log,
            on_progress=progress.append,
            on_event=on_event,
            failure=(lambda: publisher.failure) if publisher else None,
        )
        if publisher:
            publisher.drain()
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        if publisher:
            publisher.close()
    wall = time.monotonic() - t0
    last = progress[-1] if progress else {}
    steps = int(last.get("step", 0))
    waited = sum(e.get("waited_s", 0) for e in events if e.get("state") == "resumed")
    return {
        "mode": mode,
        "steps": steps,
        "train_s": float(last.get("elapsed_s", 0.0)),
        "wall_s": wall,
        "error": error,
        "waited_s": waited,
        "steps_per_s": steps / float(last["elapsed_s"]) if last.get("elapsed_s") else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-mb", type=float, default=1.0, help="proxy bandwidth, MB/s each way (default 1)")
    ap.add_argument("--steps", type=int, default=600, help="training steps per mode")
    ap.add_argument("--every", type=int, default=150, help="checkpoint interval in steps")
    ap.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="CPU ranks (default 1: on 2 cores, 2 ranks leave no core for the upload path)",
    )
    ap.add_argument("--keep-last", type=int, default=1)
    ap.add_argument(
        "--repeat", type=int, default=3, help="runs per mode, interleaved; the table takes each mode's best"
    )
    ap.add_argument("--max-pending", type=int, default=2, help="max_pending_publishes of mode (c)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="6 steps, a checkpoint every 3, keep_last 2, one run per mode at 8 MB/s: checks the script runs",
    )
    a = ap.parse_args(argv)
    if a.smoke:
        # keep_last 2: with 3 steps between saves the engine outruns mode (b)'s in-reader upload and
        # would delete step 3 locally (keep_last 1) while it is still being read
        a.steps, a.every, a.repeat, a.rate_mb, a.keep_last = 6, 3, 1, 8.0, 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    work = workdir(a.workdir, "publish-bench-")
    work.mkdir(parents=True, exist_ok=True)
    server = WeedServer(work / "weed").start()
    os.environ.update(server.env())
    server.make_bucket(BUCKET)
    proxy = ThrottleProxy(("127.0.0.1", server.ports["s3.port"]), a.rate_mb * MB, lifetime_s=3600).start()
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
    try:
        model = work / "tiny-llama"
        tiny_model(model)
        run = run_raw(
            model,
            work / "unused",
            "cpt",
            {"name": "torch_ddp", "precision": "fp32"},
            max_steps=a.steps,
            checkpoint_every=a.every,
            keep_last=a.keep_last,
            max_pending_publishes=a.max_pending,
        )
        base_dir = work / "base"
        run_engine(
            "shard",
            _job(work / "shard.json", run, model, base_dir, "shard"),
            work / "shard.json",
            LaunchConfig(nproc_per_node=a.nproc),
            "bench-shard",
            log,
        )
        base = base_dir / step_name(0)
        size = sum(f.stat().st_size for f in base.rglob("*") if f.is_file())
        print(
            f"checkpoint {size / 1e6:.2f} MB; proxy {a.rate_mb:.2f} MB/s (~{size / (a.rate_mb * MB):.1f}s per upload); "
            f"{a.nproc} rank(s), {a.steps} steps, a checkpoint every {a.every}, keep_last {a.keep_last}, "
            f"max_pending_publishes {a.max_pending}; "
            f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
        )
        runs: dict[str, list[dict]] = {}
        for rep in range(a.repeat):  # the modes interleaved, so a slow minute of the machine hits all three
            for mode in ("local", "sync", "async"):
                r = _train(mode, work, run, model, base, f"s3://{BUCKET}/{mode}-{rep}", a.nproc)
                print(
                    f"  {mode:<6} {r['steps_per_s']:6.2f} steps/s  ({r['steps']} steps in {r['train_s']:.1f}s, wall "
                    f"{r['wall_s']:.1f}s"
                    + (f", waited {r['waited_s']:.1f}s at saves" if r["waited_s"] else "")
                    + (f"; FAILED {r['error']}" if r["error"] else "")
                    + ")",
                    flush=True,
                )
                runs.setdefault(mode, []).append(r)
                shutil.rmtree(work / f"staging-{mode}", ignore_errors=True)
                shutil.rmtree(work / "local-root", ignore_errors=True)
        # Each mode's best run; a failed run is the mode's result (a failure is never averaged away).
        results = {
            m: next((r for r in rs if r["error"]), None) or max(rs, key=lambda r: r["steps_per_s"])
            for m, rs in runs.items()
        }
        if a.repeat > 1:
            print(f"(best of {a.repeat} runs per mode)")
        a_ = results["local"]["steps_per_s"] or float("nan")
        print("\nsteps/s            (a) local   (b) S3 sync   (c) S3 async")
        print(
            f"                   {results['local']['steps_per_s']:10.2f}   {results['sync']['steps_per_s']:11.2f}   "
            f"{results['async']['steps_per_s']:12.2f}"
        )
        print(
            f"ratio to (a)       {1.0:10.2f}   {results['sync']['steps_per_s'] / a_:11.2f}   "
            f"{results['async']['steps_per_s'] / a_:12.2f}"
            f"   (target: (c) >= 0.95)"
        )
        for mode in ("sync", "async"):
            if results[mode]["error"]:
                print(f"({mode} failed: {results[mode]['error']})")
    finally:
        proxy.close()
        server.stop()
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
