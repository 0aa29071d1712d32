"""What every stage task shares: the run's store, the skip rule, stage results, artifacts in the UI.

The skip rule (README, "Re-runs and retries"): a stage is skipped when its artifact's manifest
verifies AND records the config digest the stage would produce now. A stage's digest covers its
own config section and its parent artifact's manifest digest, so changing a stage's config re-runs
that stage and, through the chain of parent digests, everything downstream.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from tasks.core.config import RunConfig, digest
from tasks.core.errors import ManifestError
from tasks.core.storage import RunStore

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class StageResult:
    stage: str
    status: str  # "completed" | "skipped" | "failed-gate" | "not-configured"
    rel: str | None = None
    uri: str | None = None
    digest: str | None = None
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def store_for(cfg: RunConfig) -> RunStore:
    return RunStore(cfg.run_uri, staging_dir=cfg.staging_dir)


def stage_digest(stage: str, section: Any, parent_digest: str | None) -> str:
    return digest({"stage": stage, "config": section.model_dump(mode="json") if hasattr(section, "model_dump") else section, "parent": parent_digest})


def completed(store: RunStore, rel: str, config_digest: str) -> dict[str, Any] | None:
    """The manifest if `rel` exists, verifies and was made from this exact config; else None."""
    logger = get_run_logger()
    if not store.exists(f"{rel}/manifest.json"):
        return None
    try:
        manifest = store.verify(rel)
    except ManifestError as exc:
        logger.warning("%s exists but does not verify, so it is rebuilt: %s", store.uri(rel), exc)
        return None
    if manifest.get("config_digest") != config_digest:
        logger.info("%s was made from another config or parent (digest %s, now %s): re-running", store.uri(rel), str(manifest.get("config_digest"))[:12], config_digest[:12])
        return None
    return manifest


def skipped(stage: str, store: RunStore, rel: str, started: float) -> StageResult:
    get_run_logger().info("%s: skipped, %s verifies and its config digest matches", stage, store.uri(rel))
    return StageResult(stage, "skipped", rel, store.uri(rel), store.manifest_digest(rel), time.monotonic() - started)


def done(stage: str, store: RunStore, rel: str, started: float, **detail: Any) -> StageResult:
    digest_ = store.publish(rel)
    get_run_logger().info("%s: completed, %s (manifest %s)", stage, store.uri(rel), digest_[:12])
    return StageResult(stage, "completed", rel, store.uri(rel), digest_, time.monotonic() - started, dict(detail))


@contextmanager
def fresh_dir(path: Path) -> Iterator[Path]:
    """Build an artifact in `path.tmp-build`, then swap it into place; a failure leaves the old one."""
    tmp = path.with_name(path.name + ".tmp-build")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


def resolve_local(path_or_uri: str) -> str:
    """Relative local paths in configs are relative to the project root, wherever we run from."""
    if "://" in path_or_uri or Path(path_or_uri).is_absolute():
        return path_or_uri
    return str(REPO_ROOT / path_or_uri)
