"""The run layout and the pipeline, as data: one row per stage (its name, declared here; where its
artifact lives under the run root; the stages its task reads; its phase; what its config digest
covers), and how checkpoints are named.

    python -c "from tasks.core.run.stages import STAGES; print([(s.name, s.artifact, s.digest) for s in STAGES])"
    python -m tasks.core.run.stages_doc      # the stage list of docs/reference/stages.md, from this table

Read by the runner (tasks/flowkit/run.py: the order, what each task is called with, run.json,
`--stop-after`, failure URIs), every stage task (its artifact directory, its
source, its digest fields through `tasks.core.run.digest`), the engine (checkpoint names) and the
push (the final checkpoint of each training stage). No run-directory literal is spelled anywhere else.

    <run_root>/run.json
    <run_root>/.lease.json              the one writer's lease (tasks/core/storage/lease.py)
    <run_root>/base/                    load_from_hf
    <run_root>/data/cpt/                prepare_cpt: token shards, index.json, held-out records
    <run_root>/data/sft/                prepare_sft
    <run_root>/cpt/step-NNNNNN/         boost_and_shard (step 0), train_cpt; train_state.json in each
    <run_root>/cpt/data-split.json      what CPT trained on and held out
    <run_root>/cpt/loss-curve.png       train_cpt's loss per step
    <run_root>/cpt/tensorboard/         rank 0's event files
    <run_root>/cpt/hf/                  unshard: the HF bridge between the plugins
    <run_root>/eval/cpt/                evaluate_cpt
    <run_root>/sft/...                  reboost (step 0), train_sft: as cpt/
    <run_root>/export/                  export
    <run_root>/export-adapter/          export, with sft.lora (dpo.lora): the adapter alone in peft's layout
    <run_root>/eval/sft/                evaluate_sft
    <run_root>/eval/benchmark/          benchmark: lm-eval scores of base and export, the tasks' YAMLs and data
    <run_root>/eval/benchmark-base/     the base's scores per base manifest, tasks and settings (run once per base)
    <artifact>.tmp-build/               an artifact being built, swapped into place when whole
    <dir>.superseded-<UTC time>/        checkpoints of another config, or what sat in an artifact's place that the flow did not write: moved aside (never deleted)
    <staging>/jobs/<phase>-<verb>.json  the job file of each engine launch
    <staging>/data-cache/<phase>/       prepare_data's shards, kept across failures and re-runs
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from tasks.core.config.phases import PHASES, Phase


class Status(StrEnum):
    """A stage's outcome, as recorded in run.json and the stage table."""

    COMPLETED = "completed"  # built now, artifact published
    SKIPPED = "skipped"  # its artifact verified and its config digest matched: nothing ran
    FAILED = "failed"
    # stopped on a preemption notice with what it could commit; the flow retries it by its own
    # policy (`<phase>.elastic`), no failure attempt used (tasks/core/run/preemptions.py)
    PREEMPTED = "preempted"
    FAILED_GATE = "failed-gate"  # the gate held the push back (artifacts kept)
    NOT_CONFIGURED = "not-configured"  # nothing to do by configuration (no hub, no held-out set)
    PASSED = "passed"  # the gate's verdict
    DISABLED = "disabled"  # the gate is switched off
    NOT_RUN = "not-run"  # never reached


# Statuses of a run that did its job.
DONE = frozenset({Status.COMPLETED, Status.SKIPPED, Status.NOT_CONFIGURED, Status.PASSED, Status.DISABLED})

RUN_JSON = "run.json"  # the run's record: every stage's status, artifact and manifest digest
LEASE = ".lease.json"
BASE = "base"
EXPORT = "export"
BENCHMARK_BASE = (
    "eval/benchmark-base"  # <key>.json: the base model's benchmark scores, reused while base, tasks and settings match
)
# A LoRA run's adapter alone (adapter_config.json, adapter_model.safetensors): an artifact of its
# own that the export stage writes beside export/, never inside it, so no loader of the merged
# weights meets an adapter (tasks/core/models/folder.py).
EXPORT_ADAPTER = "export-adapter"
TENSORBOARD = "tensorboard"  # <phase>/tensorboard/: rank 0's event files (tasks/engine/metrics.py)
TRAIN_STATE = "train_state.json"  # in every checkpoint: step, tokens seen, sampler position, losses
# train_state.json's per-step figures beside the losses (null where a step had none, e.g. mfu on
# CPU): the stage's result and the model card give their medians (`step_medians`).
STEP_SUMMARY = "step_metrics"
SUMMARY_FIELDS = ("tokens_per_s", "padding_frac", "mfu")
# Also kept per step: the largest peak memory of any rank and that rank; the card gives the maximum (`step_peak`).
PEAK_FIELDS = ("peak_mem_bytes", "peak_mem_rank")

