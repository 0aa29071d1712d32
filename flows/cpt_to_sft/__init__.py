"""The `cpt-to-sft` flow: continued pre-training then supervised fine-tuning on ColossalAI.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml [--run-root URI]
    python -m flows.cpt_to_sft --config FILE --check          # pre-flight only, launches nothing
    python -m flows.cpt_to_sft --config FILE --stop-after export   # the stages up to the export only

Without PREFECT_API_URL this starts an embedded Prefect server (nothing to run first). Each line
below is one Prefect task that leaves a verified artifact under the run root; re-running skips
every stage whose artifact verifies and whose config is unchanged. The gate before push_to_hub
compares the evaluations with `gate:`; a failed gate keeps every artifact, pushes nothing, ends
the flow run in a Completed state named "FailedGate", and the CLI exits with status 3.

Ctrl-C (SIGINT) stops a run as a cancellation's SIGTERM does: the stage's processes end, run.json
is written, the lease is released and the flow run ends Cancelled (exit status 130); a second
Ctrl-C exits at once, and the processes the run started go with it (tasks/core/launch/proctree.py).
This package is the runbook; `python -m flows.cpt_to_sft` runs its `__main__.py`, which hands its arguments to
flows/cli.py (`flow_main`), the command line it shares with `cpt-to-sft run`: the CLI imports the runbook, never
the other way round.
"""

# No `from __future__ import annotations` here: `cpt_to_sft.serve()` cloudpickles the flow's function
# by value, with only the globals its code names, so Prefect could not resolve a string annotation
# ("RunOverrides") when it validates a served run's parameters. Real annotations travel with it.
import dataclasses
import json
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Cancelled, Completed, Failed

from tasks.core.config.load import load_config
from tasks.core.config.overrides import RunOverrides, on_form, parse_overrides
from tasks.core.config.paths import resolve_local
from tasks.core.config.schema import RunConfig
from tasks.core.config.tracking import flatten
from tasks.core.errors import ConfigError, Preempted
from tasks.core.preflight.checks import load_for_check
from tasks.core.run.cputime import CpuClock
from tasks.core.run.preemptions import Policy
from tasks.core.run.preemptions import record as preemption_record
from tasks.core.run.stages import DONE, STAGE, STAGE_NAMES, TRAINING, Status
from tasks.core.run.trainlog import duration, summary_table
from tasks.core.storage.fs import fetch_to_local
from tasks.core.storage.lease import Lease, LeaseHeld
from tasks.flowkit import automation, tracking, ui
from tasks.flowkit.notices import await_capacity
from tasks.flowkit.preflight import REFUSED, preflight
from tasks.flowkit.stage import (
    PREEMPTED_STATE,
    StageResult,
    disk_cause,
    outcome,
    recorded_metrics,
    store_for,
    write_record,
)
from tasks.stages.benchmark import benchmark
from tasks.stages.evaluate import evaluate_cpt, evaluate_sft
from tasks.stages.export import export_hf, write_card
from tasks.stages.gate import gate, gate_message, held_back
from tasks.stages.load import load_from_hf
from tasks.stages.prepare_data import prepare_data
from tasks.stages.push import push_to_hub
from tasks.stages.train import boost_and_shard, reboost, train_cpt, train_sft
from tasks.stages.unshard import unshard


def resolve_config(config: str, overrides: RunOverrides | dict | None = None, *, rules: bool = True) -> RunConfig:
    """Read the YAML from a local path or fsspec URI and apply the run form's typed overrides,
    validated by RunConfig like the YAML: one ConfigError with every wrong value, a value the form
    set named as the form names it (`overrides.run_name (the config's name)`). `rules=False`: the
    fields only, the rules across fields left to pre-flight's one report (as `check` does)."""
    overrides = parse_overrides(overrides)
    return _load(config, overrides.dotted(), overrides.form_fields(), rules)


def _load(config: str, dotted: dict[str, Any], form: dict[str, str], rules: bool) -> RunConfig:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="cpt-to-sft-config-") as tmp:  # a remote config's copy, gone once parsed
        path = fetch_to_local(resolve_local(config), Path(tmp))
        try:
            return (load_config if rules else load_for_check)(path, dotted or None)
        except ConfigError as exc:
            raise ConfigError(on_form(exc.problems, form), header=exc.header) from None


