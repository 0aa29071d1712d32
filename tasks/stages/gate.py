"""The gate: the thresholds of `gate:` over the recorded evaluation (and benchmark) metrics; a failed
gate holds the push back and keeps every artifact.

Not an artifact: a pure decision over recorded metrics (tasks/core/evaluation/verdict.py), taken on
every run, so changing a threshold re-decides without re-running anything upstream.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # decides it after the evaluations
"""

from __future__ import annotations

import time

from prefect import get_run_logger, task

from tasks.core.config.schema import RunConfig
from tasks.core.evaluation import verdict as rules
from tasks.core.run.stages import ROWS, Status
from tasks.flowkit import ui
from tasks.flowkit.pipeline import bind
from tasks.flowkit.stage import StageResult

EVAL_TABLE_KEY = "cpt-to-sft-evaluation"


@bind
@task(name=ROWS.gate.name, task_run_name="gate before push")
def gate(
    cfg: RunConfig,
    cpt_eval: StageResult,
    sft_eval: StageResult,
    bench_eval: StageResult | None = None,
    dpo_eval: StageResult | None = None,
) -> StageResult:
    """Status `passed`, `failed-gate` or `disabled`; detail is the verdict (checks and reasons).

    Not an artifact: a pure decision over recorded metrics and `gate:`, taken on every run, so
    changing a threshold re-decides without re-running anything upstream.
    """
    logger = get_run_logger()
    started = time.monotonic()
    cpt, sft = cpt_eval.detail.get("metrics"), sft_eval.detail.get("metrics")
    scores = bench_eval.detail.get("metrics") if bench_eval is not None else None
    dpo = dpo_eval.detail.get("metrics") if dpo_eval is not None else None  # a row only in a run with dpo
    verdict = rules.gate_verdict(cfg.gate, cpt, sft, scores, dpo, trains_dpo="dpo" in cfg.phases)
    for c in verdict["checks"]:
        logger.info("gate: %s %s: %s", "pass" if c["ok"] else "FAIL", c["check"], c["message"])
    status = Status.DISABLED if not cfg.gate.enabled else (Status.PASSED if verdict["passed"] else Status.FAILED_GATE)
    if status == Status.DISABLED:
        logger.warning("gate: disabled by gate.enabled: false; the export goes to push_to_hub whatever the checks say")
    elif status == Status.FAILED_GATE:
        logger.error("gate: FAILED, the push is skipped and every artifact is kept: %s", "; ".join(verdict["reasons"]))
    try:
        from prefect.artifacts import create_table_artifact

        create_table_artifact(
            rules.metrics_table(cpt, sft, verdict, dpo),
            key=EVAL_TABLE_KEY,
            description=f"Held-out evaluation and the publish gate: {status}",
        )
    except Exception as exc:
        logger.warning("evaluation table artifact unavailable: %s", exc)
    if scores:
        ui.benchmark_table(scores, verdict)  # the benchmark table again, with the gate's word per task
    return StageResult(ROWS.gate.name, status, seconds=time.monotonic() - started, detail=verdict)
