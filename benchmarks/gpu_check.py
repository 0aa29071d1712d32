"""GPU validation of the flow on one CUDA GPU, in one command with a time budget; and its CPU dry run.

    bash benchmarks/gpu_check.sh                     # GPU machine: install carried wheels, then this
    python benchmarks/gpu_check.py [--budget-s 540]  # the same without the installs
    python benchmarks/gpu_check.py --dry-run         # here, on CPU: small model, CPU plugin for SFT
    python benchmarks/gpu_check.py --smoke           # the dry run at 4 steps a stage, no tests/test_gpu.py: checks the script runs

What it runs, each step a time-boxed subprocess (its output goes to $OUT/gpu_check.log, or
<work>/gpu_check.log without $OUT), then one `CHECK <name>: ok|failed (<reason>)` line per check:

  env                 versions (torch/CUDA, transformers 4.51.3, colossalai 0.5.0, prefect 3.9), the GPU
  kernels             ColossalAI's CPU-Adam and fused-Adam JIT kernels (HybridAdam, Gemini's optimizer),
                      built while the model is written
  model               a Llama-shaped random model (~300M parameters, vocab 32000) + the demo tokenizer,
                      written to benchmarks/gpu-check.yaml's base_model.uri
  preflight           `python -m flows.cpt_to_sft --config gpu-check.yaml --check` is clean (on CPU:
                      exactly one problem, sft.plugin.name: gemini needs CUDA)
  plain_baseline      benchmarks/plain_colossalai_train.py under torchrun: same model, plugin, batch,
                      seq_len, steps and activation checkpointing as the config's CPT stage, no
                      orchestration, the fast kernels on as ColossalAI's own benchmark runs them; every
                      loss finite
  same_kernels        the flow's CPT training ran the same kernels as the plain script (both decided by
                      tasks/core/config/kernels.py on this machine; the flow's from its @@kernels record)
  flow_kill           the flow with CPT_TO_SFT_FAULT=kill@step=K@stage=sft (K = 1.5 checkpoint
                      intervals): CPT, unshard, evaluate_cpt and reboost complete, SFT dies after step K
  flow_resume         the retry over the same run root: nothing before SFT is relaunched, SFT resumes
                      from its last checkpoint, the run completes; redone steps' losses vs the first try
  sft_checkpoint      the SFT checkpoints are Gemini/HybridAdam ones and hold the CUDA RNG state
  export_fingerprint  export/.cpt-to-sft/verification.json matches, and the export's logits recomputed on the GPU
                      match the final SFT checkpoint's fingerprint
  throughput          the flow's CPT tokens/s (from the engine's @@progress records) over the plain
                      script's, same steps, the intervals holding a checkpoint save left out, the first
                      5 steps too; target >= 0.97. Model TFLOP/s per GPU and MFU as the engine
                      computes them (tasks/core/models/flops.py: 6 N + 12 L H T FLOPs per token, N
                      every parameter; the device's dense peak from its table), so the two agree
  gpu_tests           `pytest -m gpu tests/test_gpu.py tests/test_gpu_lora.py tests/test_eval_placement.py tests/test_gpu_construction.py`
                      (tiny model, and a 620M one built lazily on the GPU; evaluation spread
                      over the visible GPUs needs two), run beside the retry, which is not timed

--dry-run (no CUDA): the model is tiny (same config otherwise), the CPT plugin is the config's own
(HybridParallel ZeRO-1 bf16 on one CPU rank), SFT runs low_level_zero instead of Gemini, steps are
fewer; kernels are skipped and the throughput ratio is parsed and printed but not judged.
--smoke is the dry run with SMOKE_OVERRIDES on top (4 steps a stage, shorter CPT blocks) and the
flows' Prefect home seeded with an already migrated database (support/servers/prefect_home.py): every
check but gpu_tests still runs (tests/test_gpu.py only collects and skips on CPU, as the test suite
itself shows, and a pytest beside the retry would slow it on two cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support import REPO
from support.tiny import tiny_tokenizer
from tasks.core.models import flops
from tasks.core.run.events import parse_line

CONFIG = REPO / "benchmarks" / "gpu-check.yaml"
PY, ME = sys.executable, str(Path(__file__).resolve())
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
# internal subcommands (each runs in its own process)


def cmd_env() -> int:
    import importlib.metadata as md

    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if info["cuda_available"]:
        info.update(
            gpu=torch.cuda.get_device_name(0),
            gpus=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        )
    for name in (
        "transformers",
        "tokenizers",
        "huggingface-hub",
        "colossalai",
        "prefect",
        "pydantic",
        "safetensors",
        "numpy",
        "peft",
        "bitsandbytes",
        "galore-torch",
    ):
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            info[name] = None
    from torch.utils.cpp_extension import CUDA_HOME

    info["nvcc"], info["cuda_home"] = shutil.which("nvcc"), CUDA_HOME
    import colossalai  # noqa: F401
    import prefect  # noqa: F401
    from colossalai.booster.plugin import GeminiPlugin, HybridParallelPlugin  # noqa: F401
    from colossalai.nn.optimizer import HybridAdam  # noqa: F401

    import flows.cpt_to_sft  # noqa: F401
    import tasks.engine.loop  # noqa: F401

    info["imports"] = "ok"
    print("@@env " + json.dumps(info, sort_keys=True), flush=True)
    return 0


def cmd_kernels() -> int:
    """Build (JIT) and smoke-test the kernels HybridAdam needs; later processes load them from
    ~/.cache/colossalai/torch_extensions."""
    import torch
    from colossalai.kernel.kernel_loader import CPUAdamLoader, FusedOptimizerLoader

    times = {}
    for loader in (CPUAdamLoader, FusedOptimizerLoader):
        t0 = time.monotonic()
        loader().load()
        times[loader.__name__] = round(time.monotonic() - t0, 1)
    from colossalai.nn.optimizer import HybridAdam

    p = torch.nn.Parameter(torch.ones(1024, device="cuda"))
    opt = HybridAdam([p], lr=0.1, adamw_mode=True)
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    moved = float((1.0 - p.detach()).abs().max())
    if not 0.05 < moved < 0.2:  # AdamW's first step moves each weight by ~lr
        raise SystemExit(f"HybridAdam step moved weights by {moved}, expected ~0.1")
    print("@@kernels " + json.dumps({"seconds": times, "first_step_delta": moved}), flush=True)
    return 0


def cmd_build_model(out: str, size: str) -> int:
    from tasks.core.models.demo import build_tiny_model
    from tasks.core.preflight.checks import estimate_parameters

    shape = dict(FULL_MODEL if size == "full" else DRY_MODEL)
    vocab = shape.pop("vocab_size")
    dest = Path(out)
    tmp = dest.with_name(dest.name + ".tmp-build")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.monotonic()
    build_tiny_model(tmp, tiny_tokenizer(TOKENIZER_VOCAB), vocab_size=vocab, seed=0, **shape)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    mc = json.loads((dest / "config.json").read_text())
    info = {
        "path": str(dest),
        "params": estimate_parameters(mc),
        "vocab_size": mc["vocab_size"],
        "hidden_size": mc["hidden_size"],
        "layers": mc["num_hidden_layers"],
        "seconds": round(time.monotonic() - t0, 1),
    }
    print("@@model " + json.dumps(info), flush=True)
    return 0


def cmd_flow(config: str, run_root: str, records_path: str) -> int:
    """The flow in this process, every engine launch's records appended to a JSONL file as they come
    (a killed stage keeps what it printed)."""
    import tasks.train
    from flows.cli import flow_main

    real = tasks.train.run_engine
    with open(records_path, "a") as sink:

        def write(obj: dict[str, Any]) -> None:
            sink.write(json.dumps(obj, sort_keys=True) + "\n")
            sink.flush()

        def recording(verb, job, *args, **kwargs):
            stage, t0 = job.stage, time.monotonic()
            write({"event": "launch", "verb": verb, "stage": stage})
            inner_progress, inner_event = kwargs.get("on_progress"), kwargs.get("on_event")

            def on_progress(rec):
                write({**rec, "event": "progress", "verb": verb, "stage": stage})
                if inner_progress:
                    inner_progress(rec)

            def on_event(kind, rec):
                write({**rec, "event": kind, "verb": verb, "stage": stage})
                if inner_event:
                    inner_event(kind, rec)

            kwargs.update(on_progress=on_progress, on_event=on_event)
            try:
                result = real(verb, job, *args, **kwargs)
            except BaseException as exc:
                write(
                    {
                        "event": "end",
                        "verb": verb,
                        "stage": stage,
                        "ok": False,
                        "seconds": round(time.monotonic() - t0, 2),
                        "error": str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__,
                    }
                )
                raise
            write(
                {"event": "end", "verb": verb, "stage": stage, "ok": True, "seconds": round(time.monotonic() - t0, 2)}
            )
            return result

        tasks.train.run_engine = recording
        try:
            return flow_main(["--config", config, "--run-root", run_root])
        except Exception as exc:  # the flow re-raises the failed stage's error
            print(f"flow failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
            return 4  # 1 and 3 are the flow's own (a stage failed / the gate failed)


def cmd_logits(export_dir: str, checkpoint_dir: str) -> int:
    """The export's logits by plain transformers on this machine's device vs the checkpoint's fingerprint."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.core.models.fingerprint import load_fingerprint, max_abs_diff, model_logits

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(export_dir, torch_dtype=torch.bfloat16, use_safetensors=True).to(
        device
    )
    logits = model_logits(model, model.config.vocab_size)
    ref = load_fingerprint(checkpoint_dir)
    info = {
        "device": device,
        "max_abs_diff": max_abs_diff(logits, ref),
        "bitwise": bool(torch.equal(logits, ref)),
        "ref_mean_abs": float(ref.abs().mean()),
    }
    print("@@logits " + json.dumps(info), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# the check


def load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text())


