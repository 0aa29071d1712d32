"""What the tests and the benchmarks share, so that neither folder imports the other: the real-protocol
servers (`support.servers`), the engine-test helpers (`support.engine`), the tiny model and its
configs (`support.tiny`), and the measuring kit (`support.bench`: work directories, best-of timing).

    python benchmarks/skip.py --smoke      # a benchmark finds the checkout through benchmarks/_checkout.py
    python -c "import support; print(support.REPO)"

It is not installed with the project (pyproject's package list holds `tasks` and `flows` only): it is
read from the checkout. pytest puts the checkout on sys.path (pyproject's `pythonpath`, and
tests/conftest.py for the processes a test starts, through PYTHONPATH); a benchmark's first import,
benchmarks/_checkout.py, does it for `python benchmarks/x.py`; elsewhere set PYTHONPATH to the
checkout, as benchmarks/gpu_check.sh does.
"""

from __future__ import annotations

from pathlib import Path

import tasks  # noqa: F401 - first: the benchmarks' processes import transformers as the project's do (tasks/__init__.py)

REPO = Path(__file__).resolve().parents[1]
