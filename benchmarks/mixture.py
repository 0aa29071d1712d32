"""A weighted mixture against the same files as one source, side by side in one run, on CPU.

    .venv/bin/python benchmarks/mixture.py            # 3 sources, 34 MB in all, 2000 steps of 32 blocks: about a minute
    .venv/bin/python benchmarks/mixture.py --smoke    # the same path and table at tiny sizes: seconds

Data: three generated CPT sources of different sizes (`big`, `mid`, `small`, each a few JSONL
files of random words), weights 0.6 / 0.3 / 0.1, tokenized by the project's own prepare step
(`tasks.core.data.prepare`, the demo tokenizer, a process pool of 2 workers) and read by the
engine's own `tasks.engine.loop.StageData` (one rank, torch_ddp's layout), so every figure is the
path a training rank runs.

Measured, each mode from a fresh output directory (no shard cache), alternated, best of `--repeat`:
- realized token shares over the planned steps: counted from the blended stream itself (each item
  id mapped to its source), against the weights;
- prepare time: the three sources as a mixture vs the same files as one concatenated source;
- data start-up (StageData built and its first batch) and per-step data time (median of the
  next `--probe-steps` batches), mixture vs the single source.

Targets: every share within 1 % absolute of its weight; start-up and per-step data
time <= 1.05x the single source.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)
import numpy as np

from support.bench import workdir
from support.tiny import tiny_tokenizer

WORDS = (
    "the",
    "model",
    "data",
    "train",
    "token",
    "batch",
    "sample",
    "loss",
    "learn",
    "court",
    "ruling",
    "statute",
    "appeal",
    "protein",
    "enzyme",
    "cell",
    "orbit",
    "planet",
    "river",
    "market",
    "price",
    "city",
    "engine",
    "signal",
)
WEIGHTS = {"big": 0.6, "mid": 0.3, "small": 0.1}


def make_source(d: Path, mb: float, files: int, seed: int) -> str:
    """`files` JSONL files of random-word documents, about `mb` MB in all."""
    import json

    rng = np.random.RandomState(seed)
    d.mkdir(parents=True)
    per = int(mb * 1e6 / files)
    for f in range(files):
        with open(d / f"part-{f:03d}.jsonl", "w") as out:
            written = 0
            while written < per:
                line = json.dumps({"text": " ".join(rng.choice(WORDS, int(rng.randint(40, 400))))}) + "\n"
                out.write(line)
                written += len(line)
    return str(d)


def phase_cfg(data: dict, steps: int, micro: int, seq_len: int):
    from tasks.core.config.schema import PhaseConfig

    return PhaseConfig.model_validate(
        {
            "data": data,
            "plugin": {"name": "torch_ddp", "precision": "fp32"},
            "launch": {"nproc_per_node": 1},
            "max_steps": steps,
            "micro_batch_size": micro,
            "seq_len": seq_len,
            "lr": 1e-4,
            "seed": 1234,
        }
    )


def prepare_mode(cfg, tokdir: Path, out: Path) -> float:
    from tasks.core.data.blend import Source
    from tasks.core.data.prepare import prepare
    from tasks.core.data.stage_data import blend_plan

    shutil.rmtree(out, ignore_errors=True)
    sources = [Source(s.name, s.uris, s.weight) for s in cfg.data.source_list]
    t0 = time.perf_counter()
    prepare(
        sources,
        tokdir,
        out,
        workers=2,
        kind="cpt",
        field="text",
        seq_len=cfg.seq_len,
        heldout_fraction=0.0,
        blend_plan=blend_plan(cfg, "cpt"),
    )
    return time.perf_counter() - t0


def data_times(cfg, tokdir: Path, data_dir: Path, probe_steps: int) -> tuple[float, float]:
    """(start-up: StageData and its first batch, median seconds of the next probe_steps batches)."""
    from tasks.core.run.job import Job
    from tasks.engine.loop import StageData

    job = Job(
        verb="train",
        phase="cpt",
        phase_cfg=cfg,
        trust_remote_code=False,
        model_dir=str(tokdir),
        tokenizer_dir=str(tokdir),
        data_dir=str(data_dir),
        stage_dir=str(data_dir.parent / "stage"),
        parent=None,
        config_digest=None,
    )
    t0 = time.perf_counter()
    data = StageData(job, 0, 1)
    data.next_batch()
    start = time.perf_counter() - t0
    steps = []
    for _ in range(probe_steps):
        t = time.perf_counter()
        data.next_batch()
        steps.append(time.perf_counter() - t)
    return start, statistics.median(steps)


def shares(data_dir: Path) -> dict[str, float]:
    """Each source's share of the blended stream's items, counted from the stream (blocks: tokens)."""
    from tasks.core.data.dataset import TokenDataset

    ds = TokenDataset(data_dir)
    stream = np.asarray(ds.blend(), np.int64)
    ends = np.cumsum([s["samples_available"] for s in ds.sources])
    of = np.searchsorted(ends, stream, side="right")
    return {s["name"]: float(np.mean(of == i)) for i, s in enumerate(ds.sources)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="benchmarks/mixture.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, the same code path and table")
    ap.add_argument(
        "--repeat", type=int, default=None, help="runs of each mode, alternated; the best is kept (default 3, smoke 1)"
    )
    ap.add_argument(
        "--probe-steps", type=int, default=None, help="batches timed after start-up (default 200, smoke 20)"
    )
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    a = ap.parse_args(argv)
    sizes = (
        {"big": (0.6, 3), "mid": (0.2, 2), "small": (0.04, 1)}
        if a.smoke
        else {"big": (24.0, 6), "mid": (8.0, 4), "small": (2.0, 2)}
    )
    steps, micro, seq_len = (60, 8, 128) if a.smoke else (2000, 32, 256)
    repeat = a.repeat or (1 if a.smoke else 3)
    probe = a.probe_steps or (20 if a.smoke else 200)

    work = workdir(a.work, "mixture-bench-")
    work.mkdir(parents=True, exist_ok=True)
    tokdir = work / "tokenizer"
    tiny_tokenizer().save_pretrained(tokdir)
    dirs = {n: make_source(work / "corpus" / n, mb, files, seed) for seed, (n, (mb, files)) in enumerate(sizes.items())}
    files = [str(p) for n in dirs for p in sorted(Path(dirs[n]).iterdir())]
    mix = phase_cfg(
        {"sources": [{"name": n, "uri": dirs[n], "weight": WEIGHTS[n]} for n in dirs]}, steps, micro, seq_len
    )
    one = phase_cfg({"uri": files}, steps, micro, seq_len)

    prep = {"mixture": [], "single": []}
    start = {"mixture": [], "single": []}
    step = {"mixture": [], "single": []}
    for _ in range(repeat):
        for mode, cfg in (("single", one), ("mixture", mix)):
            out = work / mode / "data"
            prep[mode].append(prepare_mode(cfg, tokdir, out))
            s, p = data_times(cfg, tokdir, out, probe)
            start[mode].append(s)
            step[mode].append(p)

    import json

    index = json.loads((work / "mixture" / "data" / "index.json").read_text())
    counted = shares(work / "mixture" / "data")
    total_mb = sum(f.stat().st_size for d in dirs.values() for f in Path(d).iterdir()) / 1e6
    print(
        f"\nmixture vs one source: {total_mb:.1f} MB in {len(files)} files, {steps} steps x {micro} blocks of "
        f"{seq_len} tokens "
        f"({steps * micro:,} planned blocks), best of {repeat}\n"
    )
    print(
        f"{'source':<8} {'weight':>7} {'share':>8} {'|diff|':>8} {'epochs':>8} {'blocks avail':>13} {'tokens avail':>13}"
    )
    worst = 0.0
    for s in index["sources"]:
        diff = abs(counted[s["name"]] - s["weight"])
        worst = max(worst, diff)
        print(
            f"{s['name']:<8} {s['weight']:>7.3f} {counted[s['name']]:>8.4f} {diff:>8.4f} {s['epochs']:>8.3f} "
            f"{s['samples_available']:>13,} {s['tokens_available']:>13,}"
        )
    print(f"\n{'':<28} {'one source':>12} {'mixture':>12} {'ratio':>8}")
    rows = [("prepare (s)", prep), ("data start-up (ms)", start), ("per-step data (ms)", step)]
    ratios = {}
    for label, d in rows:
        b, m = min(d["single"]), min(d["mixture"])
        scale = 1 if label.startswith("prepare") else 1e3
        ratios[label] = m / b
        print(f"{label:<28} {b * scale:>12.3f} {m * scale:>12.3f} {m / b:>8.3f}")
    ok = worst <= 0.01 and ratios["data start-up (ms)"] <= 1.05 and ratios["per-step data (ms)"] <= 1.05
    print(
        f"\ntargets: every share within 0.01 of its weight (worst {worst:.4f}); start-up and per-step data <= 1.05x: "
        f"{'met' if ok else 'NOT met'}"
    )
    print(f"command: python benchmarks/mixture.py{' --smoke' if a.smoke else ''}")
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
