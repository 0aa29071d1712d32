"""The lifecycle configuration: frozen pydantic models, one description per field. A leaf: the
rules between fields run where a config is loaded (`tasks.core.config.load`), not here.

Prefect renders these models as the run form; the engine reads the same models from the job file
the task writes. Print the JSON schema of the run form with:

    python -c "from tasks.core.config.schema import RunConfig; import json; print(json.dumps(RunConfig.model_json_schema())[:400])"

What a single field accepts (types, bounds, registered plugin and backend names) is checked here; rules across fields
(`tasks.core.config.layout`, the gate's held-out sets) by the loader; those that need the base's config.json or the machine in pre-flight.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, WithJsonSchema, model_serializer, model_validator

from tasks.core.config.backends import BACKENDS
from tasks.core.config.base import Frozen
from tasks.core.config.batching import BATCHING
from tasks.core.config.benchmark import BenchmarkConfig
from tasks.core.config.context import Attention, ContextConfig
from tasks.core.config.data import DataConfig, HeldoutSource
from tasks.core.config.elastic import ElasticConfig
from tasks.core.config.kernels import names as kernel_names
from tasks.core.config.kernels import summaries as kernel_summaries
from tasks.core.config.kernels import unknown as unknown_kernels
from tasks.core.config.lora import LoraConfig
from tasks.core.config.outputs import ExportConfig, GateConfig, HubConfig
from tasks.core.config.paths import expand_user_path
from tasks.core.config.phases import PHASES, Phase
from tasks.core.config.plugins import PLUGINS, Precision
from tasks.core.config.preference import DPO_DESCRIPTION, PreferenceFields
from tasks.core.config.sequence import SequenceParallelConfig
from tasks.core.config.slurm import SlurmConfig
from tasks.core.config.tracking import TrackingConfig


def _registered_plugin(name: str) -> str:
    if name not in PLUGINS:
        raise ValueError(f"unknown plugin {name!r}; registered plugins: {', '.join(PLUGINS)}")
    return name


# The plugin-name type is the registry's keys, read when a config is validated and when the JSON
# schema (the Prefect run form) is rendered, so a plugin registered later is accepted everywhere.
PluginName = Annotated[
    str,
    AfterValidator(_registered_plugin),
    WithJsonSchema({"type": "string", "enum": None}),  # enum filled in by PluginConfig's schema hook
]


def _registered_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown launch backend {name!r}; registered backends: {', '.join(BACKENDS)}")
    return name


BackendName = Annotated[str, AfterValidator(_registered_backend), WithJsonSchema({"type": "string", "enum": None})]


class BaseModelConfig(Frozen):
    uri: str = Field(description="Hugging Face Hub repo id (org/name) or a local/fsspec path to an HF model directory.")
    revision: str = Field(
        default="main", description="Hub revision (branch, tag or commit sha) to pin; ignored for paths."
    )
    trust_remote_code: bool = Field(
        default=False,
        description=(
            "Accept a base model whose configs name its own Python code (auto_map): load_from_hf removes every "
            "auto_map and copies no .py file, so it loads as transformers' own class of its model_type; no model "
            "folder's code ever runs. Off: such a model is refused."
        ),
    )
    allow_pickle: bool = Field(
        default=False,
        description="Accept .bin/pickle weight files from the base model. Off: only safetensors are read.",
    )
    hub_id: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$",
        description="For a local or fsspec uri: the Hub repo id (org/name) the folder holds, which the model card names as "
        "its base_model. Unset, the card names no Hub base (a folder's name is no Hub id). A Hub uri names itself.",
    )


def _registry_enum(field: str, registry: dict[str, Any], lead: str):
    """JSON-schema hook: the field's enum is the registry's keys (the Prefect form lists them) and its
    description names each row's summary, so a registered row needs no edit here."""

    def hook(schema: dict[str, Any]) -> None:
        prop = schema["properties"][field]
        prop["enum"] = list(registry)
        prop["description"] = lead + "; ".join(f"{n} ({s.summary})" for n, s in registry.items()) + "."

    return hook


_plugin_schema = _registry_enum("name", PLUGINS, "ColossalAI booster plugin: ")


