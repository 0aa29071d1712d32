"""The memory one rank of a stage needs, estimated before launch from config.json, the plugin's
row and the batch; pre-flight prints it per stage and refuses a layout that does not fit the GPU or,
with the flow process, the host (tasks/core/preflight/memory_check.py). Each figure is the sum of
its parts (`MemoryEstimate.parts`), which is what pre-flight prints.

    python -m tasks.core.preflight.memory --table                                 # Llama-3-8B / 70B on 8x80 GB nodes
    python -m tasks.core.preflight.memory examples/tiny-cpu.yaml       # each stage of a run config

What is counted, per rank (pure arithmetic: no torch, nothing loaded):
- the rank's parameters: the family's tensor table (`tasks.core.models.families`), each tensor with a
  `TP_SPLIT_DIMS` dim divided by tp_size, the pipeline stage's layers (ColossalAI's
  `distribute_layers`), the embedding on the first stage, the final norm and LM head on the last;
- what the plugin keeps per parameter (`PluginSpec.holds`: weights, gradients, DDP buckets, fp32
  masters, Adam moments, each over dp where ZeRO shards it, each with its lifetime);
- a ZeRO optimizer's gradient bucket (`Held(per="bucket")`: `PluginSpec.grad_bucket_elements` or the rank's
  largest trainable tensor, whichever is larger): the flattened copy it reduces, and under ZeRO-2 the
  whole gradients waiting in it beside the activations;
- the activations of one micro-batch (micro_batch_size x seq_len tokens, split by sequence parallelism
  per its mode, `sequence_split`; a pipeline stage holds
  pp - stage micro-batches under 1F1B): each decoder layer what its family's `layer_activations`
  say (with `activation_checkpointing` only the layer's input, plus the layer being recomputed),
  one layer's gradients in flight, the final norm, the LM head's logits and the loss (12 fp32 bytes
  per logit: log-softmax output, its gradient, the gradient of its input; over tp, but whole on every
  rank under the derived tp policy, which gathers the logits for transformers' loss), and an SFT batch's
  attention mask;
- on CUDA: torch AdamW's foreach temporaries at the step (4 B per stepped parameter) unless the
  fused AdamW kernel is on, and `CUDA_RESERVE_BYTES`;
- on CUDA, the plugin's offload (`PluginSpec.offload`: cpu_offload, Gemini's offload fractions):
  the share of each `Held` row its field names moves from the GPU figure to the host figure, and
  the AdamW temporaries follow an offloaded step.

The device figure (what must fit one GPU) is the resident states plus the larger phase: the
forward/backward (activations, autocast copies, gathered layers) or the step (gradients and the
step's buffers), as PyTorch's caching allocator reuses one phase's blocks for the other. On a CPU
rank the host figure adds both phases: glibc's heap keeps the freed activations (most are below
its 32 MiB mmap threshold) resident and does not reliably refill them with the differently sized
gradient buffers, so after a few steps RSS holds both (benchmarks/scale.py measures it; with
MALLOC_MMAP_THRESHOLD_=131072 the same ranks' RSS drops to the device figure). Every rank also
holds `RANK_BASELINE_BYTES` (imports, process group, data), measured. On CUDA the states live on
the GPU and the host keeps the baseline plus what is offloaded. While the model is built (`construction_host`), a plugin
that builds lazily (`PluginSpec.lazy_init`: hybrid_parallel) holds its fp32 share plus one whole
tensor; the others still build the whole model on every rank's host, in the dtype they train in.
The shard verb (boost_and_shard, reboost: `shard_host`) holds the states kept from boost to the end, the
Adam moments made, plus its step-000000 save's gathered state (`PluginSpec.save_state_tensors` tensors'
two fp32 moments), or the model as it is built, whichever is larger.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

from tasks.core.config.layout import is_zero, num_microbatches
from tasks.core.config.phases import PHASES, Phase
from tasks.core.config.plugins import PLUGINS, Held, PluginSpec
from tasks.core.config.schema import PhaseConfig
from tasks.core.config.sequence import SP_MODES, sp_size
from tasks.core.evaluation.placement import (  # every GPU figure leaves CUDA_RESERVE_BYTES (a real run's: peak_mem_bytes)
    CUDA_RESERVE_BYTES,
)
from tasks.core.models.families import (
    TP_SPLIT_DIMS,
    ActivationTerm,
    family_config,
    iter_tensors,
    lora_trainable,
    model_dims,
)
from tasks.core.models.policy_rows import lazy_init_safe
from tasks.core.models.tp_plan import PLAN_POLICY

GB = 1e9
# The flow process's own resident memory while its ranks run: Prefect, the project, torch and transformers
# imported, the run's state. Measured on the demo run (examples/tiny-cpu.yaml, `cpt-to-sft run` in one
# process, its RSS polled): 0.643 GB at most while ranks ran, 0.661 GB over the whole run.
FLOW_BASELINE_BYTES = int(0.65e9)
# Steady RSS of a CPU rank training a ~0.1M-parameter Llama (benchmarks/scale.py "baseline"): torch,
# transformers and colossalai imported, the gloo group, the data; 0.45 GB under hybrid_parallel tp=2,
# 0.47 GB under low_level_zero (torch 2.13, transformers 4.51.3, colossalai 0.5.0, 2 ranks).
RANK_BASELINE_BYTES = int(0.47e9)
LOSS_BYTES_PER_LOGIT = 12
# A checkpoint save gathers a tensor's optimizer state whole (AdamW's two fp32 moments), `save_state_tensors`
# of them at once (PluginSpec); the shard verb's step-000000 save is its peak.
ADAM_STATE_BYTES = 8


def human(n: float) -> str:
    """1.52 GB, 310 MB: GB = 1e9 bytes, as the config's gpu_memory_gb."""
    return f"{n / GB:,.2f} GB" if n >= 0.1 * GB else f"{n / 1e6:,.1f} MB"


