"""The job file: what one engine invocation does, written by the Prefect task (tasks/train.py).

    torchrun --nproc_per_node=2 -m tasks.engine train --config JOB.json

JOB.json:

    {
      "verb": "shard" | "train",
      "stage": "cpt" | "sft",
      "run": { ...RunConfig.model_dump(mode="json")... },   # run[stage] is the StageConfig
      "model_dir": "/abs/HF model dir (config.json + safetensors)",
      "tokenizer_dir": "/abs/dir with tokenizer files",
      "data_path": "/abs/path of the stage's data file",
      "stage_dir": "/abs/dir holding step-NNNNNN checkpoints of this stage",
      "parent": {"uri": "...", "digest": "..."},           # recorded in manifests as-is
      "config_digest": "sha256 hex"                         # recorded in manifests as-is
    }

`shard` reads weights from model_dir; `train` reads only its config.json (the weights come from
the newest complete checkpoint in stage_dir).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core.config import RunConfig, StageConfig, parse_config
from tasks.core.errors import ConfigError

VERBS = ("shard", "train")
STAGES = ("cpt", "sft")
_REQUIRED = ("verb", "stage", "run", "model_dir", "tokenizer_dir", "data_path", "stage_dir", "parent", "config_digest")


@dataclass(frozen=True)
class Job:
    verb: str
    stage: str
    run: RunConfig
    model_dir: Path
    tokenizer_dir: Path
    data_path: Path
    stage_dir: Path
    parent: dict[str, Any] | None
    config_digest: str | None
    source: str = "job"

    @property
    def stage_cfg(self) -> StageConfig:
        return getattr(self.run, self.stage)

    @property
    def trust_remote_code(self) -> bool:
        return self.run.base_model.trust_remote_code


def parse_job(raw: dict[str, Any], source: str = "job", verb: str | None = None) -> Job:
    """Validate a job dict; every problem is reported at once, each naming its key."""
    problems: list[tuple[str, str]] = []
    if not isinstance(raw, dict):
        raise ConfigError([(source, "the job file must hold a JSON object")])
    for key in _REQUIRED:
        if key not in raw:
            problems.append((key, "missing"))
    unknown = sorted(set(raw) - set(_REQUIRED))
    for key in unknown:
        problems.append((key, f"unknown key (expected {', '.join(_REQUIRED)})"))
    if raw.get("verb") not in VERBS and "verb" in raw:
        problems.append(("verb", f"must be one of {', '.join(VERBS)}, got {raw.get('verb')!r}"))
    if verb is not None and "verb" in raw and raw["verb"] != verb:
        problems.append(("verb", f"the job says {raw['verb']!r} but the command line asked for {verb!r}"))
    if raw.get("stage") not in STAGES and "stage" in raw:
        problems.append(("stage", f"must be one of {', '.join(STAGES)}, got {raw.get('stage')!r}"))
    for key in ("model_dir", "tokenizer_dir", "data_path", "stage_dir"):
        value = raw.get(key)
        if key in raw and (not isinstance(value, str) or not Path(value).is_absolute()):
            problems.append((key, f"must be an absolute local path, got {value!r}"))
    parent = raw.get("parent")
    if parent is not None and not isinstance(parent, dict):
        problems.append(("parent", f"must be an object {{uri, digest}} or null, got {type(parent).__name__}"))
    run = None
    if isinstance(raw.get("run"), dict):
        try:
            run = parse_config(raw["run"], source=f"{source}: run")
        except ConfigError as exc:
            problems += [(f"run.{field}", msg) for field, msg in exc.problems]
    elif "run" in raw:
        problems.append(("run", "must be the RunConfig as a JSON object"))
    if problems:
        raise ConfigError(problems, header=f"invalid job file {source}")
    return Job(
        verb=raw["verb"],
        stage=raw["stage"],
        run=run,
        model_dir=Path(raw["model_dir"]),
        tokenizer_dir=Path(raw["tokenizer_dir"]),
        data_path=Path(raw["data_path"]),
        stage_dir=Path(raw["stage_dir"]),
        parent=parent,
        config_digest=raw["config_digest"],
        source=source,
    )


def load_job(path: str | Path, verb: str | None = None) -> Job:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError([(str(path), "job file not found")]) from None
    except json.JSONDecodeError as exc:
        raise ConfigError([(str(path), f"not valid JSON: {exc}")]) from None
    return parse_job(raw, source=str(path), verb=verb)


def check_inputs(job: Job) -> None:
    """Files the verb will read, checked before any process group or model exists."""
    problems: list[tuple[str, str]] = []
    if not (job.model_dir / "config.json").is_file():
        problems.append(("model_dir", f"{job.model_dir} has no config.json"))
    if job.verb == "shard":
        has_st = any(job.model_dir.glob("*.safetensors"))
        if not has_st:
            problems.append(("model_dir", f"{job.model_dir} holds no *.safetensors weights; only safetensors are loaded (no pickle)"))
    if job.verb == "train" and not job.data_path.is_file():
        problems.append(("data_path", f"{job.data_path} does not exist"))
    if not job.tokenizer_dir.is_dir():
        problems.append(("tokenizer_dir", f"{job.tokenizer_dir} is not a directory"))
    if problems:
        raise ConfigError(problems, header=f"job {job.source} cannot start")