SPLIT_FILE = "data-split.json"  # <phase>/data-split.json: the prepared data's split, beside the checkpoints
LOSS_CURVE = "loss-curve.png"
BUILD_SUFFIX = ".tmp-build"  # <artifact>.tmp-build: built here, renamed into place when whole
SUPERSEDED = ".superseded-"  # <dir>.superseded-<UTC time>: work of another config, kept aside, not deleted
JOBS = "jobs"  # <staging>/jobs/: the job files of the engine launches
DATA_CACHE = "data-cache"  # <staging>/data-cache/<phase>/: shards kept across failures and re-runs
STEP_PREFIX = "step-"
STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d{{6,}})$")


def step_medians(state: dict) -> dict[str, float]:
    """The median of each SUMMARY_FIELDS series of a train_state.json, where it has values."""
    out = {}
    for key, values in (state.get(STEP_SUMMARY) or {}).items():
        vals = [float(v) for v in values if isinstance(v, (int, float))]
        if key in SUMMARY_FIELDS and vals:
            out[key] = statistics.median(vals)
    return out


def step_peak(state: dict) -> tuple[int, int | None] | None:
    """(bytes, rank): the largest peak memory of any rank over a train_state.json's steps."""
    series = state.get(STEP_SUMMARY) or {}
    peaks = [
        (int(b), r)
        for b, r in zip(series.get("peak_mem_bytes") or [], series.get("peak_mem_rank") or [], strict=False)
        if isinstance(b, (int, float))
    ]
    return max(peaks, key=lambda p: p[0]) if peaks else None


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def is_step_name(name: str) -> bool:
    """Whether a directory name under a training stage is a checkpoint's (committed or not)."""
    return name.startswith(STEP_PREFIX)


def split_rel(phase: str) -> str:
    return f"{phase}/{SPLIT_FILE}"


def loss_curve_rel(phase: str) -> str:
    return f"{phase}/{LOSS_CURVE}"


def job_file(phase: str, verb: str) -> str:
    """Staging-relative path of the job file of one engine launch."""
    return f"{JOBS}/{phase}-{verb}.json"


def tmp_step_name(step: int) -> str:
    """Where a checkpoint is written before its manifest exists and it is renamed into place."""
    return f".{step_name(step)}.tmp"


def step_rel(phase: str, step: int) -> str:
    return f"{phase}/{step_name(step)}"


@dataclass(frozen=True)
class TrainingPhase:
    """One training phase (cpt, sft, dpo): the config section, the model it starts from, its bridge."""

    key: Phase  # the config section and the checkpoint directory
    source: str  # the HF artifact whose weights the shard verb boosts
    hf: str | None  # the HF artifact made from its final checkpoint (None: the export)

    @property
    def checkpoints(self) -> str:
        return self.key

    def step(self, step: int) -> str:
        return step_rel(self.key, step)


TRAINING: dict[str, TrainingPhase] = {
    "cpt": TrainingPhase("cpt", source=BASE, hf="cpt/hf"),
    "sft": TrainingPhase("sft", source="cpt/hf", hf=None),
    # preference tuning starts from the SFT model unsharded; its train verb also reads the reference
    # log-probabilities of its pairs (Job.reference_dir)
    "dpo": TrainingPhase("dpo", source="sft/hf", hf=None),
}


# How a training stage runs, as against what its model learns from: the launch (world size, nodes,
# backend), the plugin and its tp/pp/ZeRO and offload, the micro-batch x accumulation split, the
# kernels. None is in the digest of the stage's step-000000 (so none in its checkpoints'): a change
# resumes from the newest complete checkpoint, its model and optimizer re-sharded by the loaders
# (docs/resume.md). What they make together and the model learns from, the global batch, is
# digested instead (`global_batch`, `GLOBAL_BATCH`); the precision, lr, schedule, seed, data, LoRA
# and packing stay in the digest, so a change there still moves the checkpoints aside.
GLOBAL_BATCH = "global_batch"  # the digest entry <key>.global_batch: micro_batch_size x grad_accum_steps x dp


