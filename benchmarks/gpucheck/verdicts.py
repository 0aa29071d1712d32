"""gpu_check's verdicts on what the flows recorded: the kill, the resume, the SFT checkpoint, the
throughput against the plain script, the kernels both ran; then the summary.

    python benchmarks/gpu_check.py --smoke      # every verdict on the CPU dry run's records
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks.gpucheck.steps import (
    TARGET_RATIO,
    Ctx,
    Proc,
    launches_of,
    say,
    throughput,
    train_progress,
    why,
)
from tasks.core.models import flops
from tasks.core.run.stages import ROWS


def check_flow_kill(ctx: Ctx, p: Proc, r1, run1, kill_step: int, cpt, sft) -> None:
    launches = launches_of(r1)
    want = [("shard", "cpt"), ("train", "cpt"), ("shard", "sft"), ("train", "sft")]
    sft_steps = [r["step"] for r in train_progress(r1, "sft")]
    cpt_steps = [r["step"] for r in train_progress(r1, "cpt")]
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
    if stages.get(ROWS.train_sft.name) != "failed":
        problems.append(f"run.json says train_sft {stages.get(ROWS.train_sft.name)!r}, expected 'failed'")
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
    launches = launches_of(r2)
    steps = [r["step"] for r in train_progress(r2, "sft")]
    every = sft["checkpoint_every"]
    first = train_progress(r1, "sft")
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
    redone = [(r["step"], before[r["step"]], r["loss"]) for r in train_progress(r2, "sft") if r["step"] in before]
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
    flow_progress = train_progress(r1, "cpt")
    saves = {int(r["step"]) for r in r1 if r["event"] == "checkpoint" and r["phase"] == "cpt" and r["verb"] == "train"}
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

    flow = next((r for r in r1 if r["event"] == "kernels" and r["phase"] == "cpt" and r["verb"] == "train"), {})
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