class PluginConfig(Frozen):
    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True, json_schema_extra=_plugin_schema
    )

    name: PluginName = Field(
        description="ColossalAI booster plugin (see tasks/core/config/plugins.py for what each supports)."
    )
    tp_size: int = Field(
        default=1,
        ge=1,
        description="Tensor-parallel degree (hybrid_parallel only); must divide attention and KV heads.",
    )
    pp_size: int = Field(
        default=1, ge=1, description="Pipeline-parallel degree (hybrid_parallel only); at most the number of layers."
    )
    zero_stage: int = Field(
        default=0,
        ge=0,
        le=3,
        description="ZeRO stage: 0/1 for hybrid_parallel (1 needs bf16/fp16), 1/2 for low_level_zero.",
    )
    precision: Precision = Field(
        default="bf16",
        description="Training precision: fp32, bf16 or fp16 (mixed precision with fp32 master weights where the "
        "plugin keeps them).",
    )
    num_microbatches: int | None = Field(
        default=None, ge=1, description="Pipeline micro-batches per step (pp_size > 1); defaults to grad_accum_steps."
    )
    placement_policy: Literal["static", "auto"] = Field(
        default="static",
        description=(
            "Gemini's chunk placement: static (the offload fractions below decide) or auto (Gemini moves chunks by "
            "measured use). "
            "Plugins that take each offload field: PluginSpec.offload in tasks/core/config/plugins.py; refused "
            "elsewhere."
        ),
    )
    cpu_offload: bool = Field(
        default=False,
        description=(
            "Keep the fp32 master weights, Adam moments and the optimizer step in host memory instead of on the GPU "
            "(low_level_zero; hybrid_parallel with zero_stage 1): less GPU memory, a slower step."
        ),
    )
    offload_optim_frac: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description=(
            "Share of Gemini's fp32 master chunks and Adam moments kept in host memory (gemini, placement_policy "
            "static)."
        ),
    )
    offload_param_frac: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description=(
            "Share of Gemini's weight chunks kept in host memory (gemini, placement_policy static, offload_optim_frac "
            "1.0)."
        ),
    )
    max_norm: float = Field(
        default=1.0, ge=0, description="Gradient clipping norm applied by the plugin's optimizer (0 disables)."
    )
    sequence_parallelism: SequenceParallelConfig | None = Field(
        default=None,
        description="Split each sequence over a group of ranks (hybrid_parallel; docs/scaling.md, long context).",
    )


_launch_schema = _registry_enum("backend", BACKENDS, "Where the stage's torchrun agents run: ")


