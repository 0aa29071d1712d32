"""lm-eval's progress, turned into the stage's meter: while a model is scored, HFLM's own progress
bars draw nothing and each request (or rolling window) it finishes advances a metered part.

    python -c "from tasks.core.evaluation.lm_eval_progress import metered_hflm; from lm_eval.models.huggingface import HFLM; print(metered_hflm(HFLM, 'export').__mro__[1])"

`tasks.core.evaluation.benchmark.score` opens `bars_to_meter()` around a scoring and wraps HFLM in
`metered_hflm`, so the stage's console and heartbeat show `<label> loglikelihood: done / total
requests` with an ETA (tasks/core/run/meter.py) while lm-eval's tqdm bars, sent to /dev/null, stay
off the run's console.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from tasks.core.run.meter import Meter, metered

_phase: ContextVar[Meter | None] = ContextVar("cpt_to_sft_lm_eval_phase", default=None)


class _Bar:
    """What HFLM's progress bars are while a model is scored: each request (or rolling window) it
    finishes is added to the meter of the request type being run, nothing is drawn."""

    def __init__(self, iterable: Any = None, *args: Any, **kwargs: Any):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        if (m := _phase.get()) is not None:
            m.add(n)

    def close(self) -> None:
        pass


def metered_hflm(hflm: type, label: str) -> type:
    """HFLM whose three request types each run as a metered part: `<label> loglikelihood: done /
    total requests` (rolling: windows, counted as lm-eval cuts them), with an ETA."""
    from lm_eval import utils as lm_utils

    @contextlib.contextmanager
    def part(kind: str, total: int, unit: str) -> Iterator[None]:
        with metered(f"{label} {kind}", total, unit) as m:
            token = _phase.set(m)
            try:
                yield
            finally:
                _phase.reset(token)

    class Metered(hflm):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            with part("loglikelihood", len(requests), "requests"):
                return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

        def generate_until(self, requests, disable_tqdm: bool = False):
            with part("generate_until", len(requests), "generations"):
                return super().generate_until(requests, disable_tqdm=disable_tqdm)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            windows = sum(
                sum(
                    1
                    for _ in lm_utils.get_rolling_token_windows(
                        token_list=self.tok_encode(req.args[0]),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    )
                )
                for req in requests
            )
            with part("loglikelihood_rolling", windows, "windows"):
                return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    return Metered


@contextlib.contextmanager
def bars_to_meter() -> Iterator[None]:
    import lm_eval.models.huggingface as hf

    before, hf.tqdm = hf.tqdm, _Bar
    try:
        yield
    finally:
        hf.tqdm = before
