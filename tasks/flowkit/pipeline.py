"""Each row of the stage table bound to the Prefect task that runs it, and the arguments it is called with.

    python -c "import flows.cpt_to_sft; from tasks.flowkit.pipeline import TASKS; print({n: t.name for n, t in TASKS.items()})"

The table is `STAGES` (tasks/core/run/stages.py): a row's name, artifact, digest, the stages it
reads and its phase. A stage module binds its task when it is imported: `stage_task` binds a task
whose name is a row's, `bind` any other (a plain `@task`, or one task for several rows, as
prepare_data is each phase's prepare stage). Binding a name that is no row fails at import.

The runner (tasks/flowkit/run.py) calls a row's task with the config, then one argument for each
further parameter, in order: `phase` gets the row's phase, `tracker` the run's MLflow handle,
`results` every stage's result so far; any other parameter takes the next stage of the row's
`reads` (a parameter with a default may go without). So a stage is its row plus its task.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tasks.core.run import stages as table

# What the runner fills by parameter name rather than from `reads`.
INJECTED = ("phase", "tracker", "results")

TASKS: dict[str, Any] = {}  # stage name -> the task (a Prefect task, or any callable returning a StageResult)


def bind(task: Any = None, *, stages: Iterable[str] = ()) -> Any:
    """Bind `task` to the rows named `stages` (default: the task's own name); `@bind` or `@bind(stages=...)`."""

    def do(t: Any) -> Any:
        for name in tuple(stages) or (getattr(t, "name", None) or t.__name__,):
            if name not in table.STAGE:
                raise ValueError(
                    f"task {getattr(t, 'name', t)!r} is bound to stage {name!r}, which is no row of "
                    "tasks/core/run/stages.py STAGES: add its row (register) first"
                )
            TASKS[name] = t
        return t

    return do(task) if task is not None else do


def task_for(name: str, tasks: Mapping[str, Any] | None = None) -> Any:
    try:
        return (TASKS if tasks is None else tasks)[name]
    except KeyError:
        raise LookupError(
            f"stage {name!r} has no task: bind one (tasks/flowkit/pipeline.py bind, or stage_task named after it) "
            "in a module the flow imports"
        ) from None


def arguments(spec: table.StageSpec, task: Any, cfg: Any, results: Mapping[str, Any], tracker: Any = None) -> list[Any]:
    """The positional arguments of `spec`'s task: the config, then a value for each parameter in order."""
    fn: Callable[..., Any] = getattr(task, "fn", task)
    params = list(inspect.signature(fn).parameters.values())[1:]
    reads = list(spec.reads)
    args: list[Any] = [cfg]
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        if p.name in INJECTED:
            args.append({"phase": spec.phase, "tracker": tracker, "results": results}[p.name])
        elif reads:
            args.append(results[reads.pop(0)])
        elif p.default is p.empty:
            raise TypeError(
                f"stage {spec.name}: its task's parameter {p.name!r} has no stage to read (add it to reads)"
            )
        else:
            break
    if reads:
        raise TypeError(f"stage {spec.name}: its task takes no parameter for {', '.join(reads)} (its reads)")
    return args
