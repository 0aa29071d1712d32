"""Teardown that reaches every process of a stage, not only torchrun's process group.

torch's elastic agent starts every rank it execs with `start_new_session=True` (ranks forked from
the agent, `tasks/engine/agent.py`'s default, stay in its session), so `os.killpg(torchrun)` can
miss the ranks; once torchrun is gone they are orphans (parent PID 1) that keep training and
committing checkpoints. Three mechanisms, none of which looks at a process name:

- `subreaper()`: while a stage runs, the task process is a child subreaper (PR_SET_CHILD_SUBREAPER),
  so orphans of its descendants re-parent to it (and stay visible in its process tree) instead of
  to PID 1; the flag is cleared again when the last stage of the process ends, so a long-lived
  process (a worker, pytest) does not go on adopting, and leaving unreaped, the orphans of daemons
  it started for other reasons (a Slurm daemon's slurmstepd, say);
- a stage token: the task starts torchrun with `CPT_TO_SFT_STAGE_TOKEN=<uuid>` in its environment,
  which every rank inherits; `StageProcesses.snapshot()` finds the stage's processes as
  torchrun's descendants (psutil, recursive) plus every process carrying the token (the job's own
  record, found even where an orphan escaped to PID 1);
- `die_with_parent()`: each rank (and torchrun) sets PR_SET_PDEATHSIG, so a SIGKILLed parent
  still takes its children along when no teardown code gets to run;
- `reap_on_exit()`: a process that starts children it cannot give PR_SET_PDEATHSIG (the flow
  process and its embedded Prefect server) puts a run token in its own environment, which every
  child inherits, and starts a watchdog that tears down every process carrying it once its parent
  is gone, even after a SIGKILL.

`teardown()` snapshots before the first signal, sends SIGTERM, waits `grace_s`, SIGKILLs what is
left, re-snapshots (anything forked meanwhile), and returns only when none remains. Linux-only
calls (prctl) report False elsewhere; the snapshot and signals work wherever psutil does.

    python -m tasks.core.launch.proctree --grace 5 -- torchrun --standalone --nproc-per-node 2 train.py
    # runs the command as a stage; Ctrl+C (or --timeout S) tears down every process it started
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil

TOKEN_ENV = "CPT_TO_SFT_STAGE_TOKEN"
RUN_TOKEN_ENV = "CPT_TO_SFT_RUN_TOKEN"  # every process a flow process started: reaped by its watchdog
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _prctl(option: int, arg) -> bool:
    """prctl(option, arg); `arg` an int, or a ctypes pointer for the GET options."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(option, arg if isinstance(arg, ctypes._Pointer) else ctypes.c_ulong(arg), 0, 0, 0) == 0
    except OSError:
        return False


def become_subreaper() -> bool:
    """Orphaned descendants of this process re-parent to it instead of to PID 1 (process-wide,
    lasts until cleared). It must then reap them, which `teardown` does. A stage uses the scoped
    `subreaper()`; this is for a process that is a stage driver for its whole life."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    return _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.pointer(flag)) and flag.value != 0


_scope_lock = threading.Lock()
_scope_depth = 0
_scope_owned = False


@contextlib.contextmanager
def subreaper() -> Iterator[bool]:
    """This process is a child subreaper while any `with subreaper():` block runs (stages may run
    in several threads of one process); when the last one ends, the flag is cleared again, unless
    the process was a subreaper before the first block began. Yields whether the flag is set."""
    global _scope_depth, _scope_owned
    with _scope_lock:
        if _scope_depth == 0:
            _scope_owned = not is_subreaper() and become_subreaper()
        _scope_depth += 1
        on = is_subreaper()
    try:
        yield on
    finally:
        with _scope_lock:
            _scope_depth -= 1
            if _scope_depth == 0 and _scope_owned:
                _prctl(_PR_SET_CHILD_SUBREAPER, 0)
                _scope_owned = False


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent (thread) exits. Usable as a
    Popen preexec_fn. If the parent is already gone, exit now rather than run as an orphan."""
    parent = os.getppid()
    ok = _prctl(_PR_SET_PDEATHSIG, int(sig))
    if ok and os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)
    return ok


def new_token() -> str:
    return uuid.uuid4().hex


