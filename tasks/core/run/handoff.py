"""The hand-off file of a shared launch: how the flow tells ranks that sharded a stage's step 0 to go on training.

    python -c "from tasks.core.run.handoff import go_path; print(go_path('/run/jobs/cpt-shard.json'))"

A shared launch runs the engine verb `shard-train` (tasks/engine/handoff.py): the ranks boost the
model, commit step-000000 manifest-last, say so with a `@@sharded` event and wait for one file,
`<shard job file>.go`, written whole (a temporary name, then a rename) by the flow process:

    {"job": "<train job file>", "fault": "<CPT_TO_SFT_FAULT of the train stage>"}   train with that job
    {"stop": "<why>"}                                                               exit 0, nothing more

The train task writes `job` when it adopts the launch (tasks/core/launch/shared.py); the flow writes
`stop` when the run ends without the train stage adopting it (`--stop-after boost_and_shard`, a
failure between the stages, another layout). Ranks that hear nothing for WAIT_S exit 0 too: the
launch never outlives a flow that forgot it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.core.run.job import Job

GO_SUFFIX = ".go"
# How long the ranks of a shared launch wait for the train stage after step 0 is committed; the gap
# is the flow's own bookkeeping between two tasks (under a second on the demo).
WAIT_S = 900.0


def go_path(job_path: str | Path) -> Path:
    return Path(f"{job_path}{GO_SUFFIX}")


def _write(job_path: str | Path, record: dict[str, Any]) -> None:
    path = go_path(job_path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, sort_keys=True))
    os.replace(tmp, path)  # the ranks see the whole file or none


def write_go(job_path: str | Path, train_job: str | Path, fault: str = "") -> None:
    _write(job_path, {"job": str(train_job), "fault": fault})


def write_stop(job_path: str | Path, why: str) -> None:
    _write(job_path, {"stop": why})


def clear(job_path: str | Path) -> None:
    """Before a launch: an earlier run's hand-off file must not start this one's training."""
    go_path(job_path).unlink(missing_ok=True)


def read(job_path: str | Path) -> dict[str, Any] | None:
    """The hand-off record, or None while there is none; a record that is neither go nor stop is a ValueError."""
    path = go_path(job_path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    if not isinstance(raw, dict) or not (isinstance(raw.get("job"), str) or isinstance(raw.get("stop"), str)):
        raise ValueError(f"{path}: a shared launch's hand-off file holds a job or a stop, not {raw!r}")
    return raw


def mismatch(shard: Job, train: Job) -> str | None:
    """Why the train job cannot run in the ranks the shard job started, or None: the flow checks it
    before it adopts a launch (tasks/core/launch/shared.py), the ranks again before they train."""
    for name in ("phase", "stage_dir", "model_dir", "nodes"):
        if getattr(shard, name) != getattr(train, name):
            return f"the train job's {name} differs from the shard's ({getattr(train, name)} vs {getattr(shard, name)})"
    a, b = shard.phase_cfg, train.phase_cfg
    if a.launch != b.launch or a.plugin != b.plugin:
        return "the train stage's launch or plugin differs from the shard stage's"
    return None
