"""Which layout fits a long context: the memory estimate (`tasks.core.preflight.memory`) over sequence lengths.

    python -m tasks.core.preflight.long_context                 # Llama-3-8B / 70B at 8k, 32k, 128k on 8 x H200
    python -m tasks.core.preflight.long_context --cpu 24        # the CPU machine: 2 ranks sharing 24 GB

Each row is one phase section run through the layout rules (a layout they refuse is left out) and the
estimate: the largest rank's GPU memory (the CUDA reserve included) and whether it fits. Sequence parallelism
divides a rank's activations per its `SP_MODES` row (`memory.sequence_split`); parameters, gradients and
optimizer state do not change with the context, so at 128k the activations decide.
"""

from __future__ import annotations

import sys
from typing import Any

from tasks.core.config.layout import layout_problems
from tasks.core.config.schema import PhaseConfig
from tasks.core.preflight.memory import GB, LLAMA3, estimate

H200_GB = 141.0
SEQ_LENS = (8192, 32768, 131072)
_A2A = {"mode": "all_to_all"}
_OFFLOAD = {"zero_stage": 1, "cpu_offload": True}
# (model, plugin fields): the layouts weighed on one node of 8 GPUs, each with activation checkpointing off and on
LAYOUTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("Llama-3-8B", {"zero_stage": 1}),
    ("Llama-3-8B", {"tp_size": 8}),
    ("Llama-3-8B", {"tp_size": 8, "sequence_parallelism": {"mode": "split_gather"}}),
    ("Llama-3-8B", {"zero_stage": 1, "sequence_parallelism": {**_A2A, "size": 8}}),
    ("Llama-3-8B", {"zero_stage": 1, "sequence_parallelism": {"mode": "ring_attn", "size": 8}}),
    ("Llama-3-70B", {"tp_size": 8, **_OFFLOAD}),
    ("Llama-3-70B", {"tp_size": 8, **_OFFLOAD, "sequence_parallelism": {"mode": "split_gather"}}),
    ("Llama-3-70B", {"tp_size": 2, **_OFFLOAD, "sequence_parallelism": {**_A2A, "size": 4}}),
)  # fmt: skip
# A small Llama (~30M parameters, 8 heads) for the CPU table: what 2 CPU ranks train at long context.
SMALL = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}


def phase_cfg_for(plugin: dict[str, Any], seq_len: int, ckpt: bool, nproc: int, precision: str = "bf16") -> PhaseConfig:
    return PhaseConfig.model_validate(
        {
            "data": {"uri": "x"},
            "plugin": {"name": "hybrid_parallel", "precision": precision, **plugin},
            "max_steps": 1,
            "seq_len": seq_len,
            "lr": 1e-4,
            "micro_batch_size": 1,
            "activation_checkpointing": ckpt,
            "launch": {"nproc_per_node": nproc},
        }
    )


def describe(phase_cfg: PhaseConfig) -> str:
    p = phase_cfg.plugin
    out = p.name + (f" tp={p.tp_size}" if p.tp_size > 1 else "") + (f" zero={p.zero_stage}" if p.zero_stage else "")
    out += " cpu_offload" if p.cpu_offload else ""
    sp = p.sequence_parallelism
    return out + (f" sp={sp.mode}" + (f"/{sp.size}" if sp.size else "") if sp else "")


def table(gpu_gb: float = H200_GB, gpus: int = 8) -> str:
    out = [
        f"1 node of {gpus} x {gpu_gb:g} GB GPUs; bf16, micro_batch_size 1, AdamW; GB = 1e9 bytes, the CUDA reserve in.",
        "",
        "| model | layout | act. ckpt | " + " | ".join(f"{s // 1024}k" for s in SEQ_LENS) + " |",
        "|---|---|---|" + "---|" * len(SEQ_LENS),
    ]
    for model, plugin in LAYOUTS:
        for ckpt in (False, True):
            cells = []
            for seq in SEQ_LENS:
                phase_cfg = phase_cfg_for(plugin, seq, ckpt, gpus)
                if layout_problems(phase_cfg, "cpt", model_config=LLAMA3[model], cuda=True):
                    cells.append("refused")
                    continue
                gb = estimate(LLAMA3[model], phase_cfg, cuda=True).device / GB
                cells.append(f"{gb:,.0f} GB {'fits' if gb <= gpu_gb else 'no'}")
            out.append(f"| {model} | {describe(phase_cfg)} | {'on' if ckpt else 'off'} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def longest(plugin: dict[str, Any], budget_gb: float, nproc: int = 2, ckpt: bool = False, start: int = 1024) -> int:
    """The longest seq_len, doubling from `start`, whose CPU rank's host memory (fp32) stays within budget."""
    best, seq = 0, start
    while seq <= 1 << 22:
        phase_cfg = phase_cfg_for(plugin, seq, ckpt, nproc, precision="fp32")
        if estimate(SMALL, phase_cfg, cuda=False).host_steady / GB > budget_gb:
            break
        best, seq = seq, seq * 2
    return best


def cpu_table(host_gb: float = 24.0, nproc: int = 2) -> str:
    per_rank = host_gb / nproc
    out = [
        (
            f"{nproc} CPU ranks sharing {host_gb:g} GB ({per_rank:g} GB a rank); fp32, micro_batch_size 1; a Llama "
            f"of {SMALL['num_hidden_layers']} layers x {SMALL['hidden_size']} hidden (on CPU attention runs in torch "
            "SDPA, whose kernel keeps no seq_len x seq_len matrix)."
        ),
        "",
        "| layout | host a rank at 16k | at 64k | longest seq_len, act. ckpt off | on |",
        "|---|---|---|---|---|",
    ]
    for plugin in (
        {},
        {"tp_size": 2},
        {"tp_size": 2, "sequence_parallelism": {"mode": "split_gather"}},
        {"sequence_parallelism": {**_A2A, "size": 2}},
    ):
        at = [
            estimate(SMALL, phase_cfg_for(plugin, n, False, nproc, "fp32"), cuda=False).host_steady / GB
            for n in (16384, 65536)
        ]
        cells = [f"{at[0]:.1f} GB", f"{at[1]:.1f} GB"]
        cells += [f"{longest(plugin, per_rank, nproc, ckpt):,}" for ckpt in (False, True)]
        name = describe(phase_cfg_for(plugin, 1024, False, nproc)) + (" (dp=2)" if not plugin else "")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--cpu"]:
        print(cpu_table(float(args[1]) if len(args) > 1 else 24.0))
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
