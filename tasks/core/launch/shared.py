"""One torchrun launch for a shard stage and the training stage after it (boost_and_shard + train_cpt, reboost + train_sft).

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # run.json: train_cpt's detail.launch "adopted"

Every launch pays torchrun's start and the ranks' imports (about 15 CPU-s and 6-9 s on the demo's
CPU ranks) before any work; the shard and train stages of a phase run under the same plugin and
layout, so their ranks can be the same. The stage protocol stays whole:

- the shard task starts ONE launch with the verb `shard-train` (tasks/engine/handoff.py), reads its
  output until the ranks say `@@sharded` (step-000000 committed, manifest last), then verifies and
  publishes that artifact and ends with its own state, as after a launch of its own; the launch is
  kept here (`HELD`), its ranks waiting;
- the train task `adopt`s it: the same phase, backend and layout, and alive; it writes its job file
  and then the hand-off file (tasks/core/run/handoff.py), and follows the launch's output as it
  follows a launch today (progress, events, notices, failures; a kill fails the stage and the retry
  resumes from the newest complete checkpoint in a launch of its own);
- anything else launches as today: no session (a task called outside the runner), `launch.share`
  off, the Slurm backend (its batch job would have to hold an allocation across two tasks: not done),
  several nodes, a remote run root (the checkpoint sink publishes between the stages), a skipped
  shard stage (nothing live), a launch that died in between or a train job whose layout differs
  (then the live one is told to stop first);
- when the run ends (`session`), a launch nobody adopted (`--stop-after boost_and_shard`, a failure,
  a cancel) is told to stop and waited for, or torn down.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tasks.core.config.schema import LaunchConfig
from tasks.core.launch.proctree import subreaper
from tasks.core.launch.torchrun import LocalLaunch, Router, engine_env, notice_signals, torchrun_env
from tasks.core.run import cputime, handoff
from tasks.core.run.events import SHARDED
from tasks.core.run.job import Job

VERB = "shard-train"
STOP_WAIT_S = 30.0  # a told-to-stop launch's ranks only exit; past this it is torn down

_open = 0  # sessions open in this process: sharing happens only inside one (a PipelineRun)
HELD: dict[str, SharedLaunch] = {}  # phase -> the live launch its train stage may adopt


@dataclass
class SharedLaunch:
    phase: str
    job: Job  # the shard job it was started with
    job_path: Path
    local: LocalLaunch
    scope: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    advanced: float = 0.0  # CPU seconds its processes used for the shard stage (tasks/core/run/cputime.py)

    def why_not(self, job: Job) -> str | None:
        """Why the train `job` cannot run in these ranks, or None (`handoff.mismatch`, which the engine checks too)."""
        if not self.local.alive():
            return f"it exited (status {self.local.proc.returncode}) after the shard"
        return handoff.mismatch(self.job, job)

    def close(self, logger: Any, why: str, graceful: bool = True) -> None:
        """Tell the ranks to stop (or tear them down) and wait for them; a view of the run, never an error."""
        try:
            if graceful and self.local.alive():
                handoff.write_stop(self.job_path, why)
                router = Router(logger, ranks=self.job.phase_cfg.launch.world_size)
                try:
                    with _deadline(self.local, STOP_WAIT_S):
                        self.local.follow(router, "shard", [])
                finally:
                    router.close()
            else:
                self.local.tear_down()
        except Exception as exc:  # the shard's artifact is committed and verified: nothing to lose
            logger.warning("the shared %s launch ended badly after %s: %s", self.phase, why, exc)
            self.local.tear_down()
        finally:
            self.end()

    def discard(self) -> None:
        """After the train stage: a launch still running (it was never followed) is torn down; then `end`."""
        if self.local.alive():
            self.local.tear_down()
        self.end()

    def end(self) -> None:
        """The launch is over (reaped): its subreaper scope closes and its shard part is no longer counted twice."""
        self.scope.close()
        cputime.settle(self.advanced)
        self.advanced = 0.0


def _cpu_seconds(local: LocalLaunch) -> float:
    """User + system seconds torchrun and every rank have used so far (what each reaped too)."""
    total = 0.0
    for proc in local.stage.snapshot():
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


@contextlib.contextmanager
def _deadline(local: LocalLaunch, seconds: float) -> Iterator[None]:
    import threading

    timer = threading.Timer(seconds, local.tear_down)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def session(logger: Any) -> Iterator[None]:
    """The run's span (tasks/flowkit/run.py): launches may be shared inside it, and none outlives it."""
    global _open
    _open += 1
    graceful = True
    try:
        yield
    except BaseException:
        graceful = False
        raise
    finally:
        _open -= 1
        for phase in list(HELD):
            release(phase, logger, "the run ended before its train stage adopted the launch", graceful)


