"""Stage 0, preflight: every check a run can fail in seconds, before anything is loaded or launched.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check

The checks are pure and live in `tasks.core.preflight.checks`; this module adds what needs Prefect (the
Hub token, looked up as push and load do: HF_TOKEN, the Secret block `hf-token`, the saved
login) and the two ways in: the `preflight` task, first in the flow, which on any problem ends
Failed with the report as its message (the flow then ends Failed the same way, without a
traceback); and `run_check_cli`, a plain
function for `--check` that starts no flow and no Prefect server, prints the report and returns
the exit code. The token itself is never logged or returned: pre-flight asks the Hub `whoami` with
it and names only its source.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.states import Failed, State

from tasks.core.config.overrides import on_form
from tasks.core.config.schema import RunConfig
from tasks.core.errors import ConfigError
from tasks.core.hub.repo import SECRET_BLOCK, HubToken, find_hub_token
from tasks.core.preflight.checks import PreflightReport, load_for_check, preflight_report
from tasks.core.run.events import CONSOLE_OFF, UI_OFF
from tasks.flowkit.console_log import NOT_ON_CONSOLE

SECRET_TIMEOUT_S = 5.0


def _secret_value(timeout: float = SECRET_TIMEOUT_S) -> str | None:
    """The Secret block's value if it loads within `timeout` (a dead API must not stall pre-flight)."""
    found: list[str | None] = []

    def probe() -> None:
        try:
            from prefect.blocks.system import Secret

            found.append(Secret.load(SECRET_BLOCK).get() or None)
        except Exception:  # a missing block or an unreachable API both mean: no token from the block
            found.append(None)

    t = threading.Thread(target=probe, daemon=True, name="preflight-secret")
    t.start()
    t.join(timeout)
    return found[0] if found else None


def hub_token_found(consult_secret: bool = True) -> HubToken | None:
    """The token push/load would use, with its source, in their order (tasks.core.hub.repo.find_hub_token)."""
    return find_hub_token(_secret_value if consult_secret else None)


REFUSED = "pre-flight stopped: fix the configuration above first, nothing was launched"


@task(name="preflight", task_run_name="preflight")  # no retries: the same inputs give the same answer
def preflight(cfg: RunConfig, form: dict[str, str] | None = None) -> dict[str, Any] | State:
    """Run every pre-flight check. On any problem: a Failed state whose message is the report
    (no traceback: nothing crashed) and whose result raises one ConfigError listing every problem;
    else the checked list. `form`: the config keys a deployment run's form set -> its field names
    (`RunOverrides.form_fields`), so a refusal of one names the form's field."""
    logger = get_run_logger()
    found = hub_token_found() if cfg.hub else None
    report = preflight_report(cfg, token_present=(found is not None) if cfg.hub else None, hub_token=found)
    report.problems = on_form(report.problems, form or {})
    for w in report.warnings:
        logger.warning("pre-flight: %s", w)
    if not report.ok:
        # The run's log keeps the report; the console shows it once, as the CLI's last lines.
        logger.error("%s", report.text(), extra=NOT_ON_CONSOLE)
        return Failed(name="Refused", message=report.text(), data=report.error())
    # The checklist goes to the run's log in the UI; the console gets its first line.
    logger.info("%s", report.text(), extra=CONSOLE_OFF)
    logger.info(
        "%s; each check is listed in the run's log (Prefect UI) and by `cpt-to-sft check`",
        report.text().splitlines()[0],
        extra=UI_OFF,
    )
    return {"checked": report.checked, "warnings": report.warnings, "seconds": round(report.seconds, 3)}


def check(cfg: RunConfig | str | Path, run_root: str | None = None, run_name: str | None = None) -> PreflightReport:
    """The `--check` report for a RunConfig or a config path/URI (with the CLI's overrides).

    From a path, the config's static rules run with the other checks, so every problem is in one
    report. The Secret block is consulted only when PREFECT_API_URL names a server: without one,
    Prefect would start a temporary server just to answer, which --check must not do.
    """
    if not isinstance(cfg, RunConfig):
        import tempfile

        from tasks.core.config.paths import resolve_local
        from tasks.core.storage.fs import fetch_to_local

        overrides = {k: v for k, v in (("run_root", run_root), ("name", run_name)) if v}
        with tempfile.TemporaryDirectory(prefix="cpt-to-sft-check-") as tmp:  # a remote config's copy, gone once parsed
            cfg = load_for_check(fetch_to_local(resolve_local(str(cfg)), Path(tmp)), overrides)
    server = bool(os.environ.get("PREFECT_API_URL"))
    found = hub_token_found(consult_secret=server) if cfg.hub else None
    token = (found is not None) if cfg.hub else None
    report = preflight_report(cfg, token_present=token, hub_token=found)
    if cfg.hub and not token and not server:
        report.warnings.append(
            f"the Prefect Secret '{SECRET_BLOCK}' was not consulted (no PREFECT_API_URL); export HF_TOKEN, run `hf "
            "auth login`, "
            "or set PREFECT_API_URL to the server holding the Secret"
        )
    return report


def run_check_cli(cfg: RunConfig | str | Path, run_root: str | None = None, run_name: str | None = None) -> int:
    """Print the pre-flight report; 0 when every check passes, 1 otherwise. Starts nothing."""
    try:
        report = check(cfg, run_root, run_name)
    except ConfigError as exc:
        print(f"{exc}\n{REFUSED}")
        return 1
    print(report.text())
    return 0 if report.ok else 1
