"""A preemption notice during a stage that does not train (preparation, conversion, export,
evaluation, publishing): the stage stops at a safe point and ends *preempted*, not failed.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # with cpt.elastic.notices: [{source: sigterm}]

While a stage task runs, the notice sources any phase lists (`<phase>.elastic.notices`) raise
`Preempted` in the stage instead of ending the process: a signal row's signal (`sigterm`, `slurm`)
to the flow process, and a polled row (`aws`, `gcp`, `azure`, `file`), which a daemon thread of the
stage asks every `poll_s` seconds with the ranks' own poller (tasks/core/launch/notice_watch.py `Watch`) and
hands to the main thread as POLL_SIGNAL, so it lands where a signal would, a blocking wait included.
Every place the stage can be stopped is a safe point: its artifact is built in
`<artifact>.tmp-build` and swapped in only whole, the manifest last (`tasks/flowkit/stage.py`
`fresh_dir`), and prepare_data keeps each finished file's shards in its cache; the one stretch that
is not, the swap itself, runs inside `critical()`, and a notice that comes then is raised right after
it. The flow then retries the run by its preemption policy (flows/cpt_to_sft/__init__.py), skipping
what finished; while it waits for capacity, `await_capacity` shows the flow run AwaitingRetry. A
training stage's launch forwards the signal to its ranks instead (tasks/core/launch/proctree.py
`forward_notices`), and its ranks poll the polled rows themselves.

A SIGTERM is a notice by default (`<phase>.elastic.sigterm`), but a cancel from Prefect (the UI,
`prefect flow-run cancel`) reaches the process as a SIGTERM too. The two are told apart by what
Prefect says, not by guessing (`cancel_requested`): its runner's cancel intent, else the flow run's
state read from the API, Cancelling or Cancelled. A cancel goes on as one: to Prefect's own handler
where its runner drives the cancel, else as `CancelRequested`, which unwinds the flow like Ctrl-C and
ends the run Cancelled. A SIGTERM outside a flow run, or when the API does not answer within
`API_READ_S`, is a notice (the log says which).
"""

from __future__ import annotations

import contextvars
import datetime as dt
import functools
import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tasks.core.config.notices import NOTICES
from tasks.core.errors import Preempted
from tasks.core.launch.notice_watch import Watch
from tasks.core.launch.proctree import signal_handlers
from tasks.core.run.stages import STAGE

_state = threading.local()
# How a poller thread's notice reaches the main thread: a real signal, so a blocking call there (a
# sleep, a wait on a child or a lock) is cut as by a signal notice. SIGURG is ignored by default and
# nothing else here sends it (Go's runtime preempts goroutines with it for the same reasons), so one
# that lands after the stage's handler is gone does nothing.
POLL_SIGNAL = signal.SIGURG
# The seconds a SIGTERM's handler waits for the flow run's state from the Prefect API.
API_READ_S = 5.0


class CancelRequested(KeyboardInterrupt):
    """A SIGTERM that is Prefect's cancel of the flow run, raised in the main thread: it unwinds the
    stage as Ctrl-C does (the launch's teardown included) and the flow run ends Cancelled."""


_cancelled: dict[str, str] = {}  # flow run id -> why: once a run reads cancelled, it stays so


def _runner_cancels() -> bool:
    """Whether Prefect's runner has told this process, over its control channel, that it cancels the run
    (it does so before its SIGTERM). A private module of Prefect's: absent, the API is asked alone."""
    try:
        from prefect._internal import control_listener

        return control_listener.get_intent() == "cancel"
    except Exception:  # another Prefect: the state read below still tells
        return False


def cancel_requested() -> str | None:
    """Why a SIGTERM to this process is Prefect cancelling its flow run (its runner's intent, or the flow
    run's state read from the API: Cancelling or Cancelled), or None: not in a flow run, not being
    cancelled, or no answer from the API within API_READ_S (the SIGTERM is then a notice, said in the log).
    Called in a signal handler: the API is read in a thread of its own, so a lock the interrupted main
    thread holds cannot hang it."""
    if _runner_cancels():
        return "Prefect's runner cancels the flow run"
    from prefect.runtime import flow_run

    run_id = flow_run.id  # read here: the context (run, settings) is the main thread's
    if run_id is None:
        return None
    if str(run_id) in _cancelled:
        return _cancelled[str(run_id)]
    box: dict[str, Any] = {}

    def read() -> None:
        from prefect import get_client

        try:
            with get_client(sync_client=True) as client:
                box["state"] = client.read_flow_run(run_id).state
        except Exception as exc:  # the server is gone too (a machine's shutdown) or refuses
            box["error"] = exc

    reader = threading.Thread(target=contextvars.copy_context().run, args=(read,), name="cancel-check", daemon=True)
    reader.start()
    reader.join(API_READ_S)
    state = box.get("state")
    if state is not None and (state.is_cancelling() or state.is_cancelled()):
        _cancelled[str(run_id)] = f"the flow run is {state.name}"
        return _cancelled[str(run_id)]
    if state is None:
        why = box.get("error") or f"no answer within {API_READ_S:g} s"
        logging.getLogger(__name__).warning(
            "SIGTERM: the flow run's state could not be read (%s); taken as a preemption notice", why
        )
    return None


