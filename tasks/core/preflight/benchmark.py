"""Pre-flight of the benchmark stage: lm-eval is installed, every task is local data, and its YAML loads.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check

For each YAML `benchmark.tasks` names: it parses as one lm-eval task with the project's own loader
(no custom tag such as `!function`, no alias; tasks/core/evaluation/task_rules.py), its `task:` is a
plain name, nothing in it would reach the network or run code (a Hub `dataset_path`, an http or
hf:// data file, `include:`, `process_docs`, `class`, a metric outside lm-eval's registry...:
refused, naming the task, the key and the fix), its data files exist and the split it scores has a
record, and lm-eval's own TaskManager loads it from a copy (its data read by datasets, offline, its
templates rendered in the sandbox) as the stage will; `gate.benchmarks` names only tasks that run,
each with a metric its task scores.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from tasks.core.evaluation import benchmark as bench
from tasks.core.evaluation import task_rules as rules
from tasks.core.preflight.report import CheckContext


def check_benchmark(ctx: CheckContext) -> None:
    cfg = ctx.cfg.benchmark
    if not cfg.enabled:
        if ctx.cfg.gate.benchmarks:
            ctx.problem(
                "gate.benchmarks",
                "limits benchmark scores, but benchmark.tasks is empty; name the task YAMLs there, or drop "
                "gate.benchmarks",
            )
        return
    missing = [m for m in ("lm_eval", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        ctx.problem("benchmark.tasks", f"{' and '.join(missing)} not installed; {bench.INSTALL_HINT}")
    tasks, clean = [], True
    for i, uri in enumerate(cfg.tasks):
        where = f"benchmark.tasks[{i}] ({uri})"
        try:
            t = bench.read_task(uri)
        except (OSError, ValueError) as exc:
            ctx.problem(where, f"cannot read the task YAML: {exc}")
            clean = False
            continue
        problems = bench.task_problems(t)
        for p in problems:
            ctx.problem(where, f"task {t.name!r} is refused (a task file is local data, never code): {p}")
        absent = [f for files in t.data.values() for f in files if not problems and not _exists(f)]
        for f in absent:
            ctx.problem(
                where, f"task {t.name!r}: data file {f} does not exist (relative data_files are read beside the YAML)"
            )
        empty = [] if problems or absent else _empty_split(t)
        if empty:
            ctx.problem(
                where,
                f"task {t.name!r}: its {bench.eval_split(t)!r} split has no record (data file(s) "
                f"{', '.join(empty)}); put the documents to score there",
            )
        clean &= not problems and not absent and not empty
        tasks.append(t)
    names = [t.name for t in tasks]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        ctx.problem("benchmark.tasks", f"task names {dupes} appear more than once; each YAML's `task:` must be unique")
    for name, limit in ctx.cfg.gate.benchmarks.items():
        if tasks and name not in names:
            ctx.problem(
                f"gate.benchmarks.{name}",
                f"no task {name!r} in benchmark.tasks (its YAMLs name {names}); use one of those names",
            )
        elif name in names:
            _gate_metric(ctx, name, limit.metric, tasks[names.index(name)])
    if not (clean and tasks and not missing and not dupes):
        return
    with tempfile.TemporaryDirectory(prefix="cpt-to-sft-benchmark-check-") as tmp:
        try:
            fetched = bench.fetch(tasks, Path(tmp) / "copies")
            bench.load_tasks(
                bench.runnable(tasks, fetched, Path(tmp) / "copies", Path(tmp) / "run", Path(tmp) / "cache"), names
            )
        except (Exception, SystemExit) as exc:  # lm-eval's own reading of the YAML and its data: the user's to fix
            ctx.problem("benchmark.tasks", f"lm-eval cannot load the tasks {names}: {type(exc).__name__}: {exc}")
            return
    ctx.ok(
        f"benchmark: {len(tasks)} local lm-eval task(s) load ({', '.join(names)}), lm-eval {bench.lm_eval_version()}"
    )


def _exists(uri: str) -> bool:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(uri)
        return fs.isfile(path)
    except Exception:
        return False


def _gate_metric(ctx: CheckContext, name: str, metric: str, task: bench.TaskFile) -> None:
    """gate.benchmarks.<task>.metric is one the task scores: `acc` (lm-eval's filter `none`, the
    one a task without filter_list has) or `acc,<filter>` with a filter of its filter_list."""
    base, _, filt = metric.partition(",")
    scored, filters = rules.scored_metrics(task.config), rules.filter_names(task.config)
    known_filter = ("none" in filters) if not filt else (filt != "none" and filt in filters)
    if base not in scored or not known_filter:
        ctx.problem(
            f"gate.benchmarks.{name}.metric",
            f"{metric!r} is not scored by task {name!r}: it scores {sorted(scored)} under the filter(s) "
            f"{sorted(filters)} (`acc` is filter none, `acc,<filter>` another); use one of those, or add it to the "
            f"task's metric_list in {task.uri}",
        )


def _empty_split(task: bench.TaskFile) -> list[str]:
    """The data files of the split lm-eval scores, when none holds a record (else [])."""
    files = task.data.get(bench.eval_split(task) or "", [])
    if not files:
        return []
    builder = task.config.get("dataset_path")
    return [] if any(_has_record(f, builder) for f in files) else files


def _has_record(uri: str, builder: str) -> bool:
    import fsspec

    try:
        if builder in ("parquet", "arrow"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            with fsspec.open(uri, "rb") as fh:
                if builder == "parquet":
                    return pq.ParquetFile(fh).metadata.num_rows > 0
                return pa.ipc.open_stream(fh).read_all().num_rows > 0
        with fsspec.open(uri, "rt", compression="infer", encoding="utf-8", errors="replace") as fh:
            lines = (line for line in fh if line.strip())
            first = next(lines, None)
            if first is None:
                return False
            if builder == "csv":
                return next(lines, None) is not None  # a header alone is no record
            if builder == "json" and first.lstrip().startswith("["):
                import json

                return bool(json.loads(first + fh.read()))
            return True
    except Exception:  # a file datasets cannot read either: lm-eval's load below names the error
        return True
