"""Activation checkpointing: the peak memory per rank with and without it, side by side, and the
losses and weights of both trainings compared, through the engine's own code (Engine: plugin,
boost, train_step), on a small fp32 model on CPU.

    python benchmarks/activation_checkpointing.py            # ~1.5 min on 2 cores: hybrid_parallel tp=2 fp32
    python benchmarks/activation_checkpointing.py --smoke    # seconds: the demo's tiny model, one launch

Each mode is its own torchrun launch (2 ranks), so each rank's peak is its own process's: the peak
resident set (VmHWM, reset through /proc/self/clear_refs when training starts, so loading the model
does not count) and its growth over the resident set at that moment. On CUDA the figure is
torch.cuda.max_memory_allocated instead. The batches are seeded random token ids above the special
tokens (a sequence that starts with the pad token, whose embedding is zero, NaNs a deep model's
gradients: benchmarks/plain_colossalai_train.py says why), the same in both modes.

The rank side (`_ranks`) runs any list of cases in one launch; `cases` launches it and writes every
rank's records to a JSON file, which tests/test_activation_checkpointing.py reads for the loss
equalities under hybrid_parallel (tp=2, pp=2) and low_level_zero:

    python benchmarks/activation_checkpointing.py cases --model DIR --cases hp-tp2-fp32:off,hp-tp2-fp32:on --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support import REPO
from support.tiny import tiny_model
from tasks.core.run.hostpeak import HostPeak

PLUGINS = {
    "hp-tp2-fp32": {"name": "hybrid_parallel", "tp_size": 2, "precision": "fp32"},
    "hp-pp2-fp32": {"name": "hybrid_parallel", "pp_size": 2, "precision": "fp32"},
    "llz2-bf16": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "ddp-fp32": {"name": "torch_ddp", "precision": "fp32"},
}
# The benchmark's model: small weights, long sequences, so activations dominate what training adds.
MODEL = dict(
    hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=704, max_position_embeddings=2048
)
FIRST_ID = 3  # above bos/eos/pad of the demo tokenizer


# -- rank side -------------------------------------------------------------------------------------


def _trim_heap() -> None:
    """Collect, then hand the freed heap back (glibc), so the peak's reset starts low."""
    import gc

    from tasks.core.evaluation.release import trim

    gc.collect()
    trim()


