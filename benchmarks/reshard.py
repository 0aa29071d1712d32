"""A resume's optimizer state under a new layout: the engine's restore path beside PyTorch Distributed
Checkpoint's (DCP) default reader and its safetensors reader, in memory and from cold files.

    .venv/bin/python benchmarks/reshard.py --smoke                    # a tiny Llama, to tp2dp2, one run
    .venv/bin/python benchmarks/reshard.py --sizes 190M --repeat 3    # medians of 3, every layout
    .venv/bin/python benchmarks/reshard.py --sizes 50M 190M 700M      # ~10 GB of disk at 700M

For each size it writes one checkpoint in the engine's format as a low_level_zero ZeRO-2 bf16 stage on
2 ranks leaves it (model/; optimizer/ ColossalAI's pickled blocks of whole AdamW states, `save_shard_mib`
each, index and parameter groups; masters/ each rank's fp32 flat shards and records, by masters.py's own
writer), random values. DCP's user saves the same state (fp32 masters, both moments) from 2 source ranks
holding its rows as DTensors with DCP's writers: `FileSystemWriter` and
`HuggingFaceStorageWriter(save_distributed=True)` (safetensors, a file per source rank). Then to each
target layout (tp2dp2: hybrid_parallel tp=2 x ZeRO-1 dp=2, 4 ranks; 2: the source's own; 1: one rank),
a process per target rank runs each side in turn, a side's processes starting their clocks together
after their set-up, in memory (files in the page cache), then cold (every side's files evicted first:
`sync`, `posix_fadvise(DONTNEED)` a file, what stays resident counted by `fincore`; dropping the whole
machine's caches would take the other users' too):
  engine: Engine.load's reads after the weights, the same functions (tasks/engine/state_read.py
          `load_optimizer`, masters.py `restore`) on a torch AdamW over this rank's fp32 master shares:
          AdamW's state allocated and read as this rank's pieces on `read_threads()` threads, masters over;
  before: the engine's path until now: ColossalAI's optimizer loader's reads (every optimizer file
          `torch.load`ed whole on every rank, each state cut and cloned), masters a piece at a time;
  dcp:    `dcp.load` into the rank's DTensors (tp slice, then rows over dp: DTensor has no flat ZeRO
          placement) with `FileSystemReader`; dcp-hf: with `HuggingFaceStorageReader(thread_count=2)`.
Every side has its masters (zeroed) before the clock and allocates the moments inside it, as a restore
into a fresh optimizer does; nothing is written. It prints wall seconds (first start to last end), DCP's
over the engine's, the largest process's peak RSS growth against the largest tensor's three fp32 states
+ 0.5 GB, and bitwise: each engine rank holds `local_piece` of the whole (ColossalAI's loaders' cut), and
DCP's readers read the same bytes.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
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

_L = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
SIZES = {  # the shapes of benchmarks/scale.py
    "50M": dict(zip(_L, (512, 8, 8, 4, 1376)), vocab_size=32000),
    "190M": dict(zip(_L, (1024, 11, 16, 8, 2560)), vocab_size=32000),
    "700M": dict(zip(_L, (1536, 24, 16, 8, 4096)), vocab_size=32000),
    "tiny": dict(zip(_L, (64, 2, 4, 2, 128)), vocab_size=515),
}
SRC_RANKS = 2
KEYS = ("master", "exp_avg", "exp_avg_sq")
LAYOUTS = {"tp2dp2": (2, 2), "2": (1, 2), "1": (1, 1)}  # (tp, ZeRO dp): ranks = tp * dp, rank = tp_rank * dp + dp_rank
SIDES = ("engine", "before", "dcp", "dcp-hf")
HF_THREADS = 2
GROUPS = "pytorch_optim_group.bin"


def config_of(size: str) -> dict:
    return {"model_type": "llama", "tie_word_embeddings": False, "torch_dtype": "bfloat16", **SIZES[size]}


def write_checkpoint(out: Path, config: dict) -> dict:
    """The checkpoint as a 2-rank ZeRO-2 bf16 stage leaves it; its byte counts."""
    import torch
    from safetensors.torch import save_file

    from tasks.core.models.convert.state_view import MASTERS, OPTIM_INDEX, Piece, rank_record_name, rank_tensor_name
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
    # the parameter groups as ColossalAI saves them: AdamW's, the params by id
    groups = torch.optim.AdamW([torch.zeros(1)], lr=1e-4, weight_decay=0.1).state_dict()["param_groups"]
    groups[0]["params"] = list(range(len(tensors)))
    torch.save(groups, out / "optimizer" / GROUPS)
    (out / "model" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    index = {"metadata": {"param_groups": GROUPS}, "weight_map": opt_map}
    (out / "optimizer" / OPTIM_INDEX).write_text(json.dumps(index))
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


def tp_dims(config: dict) -> dict:
    """Each tensor's dim that tensor parallelism splits (None: kept whole on every tp rank)."""
    from tasks.core.models.families import TP_SPLIT_DIMS, iter_tensors

    return {
        key: next((d for d, sym in enumerate(rule.shape) if sym in TP_SPLIT_DIMS), None)
        for key, rule, _, _ in iter_tensors(config)
    }


