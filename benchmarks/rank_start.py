"""What a rank imports, per engine verb, against a bare torchrun rank: seconds and the gap by package.

    .venv/bin/python benchmarks/rank_start.py --repeats 3     # 2 ranks, hybrid_parallel tp=2 fp32
    .venv/bin/python benchmarks/rank_start.py --smoke         # the bare launch alone, 1 rank: checks the script runs

Each launch is the launcher's agent, `python -m tasks.engine.agent --standalone --nproc-per-node N`
(torchrun's main), with `PYTHONPROFILEIMPORTTIME=1` and each rank's stderr in a file of its own
(`--redirects 2`), so rank 0's import tree is read whole, and the ranks' stdout read as it comes (the
first step's time):

- bare:  a rank that imports torch and `colossalai`, does one all-reduce and exits;
- booster: the same, importing ColossalAI's booster and plugins as the engine does
         (`tasks.engine.lazy_compile.import_colossalai`): the floor of any rank that boosts a model,
         since `colossalai.booster` imports peft, and peft transformers' modeling, at module level;
- shard: `python -m tasks.engine shard` of the tiny Llama (the demo's), the step-000000 checkpoint;
- train: `python -m tasks.engine train` from that checkpoint, 2 steps, one checkpoint;
- shard (fork), train (fork): the same verbs with the ranks forked from the agent's imports
         (`CPT_TO_SFT_RANK_START=fork`, tasks/engine/agent.py): their import table is what a rank
         imports after the fork.

Printed per launch, the smallest over the rounds: the launch's wall seconds, the wall seconds to its
first optimizer step's `@@progress` line (train), and CPU seconds (the
torchrun agent and every rank: what a loaded machine distorts least), rank 0's import seconds
(the sum of its top-level imports' cumulative times, as `-X importtime` reports them, which adds a
little of its own), and how many modules it imported; then what the booster rank imports that the bare
one does not, and for each verb what it imports beyond the booster rank, by top-level package (self
time summed): the remaining gap, import by import.
Then, in one fresh process without torchrun, the CPU seconds each step of a training rank's imports
adds (torch, `colossalai`, what transformers' `modeling_utils` brings (sympy, DTensor, TorchDynamo,
accelerate and the hub clients), `modeling_utils` and the model's module, bitsandbytes, peft, ColossalAI's
booster and plugins, the engine's modules): the figures a loaded machine distorts least. Wall and import times are load-dependent on a
shared machine; CPU seconds much less, the module lists not at all.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support.bench import print_table, workdir
from support.engine import REPO, phase_raw, write_job
from support.tiny import tiny_model
from tasks.engine.agent import RANK_START_ENV

# {booster}: nothing, or ColossalAI's booster and plugins imported as the engine imports them.
BARE = """
import colossalai
import torch
import torch.distributed as dist
{booster}
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""

# One process, no torchrun: the CPU seconds of each step of a training rank's imports, cumulative. The booster's
# share is broken out by what transformers' modeling_utils, peft and ColossalAI's plugins import, in the order a
# rank needs them: what is left after "llama" is ColossalAI's own (docs/spot.md).
STEPS = """
import time
def mark(label):
    print(f"{label} {time.process_time():.3f}", flush=True)
import torch
mark("torch")
import colossalai
mark("colossalai")
import tasks  # transformers without scikit-learn and scipy, as every process of the project
import sympy
mark("sympy")
import torch.distributed.tensor
mark("torch.distributed.tensor")
import torch._dynamo
mark("torch._dynamo")
import accelerate, requests, huggingface_hub
mark("accelerate,requests,hf_hub")
import transformers.modeling_utils
mark("transformers.modeling_utils")
import transformers.models.llama.modeling_llama
mark("llama")
from tasks.engine.lazy_compile import deferred_compile
with deferred_compile():
    import bitsandbytes
mark("bitsandbytes")
import peft
mark("peft")
from tasks.engine.lazy_compile import import_colossalai
import_colossalai()
mark("booster")
import tasks.engine.__main__
from tasks.engine import builders, cpu_compat, faults, loop, preconditions, rankio
cpu_compat.apply()
mark("engine")
"""


def import_cpu(repeats: int) -> dict[str, float]:
    """label -> the smallest CPU seconds, over `repeats` fresh interpreters, that step of STEPS added."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    best: dict[str, float] = {}
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", STEPS], cwd=REPO, env=env, capture_output=True, text=True, check=True
        )
        prev = 0.0
        for line in out.stdout.split("\n"):
            if line.strip():
                label, t = line.split()
                best[label] = min(best.get(label, 1e9), float(t) - prev)
                prev = float(t)
    return best


LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def parse_importtime(text: str) -> dict[str, tuple[int, int, int]]:
    """module -> (self us, cumulative us, depth) from `-X importtime` output."""
    out = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out[m[4]] = (int(m[1]), int(m[2]), len(m[3]) // 2)
    return out


def package(module: str) -> str:
    """Group key: the top-level package, or its first two levels for the big ones."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in ("colossalai", "transformers", "torch", "tasks") else parts[0]


