"""Stages evaluate_cpt and evaluate_sft: held-out metrics and a generation check (the gate that reads
them: tasks/stages/gate.py).

Evaluation runs on the HF-format artifacts with plain `transformers` on the worker (CUDA when it
has one, spread over its visible GPUs when a model does not fit the first; else CPU), never under a
plugin: every model compared here already exists as an HF directory, which is also how users will
load it. `eval.dtype` unset follows export.dtype on a GPU, fp32 on CPU (`_with_eval_dtype`).
- evaluate_cpt: base/ vs cpt/hf/ on the CPT held-out set, and on each source's own (a mixture's,
  and cpt.eval.heldout_sources, never trained on) -> eval/cpt/ (metrics.json + manifest)
- evaluate_sft: cpt/hf/ (what reboost loaded: the pre-SFT model) vs export/ (sft/hf/ in a run with
  dpo) on the SFT held-out set, loss on assistant tokens; then greedy generations of held-out prompts
  with that model -> eval/sft/ (metrics.json, generations.jsonl + manifest)
- evaluate_dpo (a row of the dpo phase): sft/hf/ vs export/ (the DPO model) on the held-out pairs:
  preference accuracy, mean reward margin, the chosen reply's log-likelihood -> eval/dpo/

The held-out records were decided by prepare_data in its one pass over the corpus and are read
here from data/<phase>/ (`tasks.core.data.stage_data.heldout_records`), never re-split. The evaluation artifacts are leaves nobody trains
from, so changing an evaluation setting re-runs evaluation only, never training; and they skip
on a re-run like every stage (manifest verifies, config digest matches).

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # runs them in the flow
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from prefect import get_run_logger

from tasks.core.config.kernels import cuda_available
from tasks.core.config.phases import Phase
from tasks.core.config.schema import PhaseConfig, RunConfig
from tasks.core.data.stage_data import (
    corpus_of,
    heldout_by_source,
    heldout_only_names,
    heldout_records,
    prepared_dir,
    split_info,
    write_jsonl,
)
from tasks.core.evaluation import heldout as ev
from tasks.core.evaluation import placement
from tasks.core.evaluation.generation import generation_check
from tasks.core.run.stages import ROWS, Status
from tasks.core.storage.fs import RunStore
from tasks.flowkit import tracking, ui
from tasks.flowkit.stage import Stage, StageResult, stage_task

# ------------------------------------------------------------------------------------------------
# Evaluation stages


def _with_metrics(result: StageResult, store: RunStore) -> StageResult:
    """A skipped evaluation still reports its recorded metrics (run.json, the gate, the card)."""
    meta = store.read_manifest(result.rel).get("meta") or {}
    result.detail["metrics"] = meta.get("metrics")
    return result


def _with_eval_dtype(cfg: RunConfig, phase_cfg: PhaseConfig) -> PhaseConfig:
    """The stage with eval.dtype decided for this worker: as set, else the export's on a GPU, fp32 on CPU."""
    dtype = placement.eval_dtype(phase_cfg.eval.dtype, cfg.export.dtype, cuda_available())
    return phase_cfg.model_copy(update={"eval": phase_cfg.eval.model_copy(update={"dtype": dtype})})


def _not_configured(stage: str, which: str) -> StageResult:
    get_run_logger().info(
        "%s: no %s held-out set (%s.eval.heldout_fraction is 0, no heldout_uri): not evaluated",
        stage,
        which.upper(),
        which,
    )
    return StageResult(stage, Status.NOT_CONFIGURED, detail={"reason": f"{which}.eval has no held-out set"})


class _Opening(NamedTuple):
    """What both evaluations start from: the stage, both models staged in, the held-out data and split."""

    stage: Stage
    reference_dir: Any
    candidate_dir: Any
    data: Any
    split: dict[str, Any]
    phase_cfg: PhaseConfig


def _open(
    cfg: RunConfig, name: str, phase: Phase, reference: StageResult, candidate: StageResult, *more: StageResult
) -> StageResult | _Opening:
    """Both evaluations' start: not configured, skipped (with its recorded metrics), or what to evaluate.
    `more`: the row's other parents (evaluate_sft in a run with dpo: the export its generation check runs on)."""
    if not cfg.phase(phase).eval.enabled:
        return _not_configured(name, phase)
    stage = Stage(name, cfg, reference, candidate, *more)
    store = stage.store
    if stage.skipped:
        return _with_metrics(stage.result, store)
    reference_dir, candidate_dir = store.stage_in(reference.rel), store.stage_in(candidate.rel)
    data = prepared_dir(store, phase)
    split = split_info(data, corpus_of(cfg.phase(phase).data))
    return _Opening(stage, reference_dir, candidate_dir, data, split, _with_eval_dtype(cfg, cfg.phase(phase)))


@dataclass(frozen=True)
class _Measured:
    """What an evaluation measured: its metrics, the completed event's figures and (SFT) the generations."""

    metrics: dict[str, Any]
    event: dict[str, Any]
    generations: list[dict] | None = None


