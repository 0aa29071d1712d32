"""What the tests and the benchmarks share, so that neither folder imports the other: the real-protocol
servers (`support.servers`), the engine-test helpers (`support.engine`), the tiny model and its
configs (`support.tiny`), and the measuring kit (`support.bench`: work directories, best-of timing).

    python benchmarks/skip.py --smoke      # a benchmark finds the checkout through this package
    python -c "import support; print(support.REPO)"

Importing it puts the checkout's root first on sys.path: `python benchmarks/x.py` starts with only
benchmarks/ there, and a benchmark imports its siblings as `benchmarks.x`. The package is installed
with the project (`pip install -e .`, pyproject's package list); without an install, set
PYTHONPATH to the checkout, as benchmarks/gpu_check.sh does.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

if (REPO / "pyproject.toml").is_file() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import tasks  # noqa: F401 - first: the benchmarks' processes import transformers as the project's do (tasks/__init__.py)
