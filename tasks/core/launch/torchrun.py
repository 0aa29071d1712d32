"""Process boundary: build the torchrun command for an engine verb, run it on the stage's launch
backend, stream its output.

The argv builder is pure (unit-tested). `run_engine` writes the job file and hands the verb to the
runner of `launch.backend` (`RUNNERS`: `local` here, `slurm` in tasks/core/launch/slurm_runner.py). Every
runner feeds each output line to one `Router`, which logs it with its prefix (`[rank N]` from the
engine, `[torchrun]` for the agent's own lines, and the node name first on Slurm) at the level its
writer marked (`tasks.core.run.events`, never guessed from words), turns `@@progress` lines into
progress callbacks and other `@@` events into `on_event`, and keeps the cause: a failure raises
`StageFailed` whose first line, and `cause`, is the first error line of the failing rank
(torchrun's own error line when no rank wrote one, e.g. after a SIGKILL), followed by every
process's last lines. Callbacks run in the reader and must not block (publishing is a queue,
tasks/core/storage/publisher.py): a reader that stops reading fills the pipe and stalls every rank.

Teardown of the local runner (tasks/core/launch/proctree.py): the task process is a child subreaper while
the stage runs, and torchrun carries a stage token in its environment, so a failure, a cancellation
or a background failure reported by `failure()` (a publish that spent its retries) ends torchrun
and every rank in every session it created, and `run_engine` raises only once none of them remains.
Before its first SIGTERM the teardown writes the file the ranks know by TEARDOWN_ENV: a rank that
takes SIGTERM as a preemption notice (tasks/core/launch/notice_watch.py) finds it and ends at once instead.

Single node picks a free rendezvous port (`--standalone`); several nodes use c10d rendezvous:

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-backend c10d \
             --rdzv-endpoint head:29400 --rdzv-id run-cpt -m tasks.engine train --config job.json
"""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tasks.core.config.notices import TEARDOWN_ENV, signal_names, torchrun_env
from tasks.core.config.schema import LaunchConfig
from tasks.core.errors import Preempted, StageFailed
from tasks.core.launch.proctree import (
    RUN_TOKEN_ENV,
    TOKEN_ENV,
    StageProcesses,
    forward_notices,
    new_token,
    reap_on_exit,
    subreaper,
    teardown,
)
from tasks.core.run.events import CONSOLE_OFF, DETAIL, ERROR, INFO, PREEMPTED, PROGRESS, UI_OFF, WARNING, parse_line
from tasks.core.run.job import Job
from tasks.core.run.trainlog import SameWarnings

REPO = Path(__file__).resolve().parents[3]
_LOG_LEVELS = {INFO: logging.INFO, WARNING: logging.WARNING, ERROR: logging.ERROR, DETAIL: logging.INFO}