def write_config(ctx: Ctx) -> tuple[Path, dict[str, Any]]:
    """gpu-check.yaml itself on the GPU; a copy with DRY_OVERRIDES for the dry run."""
    raw = load_yaml(CONFIG)
    if not ctx.args.dry_run:
        return CONFIG, raw
    import yaml

    for overrides in (DRY_OVERRIDES, SMOKE_OVERRIDES) if ctx.args.smoke else (DRY_OVERRIDES,):
        for stage, over in overrides.items():
            raw[stage].update(over)
    raw["name"] = "gpu-check-dry"
    path = ctx.work / "gpu-check-dry.yaml"
    which = "DRY_OVERRIDES and SMOKE_OVERRIDES (CPU smoke run)" if ctx.args.smoke else "DRY_OVERRIDES (CPU dry run)"
    path.write_text(f"# gpu-check.yaml with benchmarks/gpu_check.py's {which}\n" + yaml.safe_dump(raw, sort_keys=False))
    return path, raw


def problems_in(text: str) -> list[str]:
    """Field names of the problems in a pre-flight report ('  - field: message' lines)."""
    return [ln.strip()[2:].split(":", 1)[0] for ln in text.splitlines() if ln.startswith("  - ")]


def make_ctx(args: argparse.Namespace, cuda: bool) -> Ctx:
    """The work directory (emptied), the log, the time budget and each step's limit for this run."""
    if args.budget_s is None:
        args.budget_s = 1800.0 if args.dry_run else 540.0
    work = Path(args.work or ("/tmp/gpu-check-dry" if args.dry_run else "/tmp/gpu-check")).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if args.smoke:
        # The first flow's embedded server would spend ~35 s wall (~11 s CPU; SQLite's fsyncs) migrating an
        # empty database, which the smoke has no use for: it starts from a copy of one already migrated.
        from support.servers.prefect_home import seeded_home

        seeded_home(work / "prefect-home")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else work
    out_dir.mkdir(parents=True, exist_ok=True)
    # two CPU cores in a dry run: every launch is slower than on the GPU machine
    timeouts = {k: v * 3 for k, v in TIMEOUTS.items()} if args.dry_run else dict(TIMEOUTS)
    ctx = Ctx(args, work, out_dir / "gpu_check.log", time.monotonic() + args.budget_s, cuda, timeouts)
    ctx.log_path.write_text(f"gpu_check {'--dry-run ' if args.dry_run else ''}started {time.ctime()} in {work}\n")
    ctx.config, ctx.raw = write_config(ctx)
    return ctx


