"""A run's preemptions as it keeps them: one record per preempted attempt of a stage (`stage`: its
row of the stage table; `phase`: the training phase it trains, None for a stage that does not), in
`<stage dir>/preemptions.json` beside the stage's checkpoints, and the flow's retry policy.

    python -m tasks.core.run.preemptions     # a sample record and its line in the end-of-run table

The engine's `@@preempted` event (tasks/engine/loop.py) says what one attempt committed; the
training stage adds when the notice came (`at`, UTC) and appends it to the stage's log; the next
attempt fills `restart_to_first_step_s` (from its start to its first step) into the newest record
that lacks it. run.json's stage rows, the Prefect stage table, the console's end-of-run table and
the model card read these records, so a re-run whose stage is skipped still shows them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

LOG = "preemptions.json"
# What each record holds, in this order (the engine's fields, then the flow's).
FIELDS = (
    "stage",
    "phase",
    "at",
    "source",
    "grace_s",
    "noticed_step",
    "checkpoint_step",
    "checkpoint",
    "steps_lost",
    "notice_to_commit_s",
    "grace_left_s",
    "restart_to_first_step_s",
)


def log_rel(checkpoints_rel: str) -> str:
    """The log's path under the run root, beside the stage's `step-NNNNNN/` checkpoints."""
    return f"{checkpoints_rel}/{LOG}"


def utc(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def record(engine: dict[str, Any], stage: str, now: float) -> dict[str, Any]:
    """The engine's record (its `phase`, for a training stage) as the run keeps it under `stage`, the
    stage-table row; `at` is the notice's time: `now` (the stage's end, epoch seconds) less the
    seconds from the notice to the commit (the grace spent when nothing was saved)."""
    spent = engine.get("notice_to_commit_s")
    if spent is None and engine.get("grace_s") is not None and engine.get("grace_left_s") is not None:
        spent = float(engine["grace_s"]) - float(engine["grace_left_s"])
    out = {k: engine.get(k) for k in FIELDS}
    out.update(stage=stage, at=utc(now - float(spent or 0.0)), restart_to_first_step_s=None)
    return out


def parse(text: str | None) -> list[dict[str, Any]]:
    """The log's records ([] for no log; a log that does not parse is a view lost, never a failed run)."""
    if not text:
        return []
    try:
        records = json.loads(text)
    except ValueError:
        return []
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []


def dump(records: list[dict[str, Any]]) -> str:
    return json.dumps(records, indent=2, sort_keys=True) + "\n"


def restarted(records: list[dict[str, Any]], seconds: float) -> list[dict[str, Any]]:
    """`records` with the newest one that has no restart time given `seconds` (from the attempt's
    start to its first step); unchanged when every record has one."""
    out = [dict(r) for r in records]
    for r in reversed(out):
        if r.get("restart_to_first_step_s") is None:
            r["restart_to_first_step_s"] = round(seconds, 3)
            break
    return out


def _s(x: Any) -> str:
    return f"{float(x):.1f} s" if isinstance(x, (int, float)) else "n/a"


def describe(r: dict[str, Any]) -> str:
    """One line: when, the step checkpointed, steps lost, notice→commit against the grace, restart→first step."""
    commit = (
        f"notice to commit {_s(r.get('notice_to_commit_s'))} of {_s(r.get('grace_s'))} grace"
        if r.get("notice_to_commit_s") is not None
        else f"no save fitted the {_s(r.get('grace_s'))} grace"
    )
    return (
        f"{r.get('stage')} preempted {r.get('at')} ({r.get('source')}) after step {r.get('noticed_step')}: "
        f"checkpoint step {r.get('checkpoint_step')}, steps lost {r.get('steps_lost')}, {commit}, "
        f"restart to first step {_s(r.get('restart_to_first_step_s'))}"
    )


def short(records: list[dict[str, Any]]) -> str:
    """The stage table's note: how many, steps lost, the slowest notice→commit and restart."""
    if not records:
        return ""
    lost = sum(int(r.get("steps_lost") or 0) for r in records)
    commits = [r["notice_to_commit_s"] for r in records if r.get("notice_to_commit_s") is not None]
    restarts = [r["restart_to_first_step_s"] for r in records if r.get("restart_to_first_step_s") is not None]
    return (
        f"preempted {len(records)}x, steps lost {lost}"
        + (f", notice to commit <= {max(commits):.1f} s" if commits else "")
        + (f", restart to first step <= {max(restarts):.1f} s" if restarts else "")
    )


@dataclass(frozen=True)
class Policy:
    """The flow's retry of a preempted stage (`<phase>.elastic`): at most `max_preemptions` retries,
    each after `wait_s` seconds of waiting for capacity; none of them a failure retry."""

    max_preemptions: int
    wait_s: float

    def retry(self, preemptions: int) -> bool:
        """Whether the run retries after its `preemptions`-th preemption (counted from 1)."""
        return preemptions <= self.max_preemptions


if __name__ == "__main__":
    r = record(
        {"source": "sigterm", "grace_s": 20.0, "noticed_step": 5, "checkpoint_step": 5, "steps_lost": 0}
        | {"notice_to_commit_s": 0.3, "grace_left_s": 19.7, "checkpoint": "cpt/step-000005"},
        "cpt",
        time.time(),
    )
    print(dump(restarted([r], 12.5)), describe(restarted([r], 12.5)[0]), sep="")