def refusal(config: str, overrides: RunOverrides | dict | None, exc: ConfigError) -> ConfigError:
    """`exc` (the config did not load) with pre-flight's problems too, so the form gets every
    problem in one refusal: pre-flight checks the config without the form's refused values (a
    wrong run name and a missing data file are one answer, not two rounds)."""
    try:
        overrides = parse_overrides(overrides)
    except ConfigError as bad:
        return ConfigError(bad.problems + exc.problems, header=exc.header)
    form = overrides.form_fields()
    refused = {k for k, name in form.items() if any(f.split(" ")[0] == name for f, _ in exc.problems)}
    if not refused or any(not f.startswith("overrides.") for f, _ in exc.problems):
        return exc  # the YAML's own fields: nothing to check the rest against
    kept = {k: v for k, v in overrides.dotted().items() if k not in refused}
    try:
        cfg = _load(config, kept, {k: v for k, v in form.items() if k in kept}, rules=False)
    except ConfigError:
        return exc
    checked = preflight(cfg, form=form, return_state=True)
    more = checked.result(raise_on_failure=False) if checked.is_failed() else None
    extra = [
        (f, m)
        for f, m in getattr(more, "problems", [])
        if not any(f == k or f.startswith(k + ".") for k in refused)  # said of the config's value, not the form's
    ]
    return ConfigError(exc.problems + extra, header=exc.header)


def _name_run(cfg: RunConfig | None, logger) -> None:
    """Name this flow run `<model>-<run name>-<first 8 characters of its id>` (`cpt-to-sft-<id>`
    when the config did not load), from the config the run already read: a `flow_run_name`
    callable would read it a second time."""
    from prefect import get_client
    from prefect.context import FlowRunContext

    run = FlowRunContext.get().flow_run
    short = str(run.id).split("-")[0]
    name = f"{cfg.base_model.uri.rstrip('/').split('/')[-1]}-{cfg.name}-{short}" if cfg else f"cpt-to-sft-{short}"
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_name(run.id, name)
    except Exception as exc:  # naming the run must not fail it
        logger.warning("flow run not renamed to %s: %s", name, exc)
        return
    run.name = name  # what prefect.runtime's flow_run.name (the lease holder) and the run's logger read


