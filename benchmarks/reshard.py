"""Re-sharding a checkpoint's optimizer state through the layout-neutral view, beside PyTorch
Distributed Checkpoint (DCP) doing the same, and against copying the checkpoint's files.

    .venv/bin/python benchmarks/reshard.py --smoke              # a tiny Llama, to tp2dp2, the same table
    .venv/bin/python benchmarks/reshard.py --sizes 50M --repeat 3   # medians of 3, both layouts
    .venv/bin/python benchmarks/reshard.py                      # 50M, 190M, 700M (~10 GB of disk at 700M)

For each size it writes one checkpoint in the engine's on-disk format as a low_level_zero ZeRO-2
bf16 stage on 2 ranks leaves it (model/ bf16 safetensors; optimizer/ ColossalAI's pickled blocks
of whole AdamW states, at most `save_shard_mib` each, with their index; masters/ each rank's fp32
flat shards and records, written by tasks/engine/masters.py's own writer), with random values:
the benchmark measures bytes moved, not training. Then, after `sync`, each measurement in its own
processes, started together once imported (a line on stdin), to each target layout (tp2dp2:
hybrid_parallel tp=2 x ZeRO-1 dp=2 on 4 ranks; 1: one rank):
  serial:  one process, tasks.core.models.convert.state_view.CheckpointState reading every
           parameter's whole fp32 master and AdamW state once and cutting it (`local_piece`) into
           every target rank's pieces, one safetensors file per target rank (the benchmark before);
  writers: the default: one process, a thread per target file (`write_rank`), no whole tensor:
           each piece of each state copied file to file in the kernel (`copy_file_range`, a run at
           a time: a row of a tp cut along dim 1) from where the source holds it
           (`CheckpointState.segments`: the ZeRO shards of the masters, the AdamW states' offsets in
           the optimizer's pickles);
  ranks:   a process per target rank, each writing its own file as `write_rank` does (what the
           engine's ranks do on a resume: tasks/engine/masters.py `restore` reads its pieces with
           `read_piece`);
  DCP:     torch.distributed.checkpoint, gloo ranks: save from the 2 source ranks (each holding its
           rows of every state as DTensors; FileSystemWriter, sync_files=True), then load into the
           target ranks' DTensors (the tp slice, its rows over dp: the same bytes a rank as ZeRO's
           flat cut) and each rank's local tensors written to its own file;
  copy:    the checkpoint's masters/ and optimizer/ files read and written in 16 MiB chunks.
Every file is fsync'd. It prints wall seconds (first start to last end), DCP load / writers, the peak
RSS growth over the start (VmHWM reset after imports and, for DCP, after building its state)
against the largest tensor's state (master + two moments, fp32) + 0.5 GB, and whether writers and
ranks wrote serial's bytes (to one rank, DCP's tensors too).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import shutil
import statistics
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


LAYOUTS = {"tp2dp2": (TP, DP), "1": (1, 1)}  # hybrid_parallel tp=2 x ZeRO-1 dp=2 on 4 ranks; one rank


def tp_dims(config: dict) -> dict:
    """Each tensor's dim that tensor parallelism splits (None: kept whole on every tp rank)."""
    from tasks.core.models.families import TP_SPLIT_DIMS, iter_tensors

    return {
        key: next((d for d, sym in enumerate(rule.shape) if sym in TP_SPLIT_DIMS), None)
        for key, rule, _, _ in iter_tensors(config)
    }


