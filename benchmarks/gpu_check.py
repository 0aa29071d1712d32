"""GPU validation of the flow on one CUDA GPU, in one command with a time budget; and its CPU dry run.

    bash benchmarks/gpu_check.sh                     # GPU machine: install carried wheels, then this
    python benchmarks/gpu_check.py [--budget-s 540]  # the same without the installs
    python benchmarks/gpu_check.py --dry-run         # here, on CPU: small model, CPU plugin for SFT
    python benchmarks/gpu_check.py --smoke           # the dry run at 4 steps a stage, no tests/test_gpu.py: checks the script runs

What it runs, each step a time-boxed subprocess (its output goes to $OUT/gpu_check.log, or
<work>/gpu_check.log without $OUT), then one `CHECK <name>: ok|failed (<reason>)` line per check:

  env                 versions (torch/CUDA, transformers 4.57.6, colossalai 0.5.0, prefect 3.9), the GPU
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
  flow_kill           the flow with CPT_TO_SFT_FAULT=kill@step=K@phase=sft (K = 1.5 checkpoint
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
itself shows, and a pytest beside the retry would slow it on two cores). With GPU_CHECK_PREFECT_API_URL
set (tests/test_benchmarks.py sets it to the session's server) the flows use that Prefect API instead of
starting an embedded server each.
"""

from __future__ import annotations

import argparse
import sys
import time

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from benchmarks.gpucheck.runs import (
    check_env,
    check_export_fingerprint,
    check_gpu_tests,
    check_kernels,
    check_model,
    check_plain_baseline,
    check_preflight,
    make_ctx,
    run_flow_kill,
    run_flow_retry,
    start_gpu_tests,
)
from benchmarks.gpucheck.steps import ME, PY, say, start
from benchmarks.gpucheck.subcommands import cmd_build_model, cmd_env, cmd_flow, cmd_kernels, cmd_logits
from benchmarks.gpucheck.verdicts import check_same_kernels, check_sft_checkpoint, check_throughput, report


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
