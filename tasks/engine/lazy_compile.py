"""Import ColossalAI without paying for torch's compiler at import time.

    python -m tasks.engine.lazy_compile    # prints the CPU seconds of `import colossalai.booster` each way

ColossalAI 0.5.0 decorates functions with `torch.compile(...)` at import time
(`colossalai.quantization.fp8`), and so does bitsandbytes >= 0.47, which ColossalAI imports through
GaLore. `torch.compile` compiles nothing until the first call, but it imports TorchDynamo's backend
registry and Inductor (compile_fx, autotune caches and their optional redis/OpenTelemetry clients)
to build the wrapper. That import was half of every rank's start-up CPU on the 2-core machine, paid
on every launch and every resume, for functions the engine never calls (fp8 communication, 8-bit
optimizers).

`deferred_compile()` swaps `torch.compile` for a wrapper that calls the real `torch.compile` with
the same arguments on the first call of the decorated function, while the block runs. Behaviour is
unchanged: torch.compile is lazy by design, and only the moment its machinery is imported moves.
The real `torch.compile` is back in place after the block, so nothing compiled later (our own code,
a kernel choice) goes through the wrapper.

The project's processes also import transformers without scikit-learn (tasks/core/models/hf_imports.py,
installed by `tasks/__init__.py`), which a rank would otherwise import through ColossalAI -> peft ->
transformers' generation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any


def _deferred(real: Callable[..., Any]) -> Callable[..., Any]:
    def compile_later(model: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        if model is None:  # used as @torch.compile(mode=...): return the decorator
            return lambda fn: compile_later(fn, **kwargs)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def call(*args: Any, **kw: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kwargs)
            return compiled(*args, **kw)

        return call

    return compile_later


@contextlib.contextmanager
def deferred_compile() -> Iterator[None]:
    """Within the block, `torch.compile(fn, **kw)` returns a function that compiles on its first call."""
    import torch

    real = torch.compile
    torch.compile = _deferred(real)
    try:
        yield
    finally:
        torch.compile = real


def import_colossalai() -> None:
    """Import ColossalAI's booster and plugins (what every engine verb uses) under deferred_compile."""
    with deferred_compile():
        import colossalai.booster
        import colossalai.booster.plugin  # noqa: F401


if __name__ == "__main__":
    import subprocess
    import sys

    probe = (
        "import time; t = time.process_time(); {imp}; "
        "import sys; print(f'{{time.process_time() - t:.2f}} s CPU, inductor imported: "
        '{{"torch._inductor.compile_fx" in sys.modules}}, sklearn imported: {{"sklearn" in sys.modules}}\')'
    )
    for label, imp in (
        ("plain import:    ", "import colossalai.booster, colossalai.booster.plugin"),
        ("as a rank does it:", "from tasks.engine.lazy_compile import import_colossalai; import_colossalai()"),
    ):
        out = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", probe.format(imp=imp)], capture_output=True, text=True, check=True
        )
        print(label, out.stdout.strip().splitlines()[-1])