def target_layout(view, config: dict, tp: int, dp: int) -> dict:
    """Every parameter's pieces for tp x ZeRO-1 dp target ranks (rank i = tp_rank * dp + dp_rank)."""
    from tasks.core.models.convert.state_view import Piece

    dims = tp_dims(config)
    layout = {}
    for name in view.names():
        shape = view.pieces(name)[0].shape
        d = dims[name] if tp > 1 else None
        local = list(shape)
        if d is not None:
            local[d] = -(-shape[d] // tp)
        length = -(-math.prod(local) // dp)
        layout[name] = [
            Piece(name, 0, shape, tuple(local), d, t, tp, z * length, length) for t in range(tp) for z in range(dp)
        ]
    return layout


def _header(entries: list[tuple[str, int]]) -> bytes:
    from tasks.core.models.convert.write import safetensors_header

    return safetensors_header([(f"{n}.{k}", "F32", (numel,), numel * 4) for n, numel in entries for k in KEYS])


KEYS = ("master", "exp_avg", "exp_avg_sq")


def _copy(sfd: int, soff: int, dfd: int, doff: int, n: int) -> None:
    """n bytes from one file to another in the kernel (no user memory); pread + pwrite where it cannot."""
    while n:
        try:
            got = os.copy_file_range(sfd, dfd, n, soff, doff)
        except OSError:  # another filesystem on an old kernel, or no copy_file_range
            got = 0
        if got <= 0:  # (0: a filesystem that copies nothing this way, or the source's end)
            got = os.pwrite(dfd, os.pread(sfd, min(n, CHUNK), soff), doff)
        if got <= 0:
            raise OSError(f"copy stopped with {n} bytes left: the source file is shorter than its record")
        soff, doff, n = soff + got, doff + got, n - got


def write_rank(view, pieces: dict, i: int, path: Path) -> None:
    """Target rank i's file: its header, then each parameter's three states' pieces (`local_piece`'s
    bytes), copied file to file from where the source holds them (`segments`; a cut along dim 1: a
    copy a row, as cheap in CPU as one covering read and a strided copy, and no memory), read whole
    and cut where the source does not store the state flat; fsync'd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        header = _header([(n, ps[i].length) for n, ps in pieces.items()])
        at = os.write(fd, header)
        for name, ps in pieces.items():
            p = ps[i]
            for k in KEYS:
                segs = view.segments(name, k, p)
                if segs is None:
                    at += os.pwrite(fd, memoryview(view.read_piece(name, k, p).numpy()).cast("B"), at)
                    continue
                for n, sfd, off in segs:
                    if sfd < 0:
                        os.pwrite(fd, bytes(n), at)
                    else:
                        _copy(sfd, off, fd, at, n)
                    at += n
        os.fsync(fd)
    finally:
        os.close(fd)


def work_reshard(src: Path, dst: Path, config: dict, layout: str = "tp2dp2", writers: int = 0, only=None) -> None:
    """One safetensors file per target rank, fsync'd. writers=0, only=None: every parameter's whole state
    read once through the view and cut by `local_piece` into every target rank's pieces, each file in
    turn (the serial writer, as before); writers=N: `write_rank` for each target file on N threads (the
    copies and the reads release the GIL), no whole tensor; only=i: `write_rank` for target rank i alone
    (a target rank writing its own state)."""
    import concurrent.futures as cf

    import torch

    from tasks.core.models.convert.state_view import CheckpointState, local_piece

    view = CheckpointState(src)
    tp, dp = LAYOUTS[layout]
    pieces = target_layout(view, config, tp, dp)
    ranks = range(tp * dp) if only is None else [only]
    dst.mkdir(parents=True, exist_ok=True)
    path = lambda i: dst / f"rank-{i:05d}.safetensors"
    if writers or only is not None:
        for name in pieces:  # every state's extents found before the threads (the pickles' meta loads)
            for k in KEYS:
                view.extents(name, k)
        with cf.ThreadPoolExecutor(max(1, min(writers, len(ranks)))) as pool:
            for fut in [pool.submit(write_rank, view, pieces, i, path(i)) for i in ranks]:
                fut.result()
        view.close()
        return
    with contextlib.ExitStack() as stack:
        outs = {i: stack.enter_context(open(path(i), "wb")) for i in ranks}
        for i, f in outs.items():  # one output per target rank: its header first, then its pieces streamed
            f.write(_header([(n, ps[i].length) for n, ps in pieces.items()]))
        for name, ps in pieces.items():
            whole = {"master": view.master(name), **{k: v for k, v in view.adam(name).items() if k != "step"}}
            whole = {k: v.to(torch.float32) for k, v in whole.items()}
            for i, f in outs.items():
                for k in KEYS:
                    f.write(memoryview(local_piece(whole[k], ps[i]).numpy()).cast("B"))
        for f in outs.values():
            _fsync(f)
    view.close()


def _fsync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def work_copy(src: Path, dst: Path, config: dict) -> None:
    buf = bytearray(CHUNK)
    for part in ("masters", "optimizer"):
        (dst / part).mkdir(parents=True)
        for f in sorted((src / part).iterdir()):
            with open(f, "rb", buffering=0) as fin, open(dst / part / f.name, "wb", buffering=0) as fout:
                while n := fin.readinto(buf):
                    fout.write(memoryview(buf)[:n])
                os.fsync(fout.fileno())


def dcp_state(view, config: dict, mesh, tp: int, empty: bool) -> dict:
    """The whole state as DTensors on `mesh`: the source's (every parameter's three states sharded by rows
    over the source ranks, as a ZeRO shard holds the same bytes) or the target's (the tp slice, then its
    rows over dp: DTensor has no flat ZeRO placement, so the same bytes a rank, cut by rows)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dims = tp_dims(config)
    out = {}
    for name in view.names():
        shape = view.pieces(name)[0].shape
        if mesh.ndim == 1:
            placements = [Shard(0)]
        else:
            placements = [Shard(dims[name]) if dims[name] is not None and tp > 1 else Replicate(), Shard(0)]
        if empty:
            whole = {k: torch.empty(shape) for k in KEYS}
        else:
            whole = {"master": view.master(name), **{k: v for k, v in view.adam(name).items() if k != "step"}}
        for k in KEYS:  # src_data_rank=None: each rank keeps its own slice of the same values, no messages
            t = distribute_tensor(whole[k].float(), mesh, placements, src_data_rank=None)
            # its own storage: not a view that keeps the whole tensor alive
            out[f"{name}.{k}"] = DTensor.from_local(
                t.to_local().clone(), mesh, placements, run_check=False, shape=t.shape, stride=t.stride()
            )
    return out


