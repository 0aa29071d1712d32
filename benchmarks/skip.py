"""The skip decision at three artifact sizes: hashing every file vs a current verification stamp.

    .venv/bin/python benchmarks/skip.py                 # 64 MB, 512 MB, 2 GB artifacts on the local disk
    .venv/bin/python benchmarks/skip.py --smoke         # 1, 4 and 16 MB: checks the script runs

Each artifact is a model-like folder (safetensors-sized shards of random bytes, a config, a
manifest written by `write_manifest`) in a local run root. Measured side by side in one process,
after one warm-up read, so the page cache is equally warm for both (a cold read from disk or NFS
makes the hashing column far slower, the stamp column not at all):

- hashed: `RunStore.verify(rel)` as the skip decision ran before stamps (every byte read, sha256);
- stamp:  `RunStore.verify(rel, trust_stamp=True)` as `tasks/flowkit/stage.py` `completed` runs it now
  (one stat per file, the manifest and the stamp read).

Target: the skip time does not grow with the artifact size; the byte-level checks still run
where an artifact is read (stage_in, the engine's resume).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support.bench import best_of

SHARD = 64 << 20


def build(root: Path, size: int) -> None:
    from tasks.core.run.manifest import write_manifest

    (root / "model").mkdir(parents=True)
    left, i = size, 0
    while left > 0:
        n = min(SHARD, left)
        (root / "model" / f"model-{i:05d}.safetensors").write_bytes(os.urandom(n))
        left, i = left - n, i + 1
    (root / "model" / "config.json").write_text('{"model_type": "llama"}')
    write_manifest(root, kind="colossalai-checkpoint", config_digest="0" * 64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="1, 4 and 16 MB artifacts")
    ap.add_argument("--dir", default=None, help="where the run root is made (default: a temporary directory)")
    a = ap.parse_args(argv)
    sizes = [1 << 20, 4 << 20, 16 << 20] if a.smoke else [64 << 20, 512 << 20, 2 << 30]

    from tasks.core.storage.fs import RunStore

    with tempfile.TemporaryDirectory(prefix="skip-bench-", dir=a.dir) as tmp:
        store = RunStore(str(Path(tmp) / "run"))
        print(f"{'artifact':>10} {'files':>6} {'hashed s':>10} {'stamp s':>10} {'hashed / stamp':>15}")
        stamps = []
        for size in sizes:
            rel = f"cpt/step-{size >> 20:06d}"
            build(store.local_path(rel), size)
            store.publish(rel)  # what Stage.done does on a local run root: hashed once, stamped
            hashed = best_of(lambda rel=rel: store.verify(rel), 2)
            assert "hashed" in store.last_verify, store.last_verify
            stamped = best_of(lambda rel=rel: store.verify(rel, trust_stamp=True), 5)
            assert store.last_verify.startswith("by its verification stamp"), store.last_verify
            files = len(store.read_manifest(rel)["files"])
            stamps.append(stamped)
            print(f"{size / (1 << 20):>8.0f}MB {files:>6} {hashed:>10.4f} {stamped:>10.4f} {hashed / stamped:>14.0f}x")
        grow = stamps[-1] / stamps[0]
        print(
            f"\nstamp time, largest / smallest artifact: {grow:.2f} (size ratio {sizes[-1] / sizes[0]:.0f}); it grows "
            "with the file count "
            f"({len(store.read_manifest(rel)['files'])} files at the largest), not the bytes"
        )
        print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