def check_env(ctx: Ctx) -> None:
    """Versions and imports in a fresh process: the pinned stack, and a CUDA device outside a dry run."""
    p = run(ctx, "env", [PY, ME, "_env"], ctx.timeouts["env"])
    env_rec = (records(p.output, "env") or [{}])[0]
    ctx.figures["env"] = env_rec
    want = {"transformers": "4.51.3", "colossalai": "0.5.0"}
    bad = [f"{k} {env_rec.get(k)} (want {v})" for k, v in want.items() if env_rec.get(k) != v]
    if not str(env_rec.get("prefect") or "").startswith("3.9"):
        bad.append(f"prefect {env_rec.get('prefect')} (want 3.9.x)")
    if not ctx.args.dry_run and not env_rec.get("cuda_available"):
        bad.append("torch sees no CUDA device")
    summary = (
        f"python {env_rec.get('python')}, torch {env_rec.get('torch')} (CUDA {env_rec.get('torch_cuda')}), "
        f"{env_rec.get('gpu', 'no GPU')}, transformers {env_rec.get('transformers')}, colossalai "
        f"{env_rec.get('colossalai')}, "
        f"prefect {env_rec.get('prefect')}, bitsandbytes {env_rec.get('bitsandbytes') or 'stub/absent'}, nvcc "
        f"{env_rec.get('nvcc')}"
    )
    ctx.check("env", p.rc == 0 and not bad, summary if p.rc == 0 and not bad else "; ".join(bad) or why(p))


