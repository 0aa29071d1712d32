"""The checkout first on sys.path: every benchmark's first import, so that `python benchmarks/x.py`
and `torchrun benchmarks/x.py` (which start with only benchmarks/ on sys.path) find `support`, which
is not installed with the project, and the benchmarks' siblings as `benchmarks.x`.

    python benchmarks/skip.py --smoke
    python -c "import sys; sys.path.insert(0, 'benchmarks'); import _checkout; print(_checkout.REPO)"
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
