"""The `tracking:` section of the run config: where the Prefect task mirrors per-step metrics.

    tracking:
      mlflow:
        uri: http://mlflow.internal:5000     # unset: no MLflow; TensorBoard files are always written
        experiment: cpt-to-sft

TensorBoard needs no setting: the training ranks always write `<run_root>/<phase>/tensorboard/`.
Also the pure helpers of the MLflow writer (tasks/flowkit/tracking.py): the secret filter of params, URI
redaction, and the reachability probe pre-flight runs (`check_tracking` in tasks/core/preflight/checks.py):

    python -m tasks.core.config.tracking http://127.0.0.1:5000   # exit 1 and the problem, or 0
"""

from __future__ import annotations

import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from pydantic import Field

from tasks.core.config.base import Frozen

FIELD = "tracking.mlflow.uri"


class MlflowConfig(Frozen):
    uri: str | None = Field(
        default=None,
        description=(
            "MLflow tracking server URI (http://host:port). Set: one MLflow run per flow run, a nested run per "
            "training stage; "
            "an unreachable server is a pre-flight error. Needs the [mlflow] extra (pip install 'cpt-to-sft[mlflow]')."
        ),
    )
    experiment: str = Field(
        default="cpt-to-sft",
        min_length=1,
        description="MLflow experiment the runs are created in (created when missing).",
    )


class TrackingConfig(Frozen):
    mlflow: MlflowConfig = Field(
        default_factory=MlflowConfig,
        description="Mirror params, per-step metrics and tags to an MLflow tracking server.",
    )


# Config keys whose values are never sent (none of RunConfig's fields is a secret today; a
# future `*_token` or a credentialed URI must not leak either).
_SECRET = re.compile(
    r"(^|[._])(token|secret|password|passwd|api_key|access_key|secret_key|credentials?|auth)($|[._])", re.IGNORECASE
)
_USERINFO = re.compile(r"^([a-z][a-z0-9+.-]*://)[^/@]+@", re.IGNORECASE)


def secret_named(name: str) -> bool:
    """Whether a key or variable name says it holds a secret (`HF_TOKEN`, `aws_secret_access_key`)."""
    return bool(_SECRET.search(name))


def redact(value: str) -> str:
    """`scheme://user:pass@host/...` -> `scheme://***@host/...`."""
    return _USERINFO.sub(r"\1***@", value)


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """Dotted keys -> string values of a nested config mapping, secrets left out (MLflow params
    are strings of at most 6000 characters)."""
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if _SECRET.search(str(k)):
                continue
            out.update(flatten(v, key))
        return out
    text = redact(obj) if isinstance(obj, str) else ("null" if obj is None else str(obj))
    return {prefix: text[:6000]}


def check_uri(uri: str, timeout: float = 5.0) -> str | None:
    """None when an MLflow server answers at `uri`, else the problem (for the pre-flight report)."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        return (
            f"{FIELD} is set to {redact(uri)} but the MLflow client is not installed: pip install "
            f"'cpt-to-sft[mlflow]' (or unset {FIELD})"
        )
    parts = urllib.parse.urlparse(uri)
    if parts.scheme not in ("http", "https"):
        return f"{redact(uri)}: expected an http(s):// MLflow tracking server URI"
    probe = uri.rstrip("/") + "/api/2.0/mlflow/experiments/get-by-name?experiment_name=cpt-to-sft-preflight"
    try:
        urllib.request.urlopen(probe, timeout=timeout).close()
    except urllib.error.HTTPError as exc:
        if exc.code >= 500:
            return f"MLflow server at {redact(uri)} answered HTTP {exc.code}; check its log and backend store"
        # 404 (no such experiment), 401/403 (auth handled by the client's env): it is there.
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return (
            f"MLflow server at {redact(uri)} is unreachable ({reason}); start it, fix {FIELD}, or unset it to "
            "train without MLflow"
        )
    return None


if __name__ == "__main__":
    problem = check_uri(sys.argv[1])
    print(problem or f"MLflow answers at {redact(sys.argv[1])}")
    sys.exit(1 if problem else 0)