def check_model(ctx: Ctx) -> dict[str, Any] | None:
    """The base model written where the config reads it; its config.json, or None when there is none."""
    size = "dry" if ctx.args.dry_run else "full"
    p = run(ctx, "model", [PY, ME, "_build-model", "--out", str(ctx.model_dir), "--size", size], ctx.timeouts["model"])
    model_rec = (records(p.output, "model") or [{}])[0]
    ctx.figures["model"] = model_rec
    ctx.check(
        "model",
        p.rc == 0 and bool(model_rec),
        f"{model_rec.get('params', 0) / 1e6:.1f}M parameters, hidden {model_rec.get('hidden_size')}, "
        f"{model_rec.get('layers')} layers, "
        f"vocab {model_rec.get('vocab_size')} (tokenizer {TOKENIZER_VOCAB}), written in {model_rec.get('seconds')}s"
        if p.rc == 0
        else why(p),
    )
    path = ctx.model_dir / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def check_preflight(ctx: Ctx) -> None:
    """Pre-flight of the committed config: clean on the GPU; on CPU exactly the Gemini problem."""
    p = run(
        ctx,
        "preflight",
        [PY, "-m", "flows.cpt_to_sft", "--config", str(CONFIG), "--run-root", str(ctx.run_root), "--check"],
        ctx.timeouts["preflight"],
    )
    found = problems_in(p.output)
    ctx.figures["preflight_report"] = p.output.strip().splitlines()
    if not ctx.args.dry_run:
        ctx.check("preflight", p.rc == 0, "clean" if p.rc == 0 else f"problems {found}: {why(p)}")
        return
    say(
        "   pre-flight report (gpu-check.yaml on this CPU machine):\n"
        + "\n".join("     " + ln for ln in p.output.strip().splitlines())
    )
    ctx.check(
        "preflight",
        p.rc == 1 and found == ["sft.plugin.name"],
        "exactly one problem on CPU: sft.plugin.name (gemini needs CUDA)"
        if found == ["sft.plugin.name"]
        else f"problems {found}, rc={p.rc}",
    )


def check_kernels(ctx: Ctx, kernels: Proc | None) -> None:
    """The JIT build started beside the model's: HybridAdam's kernels load and take a step."""
    if kernels is None:
        ctx.check("kernels", None, "dry run: no CUDA here; HybridAdam's kernels are JIT-built on the GPU machine")
        return
    finish(ctx, kernels)
    krec = (records(kernels.output, "kernels") or [{}])[0]
    ctx.figures["kernels"] = krec
    ctx.check(
        "kernels",
        kernels.rc == 0 and bool(krec),
        f"built/loaded in {krec.get('seconds')}s, HybridAdam step ok" if kernels.rc == 0 else why(kernels),
    )


def plain_argv(ctx: Ctx) -> list[str]:
    """benchmarks/plain_colossalai_train.py under torchrun, shaped as the config's CPT stage."""
    cpt = ctx.raw["cpt"]
    argv = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cpt["launch"]["nproc_per_node"])]
    argv += [ME.replace("gpu_check.py", "plain_colossalai_train.py"), "--model", str(ctx.model_dir)]
    argv += ["--plugin", cpt["plugin"]["name"], "--tp", str(cpt["plugin"].get("tp_size", 1))]
    argv += ["--zero-stage", str(cpt["plugin"].get("zero_stage", 0))]
    argv += [
        "--precision",
        cpt["plugin"].get("precision", "bf16"),
        "--max-norm",
        str(cpt["plugin"].get("max_norm", 1.0)),
    ]
    argv += ["--seq-len", str(cpt["seq_len"]), "--micro-batch-size", str(cpt["micro_batch_size"])]
    argv += [
        "--steps",
        str(cpt["max_steps"]),
        "--lr",
        str(cpt["lr"]),
        "--warmup-steps",
        str(cpt.get("warmup_steps", 0)),
    ]
    argv += ["--token-vocab", str(TOKENIZER_VOCAB)]
    if cpt.get("activation_checkpointing"):
        argv.append("--activation-checkpointing")
    return argv


def check_plain_baseline(ctx: Ctx) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The plain script's run (before the flow: nothing else runs on the machine meanwhile); its
    @@progress records and its @@kernels record."""
    cpt = ctx.raw["cpt"]
    if cpt.get("grad_accum_steps", 1) != 1:
        say("   note: the plain script runs grad_accum_steps=1; the config's CPT stage accumulates")
    penv = base_env(ctx.work)
    penv.setdefault("OMP_NUM_THREADS", "1")
    p = run(ctx, "plain", plain_argv(ctx), ctx.timeouts["plain"], penv)
    plain_progress = records(p.output, "progress")
    finite = all(math.isfinite(float(r["loss"])) for r in plain_progress)
    ctx.check(
        "plain_baseline",
        p.rc == 0 and len(plain_progress) == cpt["max_steps"] and finite,
        f"{len(plain_progress)} steps, last loss {plain_progress[-1]['loss']:.3f}"
        if plain_progress and p.rc == 0
        else why(p, "no progress records"),
    )
    return plain_progress, (records(p.output, "kernels") or [{}])[0]


def flow_argv(ctx: Ctx, records_path: Path) -> list[str]:
    return [
        PY,
        ME,
        "_flow",
        "--config",
        str(ctx.config),
        "--run-root",
        str(ctx.run_root),
        "--records",
        str(records_path),
    ]


def run_flow_kill(ctx: Ctx) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The flow with SFT killed after step K (1.5 checkpoint intervals); its launches' records and run.json."""
    rec1 = ctx.work / "records-run1.jsonl"
    env1 = base_env(ctx.work)
    env1["CPT_TO_SFT_FAULT"] = f"kill@step={ctx.kill_step}@stage=sft"
    p1 = run(ctx, "flow1-kill", flow_argv(ctx, rec1), ctx.timeouts["flow1"], env1)
    if p1.timed_out:
        argv = [PY, "-m", "flows.cpt_to_sft", "--config", str(ctx.config), "--run-root", str(ctx.run_root)]
        run(ctx, "break-lease", [*argv, "--break-lease"], 60)
    r1, run1 = read_jsonl(rec1), _read_json(ctx.run_root / "run.json")
    check_flow_kill(ctx, p1, r1, run1, ctx.kill_step, ctx.raw["cpt"], ctx.raw["sft"])
    return r1, run1