def _recorded(
    stage: Stage,
    phase: Phase,
    measured: _Measured,
    reference: StageResult,
    candidate: StageResult,
    steps: int,
    tracker: tracking.TrackerHandle | None,
) -> StageResult:
    """Both evaluations' end: metrics.json (and the generations), the scalars to TensorBoard and
    MLflow, the manifest last (its parent the candidate), then publish and the completed event."""
    metrics, generations = measured.metrics, measured.generations
    with stage.build() as out:
        (out.dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        if generations is not None:
            write_jsonl(out.dir / "generations.jsonl", generations)
        tracking.log_evaluation(phase, metrics, out.dir, steps, tracker)
        out.manifest(
            kind="evaluation",
            parent=candidate,
            meta={
                "phase": phase,
                "metrics": metrics,
                "reference": {"uri": reference.uri, "digest": reference.digest},
                "candidate": {"uri": candidate.uri, "digest": candidate.digest},
            },
        )
    return stage.done({"metrics": metrics}, event=measured.event)


@stage_task(ROWS.evaluate_cpt, task_run_name="evaluate CPT: base vs CPT held-out perplexity")
def evaluate_cpt(
    cfg: RunConfig, base: StageResult, bridge: StageResult, tracker: tracking.TrackerHandle | None = None
) -> StageResult:
    """Held-out perplexity of base vs CPT; `tracker`: the flow run's MLflow run, which gets the metrics."""
    logger = get_run_logger()
    opened = _open(cfg, ROWS.evaluate_cpt.name, "cpt", base, bridge)
    if isinstance(opened, StageResult):
        return opened
    stage, base_dir, cpt_dir, data, split, phase_cfg = opened
    with ui.WorkProgress(ROWS.evaluate_cpt.name).reporting():  # a line a while with an ETA, as training's
        metrics = ev.evaluate_cpt(
            base_dir,
            cpt_dir,
            heldout_records(data),
            phase_cfg.data.text_field,
            phase_cfg.seq_len,
            phase_cfg.eval,
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
    event = {"base_perplexity": metrics["base"]["perplexity"], "cpt_perplexity": metrics["cpt"]["perplexity"]}
    return _recorded(stage, "cpt", _Measured(metrics, event), base, bridge, phase_cfg.max_steps, tracker)


@stage_task(ROWS.evaluate_sft, task_run_name="evaluate SFT: pre-SFT vs SFT held-out loss, generation check")
def evaluate_sft(
    cfg: RunConfig,
    bridge: StageResult,
    export: StageResult,
    tracker: tracking.TrackerHandle | None = None,
    shipped: StageResult | None = None,
) -> StageResult:
    """Held-out loss of pre-SFT vs SFT and the generation check; `tracker`: the flow run's MLflow run, which gets
    the metrics. `export`: the SFT model (sft/hf in a run with dpo, whose export, `shipped`, the generation
    check runs on)."""
    logger = get_run_logger()
    g = cfg.gate
    opened = _open(cfg, ROWS.evaluate_sft.name, "sft", bridge, export, *((shipped,) if shipped is not None else ()))
    if isinstance(opened, StageResult):
        return opened
    stage, pre_dir, export_dir, data, split, phase_cfg = opened
    gen_dir = stage.store.stage_in(shipped.rel) if shipped is not None else export_dir
    heldout = heldout_records(data)
    trust = cfg.base_model.trust_remote_code
    with ui.WorkProgress(ROWS.evaluate_sft.name).reporting():  # a line a while with an ETA, as training's
        metrics = ev.evaluate_sft(
            pre_dir, export_dir, heldout, phase_cfg.data.messages_field, phase_cfg.seq_len, phase_cfg.eval, trust
        )
        gen, rows = generation_check(
            gen_dir,
            heldout,
            phase_cfg.data.messages_field,
            g.max_new_tokens,
            g.num_prompts,
            phase_cfg.eval.dtype,
            trust,
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
    event = {
        "pre_sft_loss": metrics["pre_sft"]["loss"],
        "sft_loss": metrics["sft"]["loss"],
        "generation_passed": gen["passed"],
    }
    return _recorded(stage, "sft", _Measured(metrics, event, rows), bridge, export, phase_cfg.max_steps, tracker)


@stage_task(ROWS.evaluate_dpo, task_run_name="evaluate DPO: SFT vs DPO on held-out pairs")
def evaluate_dpo(
    cfg: RunConfig, sft_model: StageResult, export: StageResult, tracker: tracking.TrackerHandle | None = None
) -> StageResult:
    """Held-out preference accuracy, reward margin and chosen log-likelihood of the SFT model (sft/hf) and the
    DPO model (the export); `tracker`: the flow run's MLflow run, which gets the metrics."""
    from tasks.core.evaluation.reference import evaluate_pairs

    opened = _open(cfg, ROWS.evaluate_dpo.name, "dpo", sft_model, export)
    if isinstance(opened, StageResult):
        return opened
    stage, sft_dir, dpo_dir, data, split, phase_cfg = opened
    dpo = cfg.phase("dpo")
    with ui.WorkProgress(ROWS.evaluate_dpo.name).reporting():
        metrics = evaluate_pairs(
            sft_dir,
            dpo_dir,
            data,
            dpo,
            dtype=phase_cfg.eval.dtype,
            batch_pairs=max(1, phase_cfg.eval.batch_size // 2),
            trust_remote_code=cfg.base_model.trust_remote_code,
        )
    metrics["split"] = split
    s, d = metrics["sft"], metrics["dpo"]
    get_run_logger().info(
        "evaluate_dpo: %d held-out pairs: preference accuracy %.3f, margin %+.4f, chosen log-likelihood %.4f -> %.4f "
        "(SFT -> DPO; SFT prefers the chosen reply in %.3f, DPO in %.3f) in %.1fs",
        metrics["pairs"],
        d["accuracy"],
        d["margin"],
        s["chosen_logp"],
        d["chosen_logp"],
        s["prefers_chosen"],
        d["prefers_chosen"],
        metrics["seconds"],
    )
    event = {
        "dpo_accuracy": d["accuracy"],
        "dpo_margin": d["margin"],
        "chosen_logp_change": metrics["chosen_logp_change"],
    }
    return _recorded(stage, "dpo", _Measured(metrics, event), sft_model, export, phase_cfg.max_steps, tracker)
