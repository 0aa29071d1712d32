"""The measuring kit of the benchmarks: a work directory, best-of timing, a right-aligned table.

python -c "from support.bench import best_of; print(best_of(lambda: sum(range(10**6)), 3))"
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def workdir(given: str | Path | None, prefix: str) -> Path:
    """`given`, or a new directory under the system's temporary one (kept: a benchmark's outputs outlive it)."""
    return Path(given or tempfile.mkdtemp(prefix=prefix))


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of `repeat` wall times of fn(), in seconds: the run least disturbed by the rest of the machine."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """`header` and `rows` as a ` | `-separated table, each column right-aligned to its widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(" | ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths)))