def start_gpu_tests(ctx: Ctx) -> Proc | None:
    """The GPU tests (tiny model), started beside the retry, which is not timed: kernels are built by
    now and nothing measured runs any more."""
    if ctx.args.skip_tests:
        return None
    argv = [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *GPU_TESTS]
    return start(ctx, "gpu-tests", argv, ctx.timeouts["tests"])


def run_flow_retry(ctx: Ctx, r1: list[dict[str, Any]], run1: dict[str, Any]) -> None:
    """The retry over the same run root: only SFT relaunched, resumed from its last checkpoint."""
    rec2 = ctx.work / "records-run2.jsonl"
    p2 = run(ctx, "flow2-retry", flow_argv(ctx, rec2), ctx.timeouts["flow2"])
    run2 = _read_json(ctx.run_root / "run.json")
    check_flow_resume(ctx, p2, r1, read_jsonl(rec2), run2, ctx.raw["sft"])
    ctx.figures["stages_run1"] = _stage_table(run1)
    ctx.figures["stages_run2"] = _stage_table(run2)


def check_export_fingerprint(ctx: Ctx, final_sft: Path) -> None:
    """The flow's own verification of the export, and the export's logits recomputed on this device
    against the final SFT checkpoint's fingerprint."""
    from tasks.core.models.hf_artifact import VERIFICATION

    export = ctx.run_root / "export"
    ver = _read_json(export / VERIFICATION)
    if not ver or not final_sft.is_dir():
        ctx.check(
            "export_fingerprint",
            False,
            "no export/.cpt-to-sft/verification.json or final SFT checkpoint: the flow did not complete",
        )
        return
    argv = [PY, ME, "_logits", "--export", str(export), "--checkpoint", str(final_sft)]
    p = run(ctx, "logits", argv, ctx.timeouts["logits"])
    lrec = (records(p.output, "logits") or [{}])[0]
    ctx.figures["export_logits"] = lrec
    # The flow's tolerance is relative to the logits' magnitude (tasks.core.models.fingerprint.compare_logits).
    tol = ver.get("fingerprint_rtol", 0.04) * ver.get("fingerprint_max_abs_logit", 1.0)
    ok = bool(ver.get("fingerprint_match")) and p.rc == 0 and lrec.get("max_abs_diff", 1e9) <= tol
    ctx.check(
        "export_fingerprint",
        ok,
        f"flow's check (transformers on CPU) max|dlogit| {ver.get('fingerprint_max_abs_diff'):.3g} <= {tol:.3g}; "
        f"recomputed on {lrec.get('device')}: {lrec.get('max_abs_diff', float('nan')):.3g}"
        f"{' (bitwise)' if lrec.get('bitwise') else ''}, logits mean |x| {lrec.get('ref_mean_abs', float('nan')):.3g}"
        if p.rc == 0
        else why(p),
    )


def check_gpu_tests(ctx: Ctx, tests: Proc | None) -> None:
    """The GPU tests' outcome; on CPU they must collect and skip."""
    if tests is None:
        ctx.check("gpu_tests", None, "--skip-tests")
        return
    p = finish(ctx, tests)
    last = [ln for ln in p.output.splitlines() if ln.strip()][-1:] or ["no output"]
    if p.skipped or p.timed_out:
        ctx.check(
            "gpu_tests", None if p.skipped else False, why(p) + "; run: python -m pytest -m gpu tests/test_gpu.py"
        )
    elif ctx.args.dry_run:
        ctx.check(
            "gpu_tests",
            p.rc == 0 and "skipped" in last[0] and "failed" not in last[0],
            f"no CUDA, collected and skipped: {last[0].strip('= ')}",
        )
    else:
        failed = [ln.strip()[:200] for ln in p.output.splitlines() if ln.startswith("FAILED")]
        ctx.check(
            "gpu_tests", p.rc == 0, last[0].strip("= ") + ("" if p.rc == 0 else f"; {' | '.join(failed) or why(p)}")
        )


