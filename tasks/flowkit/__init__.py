"""What every stage is built with, on the Prefect side.

- automation.py   the Prefect event each stage emits when it completes or fails
- checkpoints.py  where a training stage's checkpoints go: one sink
- console_log.py  failures on the console, one line each, the traceback kept in the log
- notices.py      a preemption notice during a stage that does not train, and the wait for capacity
- pipeline.py     each row of the stage table bound to its task, and the arguments it is called with
- preflight.py    stage 0, pre-flight as a task
- retry.py        Prefect's retry condition for stages that reach the network or copy large files
- run.py          one run's lifecycle: lease, tracking, the table's stages and their preemption retries, run.json, card
- stage.py        the stage protocol: skip -> build -> manifest -> publish -> event
- tracking.py     MLflow, written from the `@@progress` records the task receives
- ui.py           what the Prefect UI shows: progress, loss curves, the stage table, links
"""
