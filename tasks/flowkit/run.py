"""One run of the pipeline, from the lease to run.json: the table's stages in order, retried on a preemption.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # the flow hands its checked config to PipelineRun

The flow (flows/cpt_to_sft/) resolves the config and runs pre-flight; `PipelineRun(cfg, ...).run()`
does the rest. It takes the run root's lease and starts tracking; runs each row of `STAGES`
(tasks/core/run/stages.py) through its task (tasks/flowkit/pipeline.py), a finished one skipping;
on a preemption records the stage, waits for capacity by the stage's policy and runs the table
again (finished stages skip, training resumes from the checkpoint committed on the notice); stops
after `stop_after`. Whatever the end, it writes the model card into the export, run.json and the
closing table, finishes tracking and releases the lease. It returns the summary, or a Prefect
state saying why not (Cancelled, Failed, Failed "Preempted", Failed "Refused" for a held lease,
Completed "FailedGate": the artifacts kept, the push held back).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from prefect import Task, get_run_logger
from prefect.states import Cancelled, Completed, Failed, State

from tasks.core.config.schema import RunConfig
from tasks.core.errors import ConfigError, Preempted
from tasks.core.launch import shared
from tasks.core.run import stages as table
from tasks.core.run.cputime import CpuClock
from tasks.core.run.preemptions import Policy
from tasks.core.run.preemptions import record as preemption_record
from tasks.core.run.stages import DONE, TRAINING, StageSpec, Status
from tasks.core.run.trainlog import duration, summary_table
from tasks.core.storage.lease import Lease, LeaseHeld
from tasks.flowkit import automation, notices, tracking, ui
from tasks.flowkit.notices import CancelRequested, await_capacity
from tasks.flowkit.pipeline import arguments, task_for
from tasks.flowkit.stage import (
    PREEMPTED_STATE,
    StageResult,
    disk_cause,
    outcome,
    recorded_metrics,
    store_for,
    write_record,
)

Card = Callable[[RunConfig, dict[str, StageResult]], tuple[str, bool]]  # (uri, changed): tasks/stages/export.py


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by the first SIGINT (flows/cli.py `_on_sigint`): it unwinds like a cancellation."""


class _StopAfter(Exception):
    """Raised right after the stage named by stop_after."""