def cancel(signum: int, frame: Any, previous: Any, why: str) -> None:
    """Go on with a SIGTERM that is Prefect's cancel: to `previous`, Prefect's own handler, where its
    runner drives the cancel; else `CancelRequested` (after a `critical()` stretch, as a notice would
    be), so the flow run ends Cancelled."""
    if _runner_cancels() and callable(previous):
        previous(signum, frame)
        return
    _deliver(CancelRequested(f"cancelled from Prefect ({why})"), frame)


def signal_sources(cfg: Any) -> dict[str, tuple[str, float]]:
    """{signal name: (source, grace_s)} of the signal notice sources any phase of `cfg` lists (the
    shortest grace where two list one)."""
    out: dict[str, tuple[str, float]] = {}
    for section in cfg.phases.values():  # the phases this run trains (an optional one left out is none)
        for n in section.elastic.notices:
            sig = NOTICES[n.source].signal
            if sig and (sig not in out or n.grace < out[sig][1]):
                out[sig] = (n.source, n.grace)
    return out


def polled_sources(cfg: Any) -> list[Any]:
    """The polled notice entries any phase of `cfg` lists, one per source and endpoint (the one with
    the shortest grace where two phases list it)."""
    out: dict[tuple[str, str | None], Any] = {}
    for section in cfg.phases.values():  # the phases this run trains (an optional one left out is none)
        for n in section.elastic.notices:
            key = (n.source, n.where)
            if NOTICES[n.source].poll is not None and (key not in out or n.grace < out[key].grace):
                out[key] = n
    return list(out.values())


def _preempted(stage: str, source: str, grace: float, at: float, text: str | None = None) -> Preempted:
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
    cause = f"{stage} preempted ({source}{f': {text}' if text else ''}): stopped at a safe point, nothing torn"
    return Preempted(cause, cause=cause, record=record)


# A notice that lands inside an import, held back until the import is over (the main thread's; a
# list, not `_state`, because the timer thread that pokes the main thread reads it too).
_deferred: list[BaseException] = []
DEFER_S = 0.05


def _importing(frame: Any) -> bool:
    """Whether `frame` (where a signal handler interrupted the main thread) is inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib."):
            return True
        frame = frame.f_back
    return False


def _poke_later() -> None:
    t = threading.Timer(DEFER_S, signal.pthread_kill, (threading.main_thread().ident, POLL_SIGNAL))
    t.daemon = True
    t.start()


def _deliver(exc: BaseException, frame: Any = None) -> None:
    """Raise `exc` (Preempted, CancelRequested) in the main thread now, or when the `critical()`
    stretch it came in ends, or when the import it came in is over."""
    if getattr(_state, "depth", 0):
        _state.pending = exc  # raised when the swap ends
        return
    if _importing(frame):
        # Raised inside an import, it would leave a half-built package behind: Python drops the
        # module that failed but keeps the submodules it had loaded, so every later import in this
        # process (the flow's retry of the stage) fails ("module 'torch' has no attribute '_utils'").
        # Held back; POLL_SIGNAL, sent from a timer, raises it once the main thread is out of imports.
        _deferred[:] = [exc]
        _poke_later()
        return
    raise exc


def _redeliver(signum: int, frame: Any, chained: Any) -> None:
    """POLL_SIGNAL's handler: a held-back notice first (again held back while an import still runs),
    else the handler it wraps."""
    if _deferred:
        exc = _deferred.pop()
        _deliver(exc, frame)
        return
    if callable(chained):
        chained(signum, frame)


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


class _StagePoller(Watch):
    """The ranks' poller, in the flow process for one stage: its first notice is signalled to the main
    thread (POLL_SIGNAL), whose handler raises it at the stage's next safe point."""

    def __init__(self, notices: list[Any], say: Any) -> None:
        super().__init__(tuple(notices), poll=True, say=say)
        self.main = threading.main_thread().ident
        self.delivered = False

    def notice(self, source: str, grace_s: float, text: str) -> None:
        super().notice(source, grace_s, text)
        signal.pthread_kill(self.main, POLL_SIGNAL)

    def close(self) -> None:
        # Not joined: a poll in flight (up to its deadline) must not hold up the stage's end; should
        # it still notice, its signal finds no notice of the next stage's poller and does nothing.
        self._stop.set()

    def handler(self, stage: str, chained: Any):
        def on_signal(signum: int, frame: Any) -> None:
            n = self.first
            if n is None or self.delivered:  # not this poller's: the handler it replaced takes it
                if callable(chained):
                    chained(signum, frame)
                return
            self.delivered = True
            _deliver(_preempted(stage, n.source, n.grace_s, n.at, n.text), frame)

        return on_signal


_unreadable: set[str] = set()  # the endpoints already said to be unreadable in this process


