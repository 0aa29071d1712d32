"""Long context on 2 CPU ranks: the longest seq_len that trains under a per-rank memory cap, without and with
each sequence-parallel mode that runs on CPU, and the step time per token at one length, side by side.

    python benchmarks/long_context.py                 # ~13 min on 2 cores: 4 launches, seq_len doubling from 1k
    python benchmarks/long_context.py --smoke         # ~1.5 min: the demo's tiny model, one launch, 256 and 512 tokens

Layouts (hybrid_parallel, fp32, micro_batch_size 1, 2 ranks): `dp2` (each rank a whole sequence),
`tp2` (tensor parallelism, no sequence split), `split_gather` (tp=2, the sequence split between the tp
regions) and `all_to_all` (sp=2: each rank half of the sequence). ring is refused (wrong gradients in
ColossalAI 0.5.0), ring_attn needs CUDA (tasks/core/config/sequence.py says why).

Each layout is its own torchrun launch (a rank's peak is then that layout's alone) and goes through the
engine's own code (Engine: plugin, boost, train_step). For each seq_len it trains one step on seeded random
tokens and reads the rank's peak resident set (VmHWM, reset through /proc/self/clear_refs once the model is
built and boosted): the "training memory" is that peak's growth over the resident set at the reset
(activations, gradients, Adam moments). Doubling stops at the first length over the cap; the longest under it
is the layout's. Step time per token: a second step at `--time-len` tokens, divided by the tokens the step
trains over all ranks (dp2 trains two sequences a step, the others one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support import REPO  # the checkout first on sys.path (support/__init__.py)

HP = {"name": "hybrid_parallel", "precision": "fp32"}
LAYOUTS = {
    "dp2": HP,
    "tp2": {**HP, "tp_size": 2},
    "split_gather": {**HP, "tp_size": 2, "sequence_parallelism": {"mode": "split_gather"}},
    "all_to_all": {**HP, "sequence_parallelism": {"mode": "all_to_all", "size": 2}},
}
# Small weights, so what grows with the context (activations) decides; 4 heads, 2 KV heads: sp=2 divides both.
MODEL = dict(
    hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=704, max_position_embeddings=65536
)
FIRST_ID = 3  # above bos/eos/pad of the demo tokenizer


# -- rank side -------------------------------------------------------------------------------------


def _trim() -> None:
    """Collect, then hand the freed heap back (glibc), so the span starts low."""
    import gc

    from tasks.core.evaluation.release import trim

    gc.collect()
    trim()


def _engine(layout: str, seq_len: int, model: Path, work: Path):
    import torch.distributed as dist

    from tasks.core.run.job import Job
    from tasks.engine.boosted import Engine
    from tasks.engine.faults import Injector

    phase_cfg = {
        "data": {"uri": str(REPO / "data" / "sample" / "cpt.jsonl")},
        "plugin": LAYOUTS[layout],
        "launch": {"nproc_per_node": dist.get_world_size()},
        "max_steps": 100,
        "micro_batch_size": 1,
        "seq_len": seq_len,
        "lr": 1e-3,
        "warmup_steps": 1,
        "seed": 1234,
    }
    job = Job.model_validate(
        {
            "verb": "train",
            "phase": "cpt",
            "phase_cfg": phase_cfg,
            "trust_remote_code": False,
            "model_dir": str(model),
            "tokenizer_dir": str(model),
            "stage_dir": str(work / layout),
            "parent": None,
            "config_digest": None,
        }
    )
    eng = Engine(job, Injector("cpt", job.stage_dir, dist.get_rank(), dist.get_world_size()))
    eng.boost(eng.load_pretrained())
    return eng


def _step(eng, seq_len: int, seed: int) -> float:
    import torch

    vocab = eng.config.vocab_size
    g = torch.Generator().manual_seed(seed * 1000 + eng.layout.dp_rank)
    ids = torch.randint(FIRST_ID, vocab, (1, seq_len), generator=g)
    t0 = time.monotonic()
    eng.train_step([{"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}])
    return time.monotonic() - t0


def ranks(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="long_context.py _ranks")
    p.add_argument("--model", required=True)
    p.add_argument("--layouts", required=True)
    p.add_argument("--lens", required=True, help="comma-separated seq_lens, tried in order")
    p.add_argument("--cap-mib", type=float, required=True)
    p.add_argument("--time-len", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import torch

    from tasks.engine import hf_compat

    hf_compat.apply()  # ColossalAI's forwards on the installed transformers
    if not torch.cuda.is_available():
        from tasks.engine import cpu_compat

        cpu_compat.apply()
    import colossalai
    import torch.distributed as dist
    from colossalai.logging import get_dist_logger

    from tasks.core.run.hostpeak import HostPeak

    colossalai.launch_from_torch(seed=1234, verbose=False)
    get_dist_logger().set_level("WARNING")
    work, records = Path(a.out), []
    for layout in a.layouts.split(","):
        lens = [int(x) for x in a.lens.split(",")]
        eng = _engine(layout, max(lens + [a.time_len]), Path(a.model), work)
        trials = []
        for i, n in enumerate(lens):
            _trim()
            peak = HostPeak()  # VmHWM := the current resident set
            seconds = _step(eng, n, i)
            grown = torch.tensor([peak.added()[0] / 2**20], dtype=torch.float64)
            dist.all_reduce(grown, op=dist.ReduceOp.MAX)  # the largest rank decides
            trials.append({"seq_len": n, "growth_mib": round(grown.item(), 1), "step_s": round(seconds, 3)})
            if grown.item() > a.cap_mib:
                break
        _step(eng, a.time_len, 98)  # warm: the optimizer state exists, buffers sized
        step_s = _step(eng, a.time_len, 99)
        rows = eng.layout.dp_size  # sequences one step trains over all ranks
        records.append({"layout": layout, "trials": trials, "time_len": a.time_len, "step_s": step_s, "rows": rows})
        del eng
    if dist.get_rank() == 0:
        (work / "records.json").write_text(json.dumps(records, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# -- the parent: launches and the table -------------------------------------------------------------


def launch(model: Path, layouts: list[str], lens: list[int], cap_mib: float, time_len: int, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__, "_ranks"]
    argv += ["--model", str(model), "--layouts", ",".join(layouts), "--lens", ",".join(map(str, lens))]
    argv += ["--cap-mib", str(cap_mib), "--time-len", str(time_len), "--out", str(out)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": "false",
        # large tensors mapped on their own: freed activations leave the resident set, so each trial starts low
        "MALLOC_MMAP_THRESHOLD_": "131072",
        "PYTHONPATH": os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x),
    }
    proc = subprocess.run(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return json.loads((out / "records.json").read_text())


def longest(rec: dict, cap_mib: float) -> dict | None:
    fits = [t for t in rec["trials"] if t["growth_mib"] <= cap_mib]
    return fits[-1] if fits else None


def report(recs: list[dict], cap_mib: float, model: str) -> list[str]:
    base = {r["layout"]: r for r in recs}
    ref = longest(base["dp2"], cap_mib) if "dp2" in base else None
    ref_tpt = base["dp2"]["step_s"] / (base["dp2"]["rows"] * base["dp2"]["time_len"]) if "dp2" in base else None
    lines = [
        (
            f"long context on 2 CPU ranks, fp32, micro_batch_size 1, model {model}; cap {cap_mib:g} MiB of training "
            "memory a rank"
        ),
        (
            f"{'layout':>12} | {'longest seq_len':>15} | {'vs dp2':>6} | {'MiB at it':>9} | {'next (MiB)':>14} | "
            f"{'ms/token at ' + str(recs[0]['time_len']):>16} | {'vs dp2':>6}"
        ),
    ]
    for r in recs:
        best = longest(r, cap_mib)
        over = next((t for t in r["trials"] if t["growth_mib"] > cap_mib), None)
        tpt = r["step_s"] / (r["rows"] * r["time_len"])
        ratio = f"{best['seq_len'] / ref['seq_len']:.2f}x" if best and ref else "-"
        nxt = f"{over['seq_len']:,} ({over['growth_mib']:.0f})" if over else "not reached"
        lines.append(
            f"{r['layout']:>12} | {best['seq_len'] if best else 0:>15,} | {ratio:>6} | "
            f"{best['growth_mib'] if best else 0:>9.0f} | "
            f"{nxt:>14} | "
            f"{tpt * 1e3:>16.3f} | {(f'{tpt / ref_tpt:.2f}x' if ref_tpt else '-'):>6}"
        )
    for r in recs:
        lines.append(
            f"  {r['layout']}: " + ", ".join(f"{t['seq_len']}: {t['growth_mib']:.0f} MiB" for t in r["trials"])
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_ranks":
        return ranks(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the demo's tiny model, 256 and 512 tokens, one launch")
    p.add_argument("--cap-mib", type=float, default=400.0, help="training memory a rank may grow by")
    p.add_argument("--start", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=65536)
    p.add_argument("--time-len", type=int, default=2048, help="the equal length the step time is measured at")
    p.add_argument("--save", help="write the printed table to this file as well")
    a = p.parse_args(argv)
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    t0 = time.monotonic()
    lens = [256, 512] if a.smoke else [a.start << i for i in range(20) if a.start << i <= a.max_len]
    time_len = 256 if a.smoke else a.time_len
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(
            work / "model", build_tokenizer(DEFAULT_CORPUS, vocab_size=512), **({} if a.smoke else MODEL)
        )
        if a.smoke:
            recs = launch(model, list(LAYOUTS), lens, a.cap_mib, time_len, work / "all")
        else:  # one process per layout: a rank's peak is that layout's alone
            recs = [r for n in LAYOUTS for r in launch(model, [n], lens, a.cap_mib, time_len, work / n)]
    lines = report(recs, a.cap_mib, "demo tiny" if a.smoke else str(MODEL))
    lines.append(
        f"command: python benchmarks/long_context.py {' '.join(argv)}".rstrip() + f"   ({time.monotonic() - t0:.0f} s)"
    )
    print("\n".join(lines))
    if a.save:
        Path(a.save).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
