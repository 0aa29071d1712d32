"""Launch overhead, side by side: task start -> first training step, local backend vs Slurm backend.

The same CPT `train` verb of the tiny model (HybridParallel tp=2, world size 2), from the same
step-0 checkpoint, run through `tasks.core.launch.torchrun.run_engine` exactly as the Prefect task does:

- local: `torchrun --standalone --nproc-per-node 2` on this machine;
- slurm: one Slurm job on a real two-node test cluster (`support.servers.slurm`, slurmd n1 and n2
  on 127.0.0.1, started here), one torchrun agent per node with one rank each, c10d rendezvous.

The clock starts when `run_engine` is called and stops at the first `@@progress` record (the
end of optimizer step 1), so it covers writing the job file, submitting and scheduling (Slurm),
starting torchrun, the rendezvous, importing ColossalAI, boosting, loading the checkpoint and
one step. Rounds alternate the backends; each stage directory is a fresh copy holding only
step 0. Target: Slurm adds <= 3 s, small beside a stage's own start, so choosing the backend is not a
speed trade-off. The Slurm part needs root and Slurm (scripts/install_system.sh); without them
(as the Slurm tests skip) only the local backend runs and the Slurm columns print as `-`.

    sudo .venv/bin/python benchmarks/launch.py --repeats 3
    .venv/bin/python benchmarks/launch.py --smoke        # one round, tp=1, one local rank: checks the script runs

--smoke runs the plugin at tp=1 and the local backend (and the shard before it) with one rank, the
Slurm one still on two nodes (dp=2): two rank processes less, ~6 s of CPU each in imports, for
figures that are not judged.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support.bench import workdir
from support.engine import prepared_data
from support.servers import patched_env
from support.servers.slurm import SlurmCluster, slurm_available
from support.tiny import tiny_config_raw, tiny_model
from tasks.core.config.load import parse_config
from tasks.core.config.paths import resolve_local
from tasks.core.launch.torchrun import run_engine
from tasks.core.run.job import Job, Parent

LAUNCHES = {
    "local": {"backend": "local", "nnodes": 1, "nproc_per_node": 2},
    "slurm": {
        "backend": "slurm",
        "nnodes": 2,
        "nproc_per_node": 1,
        "slurm": {"partition": "debug", "time_limit": "10"},
    },
}
ENV = {"GLOO_SOCKET_IFNAME": "lo"}


class _Quiet(logging.Logger):
    def __init__(self):
        super().__init__("bench", logging.WARNING)


def _job(cfg, model: Path, data: Path, stage_dir: Path, verb: str) -> Job:
    """The job tasks/stages/train.py writes for the cpt stage; `data` is the prepared data/cpt of `cfg`."""
    return Job(
        verb=verb,
        phase="cpt",
        phase_cfg=cfg.cpt,
        trust_remote_code=cfg.base_model.trust_remote_code,
        model_dir=model,
        tokenizer_dir=model,
        data_dir=data,
        stage_dir=stage_dir,
        parent=Parent(uri=str(model), digest="bench"),
        config_digest="b" * 64,
    )


def _prepared(cfg, model: Path, out: Path) -> Path:
    """cpt's sample corpus tokenized as prepare_cpt does; the same for every backend (only the launch differs)."""
    section = cfg.cpt.model_dump(mode="json")
    section["data"]["uri"] = resolve_local(section["data"]["uri"])
    return prepared_data(section, "cpt", model, out)


def _config(model: Path, root: Path, backend: str, smoke: bool = False):
    raw = tiny_config_raw(model, root)
    raw["cpt"].update(max_steps=1, checkpoint_every=1, launch=LAUNCHES[backend])
    if smoke:
        raw["cpt"]["plugin"]["tp_size"] = 1
        if backend == "local":
            raw["cpt"]["launch"] = {**LAUNCHES["local"], "nproc_per_node": 1}
        else:  # dp 2 on the two nodes: the same global batch as the 1-rank step-000000 it continues
            raw["cpt"]["micro_batch_size"] = max(1, raw["cpt"].get("micro_batch_size", 4) // 2)
    return parse_config(raw)


def first_step_s(backend: str, model: Path, data: Path, step0: Path, work: Path, smoke: bool = False) -> float:
    cfg = _config(model, work / "run", backend, smoke)
    stage_dir = work / "run" / "cpt"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(step0, stage_dir / step0.name)
    first: list[float] = []
    t0 = time.monotonic()
    run_engine(
        "train",
        _job(cfg, model, data, stage_dir, "train"),
        work / "jobs" / "train.json",
        cfg.cpt.launch,
        f"bench-{backend}",
        _Quiet(),
        on_progress=lambda rec: first.append(time.monotonic()) if not first else None,
        env=ENV,
    )
    if not first:
        raise RuntimeError(f"{backend}: the stage trained no step")
    return first[0] - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="one round: checks the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeats = 1
    # the same conditions as tests/conftest_slurm.py's slurm_cluster fixture
    no_slurm = (
        "Slurm is not installed (slurmctld/slurmd/sbatch/munged)"
        if not slurm_available()
        else "the Slurm test cluster needs root"
        if os.geteuid() != 0
        else None
    )
    backends = [b for b in LAUNCHES if b != "slurm" or not no_slurm]
    if no_slurm:
        print(f"slurm: skipped ({no_slurm}; sudo bash scripts/install_system.sh installs it)", flush=True)
    tmp = workdir(None, "bench-launch-")
    cluster = None if no_slurm else SlurmCluster(tmp / "slurm").start()
    left: list[str] = []
    try:
        with patched_env(cluster.env() if cluster else {}):
            model = tmp / "model"
            tiny_model(model)
            cfg = _config(model, tmp / "seed", "local", args.smoke)
            seed_dir = tmp / "seed" / "cpt"
            data = _prepared(cfg, model, tmp / "data-cpt")
            run_engine(
                "shard",
                _job(cfg, model, data, seed_dir, "shard"),
                tmp / "seed" / "shard.json",
                cfg.cpt.launch,
                "bench-shard",
                _Quiet(),
                env=ENV,
            )
            step0 = seed_dir / "step-000000"
            times: dict[str, list[float]] = {b: [] for b in LAUNCHES}
            for r in range(args.repeats):
                for backend in backends:
                    s = first_step_s(backend, model, data, step0, tmp / f"{backend}-{r}", args.smoke)
                    times[backend].append(s)
                    print(f"round {r + 1} {backend:>5}: task start -> first step {s:6.2f} s", flush=True)
    finally:
        if cluster:
            left = cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if left:
        print("processes outlived the cluster:\n" + "\n".join(left), file=sys.stderr)
    loc, slu = times["local"], times["slurm"]
    print(f"\n{'':>30}{'local':>10}{'slurm':>10}{'slurm - local':>16}{'ratio':>8}")
    for name, f in (("best", min), ("median", statistics.median)):
        a = f(loc)
        if not slu:
            print(f"{'task start -> step 1 ' + name:>30}{a:>9.2f}s{'-':>10}{'-':>16}{'-':>8}")
            continue
        b = f(slu)
        print(f"{'task start -> step 1 ' + name:>30}{a:>9.2f}s{b:>9.2f}s{b - a:>+15.2f}s{b / a:>8.2f}")
    if not slu:
        print(f"\nSlurm adds: not measured ({no_slurm})")
        return 0
    added = statistics.median(slu) - statistics.median(loc)
    print(
        f"\nSlurm adds {added:+.2f} s (median) to the first training step; target <= 3 s: {'met' if added <= 3 else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