def layout_fields(key: str) -> tuple[str, ...]:
    plugin = (
        "name",
        "tp_size",
        "pp_size",
        "zero_stage",
        "num_microbatches",
        "placement_policy",
        "cpu_offload",
        "offload_optim_frac",
        "offload_param_frac",
    )
    return (
        f"{key}.launch",
        *(f"{key}.plugin.{f}" for f in plugin),
        f"{key}.micro_batch_size",
        f"{key}.grad_accum_steps",
        f"{key}.kernels",
    )


# Settings that change how a stage runs, never the bytes it writes, so no digest holds them
# (tasks/core/run/digest.py drops them from every declared field): the tokenize task runner (each
# shard is the same bytes whichever worker tokenized it), the upload pacing of a remote run root,
# experiment tracking and the Hub push (no artifact is made from either). The launch settings are
# NOT here: they change the bytes of the checkpoints (reduction order, sharding); a training stage
# leaves them out of its digest by `layout_fields` instead, and continues its checkpoints.
# activation_checkpointing recomputes each layer's forward from the same inputs with the same ops
# (torch.utils.checkpoint keeps the RNG state, so dropout masks repeat): measured bitwise the same
# losses and weights on CPU (hybrid_parallel tp=2 and pp=2 fp32, low_level_zero bf16:
# tests/test_activation_checkpointing.py). Left out, a stage that ran out of memory resumes from its
# own checkpoints once it is switched on, instead of training again. `kernels` change the numerics on
# CUDA (flash attention, fused norms, the fused AdamW) as another plugin does: a layout field.
NEVER_DIGESTED: tuple[str, ...] = (
    *(
        f"{key}.{field}"
        for key in TRAINING
        for field in ("data.tokenize", "max_pending_publishes", "activation_checkpointing", "log_every")
    ),
    # which preemption notices a stage listens to; keep_global_batch enters as the digest's global batch
    *(f"{key}.elastic" for key in TRAINING),
    # a declaration about the hardware, read by pre-flight's memory check only: the ranks never see it
    *(f"{key}.launch.gpu_memory_gb" for key in TRAINING),
    # the threshold of a warning (pre-flight, prepare_data) about how often a mixture repeats a source
    *(f"{key}.data.max_source_epochs" for key in TRAINING),
    # whether weights that do not sum to 1 are refused (pre-flight) or normalized, as they always are: the same blend
    *(f"{key}.data.strict_weights" for key in TRAINING),
    # how much of a model the flow process's logits checks may hold at once: streamed or whole, the same logits
    "verify_memory_gb",
    # a bound pre-flight and the stage check on the tasks' data; the data themselves enter by sha256
    "benchmark.max_split_mb",
    "tracking",
    "hub",
)


@dataclass(frozen=True)
class StageSpec:
    """One Prefect task of the flow, and what its config digest covers.

    The digest of an artifact stage (tasks/core/run/digest.py) is made from `digest` (config paths,
    less their subfields named in `minus` and NEVER_DIGESTED), the content digests of the artifacts
    of `parents`, and the run-time inputs its task passes (prepare_data: the input files). A stage
    with `continues` computes none: it carries the digest recorded by that stage's artifact.
    """

    name: str  # the task name, the key in run.json
    artifact: str | None  # run-root-relative directory it writes (a training stage: its checkpoint dir)
    source: str | None = None  # run-root-relative artifact it reads
    digest: tuple[str, ...] = ()  # config paths the artifact is made from, e.g. "cpt", "base_model.trust_remote_code"
    minus: tuple[str, ...] = ()  # subfields of those paths it is not made from
    parents: tuple[str, ...] = ()  # stages whose artifacts it is made from
    continues: str | None = None  # training: its checkpoints carry the digest of this stage's (step 0)
    global_batch: str | None = None  # a training key: digest the global batch its layout fields make
    # The pipeline: the stages whose results its task is called with, after the config, in order
    # (tasks/flowkit/pipeline.py binds them to the task's parameters), and the training phase it
    # belongs to (a PHASES row; its task gets it as `phase` when it takes one). Left out, a stage
    # reads what its artifact is made from: its parents, or the stage it continues.
    reads: tuple[str, ...] = None  # type: ignore[assignment]  (set by __post_init__)
    phase: Phase | None = None
    # Not run while this stage's verdict is failed-gate: its row records the hold instead.
    held_by: str | None = None
    publishes: bool = False  # it uploads the export: the model card is written into it first
    # What it leaves, in a line: the stage list of README.md, docs/index.md, docs/concepts.md and
    # docs/reference/stages.md is generated from the rows (tasks/core/run/reference.py).
    summary: str = ""
    # What the row becomes when a run trains an optional phase: {phase: {field: value}}, e.g. the export made
    # from that phase's checkpoints instead of SFT's. A run without the phase has the row as written above,
    # so its digest is unchanged (`run_stages`).
    with_phase: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.reads is None:
            made_from = self.parents or ((self.continues,) if self.continues else ())
            object.__setattr__(self, "reads", tuple(made_from))


