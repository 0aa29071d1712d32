"""transformers without scikit-learn or scipy: installed by `tasks/__init__.py` in every process of the project.

    python -m tasks.engine.lazy_compile    # a rank's imports, plain and as the engine makes them: CPU s, sklearn or not

transformers 4.51 imports `sklearn.metrics` (and with it scipy and pandas) as soon as its generation
package is imported, which loading a tokenizer or any model does, whenever scikit-learn is installed;
it is, for the benchmark stage's lm-eval. transformers uses it only for assisted decoding's confidence
threshold, which nothing here runs, while every rank, preparation worker and flow process paid for it:
loading a tokenizer in a fresh process took 3.1 CPU-s and a 413 MB peak with it, 1.8 s and 270 MB
without. `install()` sets transformers' own flag (`transformers.utils.import_utils._sklearn_available`)
to False right after that module first runs, and imports nothing itself: a process that never touches
transformers pays nothing. lm-eval imports scikit-learn itself and keeps it.

scipy likewise: `transformers.modeling_utils` imports its losses, and the object-detection ones import
`scipy.optimize` (for a Hungarian matching) whenever scipy is installed, so every rank, every model load
paid ~0.5 CPU-s for it (a training rank's imports, `benchmarks/rank_start.py`'s STEPS in a fresh process, three
alternating pairs: 8.1 -> 7.4 CPU-s, the booster step 4.1 -> 3.7).
Only vision, audio and FNet models use scipy in transformers, no family of the registry; the same flag
(`_scipy_available`) is set to False beside scikit-learn's. lm-eval and everything else import scipy as
they please.

`install()` also keeps bitsandbytes' harmless "Failed to load CPU gemm_4bit_forward" warning off every
console (`harmless_bnb_kernels`): peft imports bitsandbytes in the flow's own process (a LoRA run's
merge, evaluation and card) as ColossalAI does in every rank.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from typing import Any

_FLAGS = "transformers.utils.import_utils"


class _WithoutSklearn(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first import of transformers' availability flags, lets the
    other finders find the module and sets its scikit-learn flag once the module has run."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _FLAGS:
            return None
        sys.meta_path.remove(self)  # once; and not asked again by the find below
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            module._sklearn_available = False
            module._scipy_available = False

        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec


BNB_CPU_OPS = "bitsandbytes.backends.cpu.ops"


def harmless_bnb_kernels(record: logging.LogRecord) -> bool:
    """bitsandbytes (imported by ColossalAI and peft) tries the optional `kernels` package for its
    4-bit CPU matmul at import and warns, in every process that imports it, when it is not installed;
    it falls back to its own kernel, and nothing here runs 4-bit layers on a CPU. Any other failure of
    that load (the package present but broken) still gets through."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (
        str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")
        and args
        and isinstance(args[0], ModuleNotFoundError)
        and args[0].name == "kernels"
    )


def install() -> None:
    """Idempotent; too late (and a no-op) once transformers is imported. The bitsandbytes filter sits on
    its logger before bitsandbytes exists (a logger is only a name until then)."""
    bnb = logging.getLogger(BNB_CPU_OPS)
    if harmless_bnb_kernels not in bnb.filters:
        bnb.addFilter(harmless_bnb_kernels)
    if _FLAGS not in sys.modules and not any(isinstance(f, _WithoutSklearn) for f in sys.meta_path):
        sys.meta_path.insert(0, _WithoutSklearn())