@dataclass(frozen=True)
class Term:
    what: str
    bytes: int
    when: str  # a Held lifetime, or "activations"
    host: bool = False  # offloaded: in the rank's host memory, not on its GPU


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's memory for one stage, in bytes (the largest pipeline stage's rank)."""

    parameters: int  # the whole model
    rank_parameters: int  # this rank's share after tp/pp, before ZeRO
    terms: tuple[Term, ...]
    baseline: int
    cuda: bool
    construction: int  # host bytes of the model while the engine builds it (beside the baseline)
    save_transient: int = 0  # a checkpoint save's gathered state beside the states (the shard verb's peak)

    def total(self, *whens: str) -> int:
        """Bytes on the rank's device (its GPU; on CPU everything) alive in these lifetimes."""
        return sum(t.bytes for t in self.terms if t.when in whens and not t.host)

    @property
    def offloaded(self) -> int:
        """Bytes the plugin's offload keeps in host memory instead (all of them resident: pinned or heap)."""
        return sum(t.bytes for t in self.terms if t.host)

    def _on(self, *whens: str) -> list[Term]:
        return [t for t in self.terms if t.when in whens and not t.host]

    def _larger_of_backward_and_step(self) -> list[Term]:
        return self._on("backward") if self.total("backward") >= self.total("step") else self._on("step")

    def parts(self, figure: str = "device") -> list[tuple[str, int]]:
        """The terms a figure adds up, merged by name, largest first: their bytes sum to the figure exactly.
        `figure`: "device" (`device`), "host" (`host_steady`), "construction" (`construction_host`), "shard"
        (`shard_host`)."""
        if figure == "device":
            fwd = self._on("forward", "activations")
            step = self._on("grads") + self._larger_of_backward_and_step()
            phase = fwd if sum(t.bytes for t in fwd) >= sum(t.bytes for t in step) else step
            rows = [(t.what, t.bytes) for t in self._on("always") + phase]
            rows += [("CUDA reserve", CUDA_RESERVE_BYTES)] if self.cuda else []
        elif figure == "host":
            rows = [("baseline", self.baseline)]
            if self.cuda:
                rows += [(t.what + " (offloaded)", t.bytes) for t in self.terms if t.host]
            else:
                live = self._on("always", "forward", "activations", "grads") + self._larger_of_backward_and_step()
                rows += [(t.what, t.bytes) for t in live]
        elif figure == "construction":
            rows = [("baseline", self.baseline), ("the model as it is built", self.construction)]
        elif figure == "shard":
            rows = [("baseline", self.baseline)]
            if self.construction >= self._shard_held:
                rows.append(("the model as it is built", self.construction))
            elif self.cuda:
                rows += [(t.what + " (offloaded)", t.bytes) for t in self.terms if t.host]
            else:
                rows += [(t.what, t.bytes) for t in self.terms if t.when == "always"]
                rows.append(("the step-000000 save's gathered state", self.save_transient))
        else:
            raise ValueError(f"figure {figure!r}: device, host, construction or shard")
        merged: dict[str, int] = {}
        for what, n in rows:
            merged[what] = merged.get(what, 0) + n
        return sorted(((w, n) for w, n in merged.items() if n), key=lambda kv: -kv[1])

    @property
    def device(self) -> int:
        """Bytes that must fit the rank's GPU (on CPU: the live bytes besides the baseline)."""
        fwd = self.total("forward", "activations")
        step = self.total("grads") + max(self.total("backward"), self.total("step"))
        return self.total("always") + max(fwd, step) + (CUDA_RESERVE_BYTES if self.cuda else 0)

    @property
    def host_steady(self) -> int:
        """The rank's resident host memory while it trains (see the module docstring)."""
        if self.cuda:
            return self.baseline + self.offloaded
        both = self.total("forward", "activations", "grads") + max(self.total("backward"), self.total("step"))
        return self.baseline + self.total("always") + both

    @property
    def construction_host(self) -> int:
        return self.baseline + self.construction

    @property
    def _shard_held(self) -> int:
        """What the shard verb (boost_and_shard, reboost) holds in host memory once boosted: on CPU the states
        kept from boost to the end (the optimizer's moments made: `materialize_optimizer_state`) plus its
        step-000000 save's transient; on CUDA what offload keeps on the host."""
        if self.cuda:
            return self.offloaded
        return sum(t.bytes for t in self.terms if t.when == "always") + self.save_transient

    @property
    def shard_host(self) -> int:
        """A shard-verb rank's host peak: the model as it is built, or the states and the save after it."""
        return self.baseline + max(self.construction, self._shard_held)

    def breakdown(self, figure: str = "device", limit: int = 5) -> str:
        """`a 1.07 GB + b 0.54 GB + ... = total`: the figure's parts, the smallest summed as `other`."""
        rows = self.parts(figure)
        shown = rows[:limit] if len(rows) <= limit + 1 else [*rows[:limit], ("other", sum(n for _, n in rows[limit:]))]
        return " + ".join(f"{what} {human(n)}" for what, n in shown) + f" = {human(sum(n for _, n in rows))}"