# The prepare stage of each training phase; all tokenize with the base model's tokenizer.
PREPARE: dict[Phase, str] = {"cpt": "prepare_cpt", "sft": "prepare_sft", "dpo": "prepare_dpo"}
# The SFT model unsharded: the model DPO boosts from and its reference (a run without dpo exports SFT instead).
SFT_HF = TRAINING["dpo"].source
REFERENCE = (
    "reference"  # the reference model's log-probabilities of the dpo train pairs (tasks/core/evaluation/reference.py)
)


def data_rel(phase: Phase) -> str:
    """The prepared data of a training phase: token shards, index.json, held-out records."""
    return f"data/{phase}"


def _prepare_fields(key: str) -> tuple[str, ...]:
    # The corpus, how it is split and cut into sequences (a chat longer than seq_len: truncation); the held-out split decides which
    # records go where; the held-out-only sources are checked and kept with them. The input files
    # themselves come in as run-time inputs.
    return (
        f"{key}.data",
        f"{key}.eval.heldout_uri",
        f"{key}.eval.heldout_fraction",
        f"{key}.eval.heldout_sources",
        f"{key}.seq_len",
        f"{key}.truncation",
    )


# The evaluation's own knobs change the metrics, never what a stage trains on.
def _eval_knobs(key: str) -> tuple[str, ...]:
    return tuple(f"{key}.eval.{f}" for f in ("batch_size", "max_batches", "dtype"))


def _eval_fields(key: str) -> tuple[str, ...]:
    return (f"{key}.eval", f"{key}.data", f"{key}.seq_len", "base_model.trust_remote_code")