class LaunchConfig(Frozen):
    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True, json_schema_extra=_launch_schema
    )

    backend: BackendName = Field(
        default="local", description="Where the stage's torchrun agents run (see tasks/core/config/backends.py)."
    )
    slurm: SlurmConfig | None = Field(
        default=None,
        description="Slurm job settings when backend is slurm; null takes every default (default partition and time "
        "limit, no GPUs).",
    )
    nproc_per_node: int = Field(
        default=1, ge=1, description="Processes (GPUs, or CPU ranks without CUDA) per node for this stage."
    )
    nnodes: int = Field(default=1, ge=1, description="Number of nodes the stage spans (torchrun --nnodes).")
    node_rank: int = Field(
        default=0, ge=0, description="This node's rank when nnodes > 1 and no rendezvous endpoint is given."
    )
    rdzv_endpoint: str | None = Field(
        default=None, description="host:port of the c10d rendezvous for multi-node runs; None picks a free local port."
    )
    rdzv_id: str | None = Field(
        default=None, description="Rendezvous id shared by the nodes of one stage; defaults to the run name and stage."
    )
    gpu_memory_gb: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Memory of each GPU this stage's ranks run on, in GB (1e9 bytes; an 80 GB H100 is 80): pre-flight refuses "
            "a layout whose "
            "estimated memory per rank exceeds it and names the settings that fit (tasks/core/preflight/memory.py). "
            "null: the memory of "
            "the GPU the worker sees, if any. Read by pre-flight only; not part of any digest."
        ),
    )
    share: bool = Field(
        default=True,
        description=(
            "The shard stage (boost_and_shard, reboost) and this phase's training share one torchrun launch: the "
            "ranks that committed step 0 go on training when the train stage adopts them, saving a launch "
            "(tasks/core/launch/shared.py). Local backend on one node with a local run root only; false: a launch "
            "each. Not part of any digest."
        ),
    )

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class EvalConfig(Frozen):
    heldout_uri: str | None = Field(
        default=None,
        description=(
            "fsspec URI or path of this phase's held-out set (same format and fields as the training data). "
            "Training records identical to a held-out record are dropped from training. None: split heldout_fraction "
            "off the training data."
        ),
    )
    heldout_fraction: float = Field(
        default=0.05,
        ge=0.0,
        le=0.5,
        description=(
            "Without heldout_uri: the share of training records held out, chosen by a hash of each record's canonical "
            "JSON "
            "(deterministic and order-independent; identical records land on the same side; at least one record). "
            "0 with no heldout_uri: this phase is not evaluated."
        ),
    )
    batch_size: int = Field(
        default=8,
        ge=1,
        description="Sequences per forward pass during evaluation; memory only, the metric is a token-weighted mean "
        "over every evaluated token.",
    )
    max_batches: int | None = Field(
        default=50,
        ge=1,
        description="Evaluate at most this many batches of the held-out set (the first ones, in file order); null "
        "evaluates all of it.",
    )
    dtype: Precision | None = Field(
        default=None,
        description=(
            "Dtype both models of a comparison (and the generation check's model) are loaded in for evaluation, the "
            "same on both sides so the "
            "comparison is fair. null: export.dtype on a GPU worker (bf16 by default), fp32 on CPU. A model that does "
            "not fit the first GPU "
            "is spread over the visible GPUs (tasks/core/evaluation/placement.py)."
        ),
    )
    heldout_sources: list[HeldoutSource] | None = Field(
        default=None,
        description=(
            "CPT only: sources evaluated but never trained on, [{name, uri}], e.g. general text, to measure "
            "forgetting without replaying "
            "it. prepare_cpt checks and tokenizes them into data/cpt/ beside the held-out split (never into the "
            "blend); evaluate_cpt "
            "reports base vs CPT perplexity on each, like each trained source; gate.cpt_max_ppl_increase_pct may "
            "limit each by name."
        ),
    )

    @model_validator(mode="after")
    def _distinct_names(self) -> EvalConfig:
        names = [s.name for s in self.heldout_sources or ()]
        if self.heldout_sources is not None and not names:
            raise ValueError("eval.heldout_sources is empty: list at least one {name, uri}, or leave it out")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"eval.heldout_sources: the name {twice[0]!r} is given twice; each source needs its own name"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.heldout_uri is not None or self.heldout_fraction > 0


def _registered_batching(name: str) -> str:
    if name not in BATCHING:
        raise ValueError(f"unknown batching {name!r}; registered: {', '.join(BATCHING)}")
    return name


BatchingName = Annotated[str, AfterValidator(_registered_batching), WithJsonSchema({"type": "string", "enum": None})]
_batching_schema = _registry_enum(
    "batching", BATCHING, "How SFT conversations fill each micro-batch (CPT blocks are always full): "
)


def _registered_kernels(switches: dict[str, bool]) -> dict[str, bool]:
    bad = unknown_kernels(switches)
    if bad:
        raise ValueError(
            f"unknown kernel(s) {', '.join(map(repr, bad))}; registered kernels: {', '.join(kernel_names())} "
            "(tasks/core/config/kernels.py)"
        )
    return switches


KernelSwitches = Annotated[dict[str, bool], AfterValidator(_registered_kernels)]


def _phase_schema(schema: dict[str, Any]) -> None:
    """The batching enum, and the kernel names the `kernels` mapping takes (read from the registry
    when the schema is rendered, like the registry enums)."""
    _batching_schema(schema)
    prop = schema["properties"]["kernels"]
    prop["propertyNames"] = {"enum": list(kernel_names())}
    prop["description"] = (
        "Fast kernels this phase may use: each is on where the device and the installed packages support it "
        "(never without CUDA) unless switched off here, e.g. {flash_attention: false}; "
        + "; ".join(f"{n} ({s})" for n, s in kernel_summaries().items())
        + "."
    )