def work_dcp(phase: str, src: Path, dst: Path, config: dict, layout: str, rank: int, gate) -> dict:
    """PyTorch Distributed Checkpoint: `save` the source ranks' state (FileSystemWriter, fsync'd files),
    or `load` it into the target layout's DTensors and write each rank's local tensors to its own file,
    fsync'd (the same output the reshard writes, one file per target rank)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from tasks.core.models.convert.state_view import CheckpointState

    tp, dp = (SRC_RANKS, 1) if phase == "save" else LAYOUTS[layout]
    view = CheckpointState(src)
    mesh = init_device_mesh("cpu", (SRC_RANKS,) if phase == "save" else (tp, dp), mesh_dim_names=None)
    sd = dcp_state(view, config, mesh, tp, empty=phase == "load")
    view.close()
    dist.barrier()
    peak = gate()
    t0 = time.time()
    if phase == "save":
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(dst), sync_files=True))
    else:
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(src / "dcp")))
        local = [(key, t.to_local().contiguous()) for key, t in sd.items()]
        from tasks.core.models.convert.write import safetensors_header

        header = safetensors_header([(key, "F32", (t.numel(),), t.numel() * 4) for key, t in local])
        with open(dst / f"rank-{rank:05d}.safetensors", "wb") as f:
            f.write(header)
            f.writelines(memoryview(t.reshape(-1).numpy()).cast("B") for _, t in local)
            _fsync(f)
    dist.barrier()
    return {"start": t0, "end": time.time(), "growth_kb": peak.added()[0] // 1024}


def worker(spec: dict) -> dict:
    import torch  # imported before the clock and the RSS baseline

    torch.set_num_threads(1)  # one thread, as a rank has (OMP_NUM_THREADS=1): no intra-op threads spinning

    import tasks.core.models.convert.state_view  # noqa: F401

    def gate():  # every process of a measurement starts its clock together, after its imports
        print("ready", flush=True)
        sys.stdin.readline()
        return HostPeak()  # VmHWM := the current RSS

    src, dst, config, kind = Path(spec["src"]), Path(spec["dst"]), spec["config"], spec["kind"]
    if kind.startswith("dcp-"):
        import torch.distributed as dist

        rank, world = spec["rank"], spec["world"]
        dist.init_process_group(  # a peer that died fails the others' barrier in minutes, not half an hour
            "gloo",
            init_method=f"tcp://127.0.0.1:{spec['port']}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=5),
        )
        try:
            return work_dcp(kind[4:], src, dst, config, spec.get("layout", "tp2dp2"), rank, gate)
        finally:
            dist.destroy_process_group()
    peak = gate()
    t0 = time.time()
    if kind == "copy":
        work_copy(src, dst, config)
    else:
        work_reshard(src, dst, config, spec["layout"], spec.get("writers", 0), spec.get("only"))
    return {"start": t0, "end": time.time(), "growth_kb": peak.added()[0] // 1024}


def run(kind: str, src: Path, dst: Path, config: dict, procs: int = 1, keep: bool = False, **spec) -> dict:
    """`procs` processes of one measurement, started together after their imports: wall seconds from
    the first start to the last end, the largest and the summed peak RSS growth."""
    import socket

    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True, exist_ok=True)
    subprocess.run(["sync"], check=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO / "benchmarks"), str(REPO)))}  # _checkout, support
    ps, ranks = [], spec.pop("ranks", False)
    for r in range(procs):
        one = {"kind": kind, "src": str(src), "dst": str(dst), "config": config, "rank": r, "world": procs}
        one.update(port=port, **spec)
        if ranks:
            one["only"] = r
        ps.append(
            subprocess.Popen(
                [sys.executable, str(REPO / "benchmarks" / "reshard.py"), "--worker", json.dumps(one)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=str(REPO),
                env=env,
            )
        )
    for p in ps:  # each says ready once imported (and, for DCP, its state built)
        line = p.stdout.readline()
        if line.strip() != "ready":
            for q in ps:
                q.kill()
            raise RuntimeError(f"{kind} worker did not start: {line!r}")
    for p in ps:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = []
    for p in ps:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"{kind} worker failed ({p.returncode}): {out[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    if not keep:
        shutil.rmtree(dst, ignore_errors=True)
    return {
        "seconds": max(o["end"] for o in outs) - min(o["start"] for o in outs),
        "growth_kb": max(o["growth_kb"] for o in outs),
        "growth_sum_kb": sum(o["growth_kb"] for o in outs),
    }


def digest(folder: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for f in sorted(folder.glob("rank-*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fin:
            while chunk := fin.read(CHUNK):
                h.update(chunk)
    return h.hexdigest()[:16]


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(worker(json.loads(argv[1]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["50M", "190M", "700M"], choices=[s for s in SIZES if s != "tiny"])
    ap.add_argument("--layouts", nargs="+", default=None, choices=list(LAYOUTS), help="default: all (--smoke: tp2dp2)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each measurement, their median printed")
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama (vocabulary 515: padded tp slices), seconds")
    ap.add_argument("--workdir", type=Path, default=None)
    a = ap.parse_args(argv)
    sizes = ["tiny"] if a.smoke else a.sizes
    a.layouts = a.layouts or (["tp2dp2"] if a.smoke else list(LAYOUTS))
    work = Path(a.workdir or tempfile.mkdtemp(prefix="reshard-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"{'size':<6} {'layout':<7} {'state GB':>9} {'serial s':>9} {'writers s':>10} {'ranks s':>8} {'DCP save s':>11} "
        f"{'DCP load s':>11} {'DCP/writers':>11} {'peak serial GB':>15} {'peak writers GB':>16} {'DCP peak GB':>12} "
        f"{'limit GB':>9} {'bitwise':>8}"
    )
    notes = []
    try:
        for size in sizes:
            config = config_of(size)
            src = work / size / "step-000100"
            shutil.rmtree(work / size, ignore_errors=True)
            facts = write_checkpoint(src, config)
            b = facts["bytes"]
            state = b["masters"] + b["optimizer"]
            limit = facts["largest"] * 12 + 0.5e9
            gb = lambda kb: kb * 1024 / 1e9
            cp = [run("copy", src, work / size / "copied", config) for _ in range(a.repeat)]
            save = [
                run("dcp-save", src, src / "dcp", config, procs=SRC_RANKS, keep=i == a.repeat - 1)
                for i in range(a.repeat)
            ]
            for layout in a.layouts:
                n = math.prod(LAYOUTS[layout])
                out = {m: work / size / f"{layout}-{m}" for m in ("serial", "writers", "ranks", "dcp")}
                res: dict[str, list[dict]] = {m: [] for m in out}
                for i in range(a.repeat):  # interleaved, so a burst of load on the shared machine hits each alike
                    keep = i == a.repeat - 1
                    res["serial"].append(run("reshard", src, out["serial"], config, keep=keep, layout=layout))
                    res["writers"].append(
                        run("reshard", src, out["writers"], config, keep=keep, layout=layout, writers=n)
                    )
                    res["ranks"].append(
                        run("reshard", src, out["ranks"], config, procs=n, keep=keep, layout=layout, ranks=True)
                    )
                    res["dcp"].append(run("dcp-load", src, out["dcp"], config, procs=n, keep=keep, layout=layout))
                same = digest(out["serial"]) == digest(out["writers"]) == digest(out["ranks"])
                if layout == "1":  # one rank: DCP's output holds the same whole tensors in the same order
                    same = same and _payload(out["dcp"]) == _payload(out["serial"])
                ours = median(res["writers"], "seconds")
                print(
                    f"{size:<6} {layout:<7} {state / 1e9:>9.3f} {median(res['serial'], 'seconds'):>9.2f} "
                    f"{median(res['writers'], 'seconds'):>10.2f} {median(res['ranks'], 'seconds'):>8.2f} "
                    f"{median(save, 'seconds'):>11.2f} {median(res['dcp'], 'seconds'):>11.2f} "
                    f"{median(res['dcp'], 'seconds') / ours:>11.2f} {gb(median(res['serial'], 'growth_kb')):>15.3f} "
                    f"{gb(median(res['writers'], 'growth_kb')):>16.3f} {gb(median(res['dcp'], 'growth_kb')):>12.3f} "
                    f"{limit / 1e9:>9.3f} {'yes' if same else 'NO':>8}"
                )
                notes.append(
                    f"{size} {layout}: DCP load / ranks {median(res['dcp'], 'seconds') / median(res['ranks'], 'seconds'):.2f}; "
                    f"ranks' peak growth {gb(median(res['ranks'], 'growth_kb')):.3f} GB a process, "
                    f"{gb(median(res['ranks'], 'growth_sum_kb')):.3f} GB summed; DCP load's summed "
                    f"{gb(median(res['dcp'], 'growth_sum_kb')):.3f} GB"
                )
                for d in out.values():
                    shutil.rmtree(d, ignore_errors=True)
            notes.append(
                f"{size}: {facts['params'] / 1e6:.1f}M parameters; copy {median(cp, 'seconds'):.2f} s; DCP save's peak "
                f"growth {gb(median(save, 'growth_kb')):.3f} GB a rank; masters {b['masters'] / 1e9:.3f} GB, "
                f"{b['masters'] / sum(b.values()):.1%} of the checkpoint"
            )
            shutil.rmtree(work / size, ignore_errors=True)
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(notes))
    print(
        "from low_level_zero ZeRO-2 on 2 ranks to tp2dp2 (hybrid_parallel tp=2 x ZeRO-1 dp=2, 4 ranks) or 1 (one rank); "
        "serial: one process cuts whole tensors into every target file (before); writers (the default): one "
        "process, a thread per target file copying its pieces from the source files; ranks: each target rank "
        "its own process and file; DCP: torch.distributed.checkpoint "
        "save from the 2 source ranks, load into the target ranks' DTensors + each rank's file (every file "
        "fsync'd on both sides); DCP/writers = DCP load s / writers s; seconds and peaks: "
        f"medians of {a.repeat}; limit: the largest tensor's fp32 master and moments + 0.5 GB; bitwise: "
        "writers and ranks wrote serial's bytes (and DCP the same tensors, to one rank)"
    )
    print(f"command: python benchmarks/reshard.py {' '.join(argv)}".rstrip())
    return 0


def _payload(folder: Path) -> bytes:
    """The tensors' bytes of a one-rank output, without the safetensors header (the key names differ)."""
    import hashlib

    from tasks.core.models.convert.source import read_safetensors_header

    f, h = folder / "rank-00000.safetensors", hashlib.sha256()
    with open(f, "rb") as fin:
        fin.seek(read_safetensors_header(f)[0])
        while chunk := fin.read(CHUNK):
            h.update(chunk)
    return h.digest()


if __name__ == "__main__":
    sys.exit(main())