def torchrun_argv(
    verb: str, job_path: str | Path, launch: LaunchConfig, rdzv_id: str, python: str = sys.executable
) -> list[str]:
    # torch.distributed.run's own main, without the teardown of torch after it (tasks/engine/agent.py)
    argv = [python, "-m", "tasks.engine.agent", "--nproc-per-node", str(launch.nproc_per_node)]
    if launch.nnodes == 1 and not launch.rdzv_endpoint:
        argv += ["--standalone"]
    else:
        endpoint = launch.rdzv_endpoint or "127.0.0.1:29400"
        argv += [
            "--nnodes",
            str(launch.nnodes),
            "--node-rank",
            str(launch.node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            launch.rdzv_id or rdzv_id,
        ]
    argv += ["-m", "tasks.engine", verb, "--config", str(job_path)]
    return argv


# Read by the engine (tasks/engine/faults.py). The task process may hold it for one stage only: a
# launch gets it when its stage passes it (`phase_fault_env`), never by inheritance.
FAULT_ENV = "CPT_TO_SFT_FAULT"


def phase_fault_env(phase: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The fault specs of `environ[FAULT_ENV]` that may fire in `phase`'s training launch: each one
    naming no phase, or this one (`...@phase=P`), as the `extra` of `engine_env`; {} when none."""
    keep = [
        spec
        for spec in (s.strip() for s in environ.get(FAULT_ENV, "").split(";"))
        if spec and all(part.partition("=")[2] == phase for part in spec.split("@")[1:] if part.startswith("phase="))
    ]
    return {FAULT_ENV: ";".join(keep)} if keep else {}


def engine_env(extra: dict[str, str] | None = None, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """torchrun's whole environment: `environ` (this process's) without FAULT_ENV, then `extra`."""
    env = {k: v for k, v in environ.items() if k != FAULT_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    # Keep tokenizers from forking thread pools inside every rank.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


class Router:
    """Routes engine output lines into the logger, the per-process tails and the progress/event
    callbacks; the same for every backend, so a line reads the same wherever its rank ran.

    Every line reaches the run's log (the Prefect UI); the console gets a training log: rank 0's
    info lines, not its `detail` ones nor any event line, other ranks' lines only when they are
    warnings or errors, and a warning that several of the launch's `ranks` print once, naming them
    (`trainlog.SameWarnings`; `close()` prints what is still held when the launch ends)."""

    def __init__(self, logger, on_progress=None, on_event=None, ranks: int = 1):
        self.logger, self.on_progress, self.on_event = logger, on_progress, on_event
        self.warnings = SameWarnings(ranks)
        # Polled beside the reader by the local runner: an exception once the stage must stop.
        self.stop_check: Callable[[], BaseException | None] | None = None
        # Asked by the local runner on a SIGTERM: true when it is a cancel of the run, not a notice.
        self.cancelled: Callable[[], Any] | None = None
        self.tails: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=25))
        self.progress: list[dict[str, Any]] = []
        self.first_error: tuple[str, str] | None = None  # (who, line): the cause of a failure
        self.first_torchrun_error: tuple[str, str] | None = None
        self.preempted: dict[str, Any] | None = None  # the engine's @@preempted record

    def line(self, raw: str, node: str | None = None) -> None:
        line = parse_line(raw)
        who = f"{node} {line.who}" if node else line.who
        body = line.body
        self.tails[who].append(body)
        if line.kind is not None:
            if line.kind == PREEMPTED:
                self.preempted = line.record
            if line.kind == PROGRESS:
                self.progress.append(line.record)
                if self.on_progress:
                    self.on_progress(line.record)
            elif self.on_event:
                self.on_event(line.kind, line.record)
            self.logger.info("[%s] %s %s", who, line.kind, line.payload, extra=CONSOLE_OFF)
            return
        if line.level == ERROR and body.strip():
            if line.who == "torchrun":
                self.first_torchrun_error = self.first_torchrun_error or (who, body.strip())
            else:
                self.first_error = self.first_error or (who, body.strip())
        self._console(line.who, who, line.level, body)

    def _console(self, rank: str, who: str, level: str, body: str) -> None:
        if level == WARNING and rank != "torchrun":  # each rank's line to the UI, once per warning to the console
            self.logger.warning("[%s] %s", who, body, extra=CONSOLE_OFF)
            self._said(self.warnings.add(who, body))
            return
        self._said(self.warnings.flush() if level == ERROR else self.warnings.due())  # what came before stays before
        quiet = level == DETAIL or (level == INFO and rank not in ("rank 0", "torchrun"))
        self.logger.log(_LOG_LEVELS[level], "[%s] %s", who, body, **({"extra": CONSOLE_OFF} if quiet else {}))

    def _said(self, lines: list[tuple[str, str]]) -> None:
        for whos, body in lines:
            self.logger.warning("[%s] %s", whos, body, extra=UI_OFF)

    def close(self) -> None:
        """The launch ended: the warnings still held go to the console."""
        self._said(self.warnings.flush())

    @property
    def cause(self) -> tuple[str, str] | None:
        """(who, line): the first error line a rank wrote, else torchrun's, else None."""
        return self.first_error or self.first_torchrun_error

    def failure(self, verb: str, rc: int) -> StageFailed:
        """StageFailed naming the cause; `Preempted` (a StageFailed) when the ranks stopped on a
        preemption notice (PREEMPTED_EXIT, and the @@preempted record says what was committed)."""
        if self.preempted is not None:
            p = self.preempted
            head = (
                f"engine verb '{verb}' preempted ({p.get('source')}) after step {p.get('noticed_step')}: "
                f"checkpoint step {p.get('checkpoint_step')} committed, steps lost {p.get('steps_lost')}"
            )
            return Preempted(
                f"{head}\n{_failure_message(verb, rc, self.tails, None)}", cause=head, record=self.preempted
            )
        cause = self.cause
        return StageFailed(
            _failure_message(verb, rc, self.tails, cause),
            cause=f"{cause[0]}: {cause[1]}" if cause else f"exit status {rc}, no error line from any process",
        )


def run_engine(
    verb: str,
    job: Job,
    job_path: Path,
    launch: LaunchConfig,
    rdzv_id: str,
    logger: logging.Logger | logging.LoggerAdapter,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_event: Callable[[str, dict[str, Any]], None] | None = None,
    env: dict[str, str] | None = None,
    failure: Callable[[], BaseException | None] | None = None,
    cancelled: Callable[[], Any] | None = None,
) -> list[dict[str, Any]]:
    """Write `job` to `job_path`, run its engine verb on the stage's launch backend (`RUNNERS`);
    return the parsed @@progress records. `failure`, polled twice a second beside the reader,
    returns an exception once the stage must stop (the publisher gave up); the stage is then torn
    down and that exception raised. `cancelled()`, asked when a SIGTERM reaches this process while
    it forwards notices, says whether that SIGTERM cancels the run (tasks/flowkit/notices.py)."""
    job.write(job_path)
    router = Router(logger, on_progress, on_event, ranks=launch.world_size)
    router.stop_check = failure
    router.cancelled = cancelled
    # A stage that listens for notices: torchrun passes their signals on to the ranks and waits the grace.
    notices = torchrun_env(job.phase_cfg.elastic.notices) if verb in TRAIN_VERBS else {}
    try:
        RUNNERS[launch.backend](verb, job, job_path, launch, rdzv_id, router, engine_env({**notices, **(env or {})}))
    finally:
        router.close()
    return router.progress


def run_local(
    verb: str, job: Job, job_path: Path, launch: LaunchConfig, rdzv_id: str, router: Router, env: dict[str, str]
) -> None:
    """torchrun on this node, its output on a pipe; any exception kills its whole process group.
    While it runs, orphaned ranks re-parent to this process, not to PID 1 (`subreaper`)."""
    with subreaper():
        local = LocalLaunch(verb, job_path, launch, rdzv_id, env, router.logger)
        local.follow(router, verb, notice_signals(verb, job))


def notice_signals(verb: str, job: Job) -> list[str]:
    """The signals this process passes on to a training launch's ranks as a notice (none for shard)."""
    return signal_names([n.source for n in job.phase_cfg.elastic.notices]) if verb in TRAIN_VERBS else []


# The verbs whose ranks train, and so listen for preemption notices (shard-train: a shared launch, tasks/core/launch/shared.py).
TRAIN_VERBS = ("train", "shard-train")


class LocalLaunch:
    """One torchrun on this node, started at construction; `follow` reads its output into a router
    until it exits (or, for a shared launch, until `until()` says the shard part is done, when the
    process is left running for the next `follow`). Teardown reaches every process it started."""

    def __init__(
        self, verb: str, job_path: Path, launch: LaunchConfig, rdzv_id: str, env: dict[str, str], logger
    ) -> None:
        argv = torchrun_argv(verb, job_path, launch, rdzv_id)
        logger.info("launch: %s", " ".join(argv), extra=CONSOLE_OFF)
        token = new_token()
        # torchrun has no PR_SET_PDEATHSIG: should this process end without a teardown (a second
        # Ctrl-C, a SIGKILL), its watchdog ends torchrun, and the ranks go with torchrun.
        run_token = reap_on_exit()
        self.marker = Path(f"{job_path}.teardown")  # written before a teardown's SIGTERM: not a notice to the ranks
        self.marker.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**env, RUN_TOKEN_ENV: run_token, TOKEN_ENV: token, TEARDOWN_ENV: str(self.marker)},
            text=True,
            bufsize=1,
            cwd=str(REPO),
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.stage = StageProcesses(self.proc.pid, token)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tear_down(self):
        self.marker.touch()
        return teardown(self.stage)

    def follow(self, router: Router, verb: str, notices: list[str], until: Callable[[], bool] | None = None) -> bool:
        """Route every output line until torchrun exits (then tear down what is left and raise the
        failure on a non-zero status) and return True; or until `until()` after a line, and return
        False with the launch still running. An exception here tears the launch down."""
        proc = self.proc
        stop = threading.Event()
        raised: list[BaseException] = []
        check = router.stop_check

        def watch() -> None:
            while not stop.wait(0.5):
                exc = check() if check else None
                if exc is not None:
                    raised.append(exc)
                    router.logger.error("stopping the stage: %s", exc)
                    self.tear_down()  # closes the pipe, so the reader below ends
                    return

        watcher = threading.Thread(target=watch, name="stage-watch", daemon=True)
        watcher.start()
        # A stage that listens for notices: SIGTERM/SIGUSR1 to this process become a notice to its ranks.
        try:
            with forward_notices(self.stage, notices, say=router.logger.warning, cancelled=router.cancelled) as fwd:
                if notices and not fwd:
                    router.logger.info(
                        "%s reach the ranks only when sent to them: this launch is not in the main thread", notices
                    )
                for raw in proc.stdout:
                    router.line(raw.rstrip("\n"))
                    if until is not None and until():
                        return False
                rc = proc.wait()
        except BaseException:
            stop.set()
            router.logger.warning("torn down the %s stage: %s", verb, self.tear_down())
            proc.wait()
            raise
        finally:
            stop.set()
            watcher.join()
        if raised:
            self.tear_down()
            raise raised[0]
        # torchrun has exited; a rank it lost track of must not outlive it (no-op when none is left).
        report = self.tear_down()
        self.marker.unlink(missing_ok=True)
        if report.terminated or report.killed:
            router.logger.warning("after torchrun exited: %s", report)
        if rc != 0:
            raise router.failure(verb, rc)
        return True


