"""Progress of a long piece of work that is not training (scoring a benchmark, a held-out
evaluation, generations): done / total and an ETA, a line at most once per interval.

    python -m tasks.core.run.meter   # a demo: 20 items, a line every 0.2 s

Training says where it is through its @@progress records (tasks/flowkit/ui.py `Progress`); the
stages that run in the flow's own process say it through a `Meter`: the stage opens
`reporting(emit)` around its work, and the code doing the work (tasks/core/evaluation/) takes
`meter(what, total, unit)` for each part and `add`s what it finished. Each record reaches `emit`
when the part starts, at most once per `interval_s` as it goes, and when it ends; with no
`reporting` open a meter says nothing, so the same code runs quietly from the command line.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

from tasks.core.run.trainlog import duration

INTERVAL_S = 30.0  # a line at most this often: a 10-minute evaluation says where it is ~20 times

T = TypeVar("T")
Emit = Callable[[dict[str, Any]], None]
_sink: ContextVar[tuple[Emit, float] | None] = ContextVar("cpt_to_sft_meter_sink", default=None)


@contextlib.contextmanager
def reporting(emit: Emit, interval_s: float = INTERVAL_S) -> Iterator[None]:
    """Every meter taken inside the block sends its records to `emit`."""
    token = _sink.set((emit, interval_s))
    try:
        yield
    finally:
        _sink.reset(token)


class Meter:
    """`done` of `total` `unit`s of `what`; `add(n)` as work finishes, `finish()` at its end."""

    def __init__(self, what: str, total: int, unit: str, emit: Emit | None = None, interval_s: float = INTERVAL_S):
        self.what, self.total, self.unit = what, max(int(total), 0), unit
        self.emit, self.interval_s = emit, interval_s
        self.done, self.started = 0, time.monotonic()
        self._last = self.started
        self._finished = False
        self._lock = threading.Lock()
        self._send()

    def add(self, n: int = 1) -> None:
        with self._lock:  # a converter's shard threads add to one meter
            self.done += n
            now = time.monotonic()
            due = now - self._last >= self.interval_s and self.done < self.total
            if due:
                self._last = now
        if due:
            self._send()

    def counted(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, each added once the loop over it moves on."""
        for item in items:
            yield item
            self.add()

    def finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._send()

    def record(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self.started
        done = min(self.done, self.total) if self.total else self.done
        eta = elapsed * (self.total - done) / done if done and not self._finished else None
        return {
            "what": self.what,
            "done": done,
            "total": self.total,
            "unit": self.unit,
            "elapsed_s": round(elapsed, 3),
            "eta_s": None if eta is None else round(eta, 3),
            "finished": self._finished,
        }

    def _send(self) -> None:
        if self.emit is not None:
            self.emit(self.record())


def meter(what: str, total: int, unit: str) -> Meter:
    """A meter sending to the `reporting` block open here (none open: a silent one)."""
    sink = _sink.get()
    return Meter(what, total, unit, *(sink or (None, INTERVAL_S)))


@contextlib.contextmanager
def metered(what: str, total: int, unit: str) -> Iterator[Meter]:
    """`meter` as a block: its last record goes out when the block ends, failed or not."""
    m = meter(what, total, unit)
    try:
        yield m
    finally:
        m.finish()


def line(record: dict[str, Any]) -> str:
    """A record as the console's line: `export, loglikelihood: 1,200 / 4,000 requests (30%), 1m10s
    elapsed, ETA 2m43s`."""
    done, total = record["done"], record["total"]
    pct = f" ({100 * done / total:.0f}%)" if total else ""
    text = f"{record['what']}: {done:,} / {total:,} {record['unit']}{pct}, {duration(record['elapsed_s'])} elapsed"
    if record.get("finished"):
        return text + ", done"
    eta = record.get("eta_s")
    return text + (f", ETA {duration(eta)}" if eta is not None else "")


def main() -> int:
    with reporting(lambda r: print(line(r), flush=True), interval_s=0.2), metered("demo", 20, "items") as m:
        for _ in range(20):
            time.sleep(0.05)
            m.add()
    return 0


if __name__ == "__main__":
    sys.exit(main())
