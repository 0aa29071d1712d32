"""The run layout and the stage list, as data: what each stage is called, where its artifact
lives under the run root, what it reads, and how checkpoints are named.

    python -c "from tasks.core.run.stages import STAGES; print([(s.name, s.artifact) for s in STAGES])"

Read by the flow (order, stage table, failure URIs), every stage task (its artifact directory and
its source), the engine (checkpoint names) and the push (the final checkpoint of each training
stage). No run-directory literal is spelled anywhere else.

    <run_root>/run.json
    <run_root>/base/                    load_from_hf
    <run_root>/data/cpt/                prepare_cpt: token shards, index.json, held-out records
    <run_root>/data/sft/                prepare_sft
    <run_root>/cpt/step-NNNNNN/         boost_and_shard (step 0), train_cpt
    <run_root>/cpt/hf/                  unshard: the HF bridge between the plugins
    <run_root>/eval/cpt/                evaluate_cpt
    <run_root>/sft/step-NNNNNN/         reboost (step 0), train_sft
    <run_root>/export/                  export
    <run_root>/eval/sft/                evaluate_sft
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class Status(StrEnum):
    """A stage's outcome, as recorded in run.json and the stage table."""

    COMPLETED = "completed"  # built now, artifact published
    SKIPPED = "skipped"  # its artifact verified and its config digest matched: nothing ran
    FAILED = "failed"
    FAILED_GATE = "failed-gate"  # the gate held the push back (artifacts kept)
    NOT_CONFIGURED = "not-configured"  # nothing to do by configuration (no hub, no held-out set)
    PASSED = "passed"  # the gate's verdict
    DISABLED = "disabled"  # the gate is switched off
    NOT_RUN = "not-run"  # never reached


# Statuses of a run that did its job.
DONE = frozenset({Status.COMPLETED, Status.SKIPPED, Status.NOT_CONFIGURED, Status.PASSED, Status.DISABLED})

BASE = "base"
EXPORT = "export"
TENSORBOARD = "tensorboard"  # <stage>/tensorboard/: rank 0's event files (tasks/engine/metrics.py)
STEP_RE = re.compile(r"^step-(\d{6,})$")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def tmp_step_name(step: int) -> str:
    """Where a checkpoint is written before its manifest exists and it is renamed into place."""
    return f".{step_name(step)}.tmp"


def step_rel(stage: str, step: int) -> str:
    return f"{stage}/{step_name(step)}"


@dataclass(frozen=True)
class TrainingStage:
    """One training stage (cpt or sft): the config section, the model it starts from, its bridge."""

    key: str  # "cpt" or "sft": the config section and the checkpoint directory
    source: str  # the HF artifact whose weights the shard verb boosts
    hf: str | None  # the HF artifact made from its final checkpoint (None: the export)

    @property
    def checkpoints(self) -> str:
        return self.key

    def step(self, step: int) -> str:
        return step_rel(self.key, step)


TRAINING: dict[str, TrainingStage] = {
    "cpt": TrainingStage("cpt", source=BASE, hf="cpt/hf"),
    "sft": TrainingStage("sft", source="cpt/hf", hf=None),
}


@dataclass(frozen=True)
class StageSpec:
    """One Prefect task of the flow."""

    name: str  # the task name, the key in run.json
    artifact: str | None  # run-root-relative directory it writes (a training stage: its checkpoint dir)
    source: str | None = None  # run-root-relative artifact it reads


# The prepare stage of each training stage; both tokenize with the base model's tokenizer.
PREPARE: dict[str, str] = {"cpt": "prepare_cpt", "sft": "prepare_sft"}


def data_rel(stage: str) -> str:
    """The prepared data of a training stage: token shards, index.json, held-out records."""
    return f"data/{stage}"


STAGES: tuple[StageSpec, ...] = (
    StageSpec("load_from_hf", BASE),
    StageSpec(PREPARE["cpt"], data_rel("cpt"), source=BASE),
    StageSpec(PREPARE["sft"], data_rel("sft"), source=BASE),
    StageSpec("boost_and_shard", TRAINING["cpt"].checkpoints, source=BASE),
    StageSpec("train_cpt", TRAINING["cpt"].checkpoints, source=TRAINING["cpt"].checkpoints),
    StageSpec("unshard", "cpt/hf", source=TRAINING["cpt"].checkpoints),
    StageSpec("evaluate_cpt", "eval/cpt", source="cpt/hf"),
    StageSpec("reboost", TRAINING["sft"].checkpoints, source="cpt/hf"),
    StageSpec("train_sft", TRAINING["sft"].checkpoints, source=TRAINING["sft"].checkpoints),
    StageSpec("export", EXPORT, source=TRAINING["sft"].checkpoints),
    StageSpec("evaluate_sft", "eval/sft", source=EXPORT),
    StageSpec("gate", None),
    StageSpec("push_to_hub", None, source=EXPORT),
)
STAGE: dict[str, StageSpec] = {s.name: s for s in STAGES}
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