class PipelineRun:
    """The run's lifecycle around the stage table; `run()` once.

    reread: the config as its file says it now, for the retry after a preemption (the flow's
    `reread_config`: a changed config is checked by pre-flight again). card: writes the model card
    into the export. tasks: the stage -> task map (default: every bound task, `pipeline.TASKS`).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        stop_after: str | None = None,
        reread: Callable[[RunConfig], RunConfig] | None = None,
        card: Card | None = None,
        tasks: Mapping[str, Any] | None = None,
        logger: Any = None,
    ) -> None:
        self.cfg, self.stop_after, self.card, self.tasks = cfg, stop_after, card, tasks
        self.reread = reread or (lambda cfg: cfg)
        self.logger = logger or get_run_logger()
        self.results: dict[str, StageResult] = {}
        self.carded = False
        self.preempted = 0
        self.tracker: tracking.RunTracker | None = None
        self.started = time.monotonic()

    def run(self) -> dict[str, Any] | State:
        try:  # a stage of a phase this config does not train
            check_stop_after(self.stop_after, self.cfg.phases)
        except ConfigError as exc:
            return Failed(name="Refused", message=str(exc))
        store = store_for(self.cfg)
        self.logger.info("run %s: artifacts under %s", self.cfg.name, store.uri())
        self.started = time.monotonic()
        try:
            lease = Lease(store, holder=_holder()).acquire(log=self.logger.warning)
        except LeaseHeld as exc:
            return Failed(name="Refused", message=str(exc))

        self.tracker = start_tracking(self.cfg, self.logger)
        try:
            with shared.session(
                self.logger
            ):  # a shard stage's launch may be adopted by its train stage; none outlives the run
                state = self._loop()
        finally:
            try:
                summary = self._close(store, time.monotonic() - self.started)
            finally:
                lease.release()
        if state is not None:
            return state
        if summary["gate"].get("passed") is False:
            # Not a crash: the artifacts are fine and kept, they just did not earn a push.
            return Completed(name="FailedGate", message=gate_message(summary["gate"]), data=summary)
        return summary

    def _loop(self) -> State | None:
        try:
            # Preempted is not failed: the run retries itself here, by the preempted stage's own policy
            # (`<phase>.elastic.max_preemptions`, `retry_wait_s`), and none of the flow run's Prefect
            # retries is used. Each pass skips what is finished.
            while True:
                try:
                    self.carded = self._pass()
                    return None
                except Preempted as exc:
                    self._await_retry(exc)
        except (Interrupted, CancelRequested) as exc:  # Ctrl-C or Prefect's cancel: the stage has been torn down
            return Cancelled(message=str(exc))
        except _StopAfter:  # the stages after stop_after are not-run in run.json
            self.logger.info("stopped after %s, as asked (stop_after)", self.stop_after)
            return None
        except Preempted as exc:  # more preemptions than the policy allows: not a crash, the checkpoint stands
            return Failed(
                name=PREEMPTED_STATE,
                message=f"preempted {self.preempted} times, more than "
                f"{preemption_policy(self.cfg, exc).max_preemptions} (<phase>.elastic.max_preemptions); the next "
                f"run resumes: {failure_cause(exc)}",
            )
        except Exception as exc:  # any stage failure ends the run Failed with its cause
            # The failed stage's row holds its cause (for a launch: the failing rank's first error
            # line); the run's state message says it, the task run keeps the traceback.
            failed = next((r for r in reversed(self.results.values()) if r.status == Status.FAILED), None)
            return Failed(
                message=f"stage {failed.stage} failed: {failed.detail['error']}" if failed else failure_cause(exc)
            )

    def _pass(self) -> bool:
        """Every row in order (a finished stage skips); whether the card was written."""
        carded = False
        for spec in table.run_stages(self.cfg.phases):  # an unconfigured optional phase's rows are not in the run
            if spec.publishes:  # export/README.md, with the evaluation: the file the push uploads
                carded = self._write_card()
            verdict = self.results.get(spec.held_by) if spec.held_by else None
            if verdict is not None and verdict.status == Status.FAILED_GATE:
                self.results[spec.name] = self._held_back(spec, verdict)
                continue
            self._stage(spec)
        return carded

    def _stage(self, spec: StageSpec) -> StageResult:
        """One stage's task, with the CPU seconds it used on its row, whatever its end (tasks/core/run/cputime.py)."""
        used = CpuClock()
        try:
            return self._call(spec)
        finally:
            if spec.name in self.results:
                self.results[spec.name] = dataclasses.replace(self.results[spec.name], **used.read())

    def _call(self, spec: StageSpec) -> StageResult:
        name = spec.name
        before = (self.results.get(name) or StageResult(name, Status.NOT_RUN)).detail.get("preemptions") or []
        try:
            task = task_for(name, self.tasks)
            # The stages that report to MLflow get the run as a task parameter: plain data, so they
            # reach it from whatever process the task runner puts them in.
            args = arguments(spec, task, self.cfg, self.results, self.tracker.handle if self.tracker else None)
            # A skipped stage ends in a state named "Skipped"; outcome() reads its StageResult.
            self.results[name] = outcome(task(*args, return_state=True) if isinstance(task, Task) else task(*args))
        except Preempted as exc:
            self.results[name] = _preempted(self.cfg, spec, exc, before)  # not failed: _loop retries it
            raise
        except BaseException as exc:
            self.results[name] = _failed(self.cfg, spec, exc)  # its row in the stage table + a failed event
            raise
        if before and not self.results[name].detail.get("preemptions"):  # a stage without a log of its own keeps them
            self.results[name].detail["preemptions"] = before
        if name == self.stop_after:
            raise _StopAfter
        return self.results[name]

    def _await_retry(self, exc: Preempted) -> None:
        """Wait for capacity by the preempted stage's policy and take the config as it is now; raise
        `exc` again past the policy's bound."""
        self.preempted += 1
        policy = preemption_policy(self.cfg, exc)
        if not policy.retry(self.preempted):
            raise exc
        write_summary(self.cfg, self.results, time.monotonic() - self.started, self.stop_after)  # run.json: preempted
        said = (
            f"preempted ({self.preempted} of at most {policy.max_preemptions} retries, no failure retry used): "
            f"retrying the run in {policy.wait_s:g} s, from the checkpoint committed on the notice"
        )
        self.logger.warning(said)
        # the flow run shows the wait: AwaitingRetry at the retry's time, then Running again
        if not await_capacity(policy.wait_s, f"{said}; {failure_cause(exc)}"):
            raise Interrupted("the flow run was cancelled while it waited for capacity")
        self.cfg = self.reread(self.cfg)  # as many ranks as came back, if the config says so
        notices.RERUN["at"] = time.time()  # the stage skip starts: the preemption record's `rerun` mark

    def _held_back(self, spec: StageSpec, verdict: StageResult) -> StageResult:
        """The row of a stage its `held_by` stage's failed verdict keeps from running: nothing is done, the reasons are kept."""
        reasons = verdict.detail.get("reasons", [])
        target = _where(self.cfg, spec)
        self.logger.warning("%s: not run, the %s failed (%s)", spec.name, spec.held_by, "; ".join(reasons))
        automation.stage_event(spec.name, Status.FAILED_GATE, self.cfg.name, target, reasons=reasons)
        return StageResult(
            spec.name,
            Status.FAILED_GATE,
            uri=target,
            detail={"reason": f"the {spec.held_by} failed", "reasons": reasons},
        )

    def _write_card(self) -> bool:
        """The model card into the export, when the run has one; a failure to write it is a warning
        (the push then renders the card itself)."""
        export = self.results.get(table.ROWS.export.name)
        if self.card is None or export is None or export.status not in DONE:
            return False
        try:
            uri, changed = self.card(self.cfg, self.results)
        except Exception as exc:
            self.logger.warning("model card not written into the export: %s: %s", type(exc).__name__, exc)
            return False
        if changed:  # the export's manifest lists the card: run.json records the manifest as it now is
            digest = store_for(self.cfg).manifest_digest(table.ROWS.export.artifact)
            self.results[table.ROWS.export.name] = dataclasses.replace(export, digest=digest)
        self.logger.info("model card: %s%s", uri, "" if changed else " (unchanged)")
        return True

    def _close(self, store: Any, seconds: float) -> dict[str, Any]:
        if not self.carded:  # stopped or failed after the export: its card still says what the run made
            self._write_card()
        summary = write_summary(self.cfg, self.results, seconds, self.stop_after)
        self.logger.info(
            "run %s %s in %s (CPU %s):\n%s",
            self.cfg.name,
            "complete" if summary["complete"] else "incomplete",
            duration(summary["seconds"]),
            duration(summary["cpu_seconds"]),
            summary_table(summary["stages"], summary["run_root"]),
        )
        finish_tracking(self.tracker, summary)
        # Staged copies of published artifacts are recoverable from the run root; unpublished ones
        # (what a resume needs) stay.
        store.prune_staging()
        return summary


