"""Where evaluation puts a model: the CPU, one GPU, or spread over the node's visible GPUs.

    python -m tasks.core.evaluation.placement runs/tiny-demo/export          # the plan on this machine
    python -m tasks.core.evaluation.placement runs/tiny-demo/export bf16 4096

Evaluation (held-out loss and the generation check, `tasks.core.evaluation.heldout` and `.generation`) loads each
compared model with plain `transformers`, as its users will. `plan` is the pure decision: with no
GPU, the CPU; a model whose weights, one evaluation batch's forward and the CUDA
reserve fit the first GPU goes there whole; a larger one is spread over every visible GPU by
accelerate's `device_map="auto"` (the library `from_pretrained` uses for this), each GPU capped by
`max_memory` at its free memory less the reserve and the batch's forward, so what accelerate
places leaves room for the forward; one that fits nowhere is refused before it is loaded, with the
numbers and the fix. The figures are the memory estimate's (`tasks.core.preflight.memory` takes
`CUDA_RESERVE_BYTES` from here): the model's bytes are its safetensors tensors counted in the
evaluation dtype, and a forward without gradients keeps one layer's working tensors and the logits
(in the dtype, their fp32 copy and the loss's log-softmax).

The dtype (`eval.dtype`) defaults to the export's on a GPU (bf16 unless `export.dtype` says
otherwise) and to fp32 on CPU, where bf16 matmuls are slow and evaluation stays as it always was.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# CUDA context, cuBLAS workspace, NCCL buffers and the caching allocator's slack on each GPU: an
# allowance, not measured here (no GPU on this machine); every GPU figure of the project leaves it.
CUDA_RESERVE_BYTES = int(2e9)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GB = 1e9


def eval_dtype(configured: str | None, export_dtype: str, cuda: bool) -> str:
    """`eval.dtype` as set; unset: the export's dtype on a GPU, fp32 on CPU."""
    return configured or (export_dtype if cuda else "fp32")


def _headers(model_dir: str | Path) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            shapes.update({k: v["shape"] for k, v in json.loads(fh.read(size)).items() if k != "__metadata__"})
    return shapes


def safetensors_numel(model_dir: str | Path) -> int:
    """Elements of every tensor in the folder's safetensors files, from their headers (nothing loaded)."""
    return sum(math.prod(shape) for shape in _headers(model_dir).values())


def largest_block_numel(model_dir: str | Path) -> int:
    """Elements of the largest unit accelerate places whole: a numbered block (`model.layers.7.`,
    a decoder layer, which it never splits) or a tensor outside one (the embedding, the LM head)."""
    blocks: dict[str, int] = {}
    for name, shape in _headers(model_dir).items():
        parts = name.split(".")
        cut = next((i + 1 for i, part in enumerate(parts) if part.isdigit()), len(parts))
        key = ".".join(parts[:cut])
        blocks[key] = blocks.get(key, 0) + math.prod(shape)
    return max(blocks.values(), default=0)


# The held-out loss computes the LM head's logits over this many bytes of fp32 logits at a time (at least one
# position): a 262k vocabulary scores 64 positions a chunk, whatever eval.batch_size x seq_len is
# (tasks/core/evaluation/heldout.py `heldout_loss`).
LOGITS_CHUNK_BYTES = 64 * 2**20