def launch(
    argv: list[str], nproc: int, logs: Path, start: str = "exec"
) -> tuple[float, float, float | None, dict[str, tuple[int, int, int]]]:
    """Wall and CPU seconds (the agent and every rank) of one launch through the launcher's agent
    (tasks/engine/agent.py) with ranks started `start` (exec: fresh interpreters; fork: forks of the
    agent's imports), the wall seconds to the first `@@progress` line (None without one), and rank
    0's import table (a forked rank's: what it imports after the fork)."""
    shutil.rmtree(logs, ignore_errors=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update({"PYTHONPROFILEIMPORTTIME": "1", "GLOO_SOCKET_IFNAME": "lo", RANK_START_ENV: start})
    cmd = [sys.executable, "-m", "tasks.engine.agent", "--standalone", "--nproc-per-node", str(nproc)]
    # stderr (the import profile) to a file per rank, stdout to this pipe, read as it comes: the first step's time
    cmd += ["--log-dir", str(logs), "--redirects", "2", *argv]
    t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    first: float | None = None
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        err = threading.Thread(target=lambda: setattr(proc, "err_text", proc.stderr.read()), daemon=True)
        err.start()
        for line in proc.stdout:
            if first is None and "@@progress" in line:
                first = time.perf_counter() - t0
        proc.wait()
        err.join()
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    errs = sorted(logs.glob("**/0/stderr.log"))
    if proc.returncode != 0 or not errs:
        tail = "\n".join(e.read_text()[-3000:] for e in sorted(logs.glob("**/stderr.log")))
        raise SystemExit(f"launch {argv} exited {proc.returncode}:\n{proc.err_text[-2000:]}\n{tail}")
    return wall, cpu, first, parse_importtime(errs[0].read_text())


def import_seconds(table: dict[str, tuple[int, int, int]]) -> float:
    return sum(c for _, c, d in table.values() if d == 0) / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="rounds; each figure is the smallest over them")
    p.add_argument("--smoke", action="store_true", help="one round of the bare launch alone, one rank (~5 CPU-s)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--top", type=int, default=12, help="packages listed in each verb's gap")
    args = p.parse_args()
    repeats, nproc = (1, 1) if args.smoke else (args.repeats, 2)
    work = workdir(args.workdir, "rank-start-")
    work.mkdir(parents=True, exist_ok=True)
    plugin = {"name": "hybrid_parallel", "tp_size": nproc, "precision": "fp32"}
    section = phase_raw("cpt", plugin, max_steps=2, checkpoint_every=2, keep_last=1)
    section["launch"] = {"nproc_per_node": nproc}
    bares = {
        "bare": "",
        "booster": "from tasks.engine.lazy_compile import import_colossalai\nimport_colossalai()",
    }
    for name, booster in bares.items():
        (work / f"{name}_rank.py").write_text(BARE.format(booster=booster))

    best: dict[str, tuple[float, float, float | None, float, dict]] = {}
    for _ in range(repeats):
        runs = {name: ([str(work / f"{name}_rank.py")], "exec") for name in bares}
        if args.smoke:  # the script's own path (launch, parse, table) at the cost of one small launch
            runs = {"bare": runs["bare"]}
        else:
            model = work / "tiny-llama"
            if not model.is_dir():
                tiny_model(model)
            for start in ("exec", "fork"):
                stage_dir = work / f"cpt-{start}"
                shutil.rmtree(stage_dir, ignore_errors=True)
                for verb in ("shard", "train"):
                    job = write_job(
                        work / "jobs" / f"{verb}-{start}.json",
                        verb=verb,
                        phase="cpt",
                        phase_cfg=section,
                        model_dir=model,
                        tokenizer_dir=model,
                        stage_dir=stage_dir,
                    )
                    name = verb if start == "exec" else f"{verb} (fork)"
                    runs[name] = (["-m", "tasks.engine", verb, "--config", str(job)], start)
        for name, (argv, start) in runs.items():  # shard before train: train resumes from step-000000
            wall, cpu, first, table = launch(argv, nproc, work / "logs" / name.split()[0] / start, start)
            now = (wall, cpu, first if first is not None else float("inf"), import_seconds(table))
            old = best.get(name)
            best[name] = (*(min(a, b) for a, b in zip(now, old[:4])), table) if old else (*now, table)

    print(f"rank start, {nproc} rank(s), hybrid_parallel tp={nproc} fp32, tiny Llama; smallest of {repeats} round(s)")
    print(f"command: python benchmarks/rank_start.py {' '.join(sys.argv[1:])}")
    print(
        "each launch through the launcher's agent; (fork): ranks forked from its imports (CPT_TO_SFT_RANK_START=fork)"
    )
    rows = []
    for name, (wall, cpu, first, seconds, table) in best.items():
        step = f"{first:.1f}" if first != float("inf") else "-"
        rows.append([name, f"{wall:.1f}", step, f"{cpu:.1f}", f"{seconds:.2f}", str(len(table))])
    print_table(["launch", "wall s", "first step s", "CPU s (all ranks)", "rank-0 imports s", "modules"], rows)
    if not args.smoke:
        steps = import_cpu(repeats)
        print(f"\nCPU seconds of each import step in one fresh process (smallest of {repeats}), cumulative:")
        total, rows = 0.0, []
        for label, sec in steps.items():
            total += sec
            rows.append([label, f"{sec:.2f}", f"{total:.2f}"])
        print_table(["step", "CPU s", "cumulative"], rows)
    for name, base in (("booster", "bare"), ("shard", "booster"), ("train", "booster")):
        if name not in best:
            continue
        table, base_mods = best[name][4], set(best[base][4])
        gap = collections.Counter()
        for mod, (self_us, _, _) in table.items():
            if mod not in base_mods:
                gap[package(mod)] += self_us
        extra = sum(gap.values()) / 1e6
        print(
            f"\n{name}: imports beyond the {base} rank, {extra:.2f} s (self time) in {len(set(table) - base_mods)} modules"
        )
        print_table(["package", "s"], [[k, f"{v / 1e6:.2f}"] for k, v in gap.most_common(args.top)])


if __name__ == "__main__":
    main()
