"""Stages evaluate_cpt, evaluate_sft and gate: held-out metrics, a generation check, the publish gate.

Evaluation runs on the HF-format artifacts with plain `transformers` on the worker (CUDA when it
has one, spread over its visible GPUs when a model does not fit the first; else CPU), never under a
plugin: every model compared here already exists as an HF directory, which is also how users will
load it. `eval.dtype` unset follows export.dtype on a GPU, fp32 on CPU (`_with_eval_dtype`).
- evaluate_cpt: base/ vs cpt/hf/ on the CPT held-out set, and on each source's own (a mixture's,
  and cpt.eval.heldout_sources, never trained on) -> eval/cpt/ (metrics.json + manifest)
- evaluate_sft: cpt/hf/ (what reboost loaded: the pre-SFT model) vs export/ on the SFT held-out
  set, loss on assistant tokens; then greedy generations of held-out prompts with the export
  -> eval/sft/ (metrics.json, generations.jsonl + manifest)
- gate: the thresholds of `gate:` over those metrics; a failed gate holds the push back.

The held-out records were decided by prepare_data in its one pass over the corpus and are read
here from data/<stage>/ (`tasks.core.data.stage_data.heldout_records`), never re-split. The evaluation artifacts are leaves nobody trains
from, so changing an evaluation setting re-runs evaluation only, never training; and they skip
on a re-run like every stage (manifest verifies, config digest matches).

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # runs them in the flow
"""

from __future__ import annotations

import json
import time
from typing import Any

from prefect import get_run_logger, task

from tasks import automation, tracking
from tasks.core.config.kernels import cuda_available
from tasks.core.config.schema import RunConfig, StageConfig
from tasks.core.data.stage_data import (
    corpus_of,
    heldout_by_source,
    heldout_only_names,
    heldout_records,
    split_info,
    write_jsonl,
)
from tasks.core.evaluation import heldout as ev
from tasks.core.evaluation import placement
from tasks.core.evaluation import verdict as rules
from tasks.core.run.stages import Status
from tasks.core.storage.fs import RunStore
from tasks.prepare_data import prepared_dir
from tasks.stage import Stage, StageResult, stage_task

EVAL_TABLE_KEY = "cpt-to-sft-evaluation"


# ------------------------------------------------------------------------------------------------
# Evaluation stages


def _with_metrics(result: StageResult, store: RunStore) -> StageResult:
    """A skipped evaluation still reports its recorded metrics (run.json, the gate, the card)."""
    meta = store.read_manifest(result.rel).get("meta") or {}
    result.detail["metrics"] = meta.get("metrics")
    return result


def _with_eval_dtype(cfg: RunConfig, st: StageConfig) -> StageConfig:
    """The stage with eval.dtype decided for this worker: as set, else the export's on a GPU, fp32 on CPU."""
    dtype = placement.eval_dtype(st.eval.dtype, cfg.export.dtype, cuda_available())
    return st.model_copy(update={"eval": st.eval.model_copy(update={"dtype": dtype})})


def _not_configured(stage: str, which: str) -> StageResult:
    get_run_logger().info(
        "%s: no %s held-out set (%s.eval.heldout_fraction is 0, no heldout_uri): not evaluated",
        stage,
        which.upper(),
        which,
    )
    return StageResult(stage, Status.NOT_CONFIGURED, detail={"reason": f"{which}.eval has no held-out set"})


