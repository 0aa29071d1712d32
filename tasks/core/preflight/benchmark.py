"""Pre-flight of the benchmark stage: lm-eval is installed, every task is local, and its YAML loads.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check

For each YAML `benchmark.tasks` names: it parses as one lm-eval task, nothing in it would reach the
network (a Hub `dataset_path`, an http or hf:// data file, `include:`, `!function`: refused, naming
the task and the fix), its data files exist, and lm-eval's own TaskManager loads it from a copy
(its data read by datasets, offline) as the stage will; `gate.benchmarks` names only tasks that run.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from tasks.core.evaluation import benchmark as bench
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
            ctx.problem(where, f"task {t.name!r} would reach the network or cannot run offline: {p}")
        absent = [f for files in t.data.values() for f in files if not problems and not _exists(f)]
        for f in absent:
            ctx.problem(
                where, f"task {t.name!r}: data file {f} does not exist (relative data_files are read beside the YAML)"
            )
        clean &= not problems and not absent
        tasks.append(t)
    names = [t.name for t in tasks]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        ctx.problem("benchmark.tasks", f"task names {dupes} appear more than once; each YAML's `task:` must be unique")
    for name in ctx.cfg.gate.benchmarks:
        if tasks and name not in names:
            ctx.problem(
                f"gate.benchmarks.{name}",
                f"no task {name!r} in benchmark.tasks (its YAMLs name {names}); use one of those names",
            )
    if not (clean and tasks and not missing and not dupes):
        return
    with tempfile.TemporaryDirectory(prefix="cpt-to-sft-benchmark-check-") as tmp:
        try:
            fetched = bench.fetch(tasks, Path(tmp) / "copies")
            bench.load_tasks(
                bench.runnable(tasks, fetched, Path(tmp) / "copies", Path(tmp) / "run", Path(tmp) / "cache"), names
            )
        except Exception as exc:  # lm-eval's own reading of the YAML and its data: any failure is the user's to fix
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