def target_pieces(view, config: dict, tp: int, dp: int, rank: int) -> list:
    """Target rank `rank`'s piece of every parameter for tp x ZeRO dp (what masters.collect records there)."""
    from tasks.core.models.convert.state_view import Piece

    dims = tp_dims(config)
    t, z = divmod(rank, dp)
    out = []
    for name in view.names():
        shape = view.pieces(name)[0].shape
        d = dims[name] if tp > 1 else None
        local = list(shape)
        if d is not None:
            local[d] = -(-shape[d] // tp)
        length = -(-math.prod(local) // dp)
        tp_rank = t if d is not None else 0
        out.append(
            Piece(name, view.ids[name], shape, tuple(local), d, tp_rank, tp if d is not None else 1, z * length, length)
        )
    return out


def placements_of(config: dict, name: str, tp: int) -> list:
    from torch.distributed.tensor import Replicate, Shard

    d = tp_dims(config)[name]
    return [Shard(d) if d is not None and tp > 1 else Replicate(), Shard(0)]


def digest_of(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()[:16]


# -- the sides: each a set-up (before the clock) and a run (timed); a run returns what it read ----------


def setup_engine(spec: dict) -> dict:
    """A torch AdamW over this rank's fp32 master shares, zeroed (what a boosted optimizer holds before
    its load), and masters.collect's records of them."""
    from types import SimpleNamespace

    import torch

    from tasks.core.models.convert.state_view import CheckpointState
    from tasks.engine.masters import Local

    view = CheckpointState(spec["src"])
    pieces = target_pieces(view, spec["config"], *LAYOUTS[spec["layout"]], spec["rank"])
    view.close()
    held = []
    for p in pieces:
        q = torch.zeros(p.length)
        held.append(Local(p, q, q, None, q, p))
    opt = torch.optim.AdamW([loc.param for loc in held], lr=1e-4, weight_decay=0.1)
    eng = SimpleNamespace(optimizer=opt, cfg=SimpleNamespace(lora=None), weights_dtype="bf16", rank=spec["rank"])
    return {"eng": eng, "held": held}


def run_engine(spec: dict, eng, held) -> list:
    """Engine.load's reads after the weights: state_read.load_optimizer, then masters.restore, on one view."""
    from tasks.core.models.convert.state_view import CheckpointState
    from tasks.engine import masters, state_read

    src = Path(spec["src"])
    view = CheckpointState(src)
    try:
        if not state_read.load_optimizer(eng, src, view, held):
            raise RuntimeError("state_read.load_optimizer did not apply to this checkpoint")
        masters.restore(eng, src, held=held, view=view)
    finally:
        view.close()
    state = eng.optimizer.state
    return [t for loc in held for t in (loc.master, state[loc.param]["exp_avg"], state[loc.param]["exp_avg_sq"])]


def run_before(spec: dict, eng, held) -> list:
    """The engine's path until now: ColossalAI's loader's reads (every optimizer file loaded whole, each
    state cut to this rank's share and cloned), then each master read by read_piece, one at a time."""
    import torch

    from tasks.core.models.convert.state_view import OPTIM_INDEX, CheckpointState, local_piece

    src = Path(spec["src"])
    view = CheckpointState(src)
    by_id = {loc.piece.id: loc for loc in held}
    moments = {}
    files = sorted(set(json.loads((src / "optimizer" / OPTIM_INDEX).read_text())["weight_map"].values()))
    for f in files:
        block = torch.load(src / "optimizer" / f, map_location="cpu", weights_only=True)
        for pid, st in block.items():
            p = by_id[pid].piece
            moments[pid] = [local_piece(st[k].reshape(p.shape), p) for k in ("exp_avg", "exp_avg_sq")]
        del block
    for loc in held:
        loc.master.copy_(view.read_piece(loc.piece.name, "master", loc.piece))
    view.close()
    return [t for loc in held for t in (loc.master, *moments[loc.piece.id])]


def setup_dcp(spec: dict) -> dict:
    """The target layout's device mesh and this rank's master DTensors' local tensors, zeroed."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from tasks.core.models.convert.state_view import CheckpointState

    tp, dp = LAYOUTS[spec["layout"]]
    mesh = init_device_mesh("cpu", (tp, dp))
    view = CheckpointState(spec["src"])
    metas = []
    for name in view.names():
        shape = view.pieces(name)[0].shape
        placements = placements_of(spec["config"], name, tp)
        local, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
        metas.append((name, shape, placements, local, torch.zeros(local)))
    view.close()
    return {"mesh": mesh, "metas": metas}


def run_dcp(spec: dict, mesh, metas, hf: bool) -> list:
    """dcp.load into this rank's DTensors: the masters', and the moments' allocated here."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.tensor import DTensor

    sd, out = {}, []
    for name, shape, placements, local, master in metas:
        stride = torch.empty(shape, device="meta").stride()
        for k in KEYS:
            t = master if k == "master" else torch.empty(local)
            sd[f"{name}.{k}"] = DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
            out.append(t)
    src = Path(spec["src"])
    reader = (
        HuggingFaceStorageReader(str(src / "hf"), thread_count=HF_THREADS)
        if hf
        else dcp.FileSystemReader(str(src / "dcp"))
    )
    dcp.load(sd, storage_reader=reader)
    return out


def setup_save(spec: dict) -> dict:
    """The source ranks' rows of every state as DTensors (a ZeRO-2 rank holds as many bytes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from tasks.core.models.convert.state_view import CheckpointState

    mesh = init_device_mesh("cpu", (SRC_RANKS,))
    view = CheckpointState(spec["src"])
    sd = {}
    for name in view.names():
        whole = {"master": view.master(name), **{k: v for k, v in view.adam(name).items() if k != "step"}}
        for k in KEYS:  # src_data_rank=None: each rank keeps its own slice of the same values, no messages
            t = distribute_tensor(whole[k].float(), mesh, [Shard(0)], src_data_rank=None)
            sd[f"{name}.{k}"] = DTensor.from_local(
                t.to_local().clone(), mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride()
            )
    view.close()
    del whole
    return {"sd": sd}


def run_save(spec: dict, sd, hf: bool) -> None:
    """DCP's save as its user calls it: its default writer, or its safetensors writer a file per rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    src = Path(spec["src"])
    writer = (
        HuggingFaceStorageWriter(str(src / "hf"), save_distributed=True)
        if hf
        else dcp.FileSystemWriter(str(src / "dcp"))
    )
    dcp.save(sd, storage_writer=writer)


SETUP = {"engine": setup_engine, "before": setup_engine, "dcp": setup_dcp, "dcp-hf": setup_dcp}
SETUP.update({"save-dcp": setup_save, "save-hf": setup_save})
RUN = {
    "engine": run_engine,
    "before": run_before,
    "dcp": lambda spec, **s: run_dcp(spec, **s, hf=False),
    "dcp-hf": lambda spec, **s: run_dcp(spec, **s, hf=True),
    "save-dcp": lambda spec, **s: run_save(spec, **s, hf=False),
    "save-hf": lambda spec, **s: run_save(spec, **s, hf=True),
}


def say(obj) -> None:
    print("@@ " + json.dumps(obj), flush=True)  # the only stdout lines the parent reads


def worker(spec: dict) -> None:
    import gc

    import torch  # imported before the clocks and the RSS baselines

    torch.set_num_threads(1)  # one intra-op thread, as a rank has (OMP_NUM_THREADS=1)
    import torch.distributed as dist
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.hf_storage

    import tasks.engine.masters
    import tasks.engine.state_read  # noqa: F401 - every import before the first clock

    dist.init_process_group(  # a peer that died fails the others' collectives in minutes, not half an hour
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=spec["rank"],
        world_size=spec["world"],
        timeout=datetime.timedelta(minutes=5),
    )
    try:
        for side in spec["sides"]:
            state = SETUP[side](spec)
            say("ready")
            sys.stdin.readline()
            peak = HostPeak()  # VmHWM := the current RSS
            t0 = time.time()
            got = RUN[side](spec, **state)
            t1 = time.time()
            grew = peak.added()[0] // 1024
            say({"start": t0, "end": t1, "growth_kb": grew, "digest": None if got is None else digest_of(got)})
            del state, got
            gc.collect()
    finally:
        dist.destroy_process_group()


def evict(dirs: list[Path]) -> int:
    """Every file under `dirs` out of the page cache (written back first); the bytes still resident."""
    subprocess.run(["sync"], check=False)
    files = [str(f) for d in dirs if d.is_dir() for f in sorted(d.rglob("*")) if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    res = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *files], check=False, capture_output=True, text=True
    )
    return sum(int(x) for x in res.stdout.split()) if res.returncode == 0 else -1


def launch(spec: dict, procs: int, steps: list[tuple[str, bool]], evict_dirs: list[Path]) -> list[dict]:
    """`procs` worker processes running `steps` ((side, cold) pairs) in turn, each side's processes
    released together after their set-up (a cold side's files evicted first); per step the wall seconds
    (first start to last end), the largest and summed RSS growth, each rank's digest, bytes left resident."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join((str(REPO / "benchmarks"), str(REPO))),  # _checkout, support
        "LOCAL_WORLD_SIZE": str(procs),  # what torchrun tells a rank: state_read.read_threads() shares the cores
        "OMP_NUM_THREADS": "1",
    }
    ps = []
    for r in range(procs):
        one = {**spec, "rank": r, "world": procs, "port": port, "sides": [side for side, _ in steps]}
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

    def read(p) -> object:
        while line := p.stdout.readline():
            if line.startswith("@@ "):
                return json.loads(line[3:])
        for q in ps:
            q.kill()
        raise RuntimeError(f"a {spec['layout']} worker ended early (exit {p.wait()}); its stderr is above")

    results = []
    try:
        for side, cold in steps:
            for p in ps:
                if read(p) != "ready":
                    raise RuntimeError(f"{side}: a worker did not say ready")
            resident = evict(evict_dirs) if cold else None
            for p in ps:
                p.stdin.write("go\n")
                p.stdin.flush()
            outs = [read(p) for p in ps]
            results.append(
                {
                    "side": side,
                    "cold": cold,
                    "seconds": max(o["end"] for o in outs) - min(o["start"] for o in outs),
                    "growth_kb": max(o["growth_kb"] for o in outs),
                    "growth_sum_kb": sum(o["growth_kb"] for o in outs),
                    "digests": [o["digest"] for o in outs],
                    "resident": resident,
                }
            )
    finally:
        for p in ps:
            p.stdin.close()
            if p.wait(timeout=600):
                raise RuntimeError(f"a {spec['layout']} worker failed ({p.returncode}); its stderr is above")
    return results


def expected(src: Path, config: dict, layout: str) -> list[str]:
    """Each target rank's digest of `local_piece` of the whole states: the cut ColossalAI's loaders make."""
    from tasks.core.models.convert.state_view import CheckpointState, local_piece

    view = CheckpointState(src)
    tp, dp = LAYOUTS[layout]
    ranks = [target_pieces(view, config, tp, dp, r) for r in range(tp * dp)]
    hs = [hashlib.sha256() for _ in ranks]
    for i, name in enumerate(view.names()):
        whole = {"master": view.master(name), **{k: v for k, v in view.adam(name).items() if k != "step"}}
        for r, pieces in enumerate(ranks):
            for k in KEYS:
                hs[r].update(local_piece(whole[k].float(), pieces[i]).numpy().tobytes())
    view.close()
    return [h.hexdigest()[:16] for h in hs]


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


HEAD = (
    f"{'size':<6} {'layout':<7} {'state GB':>9} {'engine s':>9} {'before s':>9} {'DCP s':>7} {'DCP-HF s':>9} "
    f"{'cold: engine s':>15} {'before s':>9} {'DCP s':>7} {'DCP-HF s':>9} {'DCP/engine':>11} {'DCP-HF/engine':>14} "
    f"{'cold DCP-HF/engine':>19} {'peak engine GB':>15} {'peak DCP GB':>12} {'peak DCP-HF GB':>15} {'limit GB':>9} "
    f"{'bitwise':>8}"
)


def measure_layout(size: str, layout: str, src: Path, config: dict, repeat: int) -> tuple[str, str]:
    """Every side to one target layout, alternated, `repeat` times: its table row and its note."""
    n = math.prod(LAYOUTS[layout])
    runs: dict[tuple[str, bool], list[dict]] = {}
    dirs = [src / "masters", src / "optimizer", src / "dcp", src / "hf"]
    for i in range(repeat):  # each repeat a fresh set of processes, the sides in a rotated order
        order = SIDES[i % len(SIDES) :] + SIDES[: i % len(SIDES)]
        steps = [(side, cold) for cold in (False, True) for side in order]
        for res in launch({"src": str(src), "config": config, "layout": layout}, n, steps, dirs):
            runs.setdefault((res["side"], res["cold"]), []).append(res)
    want = expected(src, config, layout)
    last = {key: rs[-1]["digests"] for key, rs in runs.items()}
    same = all(last[side, cold] == want for side in ("engine", "before") for cold in (False, True))
    same = same and last["dcp", False] == last["dcp-hf", False] == last["dcp", True] == last["dcp-hf", True]
    if layout == "1":  # one rank: DCP's whole tensors are the engine's, byte for byte
        same = same and last["dcp", False] == want
    s = lambda side, cold=False: median(runs[side, cold], "seconds")
    gb = lambda side: median(runs[side, False], "growth_kb") * 1024 / 1e9
    row = (
        f"{s('engine'):>9.2f} {s('before'):>9.2f} {s('dcp'):>7.2f} {s('dcp-hf'):>9.2f} {s('engine', True):>15.2f} "
        f"{s('before', True):>9.2f} {s('dcp', True):>7.2f} {s('dcp-hf', True):>9.2f} {s('dcp') / s('engine'):>11.2f} "
        f"{s('dcp-hf') / s('engine'):>14.2f} {s('dcp-hf', True) / s('engine', True):>19.2f} {gb('engine'):>15.3f} "
        f"{gb('dcp'):>12.3f} {gb('dcp-hf'):>15.3f}"
    )
    resident = max(r["resident"] for (_, cold), rs in runs.items() if cold for r in rs)
    note = (
        f"{size} {layout}: {n} rank(s); summed peak growth engine {median(runs['engine', False], 'growth_sum_kb') / 1e6 * 1.024:.3f} GB, "
        f"DCP {median(runs['dcp', False], 'growth_sum_kb') / 1e6 * 1.024:.3f} GB, DCP-HF "
        f"{median(runs['dcp-hf', False], 'growth_sum_kb') / 1e6 * 1.024:.3f} GB; cold: at most {resident / 1e6:.1f} MB "
        f"of the files still resident after the eviction"
    )
    return row + f" {{limit}} {'yes' if same else 'NO':>8}", note


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(json.loads(argv[1]))
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
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the start")
    print(HEAD)
    notes = []
    try:
        for size in sizes:
            config = config_of(size)
            src = work / size / "step-000100"
            shutil.rmtree(work / size, ignore_errors=True)
            facts = write_checkpoint(src, config)
            b = facts["bytes"]
            limit = (facts["largest"] * 12 + 0.5e9) / 1e9
            saves = launch(
                {"src": str(src), "config": config, "layout": "src"},
                SRC_RANKS,
                [("save-dcp", False), ("save-hf", False)],
                [],
            )
            for layout in a.layouts:
                row, note = measure_layout(size, layout, src, config, a.repeat)
                state = (b["masters"] + b["optimizer"]) / 1e9
                print(f"{size:<6} {layout:<7} {state:>9.3f} " + row.replace("{limit}", f"{limit:>9.3f}"), flush=True)
                notes.append(note)
            notes.append(
                f"{size}: {facts['params'] / 1e6:.1f}M parameters; DCP's saves from the 2 source ranks (once, not "
                f"compared): default {saves[0]['seconds']:.2f} s, safetensors {saves[1]['seconds']:.2f} s; masters "
                f"{b['masters'] / 1e9:.3f} GB, {b['masters'] / sum(b.values()):.1%} of the checkpoint"
            )
            shutil.rmtree(work / size, ignore_errors=True)
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(notes))
    print(
        "from low_level_zero ZeRO-2 on 2 ranks to tp2dp2 (hybrid_parallel tp=2 x ZeRO-1 dp=2, 4 ranks), 2 (the same "
        "layout) or 1 (one rank), a process per target rank; engine: tasks/engine/state_read.py load_optimizer + "
        "masters.restore (Engine.load's reads after the weights); before: ColossalAI's optimizer loader's reads + "
        f"masters read one at a time; DCP: torch.distributed.checkpoint FileSystemReader; DCP-HF: its "
        f"HuggingFaceStorageReader(thread_count={HF_THREADS}); in memory, then cold (files evicted from the page "
        f"cache); seconds and peaks: medians of {a.repeat}; peak: the largest process's RSS growth; limit: the largest "
        "tensor's fp32 master and moments + 0.5 GB; bitwise: engine and before hold local_piece of the whole states, "
        "DCP's readers the same bytes as each other (and, to one rank, as the engine)"
    )
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    print(f"command: python benchmarks/reshard.py {' '.join(argv)}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