@flow(name="cpt-to-sft", log_prints=True)
def cpt_to_sft(
    config: str = "examples/tiny-cpu.yaml",
    overrides: RunOverrides = RunOverrides(),  # noqa: B008 - frozen
    stop_after: str | None = None,
) -> dict[str, Any]:
    """Load → prepare data (CPT, SFT) → boost & shard (A) → train CPT (A) → unshard → evaluate CPT → reboost (B) → train SFT (B)
    → export → evaluate SFT → gate → push.

    config: path or fsspec URI of the run's YAML (see examples/).
    overrides: per-run changes to the config (run name and root, base model, data, steps, lr);
        empty fields keep the config's values.
    stop_after: run the stages up to and including this one (a stage name, e.g. "export"); the
        rest are recorded as not-run and the run ends Completed. Empty: every stage.
    """
    from flows.console import quiet_refusals, training_log_console

    training_log_console()  # the console reads like a training log; the UI keeps every line
    quiet_refusals()  # a refusal is the state's message, not a traceback in the worker's log
    refused: ConfigError | None = None
    try:
        check_stop_after(stop_after)
        # The fields only: the rules across them are pre-flight's, in its one report with the rest.
        cfg = resolve_config(config, overrides, rules=False)
    except ConfigError as exc:
        refused = exc
    if refused is not None:  # outside the except: pre-flight's task would log this as its traceback
        _name_run(None, get_run_logger())
        return Failed(name="Refused", message=f"{refusal(config, overrides, refused)}\n{REFUSED}")
    _name_run(cfg, get_run_logger())
    logger = get_run_logger()  # after the rename: its lines name the run
    store = store_for(cfg)
    # Every problem at once, before a model is loaded or a process launched. A refusal is a
    # Failed state carrying the report, not an exception: nothing crashed, so no traceback.
    checked = preflight(cfg, form=parse_overrides(overrides).form_fields(), return_state=True)
    if checked.is_failed():
        return Failed(name="Refused", message=f"{checked.message}\n{REFUSED}")
    logger.info("run %s: artifacts under %s", cfg.name, store.uri())
    started = time.monotonic()
    results: dict[str, StageResult] = {}
    carded = False
    try:
        lease = Lease(store, holder=_holder()).acquire(log=logger.warning)
    except LeaseHeld as exc:
        return Failed(name="Refused", message=str(exc))
    tracker = _start_tracking(cfg, logger)
    # The stages that report to MLflow get the run as a task parameter: plain data, so they reach
    # it from whatever process the task runner puts them in.
    handle = tracker.handle if tracker is not None else None

    def stage(name: str, task_fn, *args) -> StageResult:
        """`_stage`, with the CPU seconds it used on its row, whatever its end (tasks/core/run/cputime.py)."""
        used = CpuClock()
        try:
            return _stage(name, task_fn, *args)
        finally:
            if name in results:
                results[name] = dataclasses.replace(results[name], **used.read())

    def _stage(name: str, task_fn, *args) -> StageResult:
        before = (results.get(name) or StageResult(name, Status.NOT_RUN)).detail.get("preemptions") or []
        try:
            # A skipped stage ends in a state named "Skipped"; outcome() reads its StageResult.
            results[name] = outcome(task_fn(*args, return_state=True))
        except Preempted as exc:
            results[name] = _preempted(cfg, name, exc, before)  # not failed: the loop below retries it
            raise
        except BaseException as exc:
            results[name] = _failed(cfg, name, exc)  # its row in the stage table + a failed event
            raise
        if before and not results[name].detail.get("preemptions"):  # a stage without a log of its own keeps them
            results[name].detail["preemptions"] = before
        if name == stop_after:
            raise _StopAfter
        return results[name]

    def stages() -> bool:
        """Every stage in order (a finished one skips); whether the card was written."""
        base = stage("load_from_hf", load_from_hf, cfg)
        # Both corpora are read in full and tokenized before any training process starts.
        data_cpt = stage("prepare_cpt", prepare_data, cfg, "cpt", base)
        data_sft = stage("prepare_sft", prepare_data, cfg, "sft", base)
        a0 = stage("boost_and_shard", boost_and_shard, cfg, base, data_cpt)
        cpt = stage("train_cpt", train_cpt, cfg, a0, handle)
        bridge = stage("unshard", unshard, cfg, cpt)
        cpt_eval = stage("evaluate_cpt", evaluate_cpt, cfg, base, bridge, handle)  # base vs CPT, held-out perplexity
        b0 = stage("reboost", reboost, cfg, bridge, data_sft)
        sft = stage("train_sft", train_sft, cfg, b0, handle)
        export = stage("export", export_hf, cfg, sft)
        sft_eval = stage("evaluate_sft", evaluate_sft, cfg, bridge, export, handle)  # pre-SFT vs SFT, generation check
        scores = stage("benchmark", benchmark, cfg, base, export, handle)  # lm-eval on local tasks, base vs export
        verdict = stage("gate", gate, cfg, cpt_eval, sft_eval, scores)
        carded = _write_card(cfg, results, logger)  # export/README.md, with the evaluation: the file the push uploads
        if verdict.status == Status.FAILED_GATE:
            results["push_to_hub"] = held_back(cfg, verdict)
        else:
            stage("push_to_hub", push_to_hub, cfg, results)
        return carded

    try:
        # Preempted is not failed: the run retries itself here, by the preempted stage's own policy
        # (`<phase>.elastic.max_preemptions`, `retry_wait_s`), and none of the flow run's Prefect
        # retries is used. Each pass skips what is finished; training resumes from the checkpoint
        # committed on the notice.
        preempted = 0
        while True:
            try:
                carded = stages()
                break
            except Preempted as exc:
                preempted += 1
                policy = preemption_policy(cfg, exc)
                if not policy.retry(preempted):
                    raise
                write_summary(cfg, results, time.monotonic() - started, stop_after)  # run.json says preempted now
                said = (
                    f"preempted ({preempted} of at most {policy.max_preemptions} retries, no failure retry used): "
                    f"retrying the run in {policy.wait_s:g} s, from the checkpoint committed on the notice"
                )
                logger.warning(said)
                # the flow run shows the wait: AwaitingRetry at the retry's time, then Running again
                if not await_capacity(policy.wait_s, f"{said}; {failure_cause(exc)}"):
                    raise Interrupted("the flow run was cancelled while it waited for capacity")
                cfg = reread_config(config, overrides, cfg, logger)  # as many ranks as came back, if the config says so
    except Interrupted as exc:  # Ctrl-C: the stage has been torn down; run.json and the lease below
        return_state = Cancelled(message=str(exc))
    except _StopAfter:  # the stages after stop_after are not-run in run.json
        logger.info("stopped after %s, as asked (stop_after)", stop_after)
        return_state = None
    except Preempted as exc:  # more preemptions than the policy allows: not a crash, the checkpoint stands
        return_state = Failed(
            name=PREEMPTED_STATE,
            message=f"preempted {preempted} times, more than {preemption_policy(cfg, exc).max_preemptions} "
            f"(<phase>.elastic.max_preemptions); the next run resumes: {failure_cause(exc)}",
        )
    except Exception as exc:  # any stage failure ends the run Failed with its cause
        # The failed stage's row holds its cause (for a launch: the failing rank's first error
        # line); the run's state message says it, the task run keeps the traceback.
        failed = next((r for r in reversed(results.values()) if r.status == Status.FAILED), None)
        return_state = Failed(
            message=f"stage {failed.stage} failed: {failed.detail['error']}" if failed else failure_cause(exc)
        )
    else:
        return_state = None
    finally:
        try:
            if not carded:  # stopped or failed after the export: its card still says what the run made
                _write_card(cfg, results, logger)
            summary = write_summary(cfg, results, time.monotonic() - started, stop_after)
            logger.info(
                "run %s %s in %s (CPU %s):\n%s",
                cfg.name,
                "complete" if summary["complete"] else "incomplete",
                duration(summary["seconds"]),
                duration(summary["cpu_seconds"]),
                summary_table(summary["stages"], summary["run_root"]),
            )
            _finish_tracking(tracker, summary)
            # Staged copies of published artifacts are recoverable from the run root; unpublished
            # ones (what a resume needs) stay.
            store.prune_staging()
        finally:
            lease.release()
    if return_state is not None:
        return return_state
    if summary["gate"].get("passed") is False:
        # Not a crash: the artifacts are fine and kept, they just did not earn a push.
        return Completed(name="FailedGate", message=gate_message(summary["gate"]), data=summary)
    return summary


