"""The job file: what one engine invocation does. One frozen pydantic model, written by the
Prefect task (tasks/stages/train.py) and read by the engine (tasks/engine/__main__.py):

    torchrun --nproc_per_node=2 -m tasks.engine train --config JOB.json

It carries only what the ranks read: its phase's own config section (`phase_cfg`), whether the
model may run remote code, and where the model, tokenizer, data and checkpoints are. The rest of
the run config (the other phases, export, gate, hub, tracking) stays with the task, which validated
all of it. `shard` reads weights from model_dir; `train` reads only its config.json (the weights
come from the newest complete checkpoint in stage_dir). Every local path is absolute: the ranks
may run with another working directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializeAsAny,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tasks.core.config.load import plugin_problems
from tasks.core.config.phases import OLD_PHASE_KEY, PHASES
from tasks.core.config.schema import VERIFY_MEMORY_GB, DpoConfig, PhaseConfig, VerifyMemoryGB
from tasks.core.errors import ConfigError
from tasks.core.run.stages import TRAINING

VERBS = ("shard", "train")


def _absolute(p: Path) -> Path:
    if not p.is_absolute():
        raise ValueError(f"must be an absolute local path, got {str(p)!r}")
    return p


AbsPath = Annotated[Path, AfterValidator(_absolute)]


class Parent(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    uri: str | None = Field(description="URI of the artifact this stage starts from.")
    digest: str | None = Field(description="sha256 of that artifact's manifest.")


class NodeStaging(BaseModel):
    """An `s3://` run root on several nodes: each node stages into its own directory
    (tasks/engine/node_staging.py); the local paths of the job are the worker's and unused there."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_uri: str = Field(description="The remote run root.")
    dir: str = Field(description="Node-local staging directory; '{node}' is replaced by the node's name.")
    model_rel: str = Field(description="Artifact in the run root holding the model and tokenizer (model_dir).")
    data_rel: str = Field(
        description="The phase's prepared data artifact in the run root (data/<phase>/, read as data_dir)."
    )
    stage_rel: str = Field(description="The stage's checkpoint directory in the run root (stage_dir).")