def _carries(proc: psutil.Process, token: str, env: str = TOKEN_ENV) -> bool:
    try:
        return proc.environ().get(env) == token
    except (psutil.Error, OSError):
        return False


def _alive(proc: psutil.Process) -> bool:
    try:
        # A zombie runs no code and writes nothing; it only waits for its parent to reap it.
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class StageProcesses:
    """The processes of one stage: `root_pid`'s descendants (none when it is None) plus those
    carrying `token` in the environment variable `token_env`."""

    root_pid: int | None
    token: str | None = None
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    token_env: str = TOKEN_ENV

    def snapshot(self) -> list[psutil.Process]:
        found: dict[int, psutil.Process] = {}
        try:
            if self.root_pid is not None:
                root = psutil.Process(self.root_pid)
                found[root.pid] = root
                for child in root.children(recursive=True):
                    found[child.pid] = child
        except psutil.NoSuchProcess:
            pass
        if self.token:
            me = os.getpid()
            for proc in psutil.process_iter():
                if proc.pid != me and proc.pid not in found and _carries(proc, self.token, self.token_env):
                    found[proc.pid] = proc
                    try:
                        for child in proc.children(recursive=True):
                            found.setdefault(child.pid, child)
                    except psutil.Error:
                        pass
        # psutil.Process remembers each process's start time, so a signal never reaches a
        # recycled PID that now belongs to someone else.
        self.seen.update(found)
        return [p for p in found.values() if _alive(p)]


@dataclass
class TeardownReport:
    terminated: list[int]  # ended after SIGTERM
    killed: list[int]  # needed SIGKILL
    seconds: float

    def __str__(self) -> str:
        return (
            f"{len(self.terminated) + len(self.killed)} process(es) ended in {self.seconds:.1f}s "
            f"({len(self.terminated)} on SIGTERM, {len(self.killed)} needed SIGKILL)"
        )