STAGES: tuple[StageSpec, ...] = (
    StageSpec("load_from_hf", BASE, digest=("base_model",), summary="the base model as HF safetensors, fingerprinted"),
    StageSpec(
        PREPARE["cpt"],
        data_rel("cpt"),
        source=BASE,
        digest=_prepare_fields("cpt"),
        reads=("load_from_hf",),
        phase="cpt",
        summary="token shards and the held-out split of the CPT corpus",
    ),
    StageSpec(
        PREPARE["sft"],
        data_rel("sft"),
        source=BASE,
        digest=_prepare_fields("sft"),
        reads=("load_from_hf",),
        phase="sft",
        summary="the same for the chat records",
    ),
    StageSpec(
        PREPARE["dpo"],
        data_rel("dpo"),
        source=BASE,
        digest=_prepare_fields("dpo"),
        reads=("load_from_hf",),
        phase="dpo",
        summary="the same for the preference pairs (dpo only)",
    ),
    StageSpec(
        "boost_and_shard",
        TRAINING["cpt"].checkpoints,
        source=BASE,
        digest=("cpt",),
        minus=(*_eval_knobs("cpt"), *layout_fields("cpt")),
        parents=("load_from_hf", PREPARE["cpt"]),
        global_batch="cpt",
        phase="cpt",
        summary="plugin A's sharded checkpoint of the base",
    ),
    StageSpec(
        "train_cpt",
        TRAINING["cpt"].checkpoints,
        source=TRAINING["cpt"].checkpoints,
        continues="boost_and_shard",
        phase="cpt",
        summary="continued pre-training under plugin A",
    ),
    # export.max_shard_size, which unshard also reads, only cuts the same tensors into other files.
    StageSpec(
        "unshard",
        "cpt/hf",
        source=TRAINING["cpt"].checkpoints,
        parents=("train_cpt",),
        phase="cpt",
        summary="HF safetensors: the bridge between the two plugins",
    ),
    StageSpec(
        "evaluate_cpt",
        "eval/cpt",
        source="cpt/hf",
        digest=_eval_fields("cpt"),
        parents=("load_from_hf", "unshard"),  # base vs CPT, held-out perplexity
        phase="cpt",
        summary="held-out perplexity, base vs CPT",
    ),
    StageSpec(
        "reboost",
        TRAINING["sft"].checkpoints,
        source="cpt/hf",
        digest=("sft",),
        minus=(*_eval_knobs("sft"), *layout_fields("sft")),
        parents=("unshard", PREPARE["sft"]),
        global_batch="sft",
        phase="sft",
        summary="plugin B's sharded checkpoint of cpt/hf",
    ),
    StageSpec(
        "train_sft",
        TRAINING["sft"].checkpoints,
        source=TRAINING["sft"].checkpoints,
        continues="reboost",
        phase="sft",
        summary="supervised fine-tuning under plugin B (or LoRA)",
    ),
    # The dpo phase's rows (only in a run with a `dpo:` section): SFT's final checkpoint unsharded to
    # sft/hf, the reference log-probabilities of the train pairs by that model, boosted under the dpo
    # plugin (its step 0 made from both), trained against the reference.
    StageSpec(
        "unshard_sft",
        SFT_HF,
        source=TRAINING["sft"].checkpoints,
        parents=("train_sft",),
        phase="dpo",
        summary="SFT's model as HF safetensors: DPO's start (dpo only)",
    ),
    # The log-probabilities are sums with their token counts, so the loss (sigmoid or per-token ipo) reads the same artifact.
    StageSpec(
        "reference",
        REFERENCE,
        source=SFT_HF,
        digest=("base_model.trust_remote_code",),
        parents=("unshard_sft", PREPARE["dpo"]),
        phase="dpo",
        summary="the SFT model's log-probs of each train pair (dpo only)",
    ),
    StageSpec(
        "reboost_dpo",
        TRAINING["dpo"].checkpoints,
        source=SFT_HF,
        digest=("dpo",),
        minus=(*_eval_knobs("dpo"), *layout_fields("dpo")),
        parents=("unshard_sft", PREPARE["dpo"], "reference"),
        global_batch="dpo",
        phase="dpo",
        summary="the dpo plugin's checkpoint of sft/hf (dpo only)",
    ),
    StageSpec(
        "train_dpo",
        TRAINING["dpo"].checkpoints,
        source=TRAINING["dpo"].checkpoints,
        continues="reboost_dpo",
        reads=("reboost_dpo", "reference"),
        phase="dpo",
        summary="preference tuning against the reference (dpo only)",
    ),
    # The last phase's final checkpoint: SFT's, or DPO's in a run that trains it.
    StageSpec(
        "export",
        EXPORT,
        source=TRAINING["sft"].checkpoints,
        digest=("export",),
        parents=("train_sft",),
        summary="a clean HF model folder, proven bitwise against the checkpoint",
        with_phase={"dpo": {"source": TRAINING["dpo"].checkpoints, "parents": ("train_dpo",), "reads": ("train_dpo",)}},
    ),
    # The thresholds of `gate:` only decide the verdict; the generation check's size (the phase row's
    # eval_digest) is evaluated.
    StageSpec(
        "evaluate_sft",
        "eval/sft",
        source=EXPORT,
        digest=(*_eval_fields("sft"), *PHASES["sft"].eval_digest),
        parents=("unshard", "export"),  # pre-SFT vs SFT, generation check
        phase="sft",
        summary="held-out loss pre-SFT vs SFT, a generation check",
        # with DPO the export is the DPO model: SFT's own model is sft/hf; the generation check stays the
        # export's (what ships, its stop tokens aligned), so the export is its third parent
        with_phase={
            "dpo": {
                "source": SFT_HF,
                "parents": ("unshard", "unshard_sft", "export"),
                "reads": ("unshard", "unshard_sft", "export"),
            }
        },
    ),
    # The SFT model vs the DPO model on the held-out pairs: preference accuracy, reward margin, chosen log-likelihood.
    StageSpec(
        "evaluate_dpo",
        "eval/dpo",
        source=EXPORT,
        digest=(*_eval_fields("dpo"), "dpo.beta", "dpo.loss", "dpo.label_smoothing"),
        parents=("unshard_sft", "export"),
        phase="dpo",
        summary="SFT vs DPO on held-out pairs: accuracy, margin (dpo only)",
    ),
    # lm-eval on local tasks: the task files' sha256 and lm-eval's version come in as run-time inputs.
    StageSpec(
        "benchmark",
        "eval/benchmark",
        source=EXPORT,
        digest=("benchmark", "base_model.trust_remote_code"),
        parents=("load_from_hf", "export"),
        summary="lm-eval scores of base vs export on local tasks (optional)",
    ),
    StageSpec(
        "gate",
        None,
        reads=("evaluate_cpt", "evaluate_sft", "benchmark"),
        with_phase={"dpo": {"reads": ("evaluate_cpt", "evaluate_sft", "benchmark", "evaluate_dpo")}},
        summary="the publish decision: a failed gate pushes nothing",
    ),
    StageSpec(
        "push_to_hub",
        None,
        source=EXPORT,
        held_by="gate",
        publishes=True,
        summary="one commit: the model, its card and its provenance",
    ),
)
STAGE: dict[str, StageSpec] = {s.name: s for s in STAGES}
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)


