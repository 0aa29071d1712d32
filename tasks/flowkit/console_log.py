"""Failures on the console: one line each, no traceback; the traceback stays in the run's log.

    python -m flows.cpt_to_sft --config FILE      # a failure ends with one line: "stage X failed: <cause>"
    CPT_TO_SFT_TRACEBACKS=1 python -m flows.cpt_to_sft --config FILE   # tracebacks on the console as well

Prefect reports a failure several times on its console handler (the root logger's
`PrefectConsoleHandler`): the task run's "Task run failed with exception" and the flow's
"Encountered exception during execution", each with a traceback (or with `NoneType: None` where a
task returned a Failed state), then a "Finished in state Failed(...)" line per task, subflow and
flow, and the launcher streams every rank's error lines (the cause, then its traceback) and
torchrun's report of its failed ranks (its own traceback, at info level). The CLI
already prints the failure's cause last, once. `one_line_failures()`, entered by the CLI's run,
keeps those echoes off the console handler only: Prefect's API handler (on the `prefect.task_runs`
and `prefect.flow_runs` loggers) has sent each record, traceback included, to the task run's log
before the record reaches the root logger's console handler, so the Prefect UI shows them all.

Worker processes (the process pool's, Dask's) print to the same console through their own
Prefect console handler: `CONSOLE_ENV` in the environment, which they inherit, asks them to keep
the same rule (`from_environment()`, called by the tasks that run there).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

CONSOLE_ENV = "CPT_TO_SFT_CONSOLE"  # "one-line" while a CLI run owns the console; workers inherit it
TRACEBACKS_ENV = "CPT_TO_SFT_TRACEBACKS"  # "1": tracebacks on the console as well (debugging)
ONE_LINE = "one-line"
_MARK = "cpt_to_sft_console"
NOT_ON_CONSOLE: dict[str, Any] = {_MARK: False}  # `extra=` of a record the run's log keeps and the console does not

# What Prefect's task and flow engines (3.9) log about a failure they also put in the run's state.
_ENGINE_ECHOES = ("Task run failed with", "Encountered exception during execution")
_FAILED_STATES = ("Failed(", "Crashed(")
_FAILED_TYPES = ("type=FAILED)", "type=CRASHED)")
_ROUTED_LINE = "[%s] %s"  # tasks/core/launch/torchrun.py Router: one line of a rank (or of torchrun)


def is_echo(record: logging.LogRecord) -> bool:
    """Whether the record repeats a failure the CLI's last line states (its cause), or is marked
    for the run's log only."""
    if getattr(record, _MARK, True) is False:
        return True
    msg = record.msg if isinstance(record.msg, str) else ""
    if record.name.startswith(("prefect.task_runs", "prefect.flow_runs")):
        if record.levelno >= logging.ERROR and msg.startswith(_ENGINE_ECHOES):
            return True
        if msg.startswith("Finished in state "):
            state = msg[len("Finished in state ") :]
            return state.startswith(_FAILED_STATES) or state.rstrip().endswith(_FAILED_TYPES)
    if msg != _ROUTED_LINE or not isinstance(record.args, tuple) or len(record.args) != 2:
        return False
    # A rank's error lines: the first is the stage's cause (the CLI's last line), the rest its
    # traceback. torchrun itself writes only about its ranks: their exit, then its own traceback.
    who = str(record.args[0])
    return record.levelno >= logging.ERROR or who == "torchrun" or who.endswith(" torchrun")


class OneLineFailures(logging.Filter):
    """On a console handler: drops the echoes of a failure (`is_echo`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_echo(record)


class _NoTraceback(logging.Formatter):
    """Wraps a console handler's formatter: the record's message line(s) without its traceback or
    stack (any logger's `exc_info`, `NoneType: None` included)."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def console_handlers() -> list[logging.Handler]:
    """Prefect's console handlers in this process (the root logger's, and any other logger's)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    seen: dict[int, logging.Handler] = {}
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, PrefectConsoleHandler):
                seen.setdefault(id(h), h)
    return list(seen.values())


def install(
    handlers: list[logging.Handler] | None = None,
) -> list[tuple[logging.Handler, OneLineFailures, logging.Formatter | None]]:
    """Put the rule on `handlers` (default: every console handler of this process), once each;
    returns what `uninstall` undoes."""
    done = []
    keep_tracebacks = os.environ.get(TRACEBACKS_ENV, "") not in ("", "0")
    for h in console_handlers() if handlers is None else handlers:
        if any(isinstance(f, OneLineFailures) for f in h.filters):
            continue
        f = OneLineFailures()
        h.addFilter(f)
        old = h.formatter
        if not keep_tracebacks:
            h.setFormatter(_NoTraceback(old))
        done.append((h, f, old))
    return done


def uninstall(done: list[tuple[logging.Handler, OneLineFailures, logging.Formatter | None]]) -> None:
    for h, f, old in done:
        h.removeFilter(f)
        if isinstance(h.formatter, _NoTraceback):
            h.setFormatter(old)


@contextlib.contextmanager
def one_line_failures() -> Iterator[None]:
    """While the block runs: this process's console and its workers' (through `CONSOLE_ENV`) show
    a failure once, without a traceback."""
    previous = os.environ.get(CONSOLE_ENV)
    os.environ[CONSOLE_ENV] = ONE_LINE
    done = install()
    try:
        yield
    finally:
        uninstall(done)
        if previous is None:
            os.environ.pop(CONSOLE_ENV, None)
        else:
            os.environ[CONSOLE_ENV] = previous


def from_environment() -> None:
    """In a worker process (pool, Dask): keep the CLI's rule when it asked for it."""
    if os.environ.get(CONSOLE_ENV) == ONE_LINE:
        install()
