"""CPU seconds a stage used, beside its wall seconds: on a shared or oversubscribed CPU the wall time says little.

    python -c "from tasks.core.run.cputime import CpuClock; c = CpuClock(); sum(range(10**7)); print(c.read())"

What the figure covers (`CpuClock`, read around one stage by the flow's stage helper):
- the flow process's own user + system time, every thread of it (`RUSAGE_SELF`): the stage's work
  there (verification, the evaluations' logits, the export's checks, and the torch threads they
  start) and, while the stage runs, Prefect's background threads (API client, log and event
  shipping; a few seconds a run). The flow runs one stage at a time, so nothing of another stage is
  in it; a process that runs several flows at once in threads would mix them (the CLI, a worker and
  `serve()` run one flow run a process).
- its child processes that ended and were waited for during the stage (`RUSAGE_CHILDREN`): the
  launcher and every process it waited for (torchrun reaps its ranks, so the ranks' time is in its
  own), the tokenizer pool of prepare_data, a Slurm client. A rank on another node (Slurm, multi-node
  torchrun) counts on its own machine, not here; a process killed and reaped by another parent (a
  torchrun SIGKILLed before it reaped its ranks) is not counted: then the figure is a lower bound.
  The embedded Prefect server is a child that lives as long as the run, so no stage counts it.
- a child that works for two stages and is waited for in the second (a shared launch,
  tasks/core/launch/shared.py: the ranks shard, then train): what it had used when the first
  stage ended is moved to that stage (`advance`, read from /proc by the launcher) and taken off the
  second when the child is reaped (`settle`), so each row keeps its own part.
Pure: the standard library's `resource` (POSIX) only.
"""

from __future__ import annotations

import resource

# CPU seconds of children still running, counted for the stage that was running when they were
# advanced, and of those children once reaped (their time is then in RUSAGE_CHILDREN as well).
_advanced = [0.0]
_settled = [0.0]


def advance(seconds: float) -> None:
    """A running child has used `seconds` for the stage now running: count them for it now."""
    _advanced[0] += max(seconds, 0.0)


def settle(seconds: float) -> None:
    """The child advanced by `seconds` has been reaped: its whole time is in RUSAGE_CHILDREN now."""
    _settled[0] += max(seconds, 0.0)


def _cpu() -> tuple[float, float]:
    """(the process's own, its waited-for children's) user + system seconds so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime + _advanced[0] - _settled[0]


class CpuClock:
    """Started at construction; `read()` gives the CPU seconds since, as run.json's stage rows keep them."""

    def __init__(self) -> None:
        self._own, self._children = _cpu()

    def read(self) -> dict[str, float]:
        own, children = _cpu()
        own, children = max(own - self._own, 0.0), max(children - self._children, 0.0)
        return {"cpu_seconds": round(own + children, 2), "cpu_children_seconds": round(children, 2)}
