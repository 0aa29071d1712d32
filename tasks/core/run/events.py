"""The line protocol between the ranks and the Prefect task, defined once: emitter and parser.

    python -c "from tasks.core.run.events import format_event, parse_line; print(parse_line('[rank 0] ' + format_event('progress', {'step': 1})))"

Every line a rank prints carries `[rank N] ` (`rank_prefix`, installed by tasks/engine/rankio.py);
lines without one come from torchrun itself. A machine-readable event is one line
`@@<kind> <json>` printed by rank 0 (`tasks.engine.boosted.emit`); the task
(`tasks/core/launch/torchrun.py`) turns `progress` events into progress callbacks and hands every other kind to
its `on_event` callback.

Levels are said by the writer, never guessed from words. The prefix carries them:
`[rank N] ` is info, `[rank N|warning] ` and `[rank N|error] ` the others, and `[rank N|detail] ` is
info for the run's log in the Prefect UI that the console leaves out (`tasks.engine.boosted.log(...,
detail=True)`: construction figures, retention, how the plugin was built). The engine writes its own
failures at `error` (`tasks.engine.rankio.say`); whatever else a rank writes to stderr (Python
warnings, library loggers) is `warning`, stdout `info`. Unprefixed lines (torchrun's elastic
agent, torch's C++ logging) are `info` unless they open with the glog severity letter those
writers put there themselves (`E1130 12:00:00.000000 ...`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PREFIX = "@@"
PROGRESS = "progress"  # one optimizer step: stage, step, total, loss, lr, tokens, elapsed_s, and the
# metric fields of tasks/engine/metrics.py (grad_norm, tokens_per_s, step_s, peak_mem_bytes: the largest of
# every rank's, peak_mem_rank, mfu, computed_tokens, padding_frac), and eta_s (this launch's pace)
CHECKPOINT = "checkpoint"  # a committed checkpoint: step, path
# the engine waits at a save for uploads: step, state (waiting | resumed), pending, max_pending_publishes, waited_s
BACKPRESSURE = "backpressure"
# what a launch runs with, once after its plugin is built: kernels ({name: reason}), activation_checkpointing
KERNELS = "kernels"
# the stage stopped on a preemption notice: source, grace_s, noticed_step, checkpoint_step, checkpoint,
# steps_lost, notice_to_commit_s (tasks/core/launch/notice_watch.py); the launcher raises errors.Preempted
PREEMPTED = "preempted"
# a shared launch (verb shard-train) committed step-000000 and waits for the train stage: stage, checkpoint
SHARDED = "sharded"
# a training launch's start-up, once after its first step: rank_start, ready, found, restore_begin,
# restore_end, first_step (rank 0's epoch seconds; the marks of tasks/core/run/preemptions.py's timeline)
STARTUP = "startup"
KINDS = (PROGRESS, CHECKPOINT, BACKPRESSURE, KERNELS, PREEMPTED, SHARDED, STARTUP)
# The numeric @@progress fields that are per-step metrics (TensorBoard tags, MLflow metrics).
METRICS = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_s",
    "peak_mem_bytes",
    "peak_mem_rank",
    "mfu",
    "tokens",
    "computed_tokens",
    "padding_frac",
)

INFO, WARNING, ERROR, DETAIL = "info", "warning", "error", "detail"
_RANK = re.compile(r"^\[rank (\d+)(?:\|(warning|error|detail))?\] ?")
# `extra=` of a log record: kept in the Prefect UI's log, left off the console (flows/console.py
# `training_log_console` filters it there); and the converse, Prefect's own `send_to_api` flag.
CONSOLE_OFF = {"cpt_to_sft_console": False}
UI_OFF = {"send_to_api": False}
_GLOG = re.compile(r"^([IWEF])\d{4} \d{2}:\d{2}:\d{2}\.\d+ ")
_GLOG_LEVELS = {"I": INFO, "W": WARNING, "E": ERROR, "F": ERROR}


def rank_prefix(rank: int, level: str = INFO) -> str:
    return f"[rank {rank}] " if level == INFO else f"[rank {rank}|{level}] "


def format_event(kind: str, record: dict[str, Any]) -> str:
    return f"{PREFIX}{kind} {json.dumps(record, sort_keys=True)}"


@dataclass(frozen=True)
class Line:
    """One line of a stage's merged output, attributed."""

    who: str  # "rank N" or "torchrun"
    body: str  # the line without its rank prefix
    level: str = INFO  # as the writer marked it (see the module docstring)
    kind: str | None = None  # the event kind for `@@` lines
    record: dict[str, Any] | None = None  # the event's payload
    payload: str = ""  # the raw JSON text of an event


def parse_line(line: str) -> Line:
    m = _RANK.match(line)
    if m:
        who, body, level = f"rank {m.group(1)}", line[m.end() :], m.group(2) or INFO
    else:
        g = _GLOG.match(line)
        who, body, level = "torchrun", line, _GLOG_LEVELS[g.group(1)] if g else INFO
    if not body.startswith(PREFIX):
        return Line(who, body, level)
    kind, _, payload = body[len(PREFIX) :].partition(" ")
    try:
        record = json.loads(payload)
    except json.JSONDecodeError:
        record = {"raw": payload}
    return Line(who, body, level, kind, record, payload)
