"""The baseline for the flow's CPT throughput: a minimal ColossalAI training loop, no orchestration.

    torchrun --standalone --nproc-per-node 1 benchmarks/plain_colossalai_train.py \
        --model build/gpu-check/base-model --plugin hybrid_parallel --zero-stage 1 --precision bf16 \
        --seq-len 2048 --micro-batch-size 8 --steps 60
    torchrun --standalone --nproc-per-node 1 benchmarks/plain_colossalai_train.py --smoke   # CPU, seconds

No Prefect, no job file, no checkpoints, no data pipeline: `from_pretrained` of the base model (fp32,
cast by the plugin), the plugin built with the arguments `tasks/engine/builders.make_plugin` uses
(so the comparison measures orchestration, not kernel choices), AdamW with the stage's
hyper-parameters under a LambdaLR warm-up + cosine, and random token ids of the stage's shape
(the data's content does not change the work). One `@@progress` line per step in the engine's
format: tokens so far, and seconds since the loop started, stamped after the loss is read back,
which synchronizes the device every step as the engine's loss all-reduce does.
`benchmarks/gpu_check.py` runs this beside the flow and compares the two.

On a machine without CUDA (gpu_check.py --dry-run) it first applies `tasks.engine.cpu_compat`, the
same patches the engine applies there; that is its only project import, and only on CPU.
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
    p.add_argument("--token-vocab", type=int, default=None, help="draw token ids below this (default: the model's vocab_size)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--smoke", action="store_true", help="a tiny random model in a temp dir, 3 steps of 2 x 64 tokens: checks the script runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.seq_len, args.micro_batch_size, args.warmup_steps = 3, 64, 2, 1
    elif not args.model:
        p.error("--model is required (or --smoke)")
    return args


def smoke_model() -> str:
    """The demo's tiny random Llama in a temp dir (each rank its own: nothing to coordinate)."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    out = Path(tempfile.mkdtemp(prefix="plain-smoke-")) / "tiny-llama"
    build_tiny_model(out, build_tokenizer(DEFAULT_CORPUS, vocab_size=512))
    return str(out)


def make_plugin(args: argparse.Namespace, cuda: bool):
    from colossalai.booster.plugin import HybridParallelPlugin, TorchDDPPlugin

    if args.plugin == "torch_ddp":
        return TorchDDPPlugin()
    return HybridParallelPlugin(
        tp_size=args.tp,
        pp_size=1,
        zero_stage=args.zero_stage,
        precision=args.precision,
        max_norm=args.max_norm,
        overlap_communication=cuda,  # record_stream does not exist for CPU tensors
        enable_all_optimization=False,
        make_vocab_size_divisible_by=1,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.smoke:
        args.model = smoke_model()
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32, use_safetensors=True)
    model.train()
    vocab = args.token_vocab or model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay)

    def factor(step: int) -> float:  # linear warm-up, then cosine to 0, as the engine's default
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    plugin = make_plugin(args, cuda)
    booster = Booster(plugin=plugin)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    autocast = args.plugin == "torch_ddp" and args.precision == "bf16"

    # Every rank the same batch when dp == 1; different rows per dp rank otherwise (dp = world / tp).
    g = torch.Generator().manual_seed(args.seed + rank // args.tp)
    dp = world // args.tp
    data = torch.randint(0, vocab, (args.steps, args.micro_batch_size, args.seq_len), generator=g)
    attn = getattr(getattr(model, "unwrap", lambda: model)(), "config", None)
    if rank == 0:
        print(f"plain: {args.plugin} tp={args.tp} zero={args.zero_stage} {args.precision} on {world} rank(s), "
              f"{'CUDA ' + torch.cuda.get_device_name(0) if cuda else 'CPU'}; attention {getattr(attn, '_attn_implementation', '?')}; "
              f"{args.steps} steps x {args.micro_batch_size} x {args.seq_len} tokens", flush=True)

    tokens = 0
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        ids = data[step - 1].to(device)
        if autocast:
            with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        else:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        booster.backward(loss, optimizer)
        if args.plugin == "torch_ddp" and args.max_norm > 0:
            optimizer.clip_grad_by_norm(args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        value = loss.item()
        tokens += args.micro_batch_size * args.seq_len * dp
        if rank == 0:
            rec = {"stage": "plain", "step": step, "total": args.steps, "loss": value, "tokens": tokens,
                   "elapsed_s": round(time.monotonic() - started, 3)}
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