def _stage_layers(layers: int, pp: int) -> list[int]:
    """Decoder layers per pipeline stage, as ColossalAI 0.5.0's PipelineStageManager.distribute_layers
    deals them: evenly, the remainder to the middle stages."""
    q, r = divmod(layers, pp)
    out = [q] * pp
    start = pp // 2 - r // 2
    for i in range(start, start + r):
        out[i] += 1
    return out


def _width(term: ActivationTerm, dims: dict[str, int], tp: int, compute: int, outside: int = 1) -> float:
    width = dims[term.dim] / (tp if term.dim in TP_SPLIT_DIMS and not term.whole else outside)
    count = term.count * (dims[term.per] if term.per else 1)
    return count * width * (8 if term.index else 4 if term.fp32 else compute)


def layer_activation_bytes(
    model_config: dict[str, Any],
    compute_bytes: int,
    tp: int = 1,
    outside: int = 1,
    gathered: int = 0,
    terms: tuple[ActivationTerm, ...] | None = None,
) -> float:
    """Bytes per token one decoder layer keeps for its backward (family's `layer_activations`, or `terms`);
    `outside` divides the tensors tp leaves whole (split_gather's sequence split between the tp regions),
    `gathered` linears each keep a whole-sequence copy of their hidden-wide input (split_gather, `SpModeSpec`)."""
    family, _ = family_config(model_config)
    dims = model_dims(model_config)
    acts = sum(_width(t, dims, tp, compute_bytes, outside) for t in terms or family.layer_activations)
    return acts + gathered * dims["hidden"] * compute_bytes


def sequence_split(phase_cfg: PhaseConfig) -> tuple[int, int, int]:
    """(outside, seq, gathered): what a stage's sequence parallelism divides a rank's activations by, per its
    SP_MODES row: the hidden-wide tensors tp leaves whole (split_gather: by tp, its linears' gathered inputs
    added back), or every per-token tensor (all_to_all, ring_attn: each rank holds seq_len / size tokens, the
    logits and the loss included)."""
    p = phase_cfg.plugin
    sp = getattr(p, "sequence_parallelism", None)
    if sp is None or not PLUGINS[p.name].sequence_parallel:
        return 1, 1, 0
    n, spec = sp_size(p), SP_MODES[sp.mode]
    return (n, 1, spec.gathered_inputs) if spec.splits == "outside_tp" else (1, n, spec.gathered_inputs)


