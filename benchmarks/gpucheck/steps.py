"""gpu_check's bookkeeping: the configuration it runs, its time-boxed subprocesses and their records.

    python -c "import sys; sys.path[:0] = ['benchmarks', '.']; from benchmarks.gpucheck.steps import TIMEOUTS; print(TIMEOUTS)"

Each step of benchmarks/gpu_check.py is a subprocess with a limit (`start`/`finish`/`run`, its output
in <work>/logs/<name>.log and appended to the run's log), reported as one `Check`; `throughput` is the
arithmetic of the CPT comparison, over the engine's @@progress records.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support import REPO
from tasks.core.run.events import parse_line

CONFIG = REPO / "benchmarks" / "gpu-check.yaml"
PY, ME = sys.executable, str(REPO / "benchmarks" / "gpu_check.py")  # ME: the entry, which runs the subcommands
TARGET_RATIO = 0.97
TOKENIZER_VOCAB = 512
# ~302M parameters: 20 x 11.8M (GQA attention 3.1M + gated MLP 8.7M) + 2 x 32.8M (embedding, LM head).
FULL_MODEL = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_layers=20,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=2816,
    max_position_embeddings=4096,
)
DRY_MODEL = dict(
    vocab_size=None,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    max_position_embeddings=4096,
)
# The dry run's changes to gpu-check.yaml (everything else, the CPT plugin included, is kept).
DRY_OVERRIDES = {
    "cpt": {"max_steps": 8, "checkpoint_every": 4},
    "sft": {
        "max_steps": 8,
        "checkpoint_every": 4,
        "plugin": {"name": "low_level_zero", "zero_stage": 1, "precision": "bf16"},
    },
}
# --smoke: on top of DRY_OVERRIDES. Checkpoints every 2 steps so the kill (after step 3) falls inside
# an interval and the throughput window (steps after the first 2, saves left out) keeps one step.
SMOKE_OVERRIDES = {
    "cpt": {"max_steps": 4, "checkpoint_every": 2, "seq_len": 256, "micro_batch_size": 2},
    "sft": {"max_steps": 4, "checkpoint_every": 2},
}
GPU_TESTS = (
    "tests/test_gpu.py",
    "tests/test_gpu_lora.py",
    "tests/test_eval_placement.py",
    "tests/test_gpu_construction.py",
)
# Each step's limit in seconds (a dry run's are three times these).
TIMEOUTS = {
    "env": 120,
    "kernels": 420,
    "model": 180,
    "preflight": 90,
    "plain": 240,
    "flow1": 420,
    "flow2": 300,
    "logits": 150,
    "tests": 300,
}


# ------------------------------------------------------------------------------------------------
# bookkeeping


@dataclass
class Check:
    name: str
    status: str  # ok | failed | skipped
    detail: str = ""

    def line(self) -> str:
        return f"CHECK {self.name}: {self.status}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class Ctx:
    args: argparse.Namespace
    work: Path
    log_path: Path
    deadline: float
    cuda: bool
    timeouts: dict[str, float]
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    config: Path = CONFIG  # the config the flow runs: gpu-check.yaml, or its dry-run copy
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def run_root(self) -> Path:
        return self.work / "run"

    @property
    def model_dir(self) -> Path:
        return REPO / self.raw["base_model"]["uri"]

    @property
    def kill_step(self) -> int:
        every = self.raw["sft"]["checkpoint_every"]
        return every + every // 2

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, name: str, ok: bool | None, detail: str = "") -> Check:
        c = Check(name, "skipped" if ok is None else ("ok" if ok else "failed"), detail)
        self.checks.append(c)
        say(c.line())
        return c


def say(msg: str) -> None:
    print(msg, flush=True)


API_URL_ENV = "GPU_CHECK_PREFECT_API_URL"


def base_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_HOME": str(work / "prefect-home"),
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
            "COLUMNS": "200",
        }
    )
    for k in ("CPT_TO_SFT_FAULT", "PREFECT_API_URL"):
        env.pop(k, None)
    # The CPU smoke in the test suite hands its flows the suite's API server: each flow's own embedded
    # server costs ~13 CPU-s there (start and life), twice a smoke. Unset (the GPU machine, a dry run by
    # hand), each flow starts its embedded server as a user's `python -m flows.cpt_to_sft` does.
    if os.environ.get(API_URL_ENV):
        env["PREFECT_API_URL"] = os.environ[API_URL_ENV]
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | None
    out_path: Path
    started: float
    timeout: float
    rc: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    skipped: str = ""

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace") if self.out_path.is_file() else ""


def start(ctx: Ctx, name: str, argv: list[str], timeout: float, env: dict[str, str] | None = None) -> Proc:
    out = ctx.work / "logs" / f"{name}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    limit = min(timeout, ctx.remaining())
    if limit < 10:
        return Proc(name, None, out, time.monotonic(), 0, skipped="out of the time budget")
    say(f"== {name}: {' '.join(argv[:6])}{' ...' if len(argv) > 6 else ''} (limit {limit:.0f}s)")
    with open(out, "w") as fh:  # the child holds its own copy of the handle; ours closes once it started
        popen = subprocess.Popen(
            argv, cwd=REPO, env=env or base_env(ctx.work), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )  # its own process group: a timeout ends all of it
    return Proc(name, popen, out, time.monotonic(), limit)


def finish(ctx: Ctx, p: Proc) -> Proc:
    if p.popen is not None:
        try:
            p.rc = p.popen.wait(timeout=max(1.0, p.timeout - (time.monotonic() - p.started)))
        except subprocess.TimeoutExpired:
            p.timed_out = True
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.rc = p.popen.wait()
        p.seconds = time.monotonic() - p.started
        say(f"   {p.name}: rc={p.rc}{' (TIMED OUT)' if p.timed_out else ''} in {p.seconds:.1f}s")
    with open(ctx.log_path, "a") as log:
        log.write(
            f"\n{'=' * 100}\n== {p.name}: rc={p.rc} timed_out={p.timed_out} {p.seconds:.1f}s {p.skipped}\n{'=' * 100}\n"
        )
        log.write(p.output)
    return p


def run(ctx: Ctx, name: str, argv: list[str], timeout: float, env: dict[str, str] | None = None) -> Proc:
    return finish(ctx, start(ctx, name, argv, timeout, env))


def why(p: Proc, default: str = "") -> str:
    if p.skipped:
        return f"skipped: {p.skipped}"
    if p.timed_out:
        return f"timed out after {p.seconds:.0f}s"
    tail = [ln for ln in p.output.splitlines() if ln.strip()][-3:]
    return f"rc={p.rc}: " + " | ".join(x.strip()[:160] for x in tail) if p.rc else default


def records(text: str, kind: str) -> list[dict[str, Any]]:
    """The payloads of a step's `@@<kind>` lines, a rank's or its own (tasks/core/run/events.py parses both)."""
    return [line.record for line in map(parse_line, text.splitlines()) if line.kind == kind]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------
# arithmetic


def throughput(progress: list[dict[str, Any]], save_steps: set[int], skip: int) -> dict[str, Any]:
    """tokens/s over steps > skip, leaving out each step whose interval held a checkpoint save."""
    recs = sorted(progress, key=lambda r: r["step"])
    tok = sec = 0.0
    used = []
    for prev, cur in itertools.pairwise(recs):
        if cur["step"] != prev["step"] + 1 or cur["step"] <= skip or prev["step"] in save_steps:
            continue
        tok += cur["tokens"] - prev["tokens"]
        sec += cur["elapsed_s"] - prev["elapsed_s"]
        used.append(cur["step"])
    out: dict[str, Any] = {"steps_used": len(used), "seconds": round(sec, 3), "tokens": int(tok)}
    out["tokens_per_s"] = tok / sec if sec > 0 else None
    if recs:
        out["wall_tokens_per_s_incl_saves"] = (
            recs[-1]["tokens"] / recs[-1]["elapsed_s"] if recs[-1]["elapsed_s"] else None
        )
    return out


# ------------------------------------------------------------------------------------------------
# the flow's records


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def stage_table(run: dict[str, Any]) -> list[str]:
    return [f"{s['stage']:<16} {s['status']:<10} {s.get('seconds', 0):7.1f}s" for s in run.get("stages", [])]


def launches_of(recs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(r["verb"], r["phase"]) for r in recs if r["event"] == "launch"]


def train_progress(recs: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    return [r for r in recs if r["event"] == "progress" and r["phase"] == phase and r["verb"] == "train"]