def _failure_message(verb: str, rc: int, tails: dict[str, collections.deque], cause: tuple[str, str] | None) -> str:
    """First line: the cause (the first error line of the failing rank); then every process's tail,
    the failing process first."""
    head = (
        f"engine verb '{verb}' failed on {cause[0]}: {cause[1]}"
        if cause
        else f"engine verb '{verb}' failed; no process wrote an error line"
    )
    parts = [head, f"engine verb '{verb}' exited with status {rc}; last lines per process:"]
    for who, lines in sorted(tails.items(), key=lambda item: (cause is None or item[0] != cause[0], item[0])):
        parts.append(f"--- {who} ---")
        parts.extend(list(lines)[-15:])
    return "\n".join(parts)


def run_slurm(
    verb: str, job: Job, job_path: Path, launch: LaunchConfig, rdzv_id: str, router: Router, env: dict[str, str]
) -> None:
    from tasks.core.launch.slurm_runner import run_slurm as run

    run(verb, job, job_path, launch, rdzv_id, router, env)


# One runner per `tasks.core.config.backends.BACKENDS` row (tests/test_structure.py checks the keys match):
# each runs one engine verb to completion or raises StageFailed, and ends what it started when
# interrupted (Prefect's cancellation arrives as an exception in this process).
RUNNERS: dict[str, Callable[[str, Job, Path, LaunchConfig, str, Router, dict[str, str]], None]] = {
    "local": run_local,
    "slurm": run_slurm,
}


def _slurm_preflight(launch: LaunchConfig, where: str, tp_pp: int) -> list[tuple[str, str]]:
    from tasks.core.launch.slurm import preflight

    return preflight(launch, where, tp_pp=tp_pp)


# A backend's pre-flight that asks its cluster, where it has one: (launch, "cpt.launch", tp_pp) -> problems.
# Run by tasks.core.preflight.checks.check_launch_backend only when a stage uses the backend.
PREFLIGHTS: dict[str, Callable[[LaunchConfig, str, int], list[tuple[str, str]]]] = {"slurm": _slurm_preflight}
