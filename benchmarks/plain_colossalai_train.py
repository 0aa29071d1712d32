"""The baseline for the flow's CPT throughput: a minimal ColossalAI training loop, no orchestration.

    torchrun --standalone --nproc-per-node 1 benchmarks/plain_colossalai_train.py \
        --model build/gpu-check/base-model --plugin hybrid_parallel --zero-stage 1 --precision bf16 \
        --seq-len 2048 --micro-batch-size 8 --steps 60
    torchrun --standalone --nproc-per-node 1 benchmarks/plain_colossalai_train.py --smoke   # CPU, seconds

No Prefect, no job file, no checkpoints, no data pipeline: `from_pretrained` of the base model (fp32,
cast by the plugin), AdamW with the stage's hyper-parameters under a LambdaLR warm-up + cosine,
and random token ids of the stage's shape (the data's content does not change the work), with an
all-ones attention mask as ColossalAI's own benchmark (examples/language/llama/benchmark.py) feeds.
Configured the way that benchmark runs: the fast kernels on where the device supports them
(shardformer's flash attention, fused norms where apex is installed; flash_attention_2 under
torch_ddp where flash_attn is; the fused AdamW step) and, with `--activation-checkpointing`, its
`-g`. Which ones is decided by the same registry the flow uses (`tasks/core/config/kernels.py`,
pure data), so "flow vs plain" compares the same best use of ColossalAI: the flow's engine
passes exactly these arguments. The kernels it ran are printed as one `@@kernels` line in the
engine's format. One `@@progress` line per step in the engine's format: tokens so far, and seconds
since the loop started, stamped after the loss is read back, which synchronizes the device every
step as the engine's loss all-reduce does. `benchmarks/gpu_check.py` runs this beside the flow and
compares the two (kernels included).

The token ids are drawn above the tokenizer's special tokens: a row starting with the pad token
(whose embedding is zero) gives RMSNorm's backward a zero input, and over a deep model in bf16 the
gradients overflow to NaN. A non-finite loss stops the run naming the step, as the engine does.

On a machine without CUDA (gpu_check.py --dry-run) it first applies `tasks.engine.cpu_compat`, the
same patches the engine applies there; that and the kernel registry are its only project imports.
`--smoke` (no --model needed) writes the demo's tiny random Llama to a temporary directory
(`tasks.core.models.demo`) and runs 3 short steps of the same loop: it checks the script runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model directory (config.json + safetensors); required unless --smoke")
    p.add_argument("--plugin", choices=["hybrid_parallel", "torch_ddp"], default="hybrid_parallel")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    p.add_argument(
        "--token-vocab", type=int, default=None, help="draw token ids below this (default: the model's vocab_size)"
    )
    p.add_argument(
        "--first-token-id",
        type=int,
        default=None,
        help="draw token ids from this one up (default: above the tokenizer's special tokens; see the docstring's NaN)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each decoder layer in the backward (ColossalAI's -g)",
    )
    p.add_argument(
        "--no-kernels",
        action="store_true",
        help="every fast kernel off (the registry's CPU answer), to see what they give",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny random model in a temp dir, 3 steps of 2 x 64 tokens: checks the script runs",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.seq_len, args.micro_batch_size, args.warmup_steps = 3, 64, 2, 1
    elif not args.model:
        p.error("--model is required (or --smoke)")
    return args


def smoke_model() -> str:
    """The demo's tiny random Llama in a temp dir (each rank its own: nothing to coordinate)."""
    from support.bench import workdir
    from support.tiny import tiny_model

    out = workdir(None, "plain-smoke-") / "tiny-llama"
    tiny_model(out)
    return str(out)


def kernels(args: argparse.Namespace, cuda: bool, model_type: str | None):
    """The kernel registry's decision for this plugin and precision on this machine: what the
    flow's engine would switch on (tasks/engine/builders.py, tasks/engine/accel.py)."""
    from tasks.core.config.kernels import Facts, resolve_for

    facts = Facts.detect(cuda=cuda and not args.no_kernels, model_type=model_type)
    return resolve_for(args.plugin, args.precision, facts, {}, "plain --no-kernels" if args.no_kernels else "kernels")