class Job(BaseModel):
    """One engine verb of one training phase's stage; recorded as-is (parent, config_digest) in its manifests."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    verb: Literal[VERBS] = Field(description="shard: boost the HF model and save step 0; train: resume and train.")
    phase: Literal[tuple(TRAINING)] = Field(description="The training phase (a key of tasks.core.run.stages.TRAINING).")
    # SerializeAsAny: a preference phase's section is a DpoConfig (beta, loss, the pair fields), which the
    # job file must carry whole; `_section_of_its_phase` reads it back as one.
    phase_cfg: SerializeAsAny[PhaseConfig] = Field(
        description="The run config's section of this phase (run[phase]), validated by the task."
    )
    trust_remote_code: StrictBool = Field(
        description="base_model.trust_remote_code: whether loading the model may run code it ships."
    )
    verify_memory_gb: VerifyMemoryGB = VERIFY_MEMORY_GB
    model_dir: AbsPath = Field(description="HF model directory (config.json + safetensors).")
    tokenizer_dir: AbsPath = Field(description="Directory with the tokenizer files.")
    data_dir: AbsPath | None = Field(
        default=None,
        description=(
            "The phase's prepared data (data/<phase>/: token shards and index.json, made by prepare_data); the train "
            "verb reads it memory-mapped."
        ),
    )
    stage_dir: AbsPath = Field(
        description="Directory holding the phase's step-NNNNNN checkpoints (<phase>/ of the run root)."
    )
    reference_dir: AbsPath | None = Field(
        default=None,
        description=(
            "A preference phase's reference log-probabilities of its pairs (tasks/core/evaluation/reference.py, "
            "verified against data_dir); the train verb of a phase whose record is a pair requires it."
        ),
    )
    parent: Parent | None = Field(description="The artifact this stage starts from, recorded in manifests.")
    config_digest: str | None = Field(description="The stage's config digest, recorded in manifests.")
    nodes: NodeStaging | None = Field(
        default=None, description="Per-node staging of a remote run root; None: every path is used as is."
    )
    remote_run_root: StrictBool = Field(
        default=False,
        description=(
            "stage_dir is staging for an s3:// run root: the task publishes each committed checkpoint and marks it "
            "`.published`; "
            "the engine deletes only marked ones and waits at a save while max_pending_publishes are unmarked."
        ),
    )
    _source: str = PrivateAttr(default="job")

    @field_validator("phase_cfg", mode="before")
    @classmethod
    def _section_of_its_phase(cls, value: Any, info: ValidationInfo) -> Any:
        # A pair phase's section is read as its own class (DpoConfig), whose problems are named under phase_cfg.
        phase = info.data.get("phase")
        if phase is None or PHASES[phase].record != "pair" or isinstance(value, DpoConfig):
            return value
        try:
            return DpoConfig.model_validate(value.model_dump() if isinstance(value, PhaseConfig) else value)
        except ValidationError as exc:
            raise ConfigError(
                [(".".join(str(x) for x in e["loc"]), e["msg"].removeprefix("Value error, ")) for e in exc.errors()]
            ) from None

    @field_validator("phase_cfg")
    @classmethod
    def _static_layout(cls, phase_cfg: PhaseConfig) -> PhaseConfig:
        # The static layout rules parse_config applies to each phase, again for the one phase the
        # ranks train: a hand-written or edited job file fails here, before any process group exists.
        problems = plugin_problems(phase_cfg, "phase_cfg")
        if problems:
            raise ConfigError(problems)
        return phase_cfg

    @model_validator(mode="after")
    def _reference_for_pairs(self) -> Job:
        if self.verb == "train" and PHASES[self.phase].record == "pair" and self.reference_dir is None:
            why = (
                f"the {self.phase} phase trains on preference pairs against the reference model's log-probabilities "
                "of them: set reference_dir to the reference artifact (the reference stage's output, "
                "tasks/core/evaluation/reference.py)"
            )
            raise ConfigError([("reference_dir", why)])
        return self

    @property
    def source(self) -> str:
        return self._source

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True))
        return path


def parse_job(raw: Any, source: str = "job", verb: str | None = None) -> Job:
    """Validate a job dict; every problem is reported at once, each naming its key."""
    if not isinstance(raw, dict):
        raise ConfigError([(source, "the job file must hold a JSON object")])
    problems: list[tuple[str, str]] = []
    if OLD_PHASE_KEY in raw:  # a job file of a run interrupted before the rename: its phase, under the old name
        old, raw = raw[OLD_PHASE_KEY], {k: v for k, v in raw.items() if k != OLD_PHASE_KEY}
        if "phase" in raw:
            problems.append((OLD_PHASE_KEY, "the old name of `phase`, given beside it: delete it"))
        else:
            raw["phase"] = old
    if verb is not None and "verb" in raw and raw["verb"] != verb:
        problems.append(("verb", f"the job says {raw['verb']!r} but the command line asked for {verb!r}"))
    job = None
    try:
        job = Job.model_validate(raw)
    except ValidationError as exc:
        for err in exc.errors():
            at = ".".join(str(x) for x in err["loc"])
            loc = at or source
            nested = (err.get("ctx") or {}).get("error")
            if isinstance(nested, ConfigError):  # the phase section's rules, or the job's own (at: empty)
                problems += [(f"{at}.{f}" if at and not f.startswith(at) else f, m) for f, m in nested.problems]
            else:
                problems.append((loc, err["msg"].removeprefix("Value error, ")))
    if problems:
        raise ConfigError(problems, header=f"invalid job file {source}")
    job._source = source
    return job


def _unique_pairs(source: str):
    """json object hook refusing a key written twice (json.loads would keep the last one)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(
                    [
                        (
                            key,
                            (
                                f"written twice in one object of {source}; JSON would silently keep the second value. "
                                "Delete one of them"
                            ),
                        )
                    ],
                    header=f"duplicated keys in {source}",
                )
            out[key] = value
        return out

    return hook


def load_job(path: str | Path, verb: str | None = None) -> Job:
    path = Path(path)
    try:
        raw = json.loads(path.read_text(), object_pairs_hook=_unique_pairs(str(path)))
    except FileNotFoundError:
        raise ConfigError([(str(path), "job file not found")]) from None
    except json.JSONDecodeError as exc:
        raise ConfigError([(str(path), f"not valid JSON: {exc}")]) from None
    return parse_job(raw, source=str(path), verb=verb)