def main_check(args: argparse.Namespace) -> int:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        say("no CUDA device visible: run on the GPU machine, or use --dry-run here")
        return 2
    ctx = make_ctx(args, cuda)
    t_start = time.monotonic()
    say(
        f"gpu_check: {'DRY RUN on CPU' if args.dry_run else 'GPU'}; work dir {ctx.work}; log {ctx.log_path}; budget "
        f"{args.budget_s:.0f}s"
    )
    check_env(ctx)
    # the kernels build in the background while the model is written
    kernels = None if args.dry_run else start(ctx, "kernels", [PY, ME, "_kernels"], ctx.timeouts["kernels"])
    mc = check_model(ctx)
    check_preflight(ctx)
    check_kernels(ctx, kernels)
    if mc is None:
        say("no model: stopping")
        return report(ctx, t_start)
    plain_progress, plain_kernels = check_plain_baseline(ctx)
    r1, run1 = run_flow_kill(ctx)
    tests = start_gpu_tests(ctx)
    run_flow_retry(ctx, r1, run1)
    sft = ctx.raw["sft"]
    final_sft = ctx.run_root / "sft" / f"step-{sft['max_steps']:06d}"
    check_sft_checkpoint(ctx, final_sft, sft)
    check_export_fingerprint(ctx, final_sft)
    # the flow's CPT stage vs the plain script, with the same kernels
    check_throughput(ctx, r1, plain_progress, mc, ctx.raw["cpt"], 2 if args.dry_run else 5)
    check_same_kernels(ctx, r1, plain_kernels)
    check_gpu_tests(ctx, tests)
    return report(ctx, t_start)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _stage_table(run: dict[str, Any]) -> list[str]:
    return [f"{s['stage']:<16} {s['status']:<10} {s.get('seconds', 0):7.1f}s" for s in run.get("stages", [])]


def _launches(recs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(r["verb"], r["stage"]) for r in recs if r["event"] == "launch"]


def _progress(recs: list[dict[str, Any]], stage: str) -> list[dict[str, Any]]:
    return [r for r in recs if r["event"] == "progress" and r["stage"] == stage and r["verb"] == "train"]


def check_flow_kill(ctx: Ctx, p: Proc, r1, run1, kill_step: int, cpt, sft) -> None:
    launches = _launches(r1)
    want = [("shard", "cpt"), ("train", "cpt"), ("shard", "sft"), ("train", "sft")]
    sft_steps = [r["step"] for r in _progress(r1, "sft")]
    cpt_steps = [r["step"] for r in _progress(r1, "cpt")]
    stages = {s["stage"]: s["status"] for s in run1.get("stages", [])}
    problems = []
    if p.rc == 0:
        problems.append("the flow succeeded although SFT was to be killed")
    if launches != want:
        problems.append(f"launches {launches}, expected {want}")
    if cpt_steps != list(range(1, cpt["max_steps"] + 1)):
        problems.append(f"CPT steps {cpt_steps[:3]}..{cpt_steps[-3:]} of {cpt['max_steps']}")
    if not sft_steps or sft_steps[-1] != kill_step:
        problems.append(f"SFT's last step {sft_steps[-1] if sft_steps else None}, expected {kill_step}")
    if stages.get("train_sft") != "failed":
        problems.append(f"run.json says train_sft {stages.get('train_sft')!r}, expected 'failed'")
    if p.timed_out or p.skipped:
        problems.insert(0, why(p))
    ctx.check(
        "flow_kill",
        not problems,
        f"CPT {len(cpt_steps)} steps, unshard, evaluate_cpt and reboost done, SFT SIGKILLed after step {kill_step}, "
        "run.json records train_sft failed"
        if not problems
        else "; ".join(problems),
    )