def _applies(h: Held, zero: int, precision: str, pp: int, dp: int, grad_accum: int) -> bool:
    return (
        zero in h.zero
        and precision in h.precisions
        and not (h.only in ("no_pipeline", "data_parallel") and pp > 1)
        and not (h.only == "data_parallel" and dp <= 1)
        and not (h.only == "grad_accum" and grad_accum <= 1)
    )


def _offloaded(spec: PluginSpec, plugin: Any, field: str, cuda: bool) -> float:
    """The share a plugin's offload field moves to host memory (0 on CPU: everything is there)."""
    row = spec.offload_field(field) if field and cuda else None
    if row is None or any(getattr(plugin, f) != want for f, want in row.requires):
        return 0.0
    value = getattr(plugin, field)
    return float(value) if isinstance(value, (bool, int, float)) else 0.0


def _split(what: str, n: int, when: str, share: float) -> list[Term]:
    moved = round(n * share)
    return [t for t in (Term(what, n - moved, when), Term(what, moved, when, host=True)) if t.bytes or not t.host]


def _fused_adamw(phase_cfg: PhaseConfig, phase: Phase, cuda: bool) -> bool:
    from tasks.core.config.kernels import Facts, resolve

    state = resolve(phase_cfg, phase, Facts(cuda=cuda)).get("fused_optimizer")
    return bool(state and state.on)