class _Rows:
    """The table's rows by attribute: `ROWS.unshard` is `STAGE["unshard"]`. Code outside this module
    names a stage this way, never in a string, so a row's name is written once and a renamed row
    fails every use by name (tests/test_structure.py checks each `ROWS.<name>` is a row)."""

    def __getattr__(self, name: str) -> StageSpec:
        try:
            return STAGE[name]
        except KeyError:
            raise AttributeError(f"no stage row named {name!r} in tasks/core/run/stages.py STAGES") from None

    def __dir__(self) -> list[str]:
        return list(STAGE)


ROWS = _Rows()


def run_stages(phases: Iterable[str]) -> tuple[StageSpec, ...]:
    """The rows of a run that trains `phases` (`RunConfig.phases`), in table order: a row of an optional
    phase the run does not train is not in it, and a row's `with_phase` changes for the phases it does
    train are made. A run of the phases every run trains gets the table's rows as they are."""
    trained = set(phases)
    out = []
    for spec in (STAGE[n] for n in STAGE_NAMES):  # by name: a row put in STAGE's place is the row
        if spec.phase is not None and spec.phase not in trained:
            continue
        for p, changes in spec.with_phase.items():
            if p in trained:
                spec = replace(spec, **changes)
        out.append(spec)
    return tuple(out)


def exported_phase(phases: Iterable[str]) -> Phase:
    """The training phase whose final checkpoint the export converts: its row's source, as the run has it
    (a training phase's checkpoint directory is its key): sft, or dpo in a run that trains it."""
    return run_stage(phases, "export").source  # type: ignore[return-value]


def run_stage(phases: Iterable[str], name: str) -> StageSpec:
    """The row `name` as a run that trains `phases` has it; a KeyError naming the phase it needs if it is not in the run."""
    rows = {s.name: s for s in run_stages(phases)}
    if name not in rows:
        if name in STAGE:
            raise KeyError(f"stage {name!r} is a row of the {STAGE[name].phase} phase, which this run does not train")
        raise KeyError(f"{name!r} is no stage; the stages are {', '.join(STAGE_NAMES)}")
    return rows[name]


def register(spec: StageSpec, after: str | None = None) -> StageSpec:
    """Add a row to the table, after the row named `after` (default: last). Its task is bound by
    tasks/flowkit/pipeline.py; the runner, run.json and `--stop-after` read the table when they run."""
    global STAGES, STAGE_NAMES
    if spec.name in STAGE:
        raise ValueError(f"stage {spec.name!r} is a row already")
    unknown = [r for r in (*spec.reads, *spec.parents) if r not in STAGE]
    if unknown or (after is not None and after not in STAGE):
        raise ValueError(f"stage {spec.name!r}: no row named {', '.join(unknown) or after!r} before it")
    rows = list(STAGES)
    rows.insert(len(rows) if after is None else STAGE_NAMES.index(after) + 1, spec)
    STAGES = tuple(rows)
    STAGE[spec.name] = spec  # in place: the modules that imported STAGE see the row
    STAGE_NAMES = tuple(s.name for s in STAGES)
    return spec