def _say() -> Any:
    """The stage's run logger (usable from the poller's thread), or this module's outside a run; an
    endpoint that cannot be read is said once a process, not once a stage."""
    try:
        from prefect import get_run_logger

        warn = get_run_logger().warning
    except Exception:  # no run context: a unit test, a stage called as a function
        warn = logging.getLogger(__name__).warning

    def say(msg: str) -> None:
        if " not readable, " in msg:
            key = msg.split(" not readable, ")[0]
            if key in _unreadable:
                return
            _unreadable.add(key)
        warn(msg)

    return say


@contextmanager
def stop_on_notice(stage: str, cfg: Any) -> Iterator[bool]:
    """While the block runs, the notices `cfg` listens for raise `Preempted` in it (at once, or at the
    end of a `critical()` stretch): the signal rows' signals, and the polled rows' answers, asked by a
    daemon thread that ends with the block (not for a training stage, whose ranks poll). The previous
    handlers come back after. Main thread only (Python's rule for handlers): elsewhere nothing is
    installed and the block yields False. A polled notice that comes as the block ends is not lost:
    the endpoint still says it when the next stage asks. A SIGTERM that is Prefect's cancel is no
    notice (`cancel_requested`): it goes on as a cancel."""
    sources = signal_sources(cfg) if cfg is not None else {}
    spec = STAGE.get(stage)
    polled = polled_sources(cfg) if cfg is not None and not (spec and spec.continues) else []
    if not (sources or polled) or threading.current_thread() is not threading.main_thread():
        yield False
        return
    poller = _StagePoller(polled, _say()) if polled else None

    previous = {getattr(signal, name): signal.getsignal(getattr(signal, name)) for name in sources}

    def handler(signum: int, frame) -> None:
        if signum == signal.SIGTERM and (why := cancel_requested()):
            cancel(signum, frame, previous.get(signum), why)
            return
        source, grace = sources[signal.Signals(signum).name]
        _deliver(_preempted(stage, source, grace, time.monotonic()), frame)

    handlers = {getattr(signal, name): handler for name in sources}
    inner = (
        poller.handler(stage, signal.getsignal(POLL_SIGNAL)) if poller is not None else signal.getsignal(POLL_SIGNAL)
    )
    handlers[POLL_SIGNAL] = functools.partial(_redeliver, chained=inner)
    _deferred.clear()
    with signal_handlers(handlers) as installed:
        if poller is not None:
            poller.start()
        try:
            yield installed
        finally:
            if poller is not None:
                poller.close()  # before the handler goes: a late signal then finds the one it replaced
        if _deferred:  # came in the block's last import: the stage's work is done, the notice still stands
            raise _deferred.pop()


# When this process's flow began its latest retry after a preemption (epoch s; tasks/flowkit/run.py sets
# "at" once the wait and the config re-read are over): the preempted stage's next attempt writes it into
# the preemption record's timeline as `rerun` (tasks/core/run/preemptions.py).
RERUN: dict[str, float] = {}


def await_capacity(wait_s: float, message: str) -> bool:
    """Wait `wait_s` seconds for capacity before the flow retries a preempted run, with the flow run
    showing it: AwaitingRetry (a Scheduled state at the retry's time, `message` naming the preemption),
    then Running again. As in Prefect's own in-process flow retry (its RetryFailedFlows rule), the run
    is marked `retry_type: in_process` meanwhile, so no worker of its pool starts it a second time;
    and it re-enters Running marked `resuming`, as a resumed pause does, so the wait counts no attempt
    against the flow run's `retries` (the mark is cleared once the run is Running). False when the run
    was cancelled (or otherwise ended) meanwhile: the server would let Running follow Cancelled, so the
    state is read each second of the wait."""
    from prefect import get_client
    from prefect.exceptions import Abort
    from prefect.runtime import flow_run
    from prefect.states import AwaitingRetry, Running
    from prefect.utilities.engine import propose_state_sync

    run_id = flow_run.id
    if run_id is None:  # not in a flow run: nothing to show
        time.sleep(wait_s)
        return True
    with get_client(sync_client=True) as client:

        def policy(**fields: Any) -> None:
            current = client.read_flow_run(run_id).empirical_policy
            client.update_flow_run(run_id, empirical_policy=current.model_copy(update=fields))

        policy(retry_type="in_process")
        at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=wait_s)
        try:
            waiting = propose_state_sync(client, AwaitingRetry(scheduled_time=at, message=message), flow_run_id=run_id)
        except Abort:
            return False
        if not waiting.is_scheduled():  # refused: the run is being cancelled
            return False
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:  # capacity to come back
            time.sleep(min(left, 1.0))
            now = client.read_flow_run(run_id).state
            if now is None or now.id != waiting.id:  # cancelled from the UI or the API
                return False
        # in_process until Running is in: cleared before, a worker polling the still-Scheduled run could take it
        policy(resuming=True)
        try:
            state = propose_state_sync(client, Running(message=f"retrying after: {message}"), flow_run_id=run_id)
        except Abort:
            return False
        finally:
            policy(retry_type=None)
    return state.is_running()
