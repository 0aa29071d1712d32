"""Stage benchmark: lm-evaluation-harness scores of the base model and the export on local tasks.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # runs it after the export, before the gate

Reads the task YAMLs and data files `benchmark.tasks` names as data (checked in pre-flight and
again here: nothing is downloaded, no task key runs code, templates render in lm-eval's environment
replaced by a sandbox; tasks/core/evaluation/task_rules.py), copies them into eval/benchmark/tasks/ with their sha256, and scores the export and
the base with `lm_eval.simple_evaluate` (tasks/core/evaluation/benchmark.py), one model in memory
at a time. The base's scores are kept in eval/benchmark-base/<key>.json, the key made from the
base's manifest digest, the tasks' sha256 and the settings, so a new export is compared without
scoring the same base again. Writes metrics.json (base, export, change per task and metric, the
settings and lm-eval's version) and the manifest; logs to TensorBoard and MLflow; shows the table
(task, metric, base, export, change) in the UI. A task lm-eval gives no score fails the stage. The gate reads the scores.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from tasks.core.config.kernels import cuda_available
from tasks.core.config.schema import RunConfig
from tasks.core.evaluation import benchmark as bench
from tasks.core.evaluation import placement
from tasks.core.run.stages import BENCHMARK_BASE, ROWS, Status
from tasks.flowkit import tracking, ui
from tasks.flowkit.stage import Stage, StageResult, stage_task

TASKS_DIR = "tasks"  # eval/benchmark/tasks/<task>/: each YAML and its data as scored


def _not_configured() -> StageResult:
    get_run_logger().info("benchmark: benchmark.tasks is empty: no lm-eval benchmark")
    return StageResult(ROWS.benchmark.name, Status.NOT_CONFIGURED, detail={"reason": "benchmark.tasks is empty"})


def _base_scores(
    stage: Stage,
    base: StageResult,
    base_dir: Path,
    include: Path,
    names: list[str],
    cfg: RunConfig,
    dtype: str,
    inputs: Any,
) -> dict[str, Any]:
    """The base's scores: from eval/benchmark-base/<key>.json when this base, these tasks and
    these settings were scored before, else scored now and kept there."""
    key = hashlib.sha256(
        json.dumps(
            {"base": base.digest, "inputs": inputs, "settings": bench.settings(cfg.benchmark, dtype)}, sort_keys=True
        ).encode()
    ).hexdigest()
    rel = f"{BENCHMARK_BASE}/{key[:32]}.json"
    if stage.store.exists(rel):
        kept = json.loads(stage.store.read_text(rel))
        if kept.get("key") == key:
            get_run_logger().info(
                "benchmark: base scores reused from %s (same base, tasks and settings)", stage.store.uri(rel)
            )
            return {**kept["scores"], "cached": True, "key": key}
    scores = bench.score(base_dir, include, names, cfg.benchmark, dtype, cfg.base_model.trust_remote_code, "base")
    stage.store.write_text(
        rel,
        json.dumps(
            {"key": key, "base": base.uri, "base_digest": base.digest, "scores": scores}, indent=2, sort_keys=True
        )
        + "\n",
    )
    return {**scores, "cached": False, "key": key}


@stage_task(ROWS.benchmark, task_run_name="benchmark: lm-eval scores of base vs export")
def benchmark(
    cfg: RunConfig, base: StageResult, export: StageResult, tracker: tracking.TrackerHandle | None = None
) -> StageResult:
    """lm-eval scores of the base and the export; `tracker`: the flow run's MLflow run, which gets them."""
    logger = get_run_logger()
    if not cfg.benchmark.enabled:
        return _not_configured()
    tasks = [bench.read_task(uri) for uri in cfg.benchmark.tasks]
    bench.require_runnable(tasks, cfg.benchmark.max_split_mb)  # pre-flight's rules again: the files may have changed
    inputs = {"tasks": bench.fingerprint(tasks), "lm_eval": bench.lm_eval_version()}
    stage = Stage(ROWS.benchmark.name, cfg, base, export, inputs=inputs)
    if stage.skipped:
        stage.result.detail["metrics"] = (stage.store.read_manifest(stage.rel).get("meta") or {}).get("metrics")
        ui.benchmark_table(stage.result.detail["metrics"])
        return stage.result
    started = time.monotonic()
    dtype = placement.eval_dtype(cfg.benchmark.dtype, cfg.export.dtype, cuda_available())
    names = [t.name for t in tasks]
    base_dir, export_dir = stage.store.stage_in(base.rel), stage.store.stage_in(export.rel)
    with (
        stage.build() as out,
        tempfile.TemporaryDirectory(prefix="cpt-to-sft-benchmark-") as tmp,
        ui.WorkProgress(ROWS.benchmark.name).reporting(),  # a line a while with an ETA, as training's
    ):
        fetched = bench.fetch(tasks, out.dir / TASKS_DIR)
        include = bench.runnable(tasks, fetched, out.dir / TASKS_DIR, Path(tmp) / "run", Path(tmp) / "datasets-cache")
        trust = cfg.base_model.trust_remote_code
        scored = bench.score(export_dir, include, names, cfg.benchmark, dtype, trust, "export")
        base_scored = _base_scores(stage, base, base_dir, include, names, cfg, dtype, inputs)
        metrics = {
            "tasks": bench.compare(base_scored, scored),
            "settings": bench.settings(cfg.benchmark, dtype),
            "n_shot": scored["n_shot"],
            "samples": scored["samples"],
            "versions": scored["versions"],
            "export": {"seconds": scored["seconds"], "device": scored["device"]},
            "base": {
                "seconds": base_scored["seconds"],
                "device": base_scored["device"],
                "cached": base_scored["cached"],
            },
            "files": fetched,
            "seconds": round(time.monotonic() - started, 3),
        }
        for task, ms in metrics["tasks"].items():  # one line a task: the console stays a short log
            said = ", ".join(
                f"{metric} {'-' if m['base'] is None else format(m['base'], '.4g')} -> {m['export']:.4g}"
                for metric, m in ms.items()
            )
            logger.info("benchmark: %s (base -> export) %s", task, said)
        (out.dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        tracking.log_evaluation(ROWS.benchmark.name, {"tasks": metrics["tasks"]}, out.dir, cfg.sft.max_steps, tracker)
        out.manifest(
            kind="evaluation",
            parent=export,
            meta={
                "stage": ROWS.benchmark.name,
                "metrics": metrics,
                "reference": {"uri": base.uri, "digest": base.digest},
                "candidate": {"uri": export.uri, "digest": export.digest},
            },
        )
    ui.benchmark_table(metrics)
    return stage.done({"metrics": metrics}, event={"tasks": names})
