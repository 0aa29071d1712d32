"""tasks/engine/lazy_compile.py: torch.compile deferred to the first call while ColossalAI is imported.

.venv/bin/python -m pytest -q tests/test_lazy_compile.py
"""

from __future__ import annotations

import torch

from tasks.engine.lazy_compile import _deferred, deferred_compile


def test_the_real_compile_runs_once_on_first_call_with_the_same_arguments():
    calls = []

    def real(fn, **kw):
        calls.append((fn.__name__, kw))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    compile_later = _deferred(real)

    @compile_later(mode="max-autotune-no-cudagraphs", dynamic=False)
    def double(x):
        """Doubles."""
        return 2 * x

    def triple(x):
        return 3 * x

    tripled = compile_later(triple, disable=True)
    assert calls == []  # decorating compiles nothing
    assert double.__name__ == "double" and double.__doc__ == "Doubles."
    assert double(2) == ("compiled", 4) and double(3) == ("compiled", 6)
    assert tripled(1) == ("compiled", 3)
    assert calls == [
        ("double", {"mode": "max-autotune-no-cudagraphs", "dynamic": False}),
        ("triple", {"disable": True}),
    ]


def test_torch_compile_is_restored_after_the_block_even_on_error():
    real = torch.compile
    try:
        with deferred_compile():
            assert torch.compile is not real
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert torch.compile is real


def test_a_deferred_function_gives_what_torch_compile_gives():
    with deferred_compile():
        f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    x = torch.arange(4.0)
    assert torch.equal(f(x), x * 2 + 1)


# That importing ColossalAI through `import_colossalai()` leaves torch's compiler (torch._inductor.compile_fx)
# unimported is checked on a rank's whole import path, in the same fresh interpreter as the rest of what a rank
# must not import: tests/test_structure.py::test_a_training_rank_imports_nothing_only_another_verb_needs.
