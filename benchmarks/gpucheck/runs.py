"""gpu_check's steps up to the flows: the config, the environment, the model, pre-flight, the kernels,
the plain baseline, the flow killed and retried, the export's fingerprint, the GPU tests.

    python benchmarks/gpu_check.py --smoke      # every step at tiny sizes on CPU

Each function runs its step's subprocess (benchmarks/gpucheck/steps.py) and reports its `Check`; the
flows' records are judged in benchmarks/gpucheck/verdicts.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from benchmarks.gpucheck.steps import (
    CONFIG,
    DRY_OVERRIDES,
    GPU_TESTS,
    ME,
    PY,
    SMOKE_OVERRIDES,
    TIMEOUTS,
    TOKENIZER_VOCAB,
    Ctx,
    Proc,
    base_env,
    finish,
    read_json,
    read_jsonl,
    records,
    run,
    say,
    stage_table,
    start,
    why,
)
from benchmarks.gpucheck.verdicts import check_flow_kill, check_flow_resume

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
    want = {"transformers": "4.57.6", "colossalai": "0.5.0"}
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
    env1["CPT_TO_SFT_FAULT"] = f"kill@step={ctx.kill_step}@phase=sft"
    p1 = run(ctx, "flow1-kill", flow_argv(ctx, rec1), ctx.timeouts["flow1"], env1)
    if p1.timed_out:
        argv = [PY, "-m", "flows.cpt_to_sft", "--config", str(ctx.config), "--run-root", str(ctx.run_root)]
        run(ctx, "break-lease", [*argv, "--break-lease"], 60)
    r1, run1 = read_jsonl(rec1), read_json(ctx.run_root / "run.json")
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
    run2 = read_json(ctx.run_root / "run.json")
    check_flow_resume(ctx, p2, r1, read_jsonl(rec2), run2, ctx.raw["sft"])
    ctx.figures["stages_run1"] = stage_table(run1)
    ctx.figures["stages_run2"] = stage_table(run2)


def check_export_fingerprint(ctx: Ctx, final_sft: Path) -> None:
    """The flow's own verification of the export, and the export's logits recomputed on this device
    against the final SFT checkpoint's fingerprint."""
    from tasks.core.models.hf_artifact import VERIFICATION

    export = ctx.run_root / "export"
    ver = read_json(export / VERIFICATION)
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
