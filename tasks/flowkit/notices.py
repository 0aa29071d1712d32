"""A preemption notice during a stage that does not train (preparation, conversion, export,
evaluation, publishing): the stage stops at a safe point and ends *preempted*, not failed.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # with cpt.elastic.notices: [{source: sigterm}]

While a stage task runs, and some phase lists a signal notice source (`<phase>.elastic.notices`:
`sigterm`, `slurm`), that signal to the flow process raises `Preempted` in the stage instead of
ending the process. Every place the stage can be stopped is a safe point: its artifact is built in
`<artifact>.tmp-build` and swapped in only whole, the manifest last (`tasks/flowkit/stage.py`
`fresh_dir`), and prepare_data keeps each finished file's shards in its cache; the one stretch that
is not, the swap itself, runs inside `critical()`, and a notice that comes then is raised right after
it. The flow then retries the run by its preemption policy (flows/cpt_to_sft/__init__.py), skipping
what finished. A training stage's launch forwards the signal to its ranks instead
(tasks/core/launch/proctree.py `forward_notices`), which take the checkpoint path.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tasks.core.config.notices import NOTICES
from tasks.core.errors import Preempted

_state = threading.local()


def signal_sources(cfg: Any) -> dict[str, tuple[str, float]]:
    """{signal name: (source, grace_s)} of the signal notice sources any phase of `cfg` lists (the
    shortest grace where two list one)."""
    from tasks.core.config.phases import PHASES

    out: dict[str, tuple[str, float]] = {}
    for phase in PHASES:
        for n in cfg.phase(phase).elastic.notices:
            sig = NOTICES[n.source].signal
            if sig and (sig not in out or n.grace < out[sig][1]):
                out[sig] = (n.source, n.grace)
    return out


def _preempted(stage: str, source: str, grace: float, at: float) -> Preempted:
    spent = round(time.monotonic() - at, 3)
    record = {
        "stage": stage,
        "source": source,
        "grace_s": grace,
        "noticed_step": None,
        "checkpoint_step": None,
        "checkpoint": None,
        "steps_lost": 0,  # nothing finished is redone: the artifact is swapped in whole or not at all
        "notice_to_commit_s": spent,
        "grace_left_s": round(grace - spent, 3),
    }
    cause = f"{stage} preempted ({source}): stopped at a safe point, nothing torn"
    return Preempted(cause, cause=cause, record=record)


@contextmanager
def critical() -> Iterator[None]:
    """A stretch no notice may cut (an artifact's swap into place): a notice that arrives inside it is
    raised as soon as it ends."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth
        pending = getattr(_state, "pending", None)
        if depth == 0 and pending is not None:
            _state.pending = None
            raise pending


@contextmanager
def stop_on_notice(stage: str, cfg: Any) -> Iterator[bool]:
    """While the block runs, the signal notices `cfg` listens for raise `Preempted` in it (at once, or
    at the end of a `critical()` stretch); the previous handlers come back after. Main thread only
    (Python's rule for handlers): elsewhere nothing is installed and the block yields False."""
    sources = signal_sources(cfg) if cfg is not None else {}
    if not sources or threading.current_thread() is not threading.main_thread():
        yield False
        return
    old: dict[int, Any] = {}

    def handler(signum: int, frame) -> None:
        source, grace = sources[signal.Signals(signum).name]
        exc = _preempted(stage, source, grace, time.monotonic())
        if getattr(_state, "depth", 0):
            _state.pending = exc  # raised when the swap ends
            return
        raise exc

    try:
        for name in sources:
            sig = getattr(signal, name)
            old[sig] = signal.signal(sig, handler)
        yield True
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
