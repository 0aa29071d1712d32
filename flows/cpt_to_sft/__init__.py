"""The `cpt-to-sft` flow: continued pre-training then supervised fine-tuning on ColossalAI.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml [--run-root URI]
    python -m flows.cpt_to_sft --config FILE --check          # pre-flight only, launches nothing
    python -m flows.cpt_to_sft --config FILE --stop-after export   # the stages up to the export only

Without PREFECT_API_URL this starts an embedded Prefect server (nothing to run first). Each row
of the stage table (tasks/core/run/stages.py) is one Prefect task that leaves a verified artifact
under the run root; tasks/flowkit/run.py runs them in order around the lease, and re-running skips
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
from functools import partial
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Failed

from tasks.core.config.load import load_config
from tasks.core.config.overrides import RunOverrides, on_form, parse_overrides
from tasks.core.config.paths import resolve_local
from tasks.core.config.schema import RunConfig
from tasks.core.config.tracking import flatten
from tasks.core.errors import ConfigError
from tasks.core.preflight.checks import load_for_check
from tasks.core.storage.fs import fetch_to_local
from tasks.flowkit.preflight import REFUSED, preflight
from tasks.flowkit.run import Interrupted, PipelineRun, check_stop_after, failure_cause

# Each stage module binds its task to its row of the table when imported (tasks/flowkit/pipeline.py).
from tasks.stages import benchmark, evaluate, gate, load, prepare_data, push, reference, train, unshard  # noqa: F401
from tasks.stages.export import write_card

__all__ = [
    "Interrupted",
    "check_stop_after",
    "config_changes",
    "cpt_to_sft",
    "failure_cause",
    "refusal",
    "reread_config",
    "resolve_config",
]


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
    # Every problem at once, before a model is loaded or a process launched. A refusal is a
    # Failed state carrying the report, not an exception: nothing crashed, so no traceback.
    checked = preflight(cfg, form=parse_overrides(overrides).form_fields(), return_state=True)
    if checked.is_failed():
        return Failed(name="Refused", message=f"{checked.message}\n{REFUSED}")
    # The stages of tasks/core/run/stages.py in order, retried on a preemption; the lease, tracking,
    # run.json and the card around them (tasks/flowkit/run.py).
    logger = get_run_logger()  # after the rename: its lines name the run
    reread = partial(reread_config, config, overrides, logger=logger)
    return PipelineRun(cfg, stop_after=stop_after, reread=reread, card=write_card, logger=logger).run()


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