def check_stop_after(stop_after: str | None, phases: Any = None) -> None:
    """`stop_after` names a row of the table (and, given the run's phases, a row of this run)."""
    names = table.STAGE_NAMES if phases is None else tuple(s.name for s in table.run_stages(phases))
    if stop_after and stop_after not in names:
        said = (
            "is no stage"
            if stop_after not in table.STAGE_NAMES
            else "is no stage of this run (its phase is not configured)"
        )
        raise ConfigError(
            [("stop_after", f"{stop_after!r} {said}; use one of: {', '.join(names)}")],
            header="invalid flow parameter",
        )


def gate_message(verdict: dict[str, Any]) -> str:
    return "gate failed, nothing pushed, every artifact kept: " + "; ".join(verdict.get("reasons") or [])


def start_tracking(cfg: RunConfig, logger: Any) -> tracking.RunTracker | None:
    if not cfg.tracking.mlflow.uri:
        return None
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_UI_URL

    ui_url = PREFECT_UI_URL.value()
    url = f"{ui_url.rstrip('/')}/runs/flow-run/{flow_run.id}" if ui_url else None
    try:
        tracker = tracking.RunTracker.start(cfg, flow_run_id=flow_run.id, flow_run_url=url, warn=logger.warning)
    except Exception as exc:  # it passed pre-flight moments ago: a view, never a failed run
        logger.warning(
            "MLflow run not created at %s: %s; training continues without it",
            tracking.redact(cfg.tracking.mlflow.uri),
            exc,
        )
        return None
    ui.link("mlflow-run", tracker.url, f"MLflow run of {cfg.name}")
    return tracker