def _write_card(cfg: RunConfig, results: dict[str, StageResult], logger) -> bool:
    """The model card into the export, when the run has one; a failure to write it is a warning
    (the push then renders the card itself)."""
    export = results.get("export")
    if export is None or export.status not in DONE:
        return False
    try:
        uri, changed = write_card(cfg, results)
    except Exception as exc:
        logger.warning("model card not written into the export: %s: %s", type(exc).__name__, exc)
        return False
    if changed:  # the export's manifest lists the card: run.json records the manifest as it now is
        results["export"] = dataclasses.replace(export, digest=store_for(cfg).manifest_digest(STAGE["export"].artifact))
    logger.info("model card: %s%s", uri, "" if changed else " (unchanged)")
    return True


def _start_tracking(cfg: RunConfig, logger) -> tracking.RunTracker | None:
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


def _finish_tracking(tracker: tracking.RunTracker | None, summary: dict[str, Any]) -> None:
    if tracker is None:
        return
    tags = {f"manifest.{s['stage']}": s.get("digest") for s in summary["stages"]}
    hub = summary.get("hub") or {}
    tracker.tag(**tags, export_uri=summary.get("export"), hub_url=hub.get("commit_url") or hub.get("repo_url"))
    tracker.finish("FINISHED" if summary["complete"] else "FAILED")


def _holder() -> str:
    from prefect.runtime import flow_run

    return f"flow run {flow_run.name or '?'} ({flow_run.id})"


def _failed(cfg: RunConfig, stage: str, exc: BaseException) -> StageResult:
    # Where the stage writes (its artifact, or its checkpoints' directory): the URI the failure
    # event and the stage table point the operator at.
    rel = STAGE[stage].artifact
    uri = store_for(cfg).uri(rel) if rel else (f"hf://{cfg.hub.repo_id}" if cfg.hub else None)
    # The event carries the cause (one line) and the message from its start (for a launch: the
    # cause, then the failing process's last lines first) for automations.
    cause = disk_cause(cfg, rel, exc) or failure_cause(exc)
    automation.stage_event(
        stage, Status.FAILED, cfg.name, uri, cause=cause, error=f"{type(exc).__name__}: {exc}"[:4000]
    )
    return StageResult(stage, Status.FAILED, rel, uri, detail={"error": cause})


