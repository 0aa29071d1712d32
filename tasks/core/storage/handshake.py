"""The publish handshake between the Prefect task and the engine: one marker file.

After the task has published a checkpoint and verified its remote manifest (tasks/core/storage/publisher.py)
it writes `<checkpoint>/.published` holding the sha256 of the manifest it committed. The engine
(tasks/engine/checkpoint.py) reads it: with a remote run root, local retention deletes only marked
checkpoints, and unmarked ones count towards backpressure. The marker names the manifest, so a
step re-saved with other content reads as unpublished.

    python -c "from tasks.core.storage.handshake import is_published; print(is_published(__import__('pathlib').Path('runs/demo/cpt/step-000004')))"
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tasks.core.run.manifest import MANIFEST as _MANIFEST
from tasks.core.run.manifest import write_atomic

PUBLISHED_MARKER = ".published"


def manifest_sha256(checkpoint_dir: Path) -> str:
    return hashlib.sha256((checkpoint_dir / _MANIFEST).read_bytes()).hexdigest()


def is_published(checkpoint_dir: Path) -> bool:
    """Marked as committed remotely, for the manifest it holds now."""
    try:
        return (checkpoint_dir / PUBLISHED_MARKER).read_text().strip() == manifest_sha256(checkpoint_dir)
    except OSError:
        return False


def mark_published(checkpoint_dir: Path, manifest_digest: str) -> None:
    """Atomic (tmp + rename): a half-written marker must never read as published."""
    write_atomic(checkpoint_dir / PUBLISHED_MARKER, manifest_digest + "\n")
