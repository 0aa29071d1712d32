"""The console is a view of a run, so a run outlives whatever reads its output.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml | head -3   # the run goes on

When the reader of this process's stdout or stderr goes away (its parent died, the terminal
closed, `| head` had its lines), the next write raises BrokenPipeError. Prefect logs to the console
through rich, whose answer to that is `SystemExit(1)`: raised inside whatever logged, it ended the
running stage in 0.0 s with the cause "SystemExit: 1", naming nothing. Under `console_guard()` a
stream whose reader is gone is pointed at /dev/null, once, and the run's logs (the Prefect UI, the
task run) get one warning naming the stream, so the run continues and is watched there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("cpt_to_sft.console")


class _Console:
    """What was lost, once per file descriptor."""

    def __init__(self) -> None:
        self.lost: list[int] = []

    def lose(self, fd: int) -> None:
        if fd in self.lost:
            return
        try:
            broken = os.fstat(fd)
        except OSError:
            return
        # stdout and stderr are often one pipe (`2>&1`): a reader gone for one is gone for both.
        same = [f for f in (1, 2, fd) if f not in self.lost and _same_file(f, broken)]
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            for f in dict.fromkeys(same):
                os.dup2(devnull, f)  # buffered output still pending goes there too, not to the broken pipe
                self.lost.append(f)
        finally:
            os.close(devnull)
        name = " and ".join({1: "stdout", 2: "stderr"}.get(f, f"fd {f}") for f in dict.fromkeys(same))
        message = (
            f"the console is gone ({name}: its reader exited, e.g. the parent process or the terminal): "
            "the run goes on; follow it in the Prefect UI or its run root"
        )
        try:
            from prefect.logging import get_run_logger

            get_run_logger().warning(message)
        except Exception:  # no flow or task run in this thread: the module logger, at least
            log.warning(message)


def _same_file(fd: int, st: os.stat_result) -> bool:
    try:
        other = os.fstat(fd)
    except OSError:
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)


class _Guarded:
    """A text stream whose writes survive the loss of its reader."""

    def __init__(self, stream: Any, console: _Console):
        self._stream, self._console = stream, console

    def _guard(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._stream, method)(*args)
        except BrokenPipeError:
            with contextlib.suppress(Exception):
                self._console.lose(self._stream.fileno())
            return len(args[0]) if args else None

    def write(self, text: str) -> int:
        return self._guard("write", text)

    def flush(self) -> None:
        self._guard("flush")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _rich_consoles() -> list[Any]:
    """The rich consoles of the logging handlers in this process (Prefect's console handler)."""
    seen, out = set(), []
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for handler in lg.handlers:
            console = getattr(handler, "console", None)
            if console is not None and hasattr(console, "on_broken_pipe") and id(console) not in seen:
                seen.add(id(console))
                out.append(console)
    return out


@contextlib.contextmanager
def console_guard() -> Iterator[None]:
    """While the block runs, a broken stdout/stderr is sent to /dev/null (and said once in the
    run's logs) instead of ending the run."""
    console = _Console()
    saved = sys.stdout, sys.stderr
    patched = _rich_consoles()
    for c in patched:
        # rich's own default raises SystemExit(1); this is the documented override point.
        c.on_broken_pipe = lambda c=c: console.lose(c.file.fileno())
    sys.stdout, sys.stderr = _Guarded(sys.stdout, console), _Guarded(sys.stderr, console)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for c in patched:
            c.__dict__.pop("on_broken_pipe", None)


# Completed states of task and subflow runs (a skipped stage's is a Completed state named Skipped).
_SAID_BY_THE_STAGE = ("Finished in state Completed()", "Finished in state Skipped()")


class _TrainingLog(logging.Filter):
    """Leaves out of the console the records marked `tasks.core.run.events.CONSOLE_OFF`, and
    Prefect's own "Finished in state Completed()" of each task and subflow run: every stage says
    it completed on the line before, with its artifact and manifest digest, and the run ends with
    the table of the stages. Any other final state (Failed, Crashed, Cancelled) is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in ("prefect.task_runs", "prefect.flow_runs") and str(record.msg).startswith(_SAID_BY_THE_STAGE):
            return False
        return getattr(record, "cpt_to_sft_console", True)


def training_log_console() -> None:
    """Make this process's Prefect console handlers a training log: a record marked CONSOLE_OFF
    (every rank's per-step record, other ranks' info lines, a rank's `detail` lines, the launch
    command) still reaches the run's log in the Prefect UI, not the console. Idempotent; called
    by the flow itself, so a worker's flow-run process gets it too."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for handler in lg.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not any(
                isinstance(f, _TrainingLog) for f in handler.filters
            ):
                handler.addFilter(_TrainingLog())


class _RefusalIsNotACrash(logging.Filter):
    """Drops Prefect's "Engine execution exited with unexpected exception" record (a 40-line
    traceback in a worker's log) when the exception is the flow's own refusal: a Failed state the
    flow returned, whose message (the refusal, every problem) the "Finished in state Refused" line
    before it already holds. Any other failure keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        from tasks.flowkit.preflight import REFUSED

        exc = record.exc_info[1] if record.exc_info else None
        return not (type(exc).__name__ == "FailedRun" and REFUSED in str(exc))


def quiet_refusals() -> None:
    """Install `_RefusalIsNotACrash` on Prefect's flow-run logger (every handler: the console, the
    worker's log, the run's log in the UI). Idempotent; called by the flow, in whatever process runs it."""
    lg = logging.getLogger("prefect.flow_runs")
    if not any(isinstance(f, _RefusalIsNotACrash) for f in lg.filters):
        lg.addFilter(_RefusalIsNotACrash())
