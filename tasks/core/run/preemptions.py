"""A run's preemptions as it keeps them: one record per preempted attempt of a stage (`stage`: its
row of the stage table; `phase`: the training phase it trains, None for a stage that does not), in
`<stage dir>/preemptions.json` beside the stage's checkpoints, and the flow's retry policy.

    python -m tasks.core.run.preemptions     # a sample record and its line in the end-of-run table

The engine's `@@preempted` event (tasks/engine/loop.py) says what one attempt committed; the
training stage adds when the notice came (`at`, UTC) and appends it to the stage's log; the next
attempt fills `restart_to_first_step_s` (from its start to its first step) into the newest record
that lacks it. Each record's `timeline` holds the moments of the recovery (epoch seconds, `MARKS`:
the engine's notice and commit, the stage's exit, the flow's retry and launch, the next launch's
rank start, ready, checkpoint found, restore and first step) and its `recovery` the seconds between
them (`RECOVERY`), each with its share of the whole, from the notice to the next first step. run.json's stage rows, the Prefect stage table, the console's end-of-run table and
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
    "timeline",
    "recovery",
)
# The recovery from a notice to the next attempt's first step, in the order it happens: (part, from, to),
# each a mark of a record's `timeline` (epoch seconds; who sets it in the comment).
RECOVERY = (
    ("notice_to_commit", "notice", "commit"),  # engine: the step in flight finishes, its checkpoint is committed
    ("exit", "commit", "exit"),  # the training stage: the ranks and torchrun are gone, the launcher raised Preempted
    (
        "retry",
        "exit",
        "rerun",
    ),  # the flow: the record kept, run.json, Prefect's AwaitingRetry, retry_wait_s, the config re-read
    (
        "stage_skip",
        "rerun",
        "launch",
    ),  # the flow: the stages already done verify and skip, the training stage's job written
    ("launch", "launch", "ready"),  # torchrun starts the ranks; they import and join the process group
    ("find", "ready", "found"),  # rank 0 verifies the newest checkpoint's manifest (every file's sha256)
    ("build", "found", "restore_begin"),  # the model built and boosted under the plugin
    ("restore", "restore_begin", "restore_end"),  # the checkpoint loaded (re-sharded under a new layout)
    ("first_step", "restore_end", "first_step"),  # the first optimizer step of the new attempt
)
MARKS = (
    "notice",
    "commit",
    "exit",
    "rerun",
    "launch",
    "rank_start",
    "ready",
    "found",
    "restore_begin",
    "restore_end",
    "first_step",
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
    out["timeline"] = dict(engine.get("timeline") or {})
    out["recovery"] = recovery(out["timeline"])
    return out


def recovery(timeline: dict[str, Any]) -> dict[str, Any]:
    """Seconds of each part of `RECOVERY` whose two marks `timeline` holds, `total_s` from the notice
    to the first step, `<part>_share` of it, and `rank_imports_s` (rank start to ready, inside `launch`)."""
    t = {k: float(v) for k, v in timeline.items() if isinstance(v, (int, float))}
    out: dict[str, Any] = {}
    for part, a, b in RECOVERY:
        if a in t and b in t:
            out[f"{part}_s"] = round(t[b] - t[a], 3)
    if "rank_start" in t and "ready" in t:
        out["rank_imports_s"] = round(t["ready"] - t["rank_start"], 3)
    if "notice" in t and "first_step" in t:
        total = out["total_s"] = round(t["first_step"] - t["notice"], 3)
        for part, _, _ in RECOVERY:
            if f"{part}_s" in out and total > 0:
                out[f"{part}_share"] = round(out[f"{part}_s"] / total, 4)
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


def restarted(
    records: list[dict[str, Any]], seconds: float, marks: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """`records` with the newest one that has no restart time given `seconds` (from the attempt's
    start to its first step) and this attempt's `marks` (the flow's rerun and launch, the ranks'
    start-up) in its timeline; unchanged when every record has one. A mark from before the record's
    exit belongs to an earlier attempt and is left out."""
    out = [dict(r) for r in records]
    for r in reversed(out):
        if r.get("restart_to_first_step_s") is None:
            r["restart_to_first_step_s"] = round(seconds, 3)
            timeline = dict(r.get("timeline") or {})
            after = float(timeline.get("exit") or timeline.get("notice") or 0.0)
            timeline.update(
                {k: v for k, v in (marks or {}).items() if k in MARKS and isinstance(v, (int, float)) and v >= after}
            )
            r["timeline"], r["recovery"] = timeline, recovery(timeline)
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
    ) + (f"; {breakdown(r)}" if (r.get("recovery") or {}).get("total_s") is not None else "")


def breakdown(r: dict[str, Any]) -> str:
    """The record's recovery, notice to first step, part by part: `recovery 9.1 s = notice to commit 0.2 s (2%) + ...`."""
    rec = r.get("recovery") or {}
    parts = [
        f"{part.replace('_', ' ')} {rec[f'{part}_s']:.1f} s ({rec.get(f'{part}_share', 0):.0%})"
        for part, _, _ in RECOVERY
        if f"{part}_s" in rec
    ]
    return f"recovery {_s(rec.get('total_s'))} = " + " + ".join(parts)


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
    t = time.time()
    r = record(
        {"source": "sigterm", "grace_s": 20.0, "noticed_step": 5, "checkpoint_step": 5, "steps_lost": 0}
        | {"notice_to_commit_s": 0.3, "grace_left_s": 19.7, "checkpoint": "cpt/step-000005"}
        | {"timeline": {"notice": t, "commit": t + 0.3, "exit": t + 1.0}},
        "cpt",
        t + 0.3,
    )
    marks = {"rerun": t + 1.5, "launch": t + 2.0, "rank_start": t + 2.5, "ready": t + 8.0, "found": t + 8.2}
    marks |= {"restore_begin": t + 9.5, "restore_end": t + 10.5, "first_step": t + 11.0}
    print(dump(restarted([r], 9.0, marks)), describe(restarted([r], 9.0, marks)[0]), sep="")