def _preempted(cfg: RunConfig, stage: str, exc: Preempted, before: list) -> StageResult:
    """The preempted stage's row: its preemption records (a training stage's log, tasks/core/run/preemptions.py;
    else those of its earlier attempts in this run and this one) and a preempted event."""
    rel = STAGE[stage].artifact
    uri = store_for(cfg).uri(rel) if rel else None
    records = exc.record.get("preemptions") or [*before, preemption_record(exc.record, stage, time.time())]
    automation.stage_event(stage, Status.PREEMPTED, cfg.name, uri, cause=failure_cause(exc), record=exc.record)
    return StageResult(stage, Status.PREEMPTED, rel, uri, detail={"error": exc.cause, "preemptions": records})


def preemption_policy(cfg: RunConfig, exc: Preempted) -> Policy:
    """The retry policy of the preempted stage's phase (the engine's record names it); for a stage that
    does not train, of the phases that listen for the notice's source (the tighter of their bounds)."""
    phase = exc.record.get("stage")
    if phase in TRAINING:
        el = cfg.phase(phase).elastic
        return Policy(el.max_preemptions, el.retry_wait_s)
    source = exc.record.get("source")
    els = [cfg.phase(p).elastic for p in TRAINING if any(n.source == source for n in cfg.phase(p).elastic.notices)]
    els = els or [cfg.phase(next(iter(TRAINING))).elastic]
    return Policy(min(e.max_preemptions for e in els), min(e.retry_wait_s for e in els))


def reread_config(config: str, overrides: RunOverrides | dict | None, cfg: RunConfig, logger) -> RunConfig:
    """The config as its file (with the overrides, `cpt-to-sft run`'s --set items among them) says it
    now, for the retry after a preemption: the capacity that came back is said there while the run
    waits (e.g. `cpt.launch.nproc_per_node: 1` and a plugin for one rank, with
    `elastic.keep_global_batch`), as a new run would read it. A changed config is checked
    by pre-flight again (ConfigError with every problem: the run ends, the checkpoint stands)."""
    new = resolve_config(config, overrides, rules=False)
    if new == cfg:
        return cfg
    if new.run_uri != cfg.run_uri:
        raise ConfigError(
            [("run_root", f"changed from {cfg.run_uri} to {new.run_uri} while the run waited: put it back")],
            header="the config changed during the run",
        )
    changed = config_changes(cfg, new)
    logger.warning("the config changed while the run waited (%s): pre-flight checks it again", "; ".join(changed))
    checked = preflight(new, form=parse_overrides(overrides).form_fields(), return_state=True)
    if checked.is_failed():
        raise checked.result(raise_on_failure=False)  # the report's one ConfigError
    return new


def config_changes(was: RunConfig, now: RunConfig) -> list[str]:
    """`key: old -> new` for each field that differs, by dotted path; tracking's flatten leaves
    secrets out and redacts URIs' credentials, as the log wants."""
    old, new = flatten(was.model_dump(mode="json")), flatten(now.model_dump(mode="json"))
    return [f"{k}: {old.get(k)} -> {new.get(k)}" for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]


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


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by the first SIGINT (flows/cli.py `_on_sigint`): it unwinds like a cancellation."""


class _StopAfter(Exception):
    """Raised by the flow's stage helper right after the stage named by stop_after."""


def check_stop_after(stop_after: str | None) -> None:
    if stop_after and stop_after not in STAGE_NAMES:
        raise ConfigError(
            [("stop_after", f"{stop_after!r} is no stage; use one of: {', '.join(STAGE_NAMES)}")],
            header="invalid flow parameter",
        )


def write_summary(
    cfg: RunConfig, results: dict[str, StageResult], seconds: float, stop_after: str | None = None
) -> dict[str, Any]:
    store = store_for(cfg)
    stages = []
    for name in STAGE_NAMES:
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
    export = results.get("export")
    push = results.get("push_to_hub")
    verdict = results.get("gate")
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
        get_run_logger().warning("stage table artifact unavailable: %s", exc)
    return summary


def recorded_config(cfg: RunConfig) -> dict[str, Any]:
    """The config the run ran with, as run.json keeps it (`cpt-to-sft card RUN_ROOT` renders the card
    from it): the tracking URI's credentials redacted, like everywhere else it is shown."""
    raw = cfg.model_dump(mode="json")
    mlflow = (raw.get("tracking") or {}).get("mlflow") or {}
    if mlflow.get("uri"):
        mlflow["uri"] = tracking.redact(mlflow["uri"])
    return raw
