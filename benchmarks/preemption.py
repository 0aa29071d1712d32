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
checkpoint against the grace budget, seconds from the retry's start to its first step. Then the
recovery from the notice to the next first step, part by part (each record's `recovery`,
tasks/core/run/preemptions.py RECOVERY): notice to commit, exit (ranks and torchrun gone), retry (the
flow's bookkeeping and config re-read), stage skip, launch (torchrun start to ranks ready, imports
included), find (the checkpoint's manifest verified), build (model built and boosted), restore
(checkpoint load), first step; each in seconds and as a share. For the stage: the wall time from its
first launch to its end, preempted N times against uninterrupted, and whether the final weights are
the uninterrupted run's, bitwise.

Two preempted runs (one without --smoke): the same layout (tp=ranks) on every attempt, and a changed
one, where each retry resumes under the other split of the same ranks (tp=ranks <-> dp=ranks, the
config rewritten while the run waits, `elastic.keep_global_batch` keeping the global batch): its
final weights are compared by their largest difference (another reduction order), not bitwise.
Beside them, a bare `torchrun --nproc-per-node <ranks>` whose ranks import torch and ColossalAI and
do one all-reduce (benchmarks/rank_start.py's bare rank): the restart (exit to first step) is
printed against it as a ratio and a difference, the floor a relaunch cannot beat. --smoke runs
neither the changed run nor the bare launch.

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
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support.bench import workdir
from support.tiny import tiny_model
from tasks.core.run.preemptions import RECOVERY
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
    ap.add_argument("--no-changed", action="store_true", help="skip the run whose retries change the layout")
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

    import tasks.flowkit.run as runner
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
    changed = not args.smoke and not args.no_changed and args.ranks > 1
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
    mbs = int(stage.get("micro_batch_size") or 4)  # tiny-cpu.yaml's
    if changed:
        # tp=ranks <-> dp=ranks at one global batch: fewer sequences a micro-batch under dp where they
        # divide, else accumulation (the engine's keep_global_batch sets it from the checkpoint's batch).
        stage["elastic"]["keep_global_batch"] = True
        if mbs % args.ranks:
            stage["grad_accum_steps"] = args.ranks
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

    def layout(raw: dict, tp: bool) -> dict:
        out = json.loads(json.dumps(raw))
        out["cpt"]["plugin"]["tp_size"] = args.ranks if tp else 1
        out["cpt"]["micro_batch_size"] = mbs if tp or mbs % args.ranks else mbs // args.ranks
        return out

    def run(run_root: Path, fault: str | None, flip: bool = False) -> tuple[float, dict]:
        raw = tiny_config_raw(model, run_root, cpt=stage)
        raw["gate"]["enabled"] = False
        for phase in ("cpt", "sft"):  # each stage's own launch, which the recording of run_engine times
            raw[phase].setdefault("launch", {})["share"] = False
        cfg = write_config(run_root.parent / f"{run_root.name}.yaml", raw)
        launches.clear()
        policy, tp = runner.preemption_policy, [True]

        def other_layout(c, exc):  # while the run waits: the other split of the same ranks
            tp[0] = not tp[0]
            write_config(cfg, layout(raw, tp[0]))
            return policy(c, exc)

        if flip:
            runner.preemption_policy = other_layout
        if fault:
            os.environ["CPT_TO_SFT_FAULT"] = fault
        try:
            assert run_flow(["--config", str(cfg), "--stop-after", ROWS.train_cpt.name]) == 0
        finally:
            os.environ.pop("CPT_TO_SFT_FAULT", None)
            runner.preemption_policy = policy
        return launches[-1][1] - launches[0][0], json.loads((run_root / "run.json").read_text())

    # The uninterrupted run prepares everything; each preempted one is its copy from step 0, so all
    # time the training stage only, from its first launch to its end.
    ref_root = tmp / "uninterrupted"
    ref_wall, _ = run(ref_root, None)

    def later(folder: str, names: list[str]) -> set[str]:  # not the training stage's own outputs
        cpt = Path(folder) == ref_root / "cpt"
        own = {n for n in names if cpt and (n == "tensorboard" or (n.startswith("step-") and n != "step-000000"))}
        return own | {n for n in names if Path(folder) == ref_root and n in (".lease.json", "run.json")}

    # term@step=K: the notice comes as step K+1 begins; one as the last step begins ends nothing (the stage ends anyway)
    at = sorted(random.Random(args.seed).sample(range(1, args.steps - 1), args.preemptions))
    fault = ";".join(f"term@step={k}@phase=cpt" for k in at)
    final = f"cpt/step-{args.steps:06d}/model"
    want = read_model_dir(ref_root / final)
    results = []
    # the bare launch before the preempted runs and after them: a loaded machine's pace changes within a run
    bares = [] if args.smoke else [bare_launch(args.ranks, tmp / "bare")]
    for name, flip in (("same layout", False), ("changed layout", True)) if changed else (("same layout", False),):
        root = tmp / name.replace(" ", "-")
        shutil.copytree(ref_root, root, ignore=later)
        wall, summary = run(root, fault, flip)
        got = read_model_dir(root / final)
        diff = max(float((got[k] - want[k]).abs().max()) for k in want) if set(got) == set(want) else float("inf")
        results.append((name, flip, wall, summary.get("preemptions") or [], diff))
    tasks.stages.train.run_engine = real
    bares += [] if args.smoke else [bare_launch(args.ranks, tmp / "bare")]
    bare = statistics.mean(bares) if bares else None

    params = sum(t.numel() for t in want.values()) / 1e6
    print(
        f"\n== preemption benchmark ({args.size} model, {params:.1f}M parameters; {args.ranks} CPU rank{'s' if args.ranks > 1 else ''}, "
        "fp32) =="
    )
    if args.smoke:
        print("(smoke: one rank, one preemption; figures printed, not judged)")
    began = [k + 1 for k in at]  # term@step=K signals as step K+1 begins: that step finishes, then the stage stops
    print(f"notices as steps {began} began, grace {args.grace:g} s, {args.steps} steps, checkpoint every {args.every}")
    split = f"tp={args.ranks}" if args.ranks > 1 else "1 rank"
    ok = True
    restarts = []
    for name, flip, wall, records, diff in results:
        print(f"\n-- {name}: " + (f"each retry switches tp={args.ranks} <-> dp={args.ranks}" if flip else split))
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
        print("\nrecovery, notice to the next first step, s (share):")
        heads = [p.replace("_", " ") for p, _, _ in RECOVERY]
        print("| # | layout after | " + " | ".join(heads) + " | recovery (s) | of which rank imports (s) |")
        print("|---|---|" + "---|" * (len(heads) + 2))
        for i, r in enumerate(records, 1):
            rec = r.get("recovery") or {}
            cells = [
                f"{rec[f'{p}_s']:.2f} ({rec.get(f'{p}_share', 0):.0%})" if f"{p}_s" in rec else "n/a"
                for p, _, _ in RECOVERY
            ]
            after = (f"dp={args.ranks}" if i % 2 else f"tp={args.ranks}") if flip else split
            print(
                f"| {i} | {after} | "
                + " | ".join(cells)
                + f" | {_f(rec.get('total_s'))} | {_f(rec.get('rank_imports_s'))} |"
            )
            t = r.get("timeline") or {}
            if "exit" in t and "first_step" in t:
                restarts.append(t["first_step"] - t["exit"])
        print(f"stage wall, uninterrupted      {ref_wall:8.1f} s")
        print(f"stage wall, {len(records)} preemption(s)     {wall:8.1f} s")
        print(f"preempted / uninterrupted      {wall / ref_wall:8.2f}")
        if flip:
            print(f"final weights vs uninterrupted max |diff| {diff:.2e} (another reduction order: not bitwise)")
        else:
            print(f"final weights bitwise equal    {'yes' if diff == 0 else 'NO'}")
        ok = ok and (
            len(records) == args.preemptions
            and all(r.get("steps_lost") == 0 for r in records)
            and all((r.get("notice_to_commit_s") or 1e9) < float(r.get("grace_s") or 0) for r in records)
            and (diff < 1e-3 if flip else diff == 0)
        )
    print()
    if restarts:
        med = statistics.median(restarts)
        print(f"restart, exit to first step (median of {len(restarts)})  {med:8.2f} s")
    if bare is not None:
        print(
            f"bare torchrun, {args.ranks} rank(s): import torch+colossalai, one all-reduce  {bare:8.2f} s"
            f" (mean of {' and '.join(f'{b:.2f}' for b in bares)} s, before and after the preempted runs)"
        )
    if restarts and bare is not None:
        print(f"restart / bare torchrun        {med / bare:8.2f}  ({med - bare:+.2f} s)")
    shutil.rmtree(tmp, ignore_errors=True)
    print("result: " + ("ok" if ok else "MISSED TARGET"))
    return 0 if ok or args.smoke else 1


def bare_launch(ranks: int, work: Path) -> float:
    """Wall seconds of `torchrun --standalone --nproc-per-node ranks` running benchmarks/rank_start.py's bare rank."""
    from rank_start import BARE

    from support.engine import REPO

    work.mkdir(parents=True, exist_ok=True)
    script = work / "bare_rank.py"
    script.write_text(BARE.format(booster=""))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(script)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def _f(x) -> str:
    return f"{float(x):.2f}" if isinstance(x, (int, float)) else "n/a"


if __name__ == "__main__":
    sys.exit(main())
