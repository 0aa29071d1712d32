"""Prefix every line a rank prints with `[rank N] `, ColossalAI's and transformers' own included.

Installed first thing in `python -m tasks.engine` (before colossalai, transformers or logging
create handlers that capture `sys.stdout`/`sys.stderr`), so the Prefect task that streams the
merged output of all ranks can attribute every line. Only Python-level writes are prefixed;
C++ messages written straight to file descriptor 1/2 (gloo, torch's c10 logging) are not, and the
launcher attributes them to torchrun.

The prefix also says the line's level (`tasks.core.run.events`): stdout is info, stderr warning,
`say(msg, ERROR)` is the one way a rank writes an error line, and `say(msg, DETAIL)` an info line
for the run's log that the console leaves out.
"""

from __future__ import annotations

import atexit
import io
import sys
import threading

from tasks.core.run.events import DETAIL, ERROR, INFO, WARNING, rank_prefix


class RankPrefixed(io.TextIOBase):
    """A text stream that writes complete lines, each with a prefix, to another stream."""

    def __init__(self, stream, prefix: str):
        self._stream = stream
        self._prefix = prefix
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._partial += text
            if "\n" in self._partial:
                *lines, self._partial = self._partial.split("\n")
                self._stream.write("".join(f"{self._prefix}{line}\n" for line in lines))
                self._stream.flush()
        return len(text)

    def flush(self) -> None:
        # A partial line stays buffered: emitting it now would leave its continuation unprefixed.
        self._stream.flush()

    def close_partial(self) -> None:
        with self._lock:
            if self._partial:
                self._stream.write(f"{self._prefix}{self._partial}\n")
                self._partial = ""
            self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", "utf-8")

    @property
    def errors(self):
        return getattr(self._stream, "errors", "strict")


# The level each stream's lines carry (tasks/core/run/events.py): stdout is info; stderr holds what
# libraries and Python's warnings machinery write, warnings by convention. Errors are never
# inferred: only `say(..., ERROR)` writes them.
_STREAM_LEVELS = {"stdout": INFO, "stderr": WARNING}
_SAY: dict[str, RankPrefixed] = {}


def install(rank: int) -> None:
    """Wrap sys.stdout and sys.stderr once; idempotent."""
    for name, level in _STREAM_LEVELS.items():
        current = getattr(sys, name)
        if isinstance(current, RankPrefixed):
            continue
        wrapped = RankPrefixed(current, rank_prefix(rank, level))
        setattr(sys, name, wrapped)
        atexit.register(wrapped.close_partial)
        _SAY[level] = wrapped
    for level, stream in ((ERROR, sys.__stderr__), (DETAIL, sys.__stdout__)):
        if level not in _SAY:
            _SAY[level] = RankPrefixed(stream, rank_prefix(rank, level))
            atexit.register(_SAY[level].close_partial)


def say(msg: str, level: str = INFO) -> None:
    """Write `msg` (every line of it) at `level`; before `install`, plain stderr/stdout."""
    stream = _SAY.get(level)
    if stream is None:
        stream = sys.stdout if level in (INFO, DETAIL) else sys.stderr
    for s in _SAY.values():  # what was written before stays before
        s.flush()
    stream.write(msg.rstrip("\n") + "\n")
    stream.flush()
