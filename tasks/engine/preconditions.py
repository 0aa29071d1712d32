"""The engine's side of the job file (the model is `tasks.core.run.job.Job`, shared with the task):
the files a verb will read, checked before any process group or model exists.

    torchrun --nproc_per_node=2 -m tasks.engine train --config JOB.json
"""

from __future__ import annotations

from tasks.core.errors import ConfigError
from tasks.core.run.job import VERBS, Job, load_job, parse_job

__all__ = ["VERBS", "Job", "check_inputs", "load_job", "parse_job"]


def check_inputs(job: Job) -> None:
    """Files the verb will read, checked before any process group or model exists."""
    problems: list[tuple[str, str]] = []
    if not (job.model_dir / "config.json").is_file():
        problems.append(("model_dir", f"{job.model_dir} has no config.json"))
    if job.verb == "shard":
        has_st = any(job.model_dir.glob("*.safetensors"))
        if not has_st:
            problems.append(
                (
                    "model_dir",
                    f"{job.model_dir} holds no *.safetensors weights; only safetensors are loaded (no pickle)",
                )
            )
    if job.verb == "train" and (job.data_dir is None or not (job.data_dir / "index.json").is_file()):
        problems.append(
            ("data_dir", f"{job.data_dir} holds no prepared data (index.json); run the prepare_data stage first")
        )
    if not job.tokenizer_dir.is_dir():
        problems.append(("tokenizer_dir", f"{job.tokenizer_dir} is not a directory"))
    if problems:
        raise ConfigError(problems, header=f"job {job.source} cannot start")