def finish_tracking(tracker: tracking.RunTracker | None, summary: dict[str, Any]) -> None:
    if tracker is None:
        return
    tags = {f"manifest.{s['stage']}": s.get("digest") for s in summary["stages"]}
    hub = summary.get("hub") or {}
    tracker.tag(**tags, export_uri=summary.get("export"), hub_url=hub.get("commit_url") or hub.get("repo_url"))
    tracker.finish("FINISHED" if summary["complete"] else "FAILED")


def _holder() -> str:
    from prefect.runtime import flow_run

    return f"flow run {flow_run.name or '?'} ({flow_run.id})"


def _where(cfg: RunConfig, spec: StageSpec) -> str | None:
    """Where the stage writes (its artifact, or its checkpoints' directory; the push: the Hub repo):
    the URI its failure event and the stage table point the operator at."""
    if spec.artifact:
        return store_for(cfg).uri(spec.artifact)
    return f"hf://{cfg.hub.repo_id}" if cfg.hub else None


def _failed(cfg: RunConfig, spec: StageSpec, exc: BaseException) -> StageResult:
    rel, uri = spec.artifact, _where(cfg, spec)
    # The event carries the cause (one line) and the message from its start (for a launch: the
    # cause, then the failing process's last lines first) for automations.
    cause = disk_cause(cfg, rel, exc) or failure_cause(exc)
    automation.stage_event(
        spec.name, Status.FAILED, cfg.name, uri, cause=cause, error=f"{type(exc).__name__}: {exc}"[:4000]
    )
    return StageResult(spec.name, Status.FAILED, rel, uri, detail={"error": cause})


def _preempted(cfg: RunConfig, spec: StageSpec, exc: Preempted, before: list) -> StageResult:
    """The preempted stage's row: its preemption records (a training stage's log, tasks/core/run/preemptions.py;
    else those of its earlier attempts in this run and this one) and a preempted event."""
    rel = spec.artifact
    uri = store_for(cfg).uri(rel) if rel else None
    records = exc.record.get("preemptions") or [*before, preemption_record(exc.record, spec.name, time.time())]
    automation.stage_event(spec.name, Status.PREEMPTED, cfg.name, uri, cause=failure_cause(exc), record=exc.record)
    return StageResult(spec.name, Status.PREEMPTED, rel, uri, detail={"error": exc.cause, "preemptions": records})


def preemption_policy(cfg: RunConfig, exc: Preempted) -> Policy:
    """The retry policy of the preempted stage's phase (the engine's record names it); for a stage that
    does not train, of the phases that listen for the notice's source (the tighter of their bounds)."""
    phase = exc.record.get("phase")
    if phase in TRAINING:
        el = cfg.phase(phase).elastic
        return Policy(el.max_preemptions, el.retry_wait_s)
    source = exc.record.get("source")
    els = [cfg.phase(p).elastic for p in cfg.phases if any(n.source == source for n in cfg.phase(p).elastic.notices)]
    els = els or [cfg.phase(next(iter(TRAINING))).elastic]
    return Policy(min(e.max_preemptions for e in els), min(e.retry_wait_s for e in els))