def make_plugin(args: argparse.Namespace, cuda: bool, plugin_kernels: dict):
    from colossalai.booster.plugin import HybridParallelPlugin, TorchDDPPlugin

    if args.plugin == "torch_ddp":
        return TorchDDPPlugin()
    # No pipeline here, so no gradient_checkpoint_config: shardformer's forward checkpoints every
    # layer once the HF model's flag is set (main), exactly as the engine does at pp = 1.
    return HybridParallelPlugin(
        tp_size=args.tp,
        pp_size=1,
        zero_stage=args.zero_stage,
        precision=args.precision,
        max_norm=args.max_norm,
        overlap_communication=cuda,  # record_stream does not exist for CPU tensors
        enable_all_optimization=False,  # each kernel its own flag, from the registry
        make_vocab_size_divisible_by=1,
        **plugin_kernels,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.smoke:
        args.model = smoke_model()
    import torch

    cuda = torch.cuda.is_available()
    from tasks.engine import hf_compat

    hf_compat.apply()  # ColossalAI's forwards on the installed transformers
    if not cuda:
        from tasks.engine import cpu_compat

        cpu_compat.apply()
    os.environ.setdefault("COLUMNS", "200")
    import colossalai
    import torch.distributed as dist
    from colossalai.accelerator import get_accelerator
    from colossalai.booster import Booster
    from colossalai.logging import get_dist_logger
    from transformers import AutoModelForCausalLM

    colossalai.launch_from_torch(seed=args.seed, verbose=False)
    get_dist_logger().set_level("WARNING")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = get_accelerator().get_current_device()

    from tasks.core.config.kernels import passed, record, report

    model_type = json.loads((Path(args.model) / "config.json").read_text()).get("model_type")
    states = kernels(args, cuda, model_type)
    model, info = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, use_safetensors=True, output_loading_info=True, **passed(states, "model")
    )
    if any(info.values()):
        raise SystemExit(f"{args.model}: weights do not match the model's config: {info}")
    model.train()
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = args.token_vocab or model.config.vocab_size
    if args.first_token_id is None:
        from transformers import AutoTokenizer

        special = AutoTokenizer.from_pretrained(args.model).all_special_ids
        args.first_token_id = max(special) + 1 if special else 0
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=tuple(args.betas),
        weight_decay=args.weight_decay,
        **passed(states, "optimizer"),
    )

    def factor(step: int) -> float:  # linear warm-up, then cosine to 0, as the engine's default
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    plugin = make_plugin(args, cuda, passed(states, "plugin"))
    booster = Booster(plugin=plugin)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    autocast = args.plugin == "torch_ddp" and args.precision == "bf16"

    # Every rank the same batch when dp == 1; different rows per dp rank otherwise (dp = world / tp).
    g = torch.Generator().manual_seed(args.seed + rank // args.tp)
    dp = world // args.tp
    data = torch.randint(args.first_token_id, vocab, (args.steps, args.micro_batch_size, args.seq_len), generator=g)
    attn = getattr(getattr(model, "unwrap", lambda: model)(), "config", None)
    if rank == 0:
        print(
            f"plain: {args.plugin} tp={args.tp} zero={args.zero_stage} {args.precision} on {world} rank(s), "
            f"{'CUDA ' + torch.cuda.get_device_name(0) if cuda else 'CPU'}; attention {getattr(attn, '_attn_implementation', '?')}; "
            f"{args.steps} steps x {args.micro_batch_size} x {args.seq_len} tokens, ids {args.first_token_id}..{vocab - 1}",
            flush=True,
        )
        print(
            f"plain: kernels: {report(states)}; activation checkpointing: {'on' if args.activation_checkpointing else 'off'}",
            flush=True,
        )
        rec = {"kernels": record(states), "activation_checkpointing": args.activation_checkpointing}
        print(f"@@kernels {json.dumps(rec, sort_keys=True)}", flush=True)

    tokens = 0
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        ids = data[step - 1].to(device)
        batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False)
        if autocast:
            with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16):
                loss = model(**batch).loss
        else:
            loss = model(**batch).loss
        booster.backward(loss, optimizer)
        if args.plugin == "torch_ddp" and args.max_norm > 0:
            optimizer.clip_grad_by_norm(args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        value = loss.item()
        if not math.isfinite(value):  # what the engine does: a NaN run is not a baseline
            raise SystemExit(f"plain: loss is {value} at step {step} (lr {scheduler.get_last_lr()[0]:.3g})")
        tokens += args.micro_batch_size * args.seq_len * dp
        if rank == 0:
            rec = {
                "stage": "plain",
                "step": step,
                "total": args.steps,
                "loss": value,
                "tokens": tokens,
                "elapsed_s": round(time.monotonic() - started, 3),
            }
            print(f"@@progress {json.dumps(rec, sort_keys=True)}", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"plain: done, {tokens} tokens in {time.monotonic() - started:.1f}s", flush=True)
    dist.destroy_process_group()
    if args.smoke:
        import shutil

        shutil.rmtree(Path(args.model).parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
