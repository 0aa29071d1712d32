"""Pre-flight's tracking check: an MLflow server answers at tracking.mlflow.uri.

python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check
"""

from __future__ import annotations

from tasks.core.config.tracking import FIELD as TRACKING_FIELD
from tasks.core.config.tracking import check_uri, redact
from tasks.core.preflight.report import CheckContext


def check_tracking(ctx: CheckContext) -> None:
    """An MLflow server answers at tracking.mlflow.uri (when set): a run must not train for hours
    believing it is tracked."""
    uri = ctx.cfg.tracking.mlflow.uri
    if not uri:
        return
    problem = check_uri(uri)
    if problem:
        ctx.problem(TRACKING_FIELD, problem)
    else:
        ctx.ok(f"tracking: MLflow answers at {redact(uri)}")
