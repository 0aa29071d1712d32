"""Where relative paths in configs (run_root, data and model URIs) point: the project root.

    python -m tasks.core.config.paths        # prints the project root in effect

1. `$CPT_TO_SFT_HOME` when set (a deployment's worker sets it to its checkout);
2. the checkout the package is imported from, when it has a pyproject.toml (editable install or
   `python -m` from a clone): relative paths resolve the same wherever the flow runs from;
3. otherwise (a non-editable `pip install .`: the package lives in site-packages) the current
   working directory, so `cpt-to-sft run --config examples/x.yaml` inside a checkout
   resolves like `python -m flows.cpt_to_sft` there, never against site-packages.
"""

from __future__ import annotations

import os
from pathlib import Path

# The directory holding the `tasks` package: a checkout, or site-packages when installed.
REPO_ROOT = Path(__file__).resolve().parents[3]


def project_root() -> Path:
    home = os.environ.get("CPT_TO_SFT_HOME")
    if home:
        return Path(home).expanduser().resolve()
    if (REPO_ROOT / "pyproject.toml").is_file():
        return REPO_ROOT
    return Path.cwd()


def resolve_local(path_or_uri: str) -> str:
    """A relative local path is relative to the project root; URIs and absolute paths are kept."""
    if "://" in path_or_uri or Path(path_or_uri).is_absolute():
        return path_or_uri
    return str(project_root() / path_or_uri)


if __name__ == "__main__":
    print(project_root())
