"""Resume benchmark on the tiny config, measured side by side in one run:

    .venv/bin/python benchmarks/resume.py [--steps 12] [--every 4]
    .venv/bin/python benchmarks/resume.py --smoke     # 6 steps, a checkpoint every 3, one CPU rank, three
                                                      # runs up to train_cpt: checks the script runs

1. wall time of re-running a completed flow / the first run's wall time   (target <= 0.1)
2. steps redone after a rank is SIGKILLed in the middle of a checkpoint interval of CPT
   (target <= one interval)

Both use the real flow on one embedded Prefect server (started before timing) and real torchrun.
"""

from __future__ import annotations

import argparse
import os
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="CPT and SFT steps")
    ap.add_argument("--every", type=int, default=4, help="checkpoint interval")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="6 steps, a checkpoint every 3, one CPU rank, three runs of one run root stopped after train_cpt, "
        "targets printed "
        "but not judged: checks the script runs",
    )
    args = ap.parse_args()
    if args.smoke:  # every=3 puts the kill (after step 5) inside an interval, as every=4 does at full size
        args.steps, args.every = 6, 3

    from flows.embedded_api import embedded_api

    # One API server for every flow run, started before any timing: each `python -m flows.cpt_to_sft`
    # would otherwise start (and time) its own, as it does when PREFECT_API_URL is unset.
    with embedded_api():
        return bench(args)


def bench(args: argparse.Namespace) -> int:
    from prefect import flow

    import tasks.stages.train
    from flows.cli import flow_main as run_flow
    from support.tiny import tiny_config_raw, write_config

    @flow(name="warm-up")
    def warm() -> None:
        return None

    warm()  # the Prefect client's first flow run, outside the timed region

    # The smoke run stops every flow run after train_cpt (the kill is in CPT; the later stages'
    # launches, a torchrun start each, would cover nothing more of this script) and takes its three
    # runs from one run root: killed, retried (together the first run), then re-run complete.
    stop = ["--stop-after", ROWS.train_cpt.name] if args.smoke else []
    tmp = workdir(None, "resume-bench-")
    model = tiny_model(tmp / "tiny")
    stage = {"max_steps": args.steps, "checkpoint_every": args.every}
    # The smoke's CPT runs one rank (the config's plugin at tp=1): its three launches then start 3
    # processes less, each ~6 s of CPU importing torch, transformers and ColossalAI; the kill, the
    # retry and the skip take the same path with one rank, and the killed rank is then rank 0.
    ranks = 1 if args.smoke else 2
    if args.smoke:
        stage.update(
            launch={"nproc_per_node": 1},
            plugin={"name": "hybrid_parallel", "tp_size": 1, "pp_size": 1, "zero_stage": 0, "precision": "fp32"},
        )

    def config(name: str, run: str, **stages) -> Path:
        raw = tiny_config_raw(model, tmp / run, **stages)
        raw["gate"]["enabled"] = False  # this measures resume, not model quality
        for phase in ("cpt", "sft"):  # each stage's own launch, which the recording of run_engine times
            raw[phase].setdefault("launch", {})["share"] = False
        return write_config(tmp / name, raw)

    def timed(cfg: Path) -> float:
        t0 = time.perf_counter()
        assert run_flow(["--config", str(cfg), *stop]) == 0
        return time.perf_counter() - t0

    # 1. first run vs re-run of the completed run
    if not args.smoke:
        cfg = config("a.yaml", "run-a", cpt=stage, sft=stage)
        first = timed(cfg)
        rerun = timed(cfg)

    # 2. kill rank 1 in the middle of an interval, then retry
    kill_at = args.every + args.every // 2 + 1  # e.g. every=4: killed after step 7, last checkpoint 4
    seen: list[int] = []
    real = tasks.stages.train.run_engine

    def recording(verb, job, *a, **kw):
        inner = kw.get("on_progress")

        def on_progress(rec):
            if job.phase == "cpt":
                seen.append(int(rec["step"]))
            if inner:
                inner(rec)

        kw["on_progress"] = on_progress
        return real(verb, job, *a, **kw)

    tasks.stages.train.run_engine = recording
    cfg_b = config("b.yaml", "run-b", cpt=stage, sft={"max_steps": 2, "checkpoint_every": 2})
    os.environ["CPT_TO_SFT_FAULT"] = f"kill@step={kill_at}@phase=cpt"
    t0 = time.perf_counter()
    try:
        run_flow(["--config", str(cfg_b), *stop])
    except Exception:  # the injected kill fails this run on purpose; what it left behind is measured below
        pass
    killed = time.perf_counter() - t0
    before = list(seen)
    seen.clear()
    del os.environ["CPT_TO_SFT_FAULT"]
    retried = timed(cfg_b)
    tasks.stages.train.run_engine = real
    if args.smoke:
        first, rerun = killed + retried, timed(cfg_b)
    last_done = max(before)
    resumed_at = min(seen) - 1
    redone = last_done - resumed_at

    print(f"\n== resume benchmark (tiny config, {ranks} CPU rank{'s' if ranks > 1 else ''}) ==")
    if args.smoke:
        print("(smoke: up to train_cpt; the first run is the killed run plus its retry)")
    print(f"first run wall           {first:8.1f} s")
    print(f"re-run of complete run   {rerun:8.1f} s")
    print(f"re-run / first           {rerun / first:8.3f}   (target <= 0.1)")
    print(f"killed after CPT step    {last_done:8d}   (checkpoint every {args.every})")
    print(f"resumed from step        {resumed_at:8d}")
    print(f"steps redone             {redone:8d}   (target <= {args.every})")
    ok = rerun / first <= 0.1 and redone <= args.every
    shutil.rmtree(tmp, ignore_errors=True)  # two run roots and a model: nothing the figures above need
    print("result: " + ("ok" if ok else "MISSED TARGET"))
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