def check_flow_resume(ctx: Ctx, p: Proc, r1, r2, run2, sft) -> None:
    launches = _launches(r2)
    steps = [r["step"] for r in _progress(r2, "sft")]
    every = sft["checkpoint_every"]
    first = _progress(r1, "sft")
    problems = []
    if p.rc != 0:
        problems.append(why(p))
    if launches != [("train", "sft")]:
        problems.append(f"launches {launches}, expected only SFT training (every earlier stage skipped)")
    last_before = first[-1]["step"] if first else 0
    resumed_from = steps[0] - 1 if steps else None
    if resumed_from is None or resumed_from != (last_before // every) * every:
        problems.append(f"resumed from step {resumed_from}, expected {(last_before // every) * every}")
    if not steps or steps[-1] != sft["max_steps"]:
        problems.append(f"SFT ended at {steps[-1] if steps else None}, expected {sft['max_steps']}")
    if not run2.get("complete"):
        problems.append("run.json not complete")
    before = {r["step"]: r["loss"] for r in first}
    redone = [(r["step"], before[r["step"]], r["loss"]) for r in _progress(r2, "sft") if r["step"] in before]
    diffs = [abs(a - b) for _, a, b in redone]
    bitwise = all(a == b for _, a, b in redone)
    ctx.figures["sft_redone_losses"] = redone
    # Losses of redone steps: close, not bitwise. The flow does not force deterministic kernels, and
    # a bf16 checkpoint holds no fp32 master weights, so the resumed masters are the bf16 weights
    # upcast; tests/test_gpu.py checks the first resumed step bitwise with deterministic kernels.
    if diffs and max(diffs) > 0.05:
        problems.append(f"redone steps' losses differ by up to {max(diffs):.3g} from the first try")
    ctx.check(
        "flow_resume",
        not problems,
        f"only SFT relaunched, resumed from step {resumed_from} ({len(redone)} steps redone, <= one interval of "
        f"{every}), completed; "
        f"redone losses max|d| {max(diffs) if diffs else float('nan'):.2g}{' (bitwise)' if bitwise and redone else ''}"
        if not problems
        else "; ".join(problems),
    )


def check_sft_checkpoint(ctx: Ctx, final_sft: Path, sft) -> None:
    from tasks.core.run.manifest import verify_artifact

    try:
        m = verify_artifact(final_sft, deep=True)
    except Exception as exc:  # whatever makes it unverifiable is this check's finding, reported with the others
        ctx.check("sft_checkpoint", False, f"{final_sft}: {exc}")
        return
    meta = m.get("meta", {})
    plugin, opt = meta.get("plugin", {}).get("name"), meta.get("optimizer")
    problems = []
    if plugin != sft["plugin"]["name"]:
        problems.append(f"plugin {plugin}")
    if sft["plugin"]["name"] == "gemini" and opt != "HybridAdam":
        problems.append(f"optimizer {opt}, expected HybridAdam")
    from safetensors import safe_open

    rng = final_sft / "rng" / "rank-00000.safetensors"
    keys = []
    if rng.is_file():
        with safe_open(str(rng), "pt") as f:
            keys = sorted(f.keys())
    if ctx.cuda and "cuda" not in keys:
        problems.append(f"rng state keys {keys}: no CUDA generator state")
    ctx.check(
        "sft_checkpoint",
        not problems,
        f"{final_sft.name} verifies ({len(m['files'])} files), plugin {plugin}, optimizer {opt}, "
        f"weights {meta.get('weights_dtype')}, rng {keys}"
        if not problems
        else "; ".join(problems),
    )


def check_throughput(ctx: Ctx, r1, plain_progress, mc, cpt, skip: int) -> None:
    flow_progress = _progress(r1, "cpt")
    saves = {int(r["step"]) for r in r1 if r["event"] == "checkpoint" and r["stage"] == "cpt" and r["verb"] == "train"}
    if not flow_progress or not plain_progress:
        ctx.check("throughput", False, f"records missing: flow {len(flow_progress)}, plain {len(plain_progress)}")
        return
    f = throughput(flow_progress, saves, skip)
    pl = throughput(plain_progress, set(), skip)
    world = cpt["launch"]["nproc_per_node"] * cpt["launch"].get("nnodes", 1)
    # the engine's MFU (tasks/engine/metrics.py): its FLOPs per token and its peak for this device
    fpt = flops.config_flops_per_token(mc, cpt["seq_len"])
    device = ctx.figures.get("env", {}).get("gpu")
    peak = flops.peak_flops(device, cpt["plugin"].get("precision", "bf16"))
    for d in (f, pl):
        tps = d["tokens_per_s"] or 0.0
        d["tflops_per_gpu"] = tps * fpt / world / 1e12
        d["mfu"] = flops.mfu(tps, fpt, peak, world)
    ratio = (f["tokens_per_s"] or 0) / pl["tokens_per_s"] if pl["tokens_per_s"] else None
    # The engine's own per-step figures (tasks/engine/metrics.py: 6N with the embeddings + attention,
    # against tasks/core/models/flops.py's peak for the device), over the same steps.
    used = [r for r in flow_progress if int(r["step"]) > skip and int(r["step"]) - 1 not in saves]
    eng_mfu = sorted(float(r["mfu"]) for r in used if r.get("mfu") is not None)
    peak_mem = max((int(r["peak_mem_bytes"]) for r in used if r.get("peak_mem_bytes")), default=None)
    f["engine_mfu_median"] = eng_mfu[len(eng_mfu) // 2] if eng_mfu else None
    f["peak_mem_gib"] = round(peak_mem / 2**30, 2) if peak_mem else None
    ctx.figures["throughput"] = {
        "flow": f,
        "plain": pl,
        "ratio": ratio,
        "flops_per_token": fpt,
        "peak_flops_per_gpu": peak,
        "checkpoint_steps_left_out": sorted(saves),
    }
    say("")
    say(
        f"   CPT throughput, steps {skip + 1}..{cpt['max_steps']} (intervals with a checkpoint save left out), "
        f"{cpt['micro_batch_size']} x {cpt['seq_len']} tokens/step, {fpt / 1e9:.2f} GFLOP/token:"
    )
    say(f"   MFU against {peak / 1e12:.0f} TFLOP/s ({device}, tasks/core/models/flops.py)" if peak else "   MFU: n/a")
    say(f"   {'':8} {'tokens/s':>12} {'TFLOP/s/GPU':>12} {'MFU':>8} {'steps':>6} {'wall tok/s incl. saves':>24}")
    for name, d in (("flow", f), ("plain", pl)):
        wall = d.get("wall_tokens_per_s_incl_saves")
        mfu = f"{d['mfu']:8.1%}" if d["mfu"] is not None else f"{'n/a':>8}"
        say(
            f"   {name:8} {d['tokens_per_s'] or 0:12.0f} {d['tflops_per_gpu']:12.1f} {mfu} "
            f"{d['steps_used']:6d} {wall or 0:24.0f}"
        )
    say(f"   flow / plain = {ratio:.3f} (target >= {TARGET_RATIO})" if ratio else "   flow / plain = n/a")
    if f["engine_mfu_median"] is not None or f["peak_mem_gib"] is not None:
        say(
            f"   the engine's own figures: median MFU {f['engine_mfu_median'] or 0:.1%} (per step), "
            f"peak GPU memory {f['peak_mem_gib']} GiB"
        )
    detail = (
        (
            f"flow {f['tokens_per_s']:.0f} tok/s = {f['tflops_per_gpu']:.1f} TFLOP/s/GPU"
            + (f" (MFU {f['mfu']:.1%})" if f["mfu"] is not None else "")
            + f", plain {pl['tokens_per_s']:.0f} tok/s = {pl['tflops_per_gpu']:.1f} TFLOP/s; "
            f"ratio {ratio:.3f} (target >= {TARGET_RATIO})"
        )
        if ratio
        else "no window"
    )
    if ctx.args.dry_run:
        ctx.check(
            "throughput",
            bool(ratio) and f["steps_used"] > 0 and pl["steps_used"] > 0,
            "dry run, parsed, not judged on CPU: " + detail,
        )
    else:
        ctx.check("throughput", bool(ratio) and ratio >= TARGET_RATIO, detail)


def check_same_kernels(ctx: Ctx, r1, plain: dict[str, Any]) -> None:
    """The flow's CPT training and the plain script ran the same kernels and activation checkpointing."""
    from tasks.core.config.kernels import describe

    flow = next((r for r in r1 if r["event"] == "kernels" and r["stage"] == "cpt" and r["verb"] == "train"), {})
    ctx.figures["kernels_used"] = {
        "flow": flow.get("kernels"),
        "plain": plain.get("kernels"),
        "activation_checkpointing": [flow.get("activation_checkpointing"), plain.get("activation_checkpointing")],
    }
    same = (
        bool(flow)
        and flow.get("kernels") == plain.get("kernels")
        and flow.get("activation_checkpointing") == plain.get("activation_checkpointing")
    )
    ac = "on" if flow.get("activation_checkpointing") else "off"
    ctx.check(
        "same_kernels",
        same,
        f"{describe(flow.get('kernels') or {})}; activation checkpointing: {ac}"
        if same
        else f"flow {flow.get('kernels')} (ac {flow.get('activation_checkpointing')}) vs plain {plain.get('kernels')} "
        f"(ac {plain.get('activation_checkpointing')})",
    )


def report(ctx: Ctx, t_start: float) -> int:
    total = time.monotonic() - t_start
    summary = {
        "dry_run": ctx.args.dry_run,
        "seconds": round(total, 1),
        "checks": [c.__dict__ for c in ctx.checks],
        "figures": ctx.figures,
    }
    spath = ctx.log_path.with_name("summary.json")
    spath.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    for name in ("stages_run1", "stages_run2"):
        if ctx.figures.get(name):
            say(f"\n   {name.replace('_', ' ')} (run.json):\n" + "\n".join("     " + ln for ln in ctx.figures[name]))
    say(
        f"\n== summary ({'dry run, CPU' if ctx.args.dry_run else 'GPU'}; {total:.0f}s; full log {ctx.log_path}; "
        f"{spath.name}) =="
    )
    for c in ctx.checks:
        say(c.line())
    failed = [c.name for c in ctx.checks if c.status == "failed"]
    say(f"RESULT: {'all checks ok' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("_"):
        sub = argparse.ArgumentParser(prog=f"gpu_check.py {argv[0]}")
        sub.add_argument("--out")
        sub.add_argument("--size", choices=["full", "dry"], default="full")
        sub.add_argument("--config")
        sub.add_argument("--run-root")
        sub.add_argument("--records")
        sub.add_argument("--export")
        sub.add_argument("--checkpoint")
        a = sub.parse_args(argv[1:])
        verb = argv[0]
        if verb == "_env":
            return cmd_env()
        if verb == "_kernels":
            return cmd_kernels()
        if verb == "_build-model":
            return cmd_build_model(a.out, a.size)
        if verb == "_flow":
            return cmd_flow(a.config, a.run_root, a.records)
        if verb == "_logits":
            return cmd_logits(a.export, a.checkpoint)
        sub.error(f"unknown internal command {verb}")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dry-run", action="store_true", help="CPU: small model, SFT on low_level_zero, fewer steps; no kernels"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no step after this many seconds (default 540; 1800 with --dry-run)",
    )
    p.add_argument("--work", help="scratch directory, emptied first (default /tmp/gpu-check[-dry])")
    p.add_argument("--skip-tests", action="store_true", help="do not run tests/test_gpu.py")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the dry run at 4 steps a stage (implies --dry-run and --skip-tests): checks the script runs",
    )
    args = p.parse_args(argv)
    args.dry_run = args.dry_run or args.smoke
    args.skip_tests = args.skip_tests or args.smoke
    return main_check(args)


if __name__ == "__main__":
    sys.exit(main())
