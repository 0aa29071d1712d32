"""Pre-flight: each evaluation stage's cost next to its training stage's, and a warning (never a
refusal) when evaluation would take a large share of the run.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check

Both sides are counted in model FLOPs (`tasks.core.models.flops`) on this worker, so the unknown
rate of the device mostly cancels. Training: (6N + attention) per token, 4N instead of 6N under
LoRA (no weight gradients of the frozen model), +2N with activation checkpointing, over
max_steps x micro_batch x grad_accum x dp sequences of seq_len, spread over the stage's GPUs (on
CPU over its ranks' threads, OMP_NUM_THREADS each, 1 unless set, at most a node's cores, against
evaluation's OMP_NUM_THREADS or every core: rate per thread assumed linear). Evaluation (`tasks.core.evaluation.heldout`) runs in ONE
process on one device at a time (a model spread by device_map runs its GPUs in turn): a forward
of (2N + attention) per token of at most max_batches x batch_size sequences of seq_len, for each
of the two compared models (base vs CPT, pre-SFT vs SFT), on the held-out set and, for CPT, on
each mixture source's and each heldout_sources' own; evaluate_sft adds the generation check's
num_prompts x max_new_tokens decoded tokens. Assumed: the held-out sets fill max_batches (an
upper bound), and one rate per FLOP for training and evaluation (bf16 training on a CPU without
native bf16 is slower, so the true share is lower there; one-token decoding is slower, higher).
The logits fingerprints are taken by load_from_hf, unshard and export, not by these stages.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tasks.core.config.phases import PHASES, Phase
from tasks.core.config.plugins import PLUGINS
from tasks.core.config.schema import PhaseConfig
from tasks.core.errors import ConversionError
from tasks.core.evaluation.placement import eval_dtype
from tasks.core.models.families import count_parameters, family_config

SHARE = 0.20  # warn when an evaluation's estimate exceeds this share of its training stage's
FLOOR = 1e13  # below this many FLOPs (about a minute on a CPU, seconds on a GPU) loading dominates: no warning


@dataclass(frozen=True)
class EvalTime:
    phase: str
    train_flops: float  # per training device (the stage's work over its parallel devices)
    eval_flops: float  # in the one evaluation process
    fixed_flops: float  # the part max_batches does not change (the generation check)
    per_batch_flops: float  # one batch of every compared set, both models

    @property
    def ratio(self) -> float:
        return self.eval_flops / self.train_flops if self.train_flops else float("inf")

    def batches_under(self, share: float) -> int:
        """The largest max_batches whose estimate is at most `share` of training (at least 1)."""
        room = share * self.train_flops - self.fixed_flops
        return max(1, int(room // self.per_batch_flops)) if self.per_batch_flops else 1


def _dims(model_config: dict[str, Any]) -> tuple[int, int, int]:
    _, c = family_config(model_config)
    return count_parameters(model_config), int(c["num_hidden_layers"]), int(c["hidden_size"])


def threads(cpu_count: int, environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(evaluation's threads, each CPU rank's): torch in the worker uses OMP_NUM_THREADS or every
    core; torchrun gives each rank OMP_NUM_THREADS, 1 unless set (`tasks.core.launch.torchrun`)."""
    raw = environ.get("OMP_NUM_THREADS", "")
    omp = int(raw) if raw.isdigit() and int(raw) > 0 else None
    return min(omp or cpu_count, cpu_count), omp or 1


@dataclass(frozen=True)
class Cpu:
    """The worker's CPU as the estimate sees it: evaluation's threads, each rank's, and the node's cores
    (`threads`); counted on CPU only."""

    eval_threads: int = 1
    rank_threads: int = 1
    cores: int = 1


@dataclass(frozen=True)
class GenerationCheck:
    """The SFT generation check's size (`gate.num_prompts`, `gate.max_new_tokens`); none by default."""

    num_prompts: int = 0
    max_new_tokens: int = 0


def _devices(phase_cfg: PhaseConfig, cuda: bool, cpu: Cpu) -> float:
    """How many evaluation processes' worth of compute training is spread over: its GPUs (evaluation
    uses one at a time), or on CPU its ranks' threads (at most each node's cores) over evaluation's."""
    if cuda:
        return phase_cfg.launch.world_size
    per_node = min(
        phase_cfg.launch.nproc_per_node * cpu.rank_threads, max(cpu.cores, cpu.eval_threads)
    )  # nodes like this worker
    return per_node * phase_cfg.launch.nnodes / cpu.eval_threads


