"""A stage added the way docs/extending.md says: one row in the stage table plus its task. Shared by the
runner's unit tests (tests/test_pipeline_run.py) and the flow run of tests/test_stop_after.py; the table
and the task map are put back when the test ends."""

from __future__ import annotations

from typing import Any

DUMMY = "dummy_stage"


def add_dummy_stage(monkeypatch, task: Any = None, after: str = "load_from_hf"):
    """Register the row `dummy_stage` (it reads `after`'s result) and bind `task` to it (default: a Prefect
    task that records what it read). Returns the row."""
    from prefect import task as prefect_task

    from tasks.core.run import stages
    from tasks.core.run.stages import StageSpec, Status
    from tasks.flowkit import pipeline
    from tasks.flowkit.stage import StageResult

    monkeypatch.setattr(stages, "STAGES", stages.STAGES)  # register rebinds both: put back after the test
    monkeypatch.setattr(stages, "STAGE_NAMES", stages.STAGE_NAMES)
    monkeypatch.setattr(pipeline, "TASKS", dict(pipeline.TASKS))
    monkeypatch.setitem(stages.STAGE, DUMMY, None)  # so the teardown removes the row register adds in place
    del stages.STAGE[DUMMY]
    spec = stages.register(StageSpec(DUMMY, None, reads=(after,)), after=after)

    if task is None:

        @prefect_task(name=DUMMY)
        def task(cfg, source: StageResult) -> StageResult:
            return StageResult(DUMMY, Status.COMPLETED, detail={"read": source.stage, "run": cfg.name})

    pipeline.bind(task, stages=(DUMMY,))
    return spec