@stage_task(name="evaluate_cpt", task_run_name="evaluate CPT: base vs CPT held-out perplexity")
def evaluate_cpt(
    cfg: RunConfig, base: StageResult, bridge: StageResult, tracker: tracking.TrackerHandle | None = None
) -> StageResult:
    """Held-out perplexity of base vs CPT; `tracker`: the flow run's MLflow run, which gets the metrics."""
    logger = get_run_logger()
    if not cfg.cpt.eval.enabled:
        return _not_configured("evaluate_cpt", "cpt")
    stage = Stage("evaluate_cpt", cfg, base, bridge)
    store = stage.store
    if stage.skipped:
        return _with_metrics(stage.result, store)
    base_dir, cpt_dir = store.stage_in(base.rel), store.stage_in(bridge.rel)
    data = prepared_dir(cfg, "cpt")
    split = split_info(data, corpus_of(cfg.cpt.data))
    st = _with_eval_dtype(cfg, cfg.cpt)
    metrics = ev.evaluate_cpt(
        base_dir,
        cpt_dir,
        heldout_records(data),
        st.data.text_field,
        st.seq_len,
        st.eval,
        cfg.base_model.trust_remote_code,
        by_source=heldout_by_source(data),
        heldout_only=heldout_only_names(data),
    )
    metrics["split"] = split
    logger.info(
        "evaluate_cpt: held-out perplexity base %.4f -> CPT %.4f (%+.2f%%) on %d tokens in %.1fs",
        metrics["base"]["perplexity"],
        metrics["cpt"]["perplexity"],
        metrics["perplexity_change_pct"],
        metrics["tokens"],
        metrics["seconds"],
    )
    for name, m in (metrics.get("sources") or {}).items():  # each source: what CPT did to its held-out text
        kind = "held-out-only source" if m.get("held_out_only") else "source"
        if m.get("base") is None:
            logger.warning("evaluate_cpt: %s %r not evaluated: %s", kind, name, m["skipped"])
        else:
            logger.info(
                "evaluate_cpt: %s %r held-out perplexity base %.4f -> CPT %.4f (%+.2f%%)",
                kind,
                name,
                m["base"]["perplexity"],
                m["cpt"]["perplexity"],
                m["perplexity_change_pct"],
            )
    with stage.build() as out:
        (out.dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        tracking.log_evaluation("cpt", metrics, out.dir, st.max_steps, tracker)
        out.manifest(
            kind="evaluation",
            parent=bridge,
            meta={
                "stage": "cpt",
                "metrics": metrics,
                "reference": {"uri": base.uri, "digest": base.digest},
                "candidate": {"uri": bridge.uri, "digest": bridge.digest},
            },
        )
    return stage.done(
        {"metrics": metrics},
        event={"base_perplexity": metrics["base"]["perplexity"], "cpt_perplexity": metrics["cpt"]["perplexity"]},
    )


@stage_task(name="evaluate_sft", task_run_name="evaluate SFT: pre-SFT vs SFT held-out loss, generation check")
def evaluate_sft(
    cfg: RunConfig, bridge: StageResult, export: StageResult, tracker: tracking.TrackerHandle | None = None
) -> StageResult:
    """Held-out loss of pre-SFT vs SFT and the generation check; `tracker`: the flow run's MLflow run, which gets the metrics."""
    logger = get_run_logger()
    if not cfg.sft.eval.enabled:
        return _not_configured("evaluate_sft", "sft")
    g = cfg.gate
    stage = Stage("evaluate_sft", cfg, bridge, export)
    store = stage.store
    if stage.skipped:
        return _with_metrics(stage.result, store)
    pre_dir, export_dir = store.stage_in(bridge.rel), store.stage_in(export.rel)
    data = prepared_dir(cfg, "sft")
    split = split_info(data, corpus_of(cfg.sft.data))
    st = _with_eval_dtype(cfg, cfg.sft)
    heldout = heldout_records(data)
    trust = cfg.base_model.trust_remote_code
    metrics = ev.evaluate_sft(pre_dir, export_dir, heldout, st.data.messages_field, st.seq_len, st.eval, trust)
    gen, rows = ev.generation_check(
        export_dir, heldout, st.data.messages_field, g.max_new_tokens, g.num_prompts, st.eval.dtype, trust
    )
    gen["file"] = "generations.jsonl"
    metrics["generation"] = gen
    metrics["split"] = split
    logger.info(
        "evaluate_sft: held-out assistant loss pre-SFT %.4f -> SFT %.4f on %d tokens; %d of %d generations stopped "
        "(%.1fs + %.1fs)",
        metrics["pre_sft"]["loss"],
        metrics["sft"]["loss"],
        metrics["tokens"],
        gen["stopped"],
        gen["prompts"],
        metrics["seconds"],
        gen["seconds"],
    )
    for problem in gen["problems"]:
        logger.warning("evaluate_sft: generation check: %s", problem)
    with stage.build() as out:
        (out.dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        write_jsonl(out.dir / "generations.jsonl", rows)
        tracking.log_evaluation("sft", metrics, out.dir, st.max_steps, tracker)
        out.manifest(
            kind="evaluation",
            parent=export,
            meta={
                "stage": "sft",
                "metrics": metrics,
                "reference": {"uri": bridge.uri, "digest": bridge.digest},
                "candidate": {"uri": export.uri, "digest": export.digest},
            },
        )
    return stage.done(
        {"metrics": metrics},
        event={
            "pre_sft_loss": metrics["pre_sft"]["loss"],
            "sft_loss": metrics["sft"]["loss"],
            "generation_passed": gen["passed"],
        },
    )


# ------------------------------------------------------------------------------------------------
# The gate


@task(name="gate", task_run_name="gate before push")
def gate(
    cfg: RunConfig, cpt_eval: StageResult, sft_eval: StageResult, bench_eval: StageResult | None = None
) -> StageResult:
    """Status `passed`, `failed-gate` or `disabled`; detail is the verdict (checks and reasons).

    Not an artifact: a pure decision over recorded metrics and `gate:`, taken on every run, so
    changing a threshold re-decides without re-running anything upstream.
    """
    logger = get_run_logger()
    started = time.monotonic()
    cpt, sft = cpt_eval.detail.get("metrics"), sft_eval.detail.get("metrics")
    scores = bench_eval.detail.get("metrics") if bench_eval is not None else None
    verdict = rules.gate_verdict(cfg.gate, cpt, sft, scores)
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
            rules.metrics_table(cpt, sft, verdict),
            key=EVAL_TABLE_KEY,
            description=f"Held-out evaluation and the publish gate: {status}",
        )
    except Exception as exc:
        logger.warning("evaluation table artifact unavailable: %s", exc)
    if scores:
        from tasks.benchmark import show

        show(scores, verdict)  # the benchmark table again, with the gate's word per task
    return StageResult("gate", status, seconds=time.monotonic() - started, detail=verdict)


def held_back(cfg: RunConfig, verdict: StageResult) -> StageResult:
    """The push_to_hub result when the gate failed: nothing is pushed, the reasons are kept."""
    reasons = verdict.detail.get("reasons", [])
    target = f"hf://{cfg.hub.repo_id}" if cfg.hub else None
    get_run_logger().warning("push_to_hub: not run, the gate failed (%s)", "; ".join(reasons))
    automation.stage_event("push_to_hub", Status.FAILED_GATE, cfg.name, target, reasons=reasons)
    return StageResult(
        "push_to_hub", Status.FAILED_GATE, uri=target, detail={"reason": "the gate failed", "reasons": reasons}
    )


def recorded_metrics(results: dict[str, StageResult]) -> dict[str, dict[str, Any] | None]:
    """{"cpt": metrics | None, "sft": metrics | None, "benchmark": metrics | None} from this run's
    stage results (skipped evaluations carry the metrics recorded in their manifests): run.json's
    "evaluation" and the input of the card's model-index (`tasks.core.evaluation.verdict.eval_results_for_card`)."""
    out: dict[str, dict[str, Any] | None] = {}
    for key, stage in (("cpt", "evaluate_cpt"), ("sft", "evaluate_sft"), ("benchmark", "benchmark")):
        r = results.get(stage)
        out[key] = r.detail.get("metrics") if r is not None else None
    return out


def gate_message(verdict: dict[str, Any]) -> str:
    return "gate failed, nothing pushed, every artifact kept: " + "; ".join(verdict.get("reasons") or [])