class PhaseConfig(Frozen):
    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True, json_schema_extra=_phase_schema
    )

    data: DataConfig = Field(description="Training data of this phase.")
    eval: EvalConfig = Field(
        default_factory=EvalConfig,
        description=(
            "Held-out data of this phase and how its evaluation runs (CPT: base vs CPT perplexity; SFT: pre-SFT vs "
            "SFT loss on assistant tokens)."
        ),
    )
    plugin: PluginConfig = Field(description="The ColossalAI plugin and its parallel layout for this phase.")
    launch: LaunchConfig = Field(
        default_factory=LaunchConfig,
        description="How many processes and nodes torchrun starts for each launch of this phase.",
    )
    max_steps: int = Field(ge=1, description="Optimizer steps to train.")
    micro_batch_size: int = Field(default=1, ge=1, description="Sequences per data-parallel rank per micro-batch.")
    grad_accum_steps: int = Field(
        default=1,
        ge=1,
        description="Micro-batches accumulated per optimizer step (pipeline micro-batches when pp_size > 1).",
    )
    seq_len: int = Field(ge=8, description="Tokens per sequence (CPT packing block, SFT truncation length).")
    context: ContextConfig | None = Field(
        default=None,
        description="CPT only: the base model's rope_theta, rope_scaling and max_position_embeddings to train with "
        "(context extension); cpt/hf, SFT and the export carry them (docs/long-context.md). null: the base's.",
    )
    attention: Attention = Field(
        default="causal",
        description="CPT only: 'causal' lets each token of a packed block attend to every token before it, the "
        "documents before it included; 'document' keeps attention and position ids inside each document (as packed "
        "SFT rows), refused under plugins whose attention cannot (tasks/core/config/context.py).",
    )
    batching: BatchingName = Field(
        default="grouped",
        description="How SFT conversations fill each micro-batch (see tasks/core/config/batching.py).",
    )
    truncation: Literal["drop", "cut", "split_turns"] = Field(
        default="drop",
        description=(
            "SFT: what a training chat longer than seq_len becomes, the same in every batching mode (prepare_data "
            "makes the rows): "
            "'drop' leaves it out (the default: nothing is trained that does not fit); 'cut' keeps its first seq_len "
            "tokens, with the "
            "reply the cut goes through unlabelled (no reply is trained as if it ended where it was cut); "
            "'split_turns' makes rows of "
            "whole exchanges (a user turn and its replies, after the system messages), as many a row as fit. Counted "
            "per source in "
            "data/sft/index.json, run.json, the log and the model card. CPT documents are always split across blocks."
        ),
    )
    kernels: KernelSwitches = Field(
        default_factory=dict,
        description=(
            "Switch fast kernels off for this phase ({name: false}); every registered kernel is on where the device "
            "and installed "
            "packages support it, off without CUDA (see tasks/core/config/kernels.py). true is the default, not a "
            "demand."
        ),
    )
    activation_checkpointing: bool = Field(
        default=False,
        description=(
            "Recompute each decoder layer's activations in the backward pass instead of keeping them: far less "
            "activation memory "
            "for about one more forward pass of compute; the losses are the same. Not part of the stage's digest (see "
            "tasks/core/run/stages.py)."
        ),
    )
    lr: float = Field(gt=0, description="Peak learning rate.")
    min_lr: float = Field(default=0.0, ge=0, description="Final learning rate of the cosine/linear schedule.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear warm-up steps.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="Learning-rate schedule after warm-up."
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW betas.")
    checkpoint_every: int = Field(
        default=100,
        ge=1,
        description="Save a complete training checkpoint every this many steps (and at the last step).",
    )
    log_every: int | None = Field(
        default=None,
        ge=1,
        description="A console line every this many steps and at the last; null: 1, 2, 5, 10, ... for <= 25 lines a "
        "stage. Not digested.",
    )
    keep_last: int = Field(
        default=2,
        ge=1,
        description="Complete checkpoints kept; older ones are deleted only after a newer manifest is committed.",
    )
    max_pending_publishes: int = Field(
        default=2,
        ge=1,
        description=(
            "With an s3:// (remote) run root: at most this many committed checkpoints may wait for their upload; a "
            "save that would "
            "exceed it waits (and says so in the log and UI) until uploads catch up. Local staging holds up to "
            "keep_last + this many "
            "checkpoints. Not part of the stage's digest: changing it re-trains nothing."
        ),
    )
    seed: int = Field(default=1234, description="Seed for model init randomness, data order and dropout.")
    elastic: ElasticConfig = Field(
        default_factory=ElasticConfig,
        description="Preemption notices and resuming on another number of ranks (docs/spot.md).",
    )
    lora: LoraConfig | None = Field(
        default=None,
        description=(
            "Train a LoRA adapter on the frozen model instead of every weight (SFT only), e.g. {r: 16, alpha: 32}; "
            "checkpoints "
            "hold the adapter and its optimizer, the base stays cpt/hf, and the export merges them in fp32. Supported "
            "under the "
            "plugins whose registry row allows it (tasks/core/config/plugins.py PluginSpec.lora). "
            "null: full fine-tuning."
        ),
    )


class DpoConfig(PreferenceFields, PhaseConfig):
    """The `dpo:` section: a phase section with the preference loss's fields (tasks/core/config/preference.py)."""


# Above this many GB of weights a logits check streams the model (tasks/core/models/stream.py):
# models up to ~1B parameters in fp32 load whole; at 8B-70B the flow process would
# otherwise need 16-140 GB of host RAM beside the node's ranks.
VERIFY_MEMORY_GB = 4.0
# The one declaration of the budget: the run config's field and the stage job's (which carries it into the ranks).
VerifyMemoryGB = Annotated[
    float,
    Field(
        gt=0,
        description=(
            "The flow process's logits checks (load_from_hf, unshard, export, cpt-to-sft verify) load a model whose "
            "weights in the checked dtype "
            "are at most this many GB (1e9 bytes) whole; a larger one is streamed a decoder layer at a time from its "
            "safetensors files through "
            "its own forward, bitwise the same logits, holding one layer instead of the model. A LoRA export whose "
            "base exceeds it in fp32 is "
            "merged a tensor at a time, bitwise the same export. Under pipeline parallelism rank 0 computes each "
            "checkpoint's fingerprint from its saved model/ folder the same way. Changes no artifact, so no digest "
            "holds it."
        ),
    ),
]


class RunConfig(Frozen):
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        description="Run name, shown in the Prefect run name and the model card.",
    )
    run_root: Annotated[str, AfterValidator(expand_user_path)] = Field(
        description=(
            "fsspec URI of this run's directory (local path, NFS path or s3://bucket/prefix); every stage artifact "
            "and run.json live under it. A leading ~ and $VAR or ${VAR} are expanded as a shell would (an unset "
            "variable is refused). Relative paths are relative to the project root."
        )
    )
    base_model: BaseModelConfig = Field(description="Where the model to continue pre-training comes from.")
    cpt: PhaseConfig = Field(description="Continued pre-training: packed raw text under plugin A.")
    sft: PhaseConfig = Field(
        description="Supervised fine-tuning: chat records, loss on assistant tokens, under plugin B."
    )
    dpo: DpoConfig | None = Field(default=None, description=DPO_DESCRIPTION)
    export: ExportConfig = Field(default_factory=ExportConfig, description="The HF safetensors export.")
    benchmark: BenchmarkConfig = Field(
        default_factory=BenchmarkConfig,
        description="lm-evaluation-harness scores of the base and the export on local tasks, before the gate.",
    )
    gate: GateConfig = Field(
        default_factory=GateConfig,
        description="Thresholds the evaluation must meet before the export is pushed to the Hub.",
    )
    hub: HubConfig | None = Field(default=None, description="Push the export to this Hub repo; None skips the push.")
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig,
        description="Experiment tracking: MLflow when tracking.mlflow.uri is set (TensorBoard event files are always "
        "written).",
    )
    staging_dir: str | None = Field(
        default=None, description="Local directory for staging remote artifacts; default a temp dir."
    )
    verify_memory_gb: VerifyMemoryGB = VERIFY_MEMORY_GB

    def phase(self, phase: Phase) -> PhaseConfig:
        """The config section of a training phase (a row of PHASES): `cfg.phase("sft").seq_len`."""
        if phase not in PHASES:
            raise KeyError(f"{phase!r} is not a training phase; the phases are {', '.join(PHASES)}")
        if (section := getattr(self, phase)) is None:
            raise KeyError(
                f"{phase!r}: this run has no {phase}: section; the phases it trains are {', '.join(self.phases)}"
            )
        return section

    @model_serializer(mode="wrap")
    def _absent_phases_unsaid(self, handler: Any) -> Any:
        """A dump (run.json, the tracker's params) without an optional phase left out: today's config, key for key."""
        out = handler(self)
        for p, row in PHASES.items():
            if row.optional and isinstance(out, dict) and out.get(p, 0) is None:
                del out[p]
        return out

    @property
    def phases(self) -> dict[str, PhaseConfig]:
        """{name: section} of the phases this run trains, in PHASES order: an optional one left out is not one."""
        return {p: s for p in PHASES if (s := getattr(self, p)) is not None}

    @property
    def run_uri(self) -> str:
        if "://" in self.run_root or self.run_root.startswith("/"):
            return self.run_root.rstrip("/")
        from tasks.core.config.paths import project_root

        return str(project_root() / self.run_root)