def failure_cause(exc: BaseException) -> str:
    """One line: a launch's cause ("rank N: <its first error line>"), else the exception's first line."""
    if isinstance(exc, SystemExit):  # str() is the bare status ("1"): say what it was
        return (
            f"SystemExit: something in the stage's process called sys.exit({exc.code!r}); its task run in the "
            "Prefect UI has the traceback"
        )
    problems = getattr(exc, "problems", None)  # a ConfigError: every field and its fix
    cause = (
        getattr(exc, "cause", None)
        or ("; ".join(f"{f}: {m}" for f, m in problems) if problems else "")
        or (str(exc).splitlines()[0] if str(exc).strip() else "")
    )
    return f"{type(exc).__name__}: {cause}"[:500] if cause else type(exc).__name__


def write_summary(
    cfg: RunConfig, results: dict[str, StageResult], seconds: float, stop_after: str | None = None
) -> dict[str, Any]:
    """run.json: every row of the table in order (a stage not reached: not-run), and the stage table artifact."""
    store = store_for(cfg)
    stages = []
    for name in (s.name for s in table.run_stages(cfg.phases)):
        r = results.get(name)
        stages.append(
            r.as_dict()
            if r
            else {
                "stage": name,
                "status": str(Status.NOT_RUN),
                "uri": None,
                "digest": None,
                "seconds": 0.0,
                "detail": {},
            }
        )
    export = results.get(table.ROWS.export.name)
    push = results.get(table.ROWS.push_to_hub.name)
    verdict = results.get(table.ROWS.gate.name)
    summary = {
        "run": cfg.name,
        "run_root": store.uri(),
        "complete": all(s["status"] in DONE for s in stages),
        # each preemption: when, the step checkpointed, steps lost, notice to commit, restart to first step
        "preemptions": [p for s in stages for p in (s.get("detail") or {}).get("preemptions") or []],
        "seconds": round(seconds, 2),
        # the stages' CPU seconds together (each row's cpu_seconds: tasks/core/run/cputime.py says what they cover)
        "cpu_seconds": round(sum(s.get("cpu_seconds") or 0.0 for s in stages), 2),
        "stages": stages,
        "export": export.uri if export else None,
        "evaluation": recorded_metrics(results),
        "gate": (
            {"status": str(verdict.status), **verdict.detail}
            if verdict and verdict.status != Status.FAILED
            else {"status": str(verdict.status if verdict else Status.NOT_RUN)}
        ),
        "hub": (
            push.detail
            if push and push.status == Status.COMPLETED
            else {"status": str(push.status if push else Status.NOT_RUN), **(push.detail if push else {})}
        ),
    }
    if stop_after:
        summary["stopped_after"] = stop_after  # the not-run stages were not asked for
    summary["config"] = recorded_config(cfg)
    write_record(cfg, store, json.dumps(summary, indent=2, sort_keys=True) + "\n")
    try:
        ui.stage_table(stages)
    except Exception as exc:  # a view only: run.json above is the record
        ui.warn_view_failure("stage table artifact", exc)
    return summary


def recorded_config(cfg: RunConfig) -> dict[str, Any]:
    """The config the run ran with, as run.json keeps it (`cpt-to-sft card RUN_ROOT` renders the card
    from it): the tracking URI's credentials redacted, like everywhere else it is shown."""
    raw = cfg.model_dump(mode="json")
    mlflow = (raw.get("tracking") or {}).get("mlflow") or {}
    if mlflow.get("uri"):
        mlflow["uri"] = tracking.redact(mlflow["uri"])
    return raw
