"""Where relative paths in configs point: the project root, wherever the flow runs from.

    python -c "from tasks.core.paths import resolve_local; print(resolve_local('deployments/configs/tiny-cpu.yaml'))"
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_local(path_or_uri: str) -> str:
    """A relative local path is relative to the project root; URIs and absolute paths are kept."""
    if "://" in path_or_uri or Path(path_or_uri).is_absolute():
        return path_or_uri
    return str(REPO_ROOT / path_or_uri)