def estimate(
    model_config: dict[str, Any],
    phase_cfg: PhaseConfig,
    phase: Phase,
    *,
    cuda: bool,
    generation: GenerationCheck = GenerationCheck(),
    max_batches: int | None = None,
    cpu: Cpu = Cpu(),
) -> EvalTime:
    """The estimate for `phase` ("cpt" or "sft"); `max_batches` overrides `phase_cfg.eval.max_batches`;
    `cpu` counts on CPU only (`threads`).
    Raises ConversionError or KeyError for a family config.json does not describe."""
    n, layers, hidden = _dims(model_config)
    p = phase_cfg.plugin
    spec = PLUGINS[p.name]
    tp, pp = (p.tp_size, p.pp_size) if spec.supports_tp_pp else (1, 1)
    dp = max(1, phase_cfg.launch.world_size // (tp * pp))
    attention = 12.0 * layers * hidden * phase_cfg.seq_len
    per_train_token = (
        (4.0 if phase_cfg.lora is not None else 6.0) * n
        + (2.0 * n if phase_cfg.activation_checkpointing else 0.0)
        + attention
    )
    train_tokens = (
        phase_cfg.max_steps * phase_cfg.micro_batch_size * phase_cfg.grad_accum_steps * dp * phase_cfg.seq_len
    )
    train = per_train_token * train_tokens / _devices(phase_cfg, cuda, cpu)
    sets = 1
    if PHASES[phase].evaluation == "perplexity":  # per source, and per held-out-only source
        sets += len(phase_cfg.data.sources or ()) + len(phase_cfg.eval.heldout_sources or ())
    per_batch = 2 * sets * (2.0 * n + attention / 3) * phase_cfg.eval.batch_size * phase_cfg.seq_len  # 2 models
    fixed = (
        (2.0 * n + attention / 3) * generation.num_prompts * generation.max_new_tokens
        if PHASES[phase].generation
        else 0.0
    )
    batches = max_batches if max_batches is not None else phase_cfg.eval.max_batches
    return EvalTime(phase, train, fixed + per_batch * (batches or 0), fixed, per_batch)


def check_eval_time(ctx: Any) -> None:
    """Warn when an evaluation stage's estimate exceeds SHARE of its training stage's, naming the
    `<phase>.eval.max_batches` that brings it under."""
    if ctx.model is None:
        return
    cuda = bool(ctx.machine.cuda_devices)
    eval_threads, rank_threads = threads(ctx.machine.cpu_count)
    g = ctx.cfg.gate
    for name in ctx.cfg.phases:
        phase_cfg: PhaseConfig = getattr(ctx.cfg, name)
        if not phase_cfg.eval.enabled:
            continue
        if phase_cfg.eval.max_batches is None:
            ctx.ok(
                f"evaluate_{name}: time not estimated ({name}.eval.max_batches is null: the whole held-out set is "
                "evaluated)"
            )
            continue
        try:
            e = estimate(
                ctx.model.config,
                phase_cfg,
                name,
                cuda=cuda,
                generation=GenerationCheck(g.num_prompts, g.max_new_tokens),
                cpu=Cpu(eval_threads, rank_threads, ctx.machine.cpu_count),
            )
        except (ConversionError, KeyError, TypeError, ValueError):
            continue  # an unknown family: check_model_family names it
        dtype = eval_dtype(phase_cfg.eval.dtype, ctx.cfg.export.dtype, cuda=cuda)
        where = (
            f"one GPU in {dtype}"
            if cuda
            else f"{eval_threads} CPU thread(s) in {dtype} (training: {phase_cfg.launch.world_size} rank(s) x {rank_threads})"
        )
        line = (
            f"evaluate_{name}: ~{e.eval_flops:.2g} FLOPs in one process on {where}, {e.ratio:.0%} of {name} training's "
            f"~{e.train_flops:.2g} FLOPs in the same unit"
        )
        if e.ratio <= SHARE or e.eval_flops < FLOOR:
            ctx.ok(line)
            continue
        fix = e.batches_under(SHARE)
        extra = (
            f" (the generation check alone is {e.fixed_flops / e.train_flops:.0%}: lower gate.num_prompts or "
            "gate.max_new_tokens too)"
            if (e.fixed_flops > SHARE * e.train_flops)
            else ""
        )
        ctx.warn(
            f"{line}, over the {SHARE:.0%} share: evaluation would take about {e.ratio:.1f}x the training stage's "
            "time; "
            f"lower {name}.eval.max_batches from {phase_cfg.eval.max_batches} to {fix}{extra}. Estimate: 2N FLOPs per "
            "evaluated token for each of "
            f"the 2 compared models at {phase_cfg.eval.batch_size} x {phase_cfg.seq_len} tokens a batch, held-out sets assumed to "
            "fill max_batches, "
            f"vs {'4N (LoRA)' if phase_cfg.lora else '6N'} per trained token spread over the stage's GPUs or CPU threads, at "
            "one rate per FLOP (and thread)"
        )