def _signal(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def _wait(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait (reaping our own children) until every process has ended or `timeout`; the rest."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            try:
                os.waitpid(p.pid, os.WNOHANG)  # reap orphans re-parented to us (subreaper)
            except (ChildProcessError, OSError):
                pass
        left = [p for p in procs if _alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def teardown(
    stage: StageProcesses, grace_s: float = 5.0, kill_timeout_s: float = 10.0, rounds: int = 5
) -> TeardownReport:
    """SIGTERM every process of the stage, SIGKILL what outlives `grace_s`, repeat for anything
    forked meanwhile; return once none is left. Raises RuntimeError naming survivors (a process
    in uninterruptible sleep longer than `kill_timeout_s`) rather than report a clean teardown."""
    t0 = time.monotonic()
    procs = stage.snapshot()  # before the first signal: afterwards orphans may have moved
    terminated: list[int] = []
    killed: list[int] = []
    for _ in range(rounds):
        if not procs:
            break
        # Stopped processes (SIGSTOP, a debugger) would ignore SIGTERM until continued.
        _signal(procs, signal.SIGTERM)
        _signal(procs, signal.SIGCONT)
        left = _wait(procs, grace_s)
        terminated += [p.pid for p in procs if p not in left]
        if left:
            _signal(left, signal.SIGKILL)
            still = _wait(left, kill_timeout_s)
            killed += [p.pid for p in left if p not in still]
            if still:
                raise RuntimeError(
                    f"teardown: {len(still)} process(es) survived SIGKILL for {kill_timeout_s:.0f}s: "
                    + ", ".join(f"pid {p.pid}" for p in still)
                )
        procs = stage.snapshot()
    if procs:
        raise RuntimeError(
            f"teardown: processes kept appearing after {rounds} rounds: " + ", ".join(f"pid {p.pid}" for p in procs)
        )
    return TeardownReport(terminated, killed, time.monotonic() - t0)


def ranks_of(stage: StageProcesses) -> list[psutil.Process]:
    """The processes torchrun started (its direct children: the ranks), alive."""
    try:
        return [p for p in psutil.Process(stage.root_pid).children() if _alive(p)] if stage.root_pid else []
    except psutil.Error:
        return []


@contextlib.contextmanager
def signal_handlers(handlers: dict[int, Callable[[int, Any], None]]) -> Iterator[bool]:
    """While the block runs, `handlers` ({signal number: handler}) are this process's; the previous
    handlers come back after, whatever ends the block. Python installs handlers from the main thread
    only: elsewhere, or with nothing to install, nothing is installed and the block yields False."""
    if not handlers or threading.current_thread() is not threading.main_thread():
        yield False
        return
    old: dict[int, Any] = {}
    try:
        for sig, handler in handlers.items():
            old[sig] = signal.signal(sig, handler)
        yield True
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def forward_notices(
    stage: StageProcesses, signals: list[str], say=None, cancelled: Callable[[], Any] | None = None
) -> Iterator[bool]:
    """While the block runs, a signal in `signals` (names: SIGTERM, SIGUSR1) that reaches this process
    is passed on to the stage's ranks as a preemption notice instead of ending this process (each
    rank finishes its step, commits a checkpoint and exits preempted: tasks/core/launch/notice_watch.py); the
    previous handlers come back after. Python installs handlers from the main thread only: elsewhere
    nothing is installed and the block yields False (a notice then reaches only ranks signalled
    directly, as Slurm and Kubernetes do). A SIGTERM for which `cancelled()` is true (the flow run is
    being cancelled) is no notice: it goes to the handler it replaced, as before SIGTERM was one."""
    previous = {name: signal.getsignal(getattr(signal, name)) for name in signals}

    def handler(signum: int, frame) -> None:
        if signum == signal.SIGTERM and cancelled is not None and cancelled():
            before = previous.get("SIGTERM")
            if callable(before):
                before(signum, frame)
            elif before == signal.SIG_DFL:  # the default: end this process, as a SIGTERM did
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        ranks = ranks_of(stage)
        _signal(ranks, signum)
        if say:
            say(f"{signal.Signals(signum).name}: passed on to {len(ranks)} rank(s) as a preemption notice")

    with signal_handlers({getattr(signal, name): handler for name in signals}) as installed:
        yield installed


_reaper: subprocess.Popen | None = None


def reap_on_exit() -> str:
    """Give this process a run token of its own (RUN_TOKEN_ENV, replacing one it inherited, and
    inherited by everything it starts from now on) and start its watchdog, once per process: when
    this process has exited, by any path, SIGKILL included, the watchdog tears down every process
    that carries the token. The watchdog runs in its own session: the terminal's Ctrl-C misses it.
    Returns the token, for a child whose environment was built before this call."""
    global _reaper
    with _scope_lock:
        if _reaper is None or _reaper.poll() is not None:
            token = os.environ[RUN_TOKEN_ENV] = new_token()
            env = {k: v for k, v in os.environ.items() if k != RUN_TOKEN_ENV}
            _reaper = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tasks.core.launch.proctree",
                    "--reap-after",
                    str(os.getpid()),
                    "--token",
                    token,
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return os.environ[RUN_TOKEN_ENV]


def _reap_after(parent: int, token: str, poll_s: float = 0.2) -> int:
    """The watchdog of `reap_on_exit`: wait until `parent` is no longer this process's parent, then
    end every process carrying `token`."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    report = teardown(StageProcesses(None, token, token_env=RUN_TOKEN_ENV))
    if report.terminated or report.killed:
        print(f"after pid {parent} exited: {report}", file=sys.stderr)
    return 0


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tasks.core.launch.proctree", description=__doc__.split("\n")[0])
    ap.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("--timeout", type=float, default=None, help="tear the command down after this many seconds")
    ap.add_argument(
        "--reap-after",
        type=int,
        metavar="PID",
        help="watchdog mode (reap_on_exit): when PID, this process's parent, is gone, end every process carrying "
        "--token",
    )
    ap.add_argument("--token", help="the run token of --reap-after")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.reap_after is not None:
        return _reap_after(args.reap_after, args.token)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command after --")
    become_subreaper()
    token = new_token()
    proc = subprocess.Popen(cmd, env={**os.environ, TOKEN_ENV: token}, start_new_session=True)
    stage = StageProcesses(proc.pid, token)
    try:
        rc = proc.wait(timeout=args.timeout)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        rc = 130
    report = teardown(stage, grace_s=args.grace)  # also after a clean exit: ranks may linger
    print(f"teardown: {report}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
