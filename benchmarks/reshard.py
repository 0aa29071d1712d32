"""Re-sharding a checkpoint's optimizer state through the layout-neutral view, against copying the
checkpoint's files, and the extra disk the fp32 master weights take in each checkpoint.

    .venv/bin/python benchmarks/reshard.py --smoke           # a tiny Llama, seconds, the same table
    .venv/bin/python benchmarks/reshard.py                   # 50M, 190M, 700M (~10 GB of disk at 700M)

For each size it writes one checkpoint in the engine's on-disk format as a low_level_zero ZeRO-2
bf16 stage on 2 ranks leaves it (model/ bf16 safetensors; optimizer/ ColossalAI's pickled blocks
of whole AdamW states, at most `save_shard_mib` each, with their index; masters/ each rank's fp32
flat shards and records, written by tasks/engine/masters.py's own writer), with random values:
the benchmark measures bytes moved, not training. Then, each in its own process after `sync`:
  (a) reshard: tasks.core.models.convert.state_view.CheckpointState reads every parameter's whole
      fp32 master and AdamW state and cuts it (`local_piece`) into the pieces of hybrid_parallel
      tp=2 x ZeRO-1 dp=2 on 4 ranks, written as one safetensors file per target rank, fsync'd;
  (b) copy: the checkpoint's masters/ and optimizer/ files read and written in 16 MiB chunks, fsync'd.
It prints seconds, GB/s of state (masters + moments) and the ratio a/b of their speeds (target
>= 0.5), the peak RSS growth of (a) over its start (VmHWM reset after imports) against the largest
tensor's state (master + two moments, fp32) + 0.5 GB, and the masters' share of the checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support import REPO
from tasks.core.run.hostpeak import HostPeak

SIZES = {  # the shapes of benchmarks/scale.py
    "50M": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1376,
        vocab_size=32000,
    ),
    "190M": dict(
        hidden_size=1024,
        num_hidden_layers=11,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=2560,
        vocab_size=32000,
    ),
    "700M": dict(
        hidden_size=1536,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=4096,
        vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=515,
    ),
}
SRC_RANKS, TP, DP = 2, 2, 2
CHUNK = 16 << 20


def config_of(size: str) -> dict:
    return {"model_type": "llama", "tie_word_embeddings": False, "torch_dtype": "bfloat16", **SIZES[size]}


def write_checkpoint(out: Path, config: dict) -> dict:
    """The checkpoint as a 2-rank ZeRO-2 bf16 stage leaves it; its byte counts."""
    import torch
    from safetensors.torch import save_file

    from tasks.core.models.convert.state_view import MASTERS, Piece, rank_record_name, rank_tensor_name
    from tasks.core.models.families import expected_tensors
    from tasks.engine.checkpoint import save_shard_mib
    from tasks.engine.masters import _write

    tensors = expected_tensors(config)
    (out / "model").mkdir(parents=True)
    (out / "optimizer").mkdir()
    (out / MASTERS).mkdir()
    g = torch.Generator().manual_seed(0)
    block_mib = save_shard_mib(config, 2)
    weight_map, opt_map, block, block_bytes, files = {}, {}, {}, 0, 0
    shards: list[list[tuple[Piece, torch.Tensor]]] = [[] for _ in range(SRC_RANKS)]

    def flush():
        nonlocal block, block_bytes, files
        if block:
            files += 1
            name = f"pytorch_optim-{files:05d}.bin"
            torch.save(block, out / "optimizer" / name)
            opt_map.update({str(k): name for k in block})
        block, block_bytes = {}, 0

    for pid, (name, shape) in enumerate(tensors.items()):
        master = torch.randn(shape, generator=g)
        save_file({name: master.to(torch.bfloat16)}, str(out / "model" / f"model-{pid + 1:05d}.safetensors"))
        weight_map[name] = f"model-{pid + 1:05d}.safetensors"
        numel = master.numel()
        length = -(-numel // SRC_RANKS)
        flat = torch.nn.functional.pad(master.reshape(-1), [0, length * SRC_RANKS - numel])
        for r in range(SRC_RANKS):
            shards[r].append(
                (
                    Piece(name, pid, shape, shape, None, 0, 1, r * length, length, saved=True, rank=r),
                    flat[r * length : (r + 1) * length].clone(),
                )
            )
        state = {
            "step": torch.tensor(100.0),
            "exp_avg": torch.randn(shape, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6,
        }
        if block and block_bytes + numel * 8 > block_mib * 2**20:
            flush()
        block[pid] = state
        block_bytes += numel * 8
    flush()
    (out / "model" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "optimizer" / "pytorch_optim.bin.index.json").write_text(json.dumps({"weight_map": opt_map}))
    for r, held in enumerate(shards):
        _write(out / MASTERS / rank_tensor_name(r), [(p.name, t) for p, t in held])
        rec = {"rank": r, "world_size": SRC_RANKS, "plugin": "low_level_zero", "params": [p.record() for p, _ in held]}
        (out / MASTERS / rank_record_name(r)).write_text(json.dumps(rec))
    sizes = {part: sum(f.stat().st_size for f in (out / part).iterdir()) for part in ("model", "optimizer", MASTERS)}
    return {
        "bytes": sizes,
        "params": sum(math.prod(s) for s in tensors.values()),
        "largest": max(math.prod(s) for s in tensors.values()),
    }


def work_reshard(src: Path, dst: Path, config: dict) -> None:
    """Every parameter's whole state, cut into the target layout's pieces, one file per target rank."""
    import torch

    from tasks.core.models.convert.state_view import CheckpointState, Piece, local_piece
    from tasks.core.models.convert.write import safetensors_header
    from tasks.core.models.families import TP_SPLIT_DIMS, iter_tensors

    view = CheckpointState(src)
    dims = {
        key: next((d for d, sym in enumerate(rule.shape) if sym in TP_SPLIT_DIMS), None)
        for key, rule, _, _ in iter_tensors(config)
    }
    ranks = [(t, z) for t in range(TP) for z in range(DP)]
    layout = {}
    for name in view.names():
        shape = view.pieces(name)[0].shape
        d = dims[name]
        local = list(shape)
        if d is not None:
            local[d] = -(-shape[d] // TP)
        length = -(-math.prod(local) // DP)
        layout[name] = [Piece(name, 0, shape, tuple(local), d, t, TP, z * length, length) for t, z in ranks]
    dst.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(open(dst / f"rank-{i:05d}.safetensors", "wb")) for i in range(len(ranks))]
        for i, f in enumerate(outs):  # one output per target rank: its header first, then its pieces streamed
            f.write(
                safetensors_header(
                    [
                        (f"{n}.{k}", "F32", (ps[i].length,), ps[i].length * 4)
                        for n, ps in layout.items()
                        for k in ("master", "exp_avg", "exp_avg_sq")
                    ]
                )
            )
        for name, pieces in layout.items():
            whole = {"master": view.master(name), **{k: v for k, v in view.adam(name).items() if k != "step"}}
            for i, p in enumerate(pieces):
                for k in ("master", "exp_avg", "exp_avg_sq"):
                    outs[i].write(memoryview(local_piece(whole[k].to(torch.float32), p).numpy()).cast("B"))
            del whole
        for f in outs:
            f.flush()
            os.fsync(f.fileno())
    view.close()


def work_copy(src: Path, dst: Path, config: dict) -> None:
    buf = bytearray(CHUNK)
    for part in ("masters", "optimizer"):
        (dst / part).mkdir(parents=True)
        for f in sorted((src / part).iterdir()):
            with open(f, "rb", buffering=0) as fin, open(dst / part / f.name, "wb", buffering=0) as fout:
                while n := fin.readinto(buf):
                    fout.write(memoryview(buf)[:n])
                os.fsync(fout.fileno())


def worker(kind: str, src: Path, dst: Path, config: dict) -> dict:
    import torch  # imported before the clock and the RSS baseline

    torch.set_num_threads(
        1
    )  # one thread, as a rank has (OMP_NUM_THREADS=1): no intra-op threads spinning on a shared CPU

    import tasks.core.models.convert.state_view  # noqa: F401

    peak = HostPeak()  # VmHWM := the current RSS
    t0 = time.perf_counter()
    (work_reshard if kind == "reshard" else work_copy)(src, dst, config)
    return {"seconds": time.perf_counter() - t0, "growth_kb": peak.added()[0] // 1024}


def run(kind: str, src: Path, dst: Path, config: dict) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["sync"], check=False)
    code = (
        "import json; from benchmarks.reshard import worker; from pathlib "
        "import Path; "
        f"print(json.dumps(worker({kind!r}, Path({str(src)!r}), Path({str(dst)!r}), "
        f"json.loads({json.dumps(json.dumps(config))}))))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO / "benchmarks"), str(REPO)))}  # _checkout, support
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=str(REPO), env=env
    )
    shutil.rmtree(dst, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["50M", "190M", "700M"], choices=[s for s in SIZES if s != "tiny"])
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama (vocabulary 515: padded tp slices), seconds")
    ap.add_argument("--workdir", type=Path, default=None)
    a = ap.parse_args(argv)
    sizes = ["tiny"] if a.smoke else a.sizes
    work = Path(a.workdir or tempfile.mkdtemp(prefix="reshard-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"{'size':<6} {'params':>9} {'state GB':>9} {'reshard s':>10} {'copy s':>8} {'speed a/b':>10} {'peak growth GB':>15} "
        f"{'limit GB':>9} {'masters GB':>11} {'masters share':>14}"
    )
    try:
        for size in sizes:
            config = config_of(size)
            src = work / size / "step-000100"
            shutil.rmtree(work / size, ignore_errors=True)
            facts = write_checkpoint(src, config)
            b = facts["bytes"]
            state = b["masters"] + b["optimizer"]
            rs, cp = (
                run("reshard", src, work / size / "resharded", config),
                run("copy", src, work / size / "copied", config),
            )
            limit = facts["largest"] * 12 + 0.5e9
            total = sum(b.values())
            print(
                f"{size:<6} {facts['params'] / 1e6:>8.1f}M {state / 1e9:>9.3f} {rs['seconds']:>10.2f} "
                f"{cp['seconds']:>8.2f} "
                f"{cp['seconds'] / rs['seconds']:>10.2f} {rs['growth_kb'] * 1024 / 1e9:>15.3f} {limit / 1e9:>9.3f} "
                f"{b['masters'] / 1e9:>11.3f} {b['masters'] / total:>13.1%}"
            )
            shutil.rmtree(work / size, ignore_errors=True)
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(
        "reshard: low_level_zero ZeRO-2 on 2 ranks -> hybrid_parallel tp=2 x ZeRO-1 dp=2 on 4 ranks; copy: masters/ + "
        "optimizer/; "
        "speed a/b = copy seconds / reshard seconds (target >= 0.5); limit: the largest tensor's fp32 master and "
        "moments + 0.5 GB; "
        "masters share: of the whole checkpoint (model/ + optimizer/ + masters/)"
    )
    print(f"command: python benchmarks/reshard.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