def _weights_digest(model) -> str:
    h = hashlib.sha256()
    module = model.unwrap() if hasattr(model, "unwrap") else model
    for name, t in sorted(module.state_dict().items()):
        if hasattr(t, "detach"):
            h.update(name.encode())
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _case(spec: str, a: argparse.Namespace, work: Path) -> dict:
    import torch
    import torch.distributed as dist

    from tasks.core.run.job import Job
    from tasks.engine.boosted import Engine
    from tasks.engine.faults import Injector

    plugin_key, _, mode = spec.partition(":")
    phase_cfg = {
        "data": {"uri": str(REPO / "data" / "sample" / "cpt.jsonl")},
        "plugin": PLUGINS[plugin_key],
        "launch": {"nproc_per_node": dist.get_world_size()},
        "max_steps": a.steps,
        "micro_batch_size": a.mbs,
        "grad_accum_steps": 2 if "pp2" in plugin_key else 1,
        "seq_len": a.seq_len,
        "lr": 3e-3,
        "warmup_steps": 1,
        "activation_checkpointing": mode == "on",
        "seed": 1234,
    }
    job = Job.model_validate(
        {
            "verb": "train",
            "phase": "cpt",
            "phase_cfg": phase_cfg,
            "trust_remote_code": False,
            "model_dir": str(a.model),
            "tokenizer_dir": str(a.model),
            "stage_dir": str(work / spec.replace(":", "-")),
            "parent": None,
            "config_digest": None,
        }
    )
    rank = dist.get_rank()
    eng = Engine(job, Injector("cpt", job.stage_dir, rank, dist.get_world_size()))
    torch.manual_seed(1234)
    model = eng.load_pretrained()
    vocab = model.config.vocab_size
    eng.boost(model)
    # Decoder-layer forwards started: with checkpointing each starts again in the backward (the
    # recompute, which torch stops early once it has what the backward needs: a pre-hook sees it).
    calls = [0]
    for module in (eng.model.unwrap() if hasattr(eng.model, "unwrap") else eng.model).modules():
        if type(module).__name__.endswith("DecoderLayer"):
            module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    _trim_heap()
    peak = HostPeak()  # VmHWM := the current resident set
    losses, t0 = [], time.monotonic()
    rows = a.mbs * phase_cfg["grad_accum_steps"]
    for step in range(a.steps):
        g = torch.Generator().manual_seed(1000 * step + eng.layout.dp_rank)
        ids = torch.randint(FIRST_ID, vocab, (rows, a.seq_len), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
        micro = [{k: v[i : i + a.mbs] for k, v in batch.items()} for i in range(0, rows, a.mbs)]
        if eng.pcfg.pp_size > 1:  # the pipeline takes the step's rows as one batch and splits them
            micro = [batch]
        losses.append(eng.train_step(micro))
    seconds = time.monotonic() - t0
    added, start = peak.added()
    out = {
        "case": spec,
        "rank": rank,
        "losses": losses,
        "seconds": round(seconds, 2),
        "peak_kib": (added + start) // 1024,
        "start_kib": start // 1024,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "activation_checkpointing": eng.activation_checkpointing,
        "layer_calls": calls[0],
        "weights": _weights_digest(eng.model),
    }
    del eng, model
    return out


def ranks(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="activation_checkpointing.py _ranks")
    p.add_argument("--model", required=True)
    p.add_argument("--cases", required=True, help="comma-separated PLUGIN:on|off, e.g. hp-tp2-fp32:off,hp-tp2-fp32:on")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--out", required=True, help="directory: each rank writes rank-N.json")
    a = p.parse_args(argv)
    import torch

    from tasks.engine import hf_compat

    hf_compat.apply()  # ColossalAI's forwards on the installed transformers
    if not torch.cuda.is_available():
        from tasks.engine import cpu_compat

        cpu_compat.apply()
    os.environ.setdefault("COLUMNS", "200")
    import colossalai
    import torch.distributed as dist
    from colossalai.logging import get_dist_logger

    colossalai.launch_from_torch(seed=1234, verbose=False)
    get_dist_logger().set_level("WARNING")
    work = Path(a.out)
    results = [_case(spec, a, work) for spec in a.cases.split(",")]
    (work / f"rank-{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# -- the parent: launches and the table -------------------------------------------------------------


def launch(
    model: Path, cases: list[str], out: Path, steps: int, seq_len: int, mbs: int, nproc: int = 2, timeout: int = 600
) -> list[dict]:
    """One torchrun launch of `cases`; every rank's records, ordered by case then rank."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        __file__,
        "_ranks",
        "--model",
        str(model),
        "--cases",
        ",".join(cases),
        "--steps",
        str(steps),
        "--seq-len",
        str(seq_len),
        "--mbs",
        str(mbs),
        "--out",
        str(out),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x),
    }
    proc = subprocess.run(
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    recs = [r for f in sorted(out.glob("rank-*.json")) for r in json.loads(f.read_text())]
    return sorted(recs, key=lambda r: (cases.index(r["case"]), r["rank"]))


def compare(recs: list[dict], base: str, other: str) -> dict:
    """Losses and weights of case `other` against case `base`, rank by rank."""
    a = {r["rank"]: r for r in recs if r["case"] == base}
    b = {r["rank"]: r for r in recs if r["case"] == other}
    diffs = [abs(x - y) for rk in a for x, y in zip(a[rk]["losses"], b[rk]["losses"])]
    return {
        "losses_bitwise": all(a[rk]["losses"] == b[rk]["losses"] for rk in a),
        "max_loss_diff": max(diffs) if diffs else None,
        "weights_bitwise": all(a[rk]["weights"] == b[rk]["weights"] for rk in a),
        "losses": a[0]["losses"],
    }


def build_model(out: Path, smoke: bool) -> Path:
    tiny_model(out, seed=0, **({} if smoke else MODEL))
    return out


def run_cases(argv: list[str]) -> int:
    """One launch of the given cases; every rank's records (as `launch` returns them) to OUT/records.json."""
    p = argparse.ArgumentParser(prog="activation_checkpointing.py cases")
    p.add_argument("--model", required=True)
    p.add_argument("--cases", required=True, help="comma-separated PLUGIN:on|off")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args(argv)
    recs = launch(Path(a.model), a.cases.split(","), a.out, a.steps, a.seq_len, a.mbs)
    (a.out / "records.json").write_text(json.dumps(recs, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_ranks":
        return ranks(argv[1:])
    if argv and argv[0] == "cases":
        return run_cases(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--smoke", action="store_true", help="the demo's tiny model, 2 steps of 2 x 64 tokens, both modes in one launch"
    )
    p.add_argument("--plugin", choices=sorted(PLUGINS), default="hp-tp2-fp32")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=4)
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.seq_len, a.mbs = 2, 64, 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ac-bench-") as tmp:
        work = Path(tmp)
        model = build_model(work / "model", a.smoke)
        cases = [f"{a.plugin}:off", f"{a.plugin}:on"]
        if a.smoke:
            recs = launch(model, cases, work / "both", a.steps, a.seq_len, a.mbs)
        else:  # one process per mode: a rank's peak is then that mode's alone
            recs = [
                r
                for i, c in enumerate(cases)
                for r in launch(model, [c], work / f"mode-{i}", a.steps, a.seq_len, a.mbs)
            ]
    cmp = compare(recs, cases[0], cases[1])
    print(
        f"activation checkpointing, {a.plugin} on {len({r['rank'] for r in recs})} CPU ranks, {a.steps} steps of "
        f"{a.mbs} x {a.seq_len} tokens, model {'demo tiny' if a.smoke else MODEL}"
    )
    print(f"{'rank':>4} | {'mode':>4} | {'peak RSS MiB':>12} | {'growth in training MiB':>22} | {'step s':>6}")
    for r in recs:
        mode = r["case"].split(":")[1]
        peak = r["cuda_peak_bytes"] / 2**20 if r["cuda_peak_bytes"] else r["peak_kib"] / 1024
        grow = (r["peak_kib"] - r["start_kib"]) / 1024
        print(f"{r['rank']:>4} | {mode:>4} | {peak:12.1f} | {grow:22.1f} | {r['seconds'] / a.steps:6.2f}")
    for rank in sorted({r["rank"] for r in recs}):
        off, on = (next(r for r in recs if r["rank"] == rank and r["case"] == c) for c in cases)
        print(
            f"rank {rank}: growth {(off['peak_kib'] - off['start_kib']) / 1024:.1f} -> {(on['peak_kib'] - on['start_kib']) / 1024:.1f} "
            "MiB "
            f"({(on['peak_kib'] - on['start_kib']) / max(1, off['peak_kib'] - off['start_kib']):.2f}x), peak "
            f"{off['peak_kib'] / 1024:.0f} -> {on['peak_kib'] / 1024:.0f} MiB, step time {on['seconds'] / max(off['seconds'], 1e-9):.2f}x"
        )
    print(
        f"losses {'bitwise equal' if cmp['losses_bitwise'] else 'max |diff| ' + format(cmp['max_loss_diff'], '.3g')}: "
        f"{cmp['losses']}; "
        f"final weights {'bitwise equal' if cmp['weights_bitwise'] else 'DIFFER'}"
    )
    print(
        f"command: python benchmarks/activation_checkpointing.py {' '.join(argv)}".rstrip()
        + f"   ({time.monotonic() - t0:.0f} s)"
    )
    return 0 if cmp["losses_bitwise"] or (cmp["max_loss_diff"] or 0) < 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
