"""Progress of long work that is not training (tasks/core/run/meter.py, tasks/flowkit/ui.py
`WorkProgress`): a record when a part starts, at most one per interval with done / total and an
ETA, and one when it ends; the console gets a part's lines only once it has run an interval.

    PYTHONPATH=$PWD python -m pytest -q tests/test_meter.py
"""

from __future__ import annotations

import logging

from tasks.core.run import meter
from tasks.flowkit import ui


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_per_interval_with_done_total_and_an_eta(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(meter.time, "monotonic", clock)
    records: list[dict] = []
    with meter.reporting(records.append, interval_s=30), meter.metered("export loglikelihood", 400, "requests") as m:
        for _ in range(400):
            clock.now += 0.5  # 200 s in all: a record every 30 s, not one per request
            m.add()
    assert [r["done"] for r in records] == [0, 60, 120, 180, 240, 300, 360, 400]
    mid = records[1]
    assert (mid["elapsed_s"], mid["eta_s"], mid["finished"]) == (30.0, 170.0, False)
    assert meter.line(mid) == "export loglikelihood: 60 / 400 requests (15%), 30.0s elapsed, ETA 2m50s"
    assert meter.line(records[-1]) == "export loglikelihood: 400 / 400 requests (100%), 3m20s elapsed, done"
    assert meter.meter("no block open", 3, "items").emit is None  # from the command line: silent


def test_the_stage_logs_a_long_part_on_the_console_and_every_record_in_the_ui(monkeypatch, caplog):
    clock = Clock()
    monkeypatch.setattr(meter.time, "monotonic", clock)
    caplog.set_level(logging.INFO, logger=ui.__name__)
    bar: list[tuple] = []  # the UI's progress artifact, recorded here (no Prefect server for a unit test)
    monkeypatch.setattr(ui, "create_progress_artifact", lambda pct, key, description: bar.append((key, pct)) or "id")
    monkeypatch.setattr(ui, "update_progress_artifact", lambda _id, pct, description: bar.append((pct, description)))
    with ui.WorkProgress("evaluate_cpt").reporting(interval_s=30):
        with meter.metered("held-out loss of run/base", 10, "sequences") as short:
            short.add(10)  # under an interval: nothing on the console
        with meter.metered("held-out loss of cpt/hf", 10, "sequences") as long:
            for _ in range(10):
                clock.now += 10
                long.add()
    said = [(r.getMessage(), getattr(r, "cpt_to_sft_console", True)) for r in caplog.records if r.name == ui.__name__]
    assert [text for text, console in said if console] == [
        "evaluate_cpt: held-out loss of cpt/hf: 3 / 10 sequences (30%), 30.0s elapsed, ETA 1m10s",
        "evaluate_cpt: held-out loss of cpt/hf: 6 / 10 sequences (60%), 1m00s elapsed, ETA 40.0s",
        "evaluate_cpt: held-out loss of cpt/hf: 9 / 10 sequences (90%), 1m30s elapsed, ETA 10.0s",
        "evaluate_cpt: held-out loss of cpt/hf: 10 / 10 sequences (100%), 1m40s elapsed, done",
    ]
    assert [text for text, console in said if not console] == [  # the run's log in the UI only
        "evaluate_cpt: held-out loss of run/base: 0 / 10 sequences (0%), 0.0s elapsed",
        "evaluate_cpt: held-out loss of run/base: 10 / 10 sequences (100%), 0.0s elapsed, done",
        "evaluate_cpt: held-out loss of cpt/hf: 0 / 10 sequences (0%), 0.0s elapsed",
    ]
    assert bar[0] == ("evaluate-cpt-progress", 0.0) and len(bar) == 1 + len(said)
    assert bar[-1] == (100.0, "evaluate_cpt: held-out loss of cpt/hf: 10 / 10 sequences (100%), 1m40s elapsed, done")
