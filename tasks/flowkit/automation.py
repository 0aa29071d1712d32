"""The Prefect event each stage emits when it completes or fails, for automations to match on.

    prefect automation ls        # automations matching `cpt-to-sft.stage.*` react to these

A failure to emit is a warning in the log, never a failed stage.
"""

from __future__ import annotations

from typing import Any

from prefect.events import emit_event

from tasks.flowkit.ui import warn_view_failure


def stage_event(stage: str, status: str, run_name: str, uri: str | None, **payload: Any) -> None:
    """`cpt-to-sft.stage.<status>` (completed | failed) with the artifact URI in the payload; a
    failed stage's payload has `cause` (one line) and `error` (the whole message).

    The resource is the run's stage; Prefect adds the flow run (and task run) as related resources,
    so the event shows in the run's event feed and automations can match on either.
    """
    try:
        emit_event(
            event=f"cpt-to-sft.stage.{status}",
            resource={
                "prefect.resource.id": f"cpt-to-sft.run.{run_name}.{stage}",
                "prefect.resource.name": stage,
                "cpt-to-sft.run": run_name,
            },
            payload={"stage": stage, "status": status, "artifact_uri": uri, "run": run_name, **payload},
        )
    except Exception as exc:
        warn_view_failure(f"{status} event for {stage}", exc)
