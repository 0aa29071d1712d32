"""The line protocol between the ranks and the Prefect task, defined once: emitter and parser.

    python -c "from tasks.core.events import format_event, parse_line; print(parse_line('[rank 0] ' + format_event('progress', {'step': 1})))"

Every line a rank prints carries `[rank N] ` (`rank_prefix`, installed by tasks/engine/rankio.py);
lines without one come from torchrun itself. A machine-readable event is one line
`@@<kind> <json>` printed by rank 0 (`tasks.engine.engine.emit`); the task
(`tasks/launch.py`) turns `progress` events into progress callbacks and hands every other kind to
its `on_event` callback.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PREFIX = "@@"
PROGRESS = "progress"  # one optimizer step: stage, step, total, loss, lr, tokens, elapsed_s
CHECKPOINT = "checkpoint"  # a committed checkpoint: step, path
KINDS = (PROGRESS, CHECKPOINT)

_RANK = re.compile(r"^\[rank (\d+)\] ?")


def rank_prefix(rank: int) -> str:
    return f"[rank {rank}] "


def format_event(kind: str, record: dict[str, Any]) -> str:
    return f"{PREFIX}{kind} {json.dumps(record, sort_keys=True)}"


@dataclass(frozen=True)
class Line:
    """One line of a stage's merged output, attributed."""

    who: str  # "rank N" or "torchrun"
    body: str  # the line without its rank prefix
    kind: str | None = None  # the event kind for `@@` lines
    record: dict[str, Any] | None = None  # the event's payload
    payload: str = ""  # the raw JSON text of an event


def parse_line(line: str) -> Line:
    m = _RANK.match(line)
    who = f"rank {m.group(1)}" if m else "torchrun"
    body = line[m.end():] if m else line
    if not body.startswith(PREFIX):
        return Line(who, body)
    kind, _, payload = body[len(PREFIX):].partition(" ")
    try:
        record = json.loads(payload)
    except json.JSONDecodeError:
        record = {"raw": payload}
    return Line(who, body, kind, record, payload)
