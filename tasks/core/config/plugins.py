"""The plugin registry: one `PluginSpec` row per ColossalAI booster plugin, pure data.

    python -c "from tasks.core.config.plugins import PLUGINS; print(sorted(PLUGINS))"

Everything the rest of the project needs to know about a plugin by name is a field here: the
config's plugin-name type (`tasks.core.config.schema.PluginConfig.name`) is checked against these keys,
the layout rules (`tasks.core.config.layout`) read the capabilities, and the engine
(`tasks.engine.builders.BUILDERS`) keeps exactly one builder per key, the kernel registry
(`tasks.core.config.kernels`) applies its rows by the routes a row lists (`PluginSpec.kernel_routes`),
and the memory estimate (`tasks.core.preflight.memory`) sums `holds` and offers the plugins whose
`lever` is set as a memory saver. Adding a plugin is one `register(PluginSpec(...))` plus one builder;
nothing branches on a plugin's name elsewhere (tests/test_structure.py finds such branches).

Facts recorded in the rows were measured with colossalai 0.5.0 (see tasks/engine/builders.py):
- HybridParallelPlugin.configure asserts precision != "fp32" whenever zero_stage > 0 ("Please set
  precision to 'fp16' or 'bf16' when using ZeRO"), so fp32 there is zero_stage 0 only
  (`PluginSpec.zero_fp32_refused`). LowLevelZeroPlugin lists fp32 among its precisions and runs it:
  the model stays fp32 and its optimizer keeps an fp32 master copy of the rank's shard, as it
  does for bf16. GeminiPlugin takes fp16 and bf16 only (SUPPORTED_PRECISION).
- ZeRO-2 partitions gradients as they are reduced, so it must reduce every micro-batch (no
  `no_sync`); Gemini accumulates inside its chunks.
- Gemini's forward asserts that its chunks live on CUDA; torch_ddp's fp16 is torch.cuda.amp.
- fp16 needs CUDA on every plugin (`PRECISION_SPECS`), and every fp16 plugin scales the loss
  dynamically: HybridParallel, LowLevelZero and Gemini through ColossalAI's DynamicGradScaler,
  torch_ddp through torch.cuda.amp's GradScaler; the engine passes `LOSS_SCALE` to each.
- torch_ddp does not cast the model: bf16 there is fp32 weights under torch.autocast.
- HybridParallel's checkpoint IO drops the tied LM head itself and loads strictly; the general IO
  (low_level_zero, torch_ddp) needs the tied tensor saved once and a non-strict load whose key
  set is checked by the engine.
- Gemini accepts only ColossalAI's own Adam kernels (HybridAdam); every other plugin wraps AdamW.
- LoRA (booster.enable_lora, before boost) trains under TorchDDP, LowLevelZero and HybridParallel
  with tp_size 1 and pp_size 1 (`PluginSpec.lora`); Gemini refuses it.
- Offload (`PluginSpec.offload`, `Held.offload`): LowLevelZeroPlugin's `cpu_offload` (and
  HybridParallelPlugin's, which reaches the same LowLevelZeroOptimizer through ZeRO-1 only) puts
  the fp32 master shard on the CPU (`_create_master_param_current_rank`), so the Adam moments and
  the step, with its fp32 gradient shard, follow it; the working weights and gradients stay on the
  GPU. GeminiPlugin's `offload_optim_frac` puts that share of the chunks' fp32 masters and moments
  on the CPU and `offload_param_frac` that share of the weight chunks; both act under the "static"
  `placement_policy` only, and `offload_param_frac` only with `offload_optim_frac` 1.0 (else
  StaticPlacementPolicy warns and drops it). On a CPU rank every tensor is on the host already.

`PluginSpec.holds` is what each plugin keeps on a rank per parameter (the memory estimate,
`tasks.core.preflight.memory`, sums it), read in colossalai 0.5.0's source and checked against the
measured RSS of the engine's ranks (benchmarks/scale.py):
- HybridParallel wraps the module in torch DDP whenever pp == 1 and ZeRO is off (dp == 1 included),
  with gradient_as_bucket_view False: DDP's buckets are a second, flat copy of every gradient.
  Its AMP optimizer (bf16/fp16, ZeRO off) keeps fp32 masters beside the working weights and turns
  each working gradient into an fp32 master gradient at the step, releasing the first as it goes.
- LowLevelZero (and HybridParallel's ZeRO-1, the same optimizer over the dp group) keeps the whole
  model in the working dtype, an fp32 master shard and the Adam moments of that shard. ZeRO-1
  all-reduces every gradient and keeps all of them until the step; ZeRO-2 reduce-scatters each
  12M-element bucket as the backward goes and keeps only this rank's shard. The step casts the
  rank's gradient shard to fp32.
- torch_ddp keeps fp32 weights, gradients, DDP's buckets and the moments; under bf16 autocast, the
  bf16 copy of each weight lives from its forward use to its backward.
- Gemini shards weights, fp32 masters and moments in chunks; gradients reuse the weight chunks
  unless gradient accumulation is on (then they get chunks of their own); the layer in use is
  gathered whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class PrecisionSpec:
    """What a training precision needs, whatever the plugin (the layout rules read these rows)."""

    name: str
    cuda_reason: str = ""  # non-empty: refused without CUDA, for this reason
    loss_scaling: bool = False  # gradients underflow unless the loss is scaled (dynamically)


PRECISION_SPECS: dict[str, PrecisionSpec] = {
    "fp32": PrecisionSpec("fp32"),
    "bf16": PrecisionSpec("bf16"),
    # Measured on the demo (tiny-cpu, low_level_zero): fp16 on CPU ends at loss 4.90 against
    # 3.61 in bf16 and fails the gate; torch_ddp's fp16 is torch.cuda.amp, which disables itself.
    "fp16": PrecisionSpec(
        "fp16",
        cuda_reason="fp16 mixed precision trains badly on CPU (demo: final loss 4.90 vs 3.61 in bf16) and torch_ddp's "
        "fp16 is torch.cuda.amp",
        loss_scaling=True,
    ),
}


@dataclass(frozen=True)
class DynamicLossScale:
    """The dynamic loss scale every fp16 plugin is built with (ColossalAI's DynamicGradScaler
    names; torch_ddp's torch.cuda.amp GradScaler takes the first four). Passed explicitly, so a
    plugin default (low_level_zero starts at 2**32, torch amp grows every 2000 steps) cannot
    change a run silently: the scale halves after `hysteresis` overflowing steps (skipped) and
    doubles after `growth_interval` clean ones."""

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    max_scale: float = 2.0**32


LOSS_SCALE = DynamicLossScale()


MIXED: tuple[str, ...] = ("bf16", "fp16")
HeldWhen = Literal["always", "forward", "grads", "backward", "step"]


@dataclass(frozen=True)
class Held:
    """One kind of tensor a plugin keeps on a rank, per parameter of the rank's share (after tp/pp),
    for the memory estimate. `when` is its lifetime: `always` (boost to the end), `forward` (from
    the forward to the end of the backward, beside the activations), `grads` (the end of the
    backward through the step), `backward` (the end of the backward until the step releases it),
    `step` (during the optimizer step only)."""

    what: str
    bytes: int | Literal["weights"]  # per parameter; "weights": the size of the dtype the plugin trains in
    sharded: bool = False  # divided over the data-parallel ranks (ZeRO)
    when: HeldWhen = "always"
    zero: tuple[int, ...] = (0, 1, 2, 3)  # ZeRO stages (the stage the plugin runs) it exists under
    precisions: tuple[str, ...] = PRECISIONS
    # "no_pipeline": pp == 1 only; "data_parallel": pp == 1 and dp > 1 only; "grad_accum": grad_accum_steps > 1 only
    only: Literal["", "no_pipeline", "data_parallel", "grad_accum"] = ""
    # "layer": counts one decoder layer's parameters, unsharded; "bucket": the plugin's gradient bucket
    # (`PluginSpec.grad_bucket_elements`) or the rank's largest trainable tensor, whichever is larger, unsharded
    per: Literal["parameter", "layer", "bucket"] = "parameter"
    offload: str = (
        ""  # the PluginConfig field (an `Offload` row) whose value is the share of this tensor put in host memory
    )
    master: bool = (
        False  # the fp32 master weights: every checkpoint saves them (tasks/engine/masters.py), a resume restores them
    )
    trainable: bool = True  # per trainable parameter only (gradients, masters, moments); False: per parameter (weights), frozen ones too


@dataclass(frozen=True)
class Offload:
    """One memory saver a plugin has: a PluginConfig field, passed to the plugin under the same
    name. A value other than the field's default is refused under a plugin without this row."""

    field: str
    # (PluginConfig field, value) pairs the saver needs to act (else the plugin ignores it
    # silently), and why, for the message
    requires: tuple[tuple[str, object], ...] = ()
    why: str = ""
    moves_step: bool = (
        False  # the optimizer step runs in host memory with the state it moves (AdamW's temporaries follow)
    )


@dataclass(frozen=True)
class LoraSupport:
    """Whether LoRA (booster.enable_lora before boost) trains under a plugin, read in colossalai 0.5.0."""

    refused: str = ""  # non-empty: LoRA is refused under the plugin, for this reason
    tp1_reason: str = ""  # non-empty: LoRA only with tp_size 1, for this reason
    pp1_reason: str = ""  # non-empty: LoRA only with pp_size 1, for this reason


# How the engine passes a kernel (`tasks.core.config.kernels.KernelSpec.route`): "shardformer", flags of a
# plugin that shards the model through shardformer policies; "hf_model", from_pretrained arguments of
# the HF model's own forward; "torch_adamw", arguments of torch's AdamW.
KernelRoute = Literal["shardformer", "hf_model", "torch_adamw"]


@dataclass(frozen=True)
class Lever:
    """The plugin offered as a memory saver to a layout under another plugin (pre-flight's advice,
    `tasks.core.preflight.memory`): the PluginConfig fields set with the switch. The layout must fit
    the row otherwise (tp/pp 1 unless it supports them, CUDA where it needs it)."""

    fields: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class PluginSpec:
    """What one booster plugin supports; read by config validation, pre-flight and the engine."""

    name: str
    summary: str  # one line for the config field description and error messages
    supports_tp_pp: bool = False  # tensor/pipeline parallel (and a stage manager, tp/dp groups)
    # shards the model with a shardformer policy (even at tp=pp=1): runs only families that have one
    # (`ModelFamily.shardformer_policy`, tasks/core/models/families.py)
    shardformer: bool = False
    sequence_parallel: bool = False  # takes plugin.sequence_parallelism (tasks/core/config/sequence.py)
    zero_stages: tuple[int, ...] = (0,)  # accepted values of plugin.zero_stage
    implicit_zero: int | None = None  # ZeRO stage the plugin always runs (gemini: 3), whatever zero_stage says
    zero_hint: str = ""  # how to pick a valid zero_stage, for the message
    needs_cuda: bool = False  # refused on a machine without CUDA (before any model is loaded)
    cuda_reason: str = ""  # why it needs CUDA, for the message
    loss_scale: Literal["dynamic", "none"] = "dynamic"  # what its builder gives fp16: dynamic (LOSS_SCALE) or none
    precisions: tuple[str, ...] = PRECISIONS
    zero_fp32_refused: str = ""  # non-empty: fp32 with ZeRO on is refused under this plugin, for this reason
    no_sync_zero_stages: tuple[int, ...] = (0, 1)  # zero stages that may skip the gradient sync under accumulation
    casts_model: bool = True  # False: weights stay fp32; bf16 runs under torch.autocast, fp16 under amp
    optimizer: Literal["adamw", "hybrid_adam"] = "adamw"
    clips_grad: bool = (
        True  # the plugin applies plugin.max_norm itself; else the engine clips through its optimizer wrapper
    )
    strict_load: bool = True  # booster.load_model(strict=True) works; else non-strict plus an exact key check
    dedupes_tied_weights: bool = True  # its checkpoint IO saves a tied tensor once by itself
    extra_meta: tuple[str, ...] = field(default=())  # PluginConfig fields recorded in manifests for this plugin only
    # Non-empty: why this plugin's attention cannot keep packed conversations apart (sft batching
    # `packed` is refused under it, naming this); empty: the HF model's own forward, which takes
    # the block-diagonal mask or the restarting position ids as they are.
    packing_refused: str = ""
    holds: tuple[Held, ...] = ()  # what it keeps per parameter on a rank (memory estimate); () = not estimated
    # Elements of the gradient bucket its ZeRO optimizer reduces at once (ColossalAI's reduce_bucket_size,
    # 12 Mi elements unless the builder passes another); a tensor larger than it is a bucket of its own
    grad_bucket_elements: int = 0
    # How many tensors' whole Adam state (two fp32 moments) a checkpoint save holds at once beside the states:
    # the shard verb's step-000000 save is its peak (benchmarks/scale.py "shard peak"). A plugin whose ranks
    # hold the state sharded gathers it a tensor at a time (tasks/engine/lean_save.py); torch DDP's is whole
    # and local, saved as it is.
    save_state_tensors: float = 2.0
    # The plugin materializes a model built under ColossalAI's LazyInitContext as it shards it, so
    # a rank holds its own share plus one full tensor, never the whole model (hybrid_parallel: each
    # layer's weight is materialized by shardformer's from_native_module, then split; a pipeline
    # stage drops the layers it does not hold first). The weights are then loaded shard file by
    # shard file into the sharded model (booster.load_model), which also refreshes ZeRO's masters.
    lazy_init: bool = False
    lora: LoraSupport = LoraSupport()  # LoRA under this plugin: supported, or why not (the layout rules name it)
    offload: tuple[
        Offload, ...
    ] = ()  # the plugin's own memory savers, each a PluginConfig field (recorded in manifests)
    # The kernel rows that apply under it (`KernelSpec.route`): the model's own forward and torch's AdamW
    # unless it shards through shardformer or steps its own optimizer.
    kernel_routes: tuple[KernelRoute, ...] = ("hf_model", "torch_adamw")
    lever: Lever | None = None  # offered to other layouts as a memory saver with these fields; None: never

    def zero_stage(self, configured: int) -> int:
        """The ZeRO stage the plugin really runs."""
        return self.implicit_zero if self.implicit_zero is not None else configured

    def can_no_sync(self, zero_stage: int) -> bool:
        return self.zero_stage(zero_stage) in self.no_sync_zero_stages

    def weights_dtype(self, precision: str) -> str:
        """dtype of the parameters the plugin trains (and saves)."""
        return precision if self.casts_model else "fp32"

    def autocast(self, precision: str) -> str | None:
        """The torch.autocast dtype for a plugin that does not cast the model (bf16 only)."""
        return "bf16" if not self.casts_model and precision == "bf16" else None

    def booster_mixed_precision(self, precision: str) -> str | None:
        """Booster(mixed_precision=...) for a plugin that does not cast the model: fp16 amp."""
        return "fp16" if not self.casts_model and precision == "fp16" else None

    def saves_masters(self, precision: str, zero_stage: int = 0) -> bool:
        """Whether the plugin keeps fp32 master weights apart from the weights it trains, which its
        checkpoints then hold (4 bytes a parameter; the disk estimate counts them)."""
        z = self.zero_stage(zero_stage)
        return precision in MIXED and any(h.master and precision in h.precisions and z in h.zero for h in self.holds)

    def offload_field(self, name: str) -> Offload | None:
        return next((o for o in self.offload if o.field == name), None)


# Every PluginConfig field some plugin row may take as an `Offload`: refused where the row lacks it.
OFFLOAD_FIELDS: tuple[str, ...] = ("cpu_offload", "placement_policy", "offload_optim_frac", "offload_param_frac")

PLUGINS: dict[str, PluginSpec] = {}


def register(spec: PluginSpec) -> PluginSpec:
    """Add (or replace) a plugin row. The engine needs a builder under the same name."""
    if "torch_adamw" in spec.kernel_routes and spec.optimizer != "adamw":
        raise ValueError(f"plugin {spec.name!r}: kernel route torch_adamw needs optimizer 'adamw'")
    if {"shardformer", "hf_model"} <= set(spec.kernel_routes):
        raise ValueError(f"plugin {spec.name!r}: the model runs either shardformer's forward or its own, not both")
    PLUGINS[spec.name] = spec
    return spec


def spec_of(name: str) -> PluginSpec:
    try:
        return PLUGINS[name]
    except KeyError:
        raise KeyError(f"unknown plugin {name!r}; registered plugins: {', '.join(PLUGINS)}") from None


register(
    PluginSpec(
        name="hybrid_parallel",
        summary="tensor/pipeline parallel with optional ZeRO-1",
        supports_tp_pp=True,
        shardformer=True,
        sequence_parallel=True,
        zero_stages=(0, 1),
        zero_hint="hybrid_parallel supports zero_stage 0 or 1 here; use low_level_zero for stage 2 or gemini for "
        "stage 3",
        zero_fp32_refused="HybridParallelPlugin.configure asserts precision != 'fp32' when zero_stage > 0 in "
        "colossalai 0.5.0",
        no_sync_zero_stages=(0, 1),
        lazy_init=True,
        kernel_routes=("shardformer", "torch_adamw"),
        offload=(
            Offload(
                "cpu_offload",
                requires=(("zero_stage", 1),),
                moves_step=True,
                why="HybridParallelPlugin passes cpu_offload to its ZeRO optimizer only",
            ),
        ),
        lora=LoraSupport(
            tp1_reason="HybridParallelPlugin.enable_lora asserts tp_size == 1 in colossalai 0.5.0 (shardformer's "
            "split linears take no peft adapter)",
            # measured: shard verb, tiny Llama, pp=2 fp32 (ColossalAI's tests cover LoRA with pp=1 only)
            pp1_reason=(
                "colossalai 0.5.0's pipeline policy reads the peft-wrapped model one level too shallow "
                "(LlamaPolicy.get_shared_params: 'LlamaForCausalLM' object has no attribute 'embed_tokens')"
            ),
        ),
        packing_refused=(
            "ColossalAI 0.5.0's shardformer Llama forward builds its attention from the padding mask plus causal only "
            "(ColoAttention.prepare_attn_kwargs on its flash-attention path), so packed conversations would attend to "
            "each other"
        ),
        holds=(
            Held("weights", "weights", trainable=False),
            Held("gradients", "weights", when="grads", zero=(0,), precisions=("fp32",)),
            Held("gradients", "weights", when="backward", zero=(0,), precisions=MIXED),
            Held("fp32 master gradients", 4, when="step", zero=(0,), precisions=MIXED),
            # torch DDP wraps the model at pp == 1 without ZeRO; not at dp == 1, where the engine
            # turns it off (tasks/engine/solo_ddp.py)
            Held("DDP gradient buckets", "weights", zero=(0,), only="data_parallel"),
            Held("fp32 master weights", 4, zero=(0,), precisions=MIXED, master=True),
            Held("Adam moments", 8, zero=(0,)),
            Held("gradients", "weights", when="grads", zero=(1,)),
            Held("fp32 gradient shard", 4, sharded=True, when="step", zero=(1,), offload="cpu_offload"),
            Held("fp32 master weight shard", 4, sharded=True, zero=(1,), offload="cpu_offload", master=True),
            Held("Adam moment shard", 8, sharded=True, zero=(1,), offload="cpu_offload"),
        ),
    )
)
register(
    PluginSpec(
        name="low_level_zero",
        summary="ZeRO-1/2 data parallel",
        zero_stages=(1, 2),
        zero_hint="low_level_zero needs zero_stage 1 or 2",
        no_sync_zero_stages=(1,),
        strict_load=False,
        dedupes_tied_weights=False,
        offload=(Offload("cpu_offload", moves_step=True),),
        lever=Lever((("zero_stage", 2),)),
        # ColossalAI 0.5.0's LowLevelZeroOptimizer: a bucket's gradients are flattened into one new tensor
        # (_flatten_dense_tensors) to be reduced; under ZeRO-2 each gradient waits whole in its bucket until
        # the bucket fills during the backward, beside the activations (a tensor over the bucket alone: the
        # LM head's, the embedding's, a tied one's until the backward reaches the input); the fp32 copy of
        # the gradient shard at the step is a copy in bf16/fp16 only (in fp32 `.to(float32)` is the tensor)
        grad_bucket_elements=12 * 1024 * 1024,
        save_state_tensors=1.5,  # measured: 1.45 x at 80M (tied, 131k vocabulary), 2 CPU ranks, fp32
        holds=(
            Held("working weights", "weights", trainable=False),
            Held("fp32 master weight shard", 4, sharded=True, offload="cpu_offload", master=True),
            Held("Adam moment shard", 8, sharded=True, offload="cpu_offload"),
            Held("gradients", "weights", when="grads", zero=(1,)),
            Held("gradient shard", "weights", sharded=True, when="grads", zero=(2,)),
            Held("whole gradients awaiting their bucket", "weights", when="forward", zero=(2,), per="bucket"),
            Held("flattened gradient bucket", "weights", when="forward", zero=(2,), per="bucket"),
            Held("flattened gradient bucket", "weights", when="backward", zero=(1,), per="bucket"),
            Held("fp32 gradient shard", 4, sharded=True, when="step", offload="cpu_offload", precisions=MIXED),
        ),
    )
)
register(
    PluginSpec(
        name="gemini",
        summary="ZeRO-3 with chunked heterogeneous memory (CUDA only)",
        zero_stages=(0, 3),
        implicit_zero=3,
        zero_hint="gemini is ZeRO-3 by construction; leave zero_stage at 0 or 3",
        needs_cuda=True,
        cuda_reason="ColossalAI asserts in every forward that Gemini's chunks live on a GPU",
        precisions=MIXED,  # GeminiPlugin's SUPPORTED_PRECISION
        no_sync_zero_stages=(),
        optimizer="hybrid_adam",
        kernel_routes=("hf_model",),  # its optimizer is always HybridAdam, a fused CUDA kernel already
        lever=Lever((("zero_stage", 0),)),
        lora=LoraSupport(
            refused="GeminiPlugin.support_lora() is False and its enable_lora raises NotImplementedError in "
            "colossalai 0.5.0 (ColossalAI #6138)"
        ),
        strict_load=False,
        dedupes_tied_weights=False,
        offload=(
            Offload("placement_policy"),
            Offload(
                "offload_optim_frac",
                requires=(("placement_policy", "static"),),
                moves_step=True,
                why="GeminiPlugin's offload fractions act under the static placement policy only",
            ),
            Offload(
                "offload_param_frac",
                requires=(("placement_policy", "static"), ("offload_optim_frac", 1.0)),
                why="StaticPlacementPolicy drops offload_param_frac unless the optimizer state is wholly offloaded "
                "(offload_optim_frac 1.0)",
            ),
        ),
        holds=(
            Held("weight chunk shard", "weights", sharded=True, offload="offload_param_frac", trainable=False),
            Held("gathered weights of the layer in use", "weights", when="forward", per="layer", trainable=False),
            Held(
                "gradient chunk shard",
                "weights",
                sharded=True,
                when="grads",
                only="grad_accum",
                offload="offload_optim_frac",
            ),
            Held("fp32 master shard", 4, sharded=True, offload="offload_optim_frac", master=True),
            Held("Adam moment shard", 8, sharded=True, offload="offload_optim_frac"),
        ),
    )
)
register(
    PluginSpec(
        name="torch_ddp",
        summary="plain PyTorch DDP",
        zero_stages=(0,),
        zero_hint="torch_ddp has no ZeRO; set zero_stage: 0",
        no_sync_zero_stages=(0,),
        casts_model=False,
        clips_grad=False,
        strict_load=False,
        dedupes_tied_weights=False,
        save_state_tensors=0.0,
        holds=(
            Held("fp32 weights", "weights", trainable=False),
            Held("gradients", "weights", when="grads"),
            Held("DDP gradient buckets", "weights"),
            Held("autocast weight copies", 2, when="forward", precisions=MIXED, trainable=False),
            Held("Adam moments", 8),
        ),
    )
)