def estimate(
    model_config: dict[str, Any],
    phase_cfg: PhaseConfig,
    *,
    phase: str = "cpt",
    cuda: bool = False,
    baseline: int = RANK_BASELINE_BYTES,
) -> MemoryEstimate:
    """The largest rank's memory for `phase_cfg` on the model `model_config` (config.json) describes.
    Raises ConversionError for an unknown family, KeyError for a plugin without `holds`."""
    spec: PluginSpec = PLUGINS[phase_cfg.plugin.name]
    if not spec.holds:
        raise KeyError(
            f"plugin {spec.name} has no `holds` rows (tasks/core/config/plugins.py): its memory is not estimated"
        )
    family, config = family_config(model_config)
    dims = model_dims(model_config)
    p = phase_cfg.plugin
    tp, pp = (p.tp_size, p.pp_size) if spec.supports_tp_pp else (1, 1)
    dp = max(1, phase_cfg.launch.world_size // (tp * pp))
    zero = spec.zero_stage(p.zero_stage)
    weights = 4 if spec.weights_dtype(p.precision) == "fp32" else 2
    compute = 2 if p.precision in ("bf16", "fp16") else 4
    layers = config["num_hidden_layers"]
    per_stage = _stage_layers(layers, pp)
    nmb = num_microbatches(phase_cfg) if pp > 1 else 1
    rows = phase_cfg.micro_batch_size * (phase_cfg.grad_accum_steps // nmb if pp > 1 else 1)
    outside, seq_split, gathered = sequence_split(phase_cfg)
    tokens = rows * phase_cfg.seq_len / seq_split

    shares, trained, layer_params, largest, total = [0] * pp, [0] * pp, 0, 0, 0
    largest_trained = [0] * pp  # per pipeline stage: the largest trainable tensor of the rank's share
    bounds = [sum(per_stage[:s]) for s in range(pp + 1)]
    for key, rule, shape, layer in iter_tensors(model_config):
        n = math.prod(shape)
        total += n
        largest = max(largest, n)
        split = any(d in TP_SPLIT_DIMS for d in rule.shape) or family.tp_splits(key)
        mine = n // tp if tp > 1 and split else n
        s_ = (
            (0 if rule in family.head else pp - 1)
            if layer is None
            else next(s for s in range(pp) if bounds[s] <= layer < bounds[s + 1])
        )
        shares[s_] += mine
        mine_trained = mine if phase_cfg.lora is None else lora_trainable(phase_cfg.lora, key, shape, layer)
        trained[s_] += mine_trained
        largest_trained[s_] = max(largest_trained[s_], mine_trained)
        if layer == 0:
            layer_params += mine

    ckpt = bool(getattr(phase_cfg, "activation_checkpointing", False))
    per_layer = layer_activation_bytes(model_config, compute, tp, outside, gathered)
    saved = dims["hidden"] * compute / outside if ckpt else per_layer  # with checkpointing: the layer's input only
    # a policy row built whole on every rank (PolicyRow.eager_build: GPT-J) is not built lazily (Engine.lazy_init)
    lazy = bool(getattr(spec, "lazy_init", False)) and lazy_init_safe(model_config.get("model_type"))
    best: MemoryEstimate | None = None
    for s in range(pp):
        terms = []
        for h in spec.holds:
            if not _applies(h, zero, p.precision, pp, dp, phase_cfg.grad_accum_steps):
                continue
            if h.per == "layer":
                n = layer_params
            elif h.per == "bucket":  # a bucket never holds more than the rank's trainable parameters
                n = min(trained[s], max(spec.grad_bucket_elements, largest_trained[s]))
            else:
                n = shares[s] if not h.trainable else trained[s]
            n = math.ceil(n / dp) if h.sharded else n
            terms += _split(
                h.what, n * (weights if h.bytes == "weights" else h.bytes), h.when, _offloaded(spec, p, h.offload, cuda)
            )
        if cuda and spec.optimizer == "adamw" and not _fused_adamw(phase_cfg, phase, cuda):
            n = (
                math.ceil(trained[s] / dp) if is_zero(spec, p.zero_stage) else trained[s]
            )  # ZeRO steps this rank's shard
            step_share = max((_offloaded(spec, p, o.field, cuda) for o in spec.offload if o.moves_step), default=0.0)
            terms += _split("AdamW foreach temporaries", n * 4, "step", step_share)
        in_flight = min(pp - s, nmb)
        acts = (
            in_flight * per_stage[s] * saved + (2 if ckpt else 1) * per_layer
        )  # + the layer in the backward (recomputed)
        if s == pp - 1:
            acts += sum(_width(t, dims, tp, compute, outside) for t in family.final_activations)
            # the derived tp policy gathers the head's logits and runs transformers' own loss: each rank whole
            vocab_tp = 1 if family.shardformer_policy == PLAN_POLICY else tp
            acts += dims["vocab"] / vocab_tp * (LOSS_BYTES_PER_LOGIT + (compute if compute < 4 else 0))
        terms.append(Term("activations", int(acts * tokens), "activations"))
        if PHASES[phase].rows:  # padded or packed rows: a 4D attention mask, shared by the layers
            terms.append(Term("attention mask", rows * phase_cfg.seq_len**2 * compute, "activations"))
        # the engine builds a lazily built model's share in fp32 one tensor at a time (Engine._construction),
        # any other whole, in the dtype its plugin trains in (Engine.build_dtype: fp32 for torch_ddp)
        construction = 4 * (shares[s] + largest) if lazy else weights * total
        save = round(spec.save_state_tensors * ADAM_STATE_BYTES * max(largest_trained))
        est = MemoryEstimate(total, shares[s], tuple(terms), baseline, cuda, construction, save)
        if best is None or est.device > best.device:
            best = est
    assert best is not None
    return best


# -- the map: what fits where (docs/scaling.md) ----------------------------------------------------

# config.json of meta-llama/Meta-Llama-3-8B and -70B (the fields the estimate reads)
LLAMA3 = {
    "Llama-3-8B": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "Llama-3-70B": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
}
# (model, nodes, plugin fields, activation checkpointing): the layouts the table weighs
TABLE_LAYOUTS: tuple[tuple[str, int, dict[str, Any], bool], ...] = (
    ("Llama-3-8B", 1, {"name": "torch_ddp"}, False),
    ("Llama-3-8B", 1, {"name": "hybrid_parallel", "zero_stage": 1}, False),
    ("Llama-3-8B", 1, {"name": "low_level_zero", "zero_stage": 2}, False),
    ("Llama-3-8B", 1, {"name": "low_level_zero", "zero_stage": 2}, True),
    ("Llama-3-8B", 1, {"name": "low_level_zero", "zero_stage": 2, "cpu_offload": True}, True),
    ("Llama-3-8B", 1, {"name": "hybrid_parallel", "tp_size": 2, "zero_stage": 1}, False),
    ("Llama-3-8B", 1, {"name": "hybrid_parallel", "tp_size": 8}, False),
    ("Llama-3-8B", 1, {"name": "gemini"}, False),
    ("Llama-3-70B", 8, {"name": "low_level_zero", "zero_stage": 2}, True),
    ("Llama-3-70B", 1, {"name": "hybrid_parallel", "tp_size": 8, "zero_stage": 1}, True),
    ("Llama-3-70B", 2, {"name": "hybrid_parallel", "tp_size": 8, "zero_stage": 1}, False),
    ("Llama-3-70B", 2, {"name": "hybrid_parallel", "tp_size": 8, "zero_stage": 1}, True),
    ("Llama-3-70B", 4, {"name": "hybrid_parallel", "tp_size": 8, "zero_stage": 1}, True),
    ("Llama-3-70B", 8, {"name": "hybrid_parallel", "tp_size": 8, "zero_stage": 1}, True),
    ("Llama-3-70B", 2, {"name": "hybrid_parallel", "tp_size": 8, "pp_size": 2, "zero_stage": 1}, True),
    ("Llama-3-70B", 4, {"name": "hybrid_parallel", "tp_size": 8, "pp_size": 2, "zero_stage": 1}, True),
    ("Llama-3-70B", 1, {"name": "gemini"}, True),
    ("Llama-3-70B", 2, {"name": "gemini"}, True),
    ("Llama-3-70B", 4, {"name": "gemini"}, True),
    ("Llama-3-70B", 2, {"name": "hybrid_parallel", "tp_size": 8, "zero_stage": 1, "cpu_offload": True}, True),
    ("Llama-3-70B", 1, {"name": "gemini", "offload_optim_frac": 1.0}, True),
)


def table(gpu_gb: float = 80.0, gpus_per_node: int = 8, seq_len: int = 4096, micro_batch_size: int = 1) -> str:
    """The markdown table of TABLE_LAYOUTS: per-rank GPU memory, whether it fits, host RAM per node."""
    out = [
        (
            f"{gpus_per_node} x {gpu_gb:g} GB GPUs per node; bf16, micro_batch_size {micro_batch_size} x seq_len "
            f"{seq_len}, AdamW, "
            f"fused AdamW on; GB = 1e9 bytes; GPU figure includes the {CUDA_RESERVE_BYTES / GB:.0f} GB CUDA reserve."
        ),
        "",
        (
            "| model | nodes | plugin / layout | act. ckpt | GPU per rank | fits | host per node, steady | host per node, "
            "model build (today) |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, nodes, plugin, ckpt in TABLE_LAYOUTS:
        pp = plugin.get("pp_size", 1)
        phase_cfg = PhaseConfig.model_validate(
            {
                "data": {"uri": "x"},
                "plugin": {"precision": "bf16", **plugin},
                "max_steps": 1,
                "seq_len": seq_len,
                "lr": 1e-4,
                "micro_batch_size": micro_batch_size,
                "grad_accum_steps": 2 * pp if pp > 1 else 1,
                "activation_checkpointing": ckpt,
                "launch": {"nproc_per_node": gpus_per_node, "nnodes": nodes},
            }
        )
        est = estimate(LLAMA3[model], phase_cfg, cuda=True)
        p = phase_cfg.plugin
        layout = p.name + "".join(f" {k}={getattr(p, k)}" for k in ("tp_size", "pp_size") if getattr(p, k) > 1)
        layout += f" zero={PLUGINS[p.name].zero_stage(p.zero_stage)} dp={phase_cfg.launch.world_size // (p.tp_size * p.pp_size)}"
        layout += "".join(
            f" {k}={v}" for k, v in plugin.items() if k in ("cpu_offload", "offload_optim_frac", "offload_param_frac")
        )
        fits = "yes" if est.device <= gpu_gb * GB else "no"
        out.append(
            f"| {model} | {nodes} | {layout} | {'on' if ckpt else 'off'} | {est.device / GB:.1f} GB | {fits} | "
            f"{gpus_per_node * est.host_steady / GB:.0f} GB | {gpus_per_node * est.construction_host / GB:,.0f} GB |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if args[0] == "--table":
        print(table())
        return 0
    from tasks.core.config.load import parse_fields, read_raw_config
    from tasks.core.preflight.model_info import read_model_info

    cfg = parse_fields(
        read_raw_config(args[0]), source=args[0]
    )  # as pre-flight reads it: the static rules are its own checks
    mc = read_model_info(cfg.base_model.uri, cfg.base_model.revision).config
    for name in cfg.phases:
        phase_cfg = cfg.phase(name)
        cuda = bool(getattr(phase_cfg.launch, "gpu_memory_gb", None))
        est = estimate(mc, phase_cfg, phase=name, cuda=cuda)
        print(
            f"{name}: {phase_cfg.plugin.name} on {phase_cfg.launch.world_size} rank(s): {'GPU' if cuda else 'live'} "
            f"{human(est.device)}, "
            f"host {human(est.host_steady)} steady, {human(est.construction_host)} while the model is built, "
            f"{human(est.shard_host)} in the shard verb ({est.breakdown('host' if not cuda else 'device', 8)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