def logits_chunk_tokens(vocab: int) -> int:
    """Positions whose fp32 logits fit LOGITS_CHUNK_BYTES, a multiple of 8 (at least 8): products of 8k rows
    give each row bitwise what the whole batch's product does (measured with torch 2.13's MKL)."""
    return max(8, LOGITS_CHUNK_BYTES // max(1, 4 * vocab) // 8 * 8)


def forward_bytes(config: dict[str, Any], dtype: str, tokens: int) -> int:
    """Peak bytes of one no-grad forward over `tokens` tokens besides the weights: a decoder layer's
    working tensors (q, k, v, attention output and the residual stream: ~6 hidden-wide; gate, up and
    their product: 3 MLP-wide), the final hidden states, and one chunk of logits (`logits_chunk_tokens`)
    with their fp32 copy and log-softmax (8 B per logit)."""
    d = DTYPE_BYTES[dtype]
    hidden = int(config.get("hidden_size") or 0)
    mlp = int(config.get("intermediate_size") or 4 * hidden)
    vocab = int(config.get("vocab_size") or 0)
    chunk = min(tokens, logits_chunk_tokens(vocab))
    return tokens * (7 * hidden + 3 * mlp) * d + chunk * vocab * (d + 8)


@dataclass(frozen=True)
class Placement:
    """How one model is loaded for evaluation: `device_map`/`max_memory` as `from_pretrained` takes them."""

    kind: str  # "cpu" | "gpu" (whole, on the first GPU) | "spread" (device_map auto) | "refused"
    model_bytes: int = 0
    device_map: str | dict[str, int] | None = None
    max_memory: dict[int, int] = field(default_factory=dict)
    problem: str = ""

    @property
    def gpus(self) -> int:
        return len(self.max_memory) if self.kind == "spread" else int(self.kind == "gpu")

    def describe(self) -> str:
        if self.kind == "spread":
            return f"cuda:0-{self.gpus - 1} (device_map auto, {self.model_bytes / GB:.2f} GB over {self.gpus} GPUs)"
        return "cuda:0" if self.kind == "gpu" else "cpu"


def plan(
    model_bytes: int, gpu_bytes: Sequence[int], forward: int, reserve: int = CUDA_RESERVE_BYTES, largest: int = 0
) -> Placement:
    """The placement of a model of `model_bytes` (in the evaluation dtype) on GPUs with `gpu_bytes`
    free each (none: the CPU), leaving `reserve` and one forward's `forward` bytes on every GPU.
    Spread, the model must fit with `largest` (its largest block's bytes) spare on each GPU:
    accelerate keeps that much free on a device while it fills it, and puts what is left over on
    the disk (measured: tests/test_eval_placement.py)."""
    if not gpu_bytes:
        return Placement("cpu", model_bytes)
    room = [max(0, int(free) - reserve - forward) for free in gpu_bytes]
    if model_bytes <= room[0]:
        return Placement("gpu", model_bytes, device_map={"": 0})
    if len(room) > 1 and model_bytes <= sum(max(0, r - largest) for r in room):
        return Placement("spread", model_bytes, device_map="auto", max_memory=dict(enumerate(room)))
    return Placement(
        "refused",
        model_bytes,
        problem=(
            f"the model needs {model_bytes / GB:.2f} GB for its weights in the evaluation dtype, and the {len(room)} "
            "visible GPU(s) "
            f"leave {sum(room) / GB:.2f} GB for weights ({', '.join(f'{b / GB:.2f}' for b in gpu_bytes)} GB free, "
            "less the "
            f"{reserve / GB:.0f} GB CUDA reserve and one evaluation batch's forward, {forward / GB:.2f} GB, on each"
            + (f"; spread, {largest / GB:.2f} GB of each, the largest block, stays free" if len(room) > 1 else "")
            + ")"
        ),
    )


def visible_gpu_bytes() -> list[int]:
    """Free bytes of each GPU this process sees (none without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]


def place(model_dir: str | Path, dtype: str, tokens: int, gpu_bytes: Sequence[int] | None = None) -> Placement:
    """`plan` for the HF folder `model_dir` on this machine's GPUs (or on `gpu_bytes`)."""
    gpus = visible_gpu_bytes() if gpu_bytes is None else list(gpu_bytes)
    if not gpus:
        return Placement("cpu")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    d = DTYPE_BYTES[dtype]
    return plan(
        safetensors_numel(model_dir) * d,
        gpus,
        forward_bytes(config, dtype, tokens),
        largest=largest_block_numel(model_dir) * d,
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    import torch

    dtype = args[1] if len(args) > 1 else eval_dtype(None, "bf16", torch.cuda.is_available())
    where = place(args[0], dtype, int(args[2]) if len(args) > 2 else 8 * 2048)
    print(f"{args[0]} in {dtype}: {where.problem or where.describe()} (max_memory {where.max_memory or '-'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