def can_share(launch: LaunchConfig, local_store: bool) -> bool:
    """Whether a shard stage with this launch starts a shared launch (see the module docstring)."""
    return bool(_open) and launch.share and launch.backend == "local" and launch.nnodes == 1 and local_store


def release(phase: str, logger: Any, why: str, graceful: bool = True) -> None:
    live = HELD.pop(phase, None)
    if live is not None:
        logger.info("shared %s launch: stopping it, %s", phase, why)
        live.close(logger, why, graceful)


def start(job: Job, job_path: Path, rdzv_id: str, logger: logging.Logger | logging.LoggerAdapter) -> SharedLaunch:
    """The shard part of a shared launch: write `job`, start `shard-train`, follow it until step-000000
    is committed (`@@sharded`), keep it in HELD for the train stage. A failure before that raises as
    a shard launch's does, and nothing is kept."""
    release(job.phase, logger, "a new shard stage started")
    job.write(job_path)
    handoff.clear(job_path)
    router = Router(logger, ranks=job.phase_cfg.launch.world_size)
    sharded: list[dict] = []
    router.on_event = lambda kind, record: sharded.append(record) if kind == SHARDED else None
    env = engine_env(torchrun_env(job.phase_cfg.elastic.notices))  # the train part's notices; no fault specs
    scope = contextlib.ExitStack()
    try:
        scope.enter_context(subreaper())  # ranks orphaned at any point re-parent here, until close or the train ends
        local = LocalLaunch(VERB, job_path, job.phase_cfg.launch, rdzv_id, env, logger)
        try:
            ended = local.follow(router, "shard", [], until=lambda: bool(sharded))
        finally:
            router.close()
        if ended:  # exited 0 without the event: a shard that did not say it committed
            raise RuntimeError(f"the shared {job.phase} launch exited before it reported step 0 committed (@@sharded)")
    except BaseException:
        scope.close()
        raise
    # The ranks' time so far is the shard stage's, though torchrun is reaped in the train stage.
    advanced = _cpu_seconds(local)
    cputime.advance(advanced)
    live = HELD[job.phase] = SharedLaunch(job.phase, job, job_path, local, scope, advanced)
    return live


def adopt(job: Job, logger: Any) -> SharedLaunch | None:
    """The live launch of `job`'s phase when the train `job` can run in it (else it is stopped, and None)."""
    live = HELD.get(job.phase)
    if live is None:
        return None
    why = live.why_not(job)
    if why:
        release(job.phase, logger, f"not adopted: {why}; the train stage launches its own")
        return None
    del HELD[job.phase]
    return live


def follow_train(
    live: SharedLaunch,
    job: Job,
    job_path: Path,
    logger: Any,
    env: dict[str, str] | None = None,
    **hooks: Any,
) -> list[dict[str, Any]]:
    """The train part: write `job` and the hand-off file, then follow the launch as `run_engine` follows
    one (the same router, failure, notices and teardown); the parsed @@progress records. `hooks`:
    run_engine's callbacks of the same names (on_progress, on_event, failure, cancelled)."""
    from tasks.core.launch.torchrun import FAULT_ENV

    unknown = set(hooks) - {"on_progress", "on_event", "failure", "cancelled"}
    if unknown:
        raise TypeError(f"follow_train: no hook named {', '.join(sorted(unknown))}")
    try:
        job.write(job_path)
        router = Router(logger, hooks.get("on_progress"), hooks.get("on_event"), ranks=job.phase_cfg.launch.world_size)
        router.stop_check, router.cancelled = hooks.get("failure"), hooks.get("cancelled")
        handoff.write_go(live.job_path, job_path, fault=(env or {}).get(FAULT_ENV, ""))
        try:
            live.local.follow(router, "train", notice_signals("train", job))
        finally:
            router.close()
        return router.progress
    finally:
        live.end()
