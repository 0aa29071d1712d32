"""Pre-flight: where each evaluation stage will put its models on this worker's GPUs, and a refusal
before any training when they fit none.

    python -c "from tasks.core.preflight.eval_memory import eval_plan; from tasks.core.preflight.memory import LLAMA3; \
print(eval_plan(LLAMA3['Llama-3-70B'], 'bf16', 4 * 4096, gpus=8, gpu_bytes=int(80e9)).describe())"

Evaluation runs in the flow's worker process, the one pre-flight runs in, so the GPUs seen here are
the ones it gets (`tasks.core.evaluation.placement`: the first GPU, or every visible GPU through
accelerate's `device_map="auto"`). The figures are the placement's own, from config.json instead
of the safetensors headers: the model's tensors (the family's tensor table) in the evaluation
dtype, its largest block (a decoder layer or the embedding), one evaluation batch's forward
(`eval.batch_size` x `seq_len` tokens) and the CUDA reserve on each GPU. Without a GPU,
evaluation runs on the CPU in fp32, as it always has: nothing to check here.
"""

from __future__ import annotations

import math
from typing import Any

from tasks.core.errors import ConversionError
from tasks.core.evaluation.placement import DTYPE_BYTES, Placement, eval_dtype, forward_bytes, plan
from tasks.core.models.families import iter_tensors


def eval_plan(model_config: dict[str, Any], dtype: str, tokens: int, *, gpus: int, gpu_bytes: int) -> Placement:
    """The placement of the model config.json describes, on `gpus` GPUs of `gpu_bytes` each."""
    total, blocks = 0, {}
    for key, _, shape, layer in iter_tensors(model_config):
        n = math.prod(shape)
        total += n
        block = f"layer {layer}" if layer is not None else key  # a decoder layer is placed whole
        blocks[block] = blocks.get(block, 0) + n
    d = DTYPE_BYTES[dtype]
    return plan(
        total * d,
        [gpu_bytes] * gpus,
        forward_bytes(model_config, dtype, tokens),
        largest=max(blocks.values(), default=0) * d,
    )


def check_eval_memory(ctx: Any) -> None:
    """Each evaluated stage's placement on the visible GPUs; a refusal naming `<phase>.eval.dtype`
    (and the batch) when its models fit none of them."""
    n, gpu = ctx.machine.cuda_devices, getattr(ctx.machine, "gpu_memory_bytes", None)
    if ctx.model is None or not n or not gpu:
        return
    for name in ctx.cfg.phases:
        phase_cfg = getattr(ctx.cfg, name)
        if not phase_cfg.eval.enabled:
            continue
        dtype = eval_dtype(phase_cfg.eval.dtype, ctx.cfg.export.dtype, cuda=True)
        try:
            p = eval_plan(ctx.model.config, dtype, phase_cfg.eval.batch_size * phase_cfg.seq_len, gpus=n, gpu_bytes=gpu)
        except (ConversionError, KeyError) as exc:  # an unknown family: check_model_family names it
            ctx.warn(f"{name} evaluation memory not estimated: {exc}")
            continue
        if p.kind != "refused":
            ctx.ok(
                f"evaluate_{name}: {p.model_bytes / 1e9:,.2f} GB model in {dtype} on {p.describe()} of {n} visible "
                "GPU(s)"
            )
            continue
        fixes = ([f"{name}.eval.dtype: bf16 (half of {dtype})"] if dtype == "fp32" else []) + (
            [f"a smaller {name}.eval.batch_size (each row is {phase_cfg.seq_len} tokens of forward on every GPU)"]
            if phase_cfg.eval.batch_size > 1
            else []
        )
        ctx.problem(
            f"{name}.eval.dtype",
            f"evaluate_{name} cannot load its models on this worker's GPUs: {p.problem}; set "
            + " or ".join([*fixes, "run the flow on a worker with more GPU memory"]),
        )
