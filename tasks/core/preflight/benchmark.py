"""Pre-flight of the benchmark stage: lm-eval is installed, every task is local data, and its YAML loads.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check

For each YAML `benchmark.tasks` names: it parses as one lm-eval task with the project's own loader
(no custom tag such as `!function`, no alias; tasks/core/evaluation/task_rules.py), its `task:` is a
plain name, nothing in it would reach the network or run code (a Hub `dataset_path`, an http or
hf:// data file, `include:`, `process_docs`, `class`, a metric outside lm-eval's registry...:
refused, naming the task, the key and the fix), its data files exist, no split is larger on disk
than `benchmark.max_split_mb`, the split it scores has a record, `num_fewshot` fits the split
lm-eval draws few-shot examples from, and lm-eval's own TaskManager loads each task (its templates
rendered in the sandbox) as the stage will; `gate.benchmarks` names only tasks that run, each with
a metric its task scores.

Its cost does not grow with the data: sizes come from the file system, and every count and lm-eval's
load come from a head sample of each data file (`task_data.head_sample`: at most SAMPLE_DOCS documents
from the first SAMPLE_BYTES). The stage reads the data whole as it runs.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from tasks.core.evaluation import benchmark as bench
from tasks.core.evaluation import task_data as data
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
    tasks, clean, sampled = [], True, {}
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
        big = [] if problems or absent else data.size_problems(t, cfg.max_split_mb)
        for p in big:
            ctx.problem(where, f"task {t.name!r}: {p}")
        unread = [] if problems or absent or big else _sample(ctx, where, t, sampled)
        clean &= not problems and not absent and not big and not unread
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
    # lm-eval loads each task from a head sample of its data (document 0 rendered in the sandbox), as
    # the stage will load the whole: a task it cannot load is named with its file
    with tempfile.TemporaryDirectory(prefix="cpt-to-sft-benchmark-check-") as tmp:
        copies = Path(tmp) / "copies"
        failed = False
        try:
            fetched = data.samples(tasks, copies, sampled)
            include = bench.runnable(tasks, fetched, copies, Path(tmp) / "run", Path(tmp) / "cache")
        except (OSError, ValueError) as exc:
            ctx.problem("benchmark.tasks", f"cannot sample the tasks' data {names}: {type(exc).__name__}: {exc}")
            return
        for i, t in enumerate(tasks):
            try:
                bench.load_tasks(include, [t.name])
            except (Exception, SystemExit) as exc:  # lm-eval's own reading of the YAML and its data: the user's to fix
                ctx.problem(
                    f"benchmark.tasks[{i}] ({t.uri})",
                    f"lm-eval cannot load task {t.name!r} (from the first {data.SAMPLE_DOCS} documents of each data "
                    f"file): {type(exc).__name__}: {exc}",
                )
                failed = True
    if failed:
        return
    ctx.ok(
        f"benchmark: {len(tasks)} local lm-eval task(s) load ({', '.join(names)}), lm-eval {bench.lm_eval_version()}"
        f" (from a sample of each data file; the largest split {_largest(tasks)})"
    )


def _largest(tasks: list[bench.TaskFile]) -> str:
    size, split, name = max((b, s, t.name) for t in tasks for s, b in data.split_bytes(t).items())
    return f"{name}:{split}, {size / 1e6:.1f} MB"


def _sample(ctx: CheckContext, where: str, task: bench.TaskFile, sampled: dict) -> list[str]:
    """Read a head sample of each data file (bounded: tasks/core/evaluation/task_data.py) and refuse,
    from it, a scored split with no record and a num_fewshot larger than the few-shot split."""
    builder = task.config.get("dataset_path")
    out: list[str] = []
    try:
        heads = {
            uri: data.head_sample(uri, builder) for files in task.data.values() for uri in files[: data.SAMPLE_FILES]
        }
    except Exception as exc:  # a file pyarrow or the sampler cannot read: name it
        heads = {}
        out.append(f"task {task.name!r}: cannot read a sample of its data: {type(exc).__name__}: {exc}")
    else:
        for uri, h in heads.items():
            if h.note:
                out.append(f"task {task.name!r}: data file {uri}: {h.note}; write one document a line (JSON lines)")
        scored = bench.eval_split(task) or ""
        files = task.data.get(scored, [])
        if not out and files and all(f in heads and heads[f].count == 0 and heads[f].complete for f in files):
            out.append(
                f"task {task.name!r}: its {scored!r} split has no record (data file(s) {', '.join(files)}); put the "
                "documents to score there"
            )
        if not out:
            out += _fewshot(ctx, task, heads)
    for p in out:
        ctx.problem(where, p)
    sampled[task.name] = heads
    return out


def _fewshot(ctx: CheckContext, task: bench.TaskFile, heads: dict) -> list[str]:
    """num_fewshot larger than what lm-eval draws few-shot examples from fails the stage with
    "Sample larger than population" after training: refused here, from the samples' counts (a count
    the first SAMPLE_BYTES of a file cannot settle is left to lm-eval)."""
    configured = ctx.cfg.benchmark.num_fewshot
    n = data.num_fewshot(task, configured)
    if n <= 0:
        return []
    split, listed, extra = data.fewshot_pool(task)
    if split is not None:
        files = task.data.get(split, [])
        if not files or not all(f in heads and heads[f].complete for f in files):
            return []  # a split the data do not name: lm-eval's load names it; a long split: enough documents
        have, what = sum(heads[f].count for f in files), f"its few-shot split {split!r} ({', '.join(files)})"
    elif listed is not None:
        have, what = listed, "its fewshot_config.samples"
    else:
        return []
    need = n + extra
    if have >= need:
        return []
    field_ = "benchmark.num_fewshot" if configured is not None else f"num_fewshot in {task.uri}"
    drawn = " (lm-eval draws one more and drops the document being scored: the split is also the scored one)"
    return [
        (
            f"task {task.name!r}: {field_} is {n}, but {what} holds {have} document(s) and lm-eval needs {need}"
            f"{drawn if extra else ''}; set {field_} to at most {max(have - extra, 0)}, or give the task a few-shot "
            "split with more documents (fewshot_split)"
        )
    ]


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
