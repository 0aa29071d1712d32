"""Preemption benchmark: N preemption notices at random steps of CPT on the demo-sized model or a ~190M
one, each retried by the flow itself, against the same stage run uninterrupted:

    .venv/bin/python benchmarks/preemption.py [--preemptions 3] [--steps 16] [--grace 20] [--seed 0]
    .venv/bin/python benchmarks/preemption.py --size 190M   # 3 notices in 8 steps, 60 s grace: ~10 min on 2 cores
    .venv/bin/python benchmarks/preemption.py --smoke   # 1 preemption, 6 steps, one CPU rank: checks the script runs

`--size 190M` is benchmarks/scale.py's 190M Llama shape (186.7M parameters, 32,000-token vocabulary; the
demo tokenizer's ids fall below it), random, fp32, tp=2 on 2 CPU ranks, 1 x 64 tokens a step: each
checkpoint holds 2.2 GB (weights and AdamW's two moments), so the notice's save is a real one.

Per preemption (from run.json's `preemptions`): the step noticed, the step checkpointed, steps lost
(target 0: the step in flight finishes within the grace), seconds from the notice to the committed
checkpoint against the grace budget, seconds from the retry's start to its first step. For the
stage: the wall time from its first launch to its end, preempted N times against uninterrupted,
and whether the final weights are the uninterrupted run's, bitwise.

The notice is the engine's fault injection (`term@step=K`, tasks/engine/faults.py): SIGTERM to one
rank after step K, as a spot reclaim or `kill -TERM` would send it. Both runs use the real flow on
one embedded Prefect server (started before timing) and real torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support.bench import workdir
from support.tiny import tiny_model
from tasks.core.run.stages import ROWS

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The embedded server's default 20 s is too short on a loaded 2-core machine (as in gpu_check.py).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


# The model each size trains, its stage settings and the benchmark's defaults for it.
SIZES = {
    "demo": {"model": {}, "stage": {}, "defaults": {"preemptions": 3, "steps": 16, "every": 8, "grace": 20.0}},
    "190M": {  # benchmarks/scale.py's 190M shape
        "model": dict(
            vocab_size=32000, hidden_size=1024, num_layers=11, num_heads=16, num_kv_heads=8, intermediate_size=2560
        ),
        "stage": {"micro_batch_size": 1, "seq_len": 64},
        "defaults": {"preemptions": 3, "steps": 8, "every": 8, "grace": 60.0},
    },
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="demo", help="the model (and the defaults below)")
    ap.add_argument("--preemptions", type=int, help="notices, at distinct random steps (3)")
    ap.add_argument("--steps", type=int, help="CPT steps (demo 16, 190M 8)")
    ap.add_argument("--every", type=int, help="periodic checkpoint interval (demo 8, 190M 8)")
    ap.add_argument("--grace", type=float, help="the notice's grace budget, seconds (demo 20, 190M 60)")
    ap.add_argument("--ranks", type=int, default=2, help="CPU ranks (tp=ranks, fp32)")
    ap.add_argument("--seed", type=int, default=0, help="picks the steps")
    ap.add_argument("--smoke", action="store_true", help="1 preemption, 6 steps, one rank; figures printed, not judged")
    args = ap.parse_args()
    for k, v in SIZES[args.size]["defaults"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.smoke:
        args.preemptions, args.steps, args.every, args.ranks = 1, 6, 3, 1
    if not 0 < args.preemptions < args.steps - 1:
        ap.error(f"--preemptions must be between 1 and --steps - 2 ({args.steps - 2})")

    from flows.embedded_api import embedded_api

    with embedded_api():
        return bench(args)


def bench(args: argparse.Namespace) -> int:
    from prefect import flow

    import tasks.stages.train
    from flows.cli import flow_main as run_flow
    from support.engine import read_model_dir
    from support.tiny import tiny_config_raw, write_config

    @flow(name="warm-up")
    def warm() -> None:
        return None

    warm()  # the Prefect client's first flow run, outside the timed region

    tmp = workdir(None, "preemption-bench-")
    size = SIZES[args.size]
    model = tiny_model(tmp / f"model-{args.size}", **size["model"])
    stage = {
        **size["stage"],
        "max_steps": args.steps,
        "checkpoint_every": args.every,
        "launch": {"nproc_per_node": args.ranks},
        "plugin": {"name": "hybrid_parallel", "tp_size": args.ranks, "pp_size": 1, "zero_stage": 0}
        | {"precision": "fp32"},
        "elastic": {
            "notices": [{"source": "sigterm", "grace_s": args.grace}],
            "max_preemptions": args.preemptions,
            "retry_wait_s": 0,
        },
    }
    launches: list[tuple[float, float]] = []  # each CPT launch's start and end
    real = tasks.stages.train.run_engine

    def timing(verb, job, *a, **kw):
        if verb != "train":
            return real(verb, job, *a, **kw)
        t0 = time.perf_counter()
        try:
            return real(verb, job, *a, **kw)
        finally:
            launches.append((t0, time.perf_counter()))

    tasks.stages.train.run_engine = timing

    def run(run_root: Path, fault: str | None) -> tuple[float, dict]:
        raw = tiny_config_raw(model, run_root, cpt=stage)
        raw["gate"]["enabled"] = False
        for phase in ("cpt", "sft"):  # each stage's own launch, which the recording of run_engine times
            raw[phase].setdefault("launch", {})["share"] = False
        cfg = write_config(run_root.parent / f"{run_root.name}.yaml", raw)
        launches.clear()
        if fault:
            os.environ["CPT_TO_SFT_FAULT"] = fault
        try:
            assert run_flow(["--config", str(cfg), "--stop-after", ROWS.train_cpt.name]) == 0
        finally:
            os.environ.pop("CPT_TO_SFT_FAULT", None)
        return launches[-1][1] - launches[0][0], json.loads((run_root / "run.json").read_text())

    # The uninterrupted run prepares everything; the preempted one is its copy from step 0, so both
    # time the training stage only, from its first launch to its end.
    ref_root = tmp / "uninterrupted"
    ref_wall, _ = run(ref_root, None)
    pre_root = tmp / "preempted"

    def later(folder: str, names: list[str]) -> set[str]:  # not the training stage's own outputs
        cpt = Path(folder) == ref_root / "cpt"
        own = {n for n in names if cpt and (n == "tensorboard" or (n.startswith("step-") and n != "step-000000"))}
        return own | {n for n in names if Path(folder) == ref_root and n in (".lease.json", "run.json")}

    shutil.copytree(ref_root, pre_root, ignore=later)
    # term@step=K: the notice comes as step K+1 begins; one as the last step begins ends nothing (the stage ends anyway)
    at = sorted(random.Random(args.seed).sample(range(1, args.steps - 1), args.preemptions))
    pre_wall, summary = run(pre_root, ";".join(f"term@step={k}@phase=cpt" for k in at))
    tasks.stages.train.run_engine = real

    final = f"cpt/step-{args.steps:06d}/model"
    got, want = read_model_dir(pre_root / final), read_model_dir(ref_root / final)
    same = set(got) == set(want) and all(bool((got[k] == want[k]).all()) for k in want)
    records = summary.get("preemptions") or []

    params = sum(t.numel() for t in want.values()) / 1e6
    print(
        f"\n== preemption benchmark ({args.size} model, {params:.1f}M parameters; {args.ranks} CPU rank{'s' if args.ranks > 1 else ''}, "
        "fp32) =="
    )
    if args.smoke:
        print("(smoke: one rank, one preemption; figures printed, not judged)")
    began = [k + 1 for k in at]  # term@step=K signals as step K+1 begins: that step finishes, then the stage stops
    print(f"notices as steps {began} began, grace {args.grace:g} s, {args.steps} steps, checkpoint every {args.every}")
    print(
        "| # | noticed after step | checkpoint step | steps lost | notice to commit (s) | grace (s) "
        "| restart to first step (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(records, 1):
        print(
            f"| {i} | {r.get('noticed_step')} | {r.get('checkpoint_step')} | {r.get('steps_lost')} | "
            f"{_f(r.get('notice_to_commit_s'))} | {_f(r.get('grace_s'))} | {_f(r.get('restart_to_first_step_s'))} |"
        )
    print(f"stage wall, uninterrupted      {ref_wall:8.1f} s")
    print(f"stage wall, {len(records)} preemption(s)     {pre_wall:8.1f} s")
    print(f"preempted / uninterrupted      {pre_wall / ref_wall:8.2f}")
    print(f"final weights bitwise equal    {'yes' if same else 'NO'}")
    ok = (
        len(records) == args.preemptions
        and all(r.get("steps_lost") == 0 for r in records)
        and all((r.get("notice_to_commit_s") or 1e9) < float(r.get("grace_s") or 0) for r in records)
        and same
    )
    shutil.rmtree(tmp, ignore_errors=True)
    print("result: " + ("ok" if ok else "MISSED TARGET"))
    return 0 if ok or args.smoke else 1


def _f(x) -> str:
    return f"{float(x):.2f}" if isinstance(x, (int, float)) else "n/a"


if __name__ == "__main__":
    sys.exit(main())
