"""Stages unshard and unshard_sft: a phase's final checkpoint -> its HF-format bridge (`cpt/hf/`, `sft/hf/`).

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml       # unshard: CPT -> cpt/hf
    python -m flows.cpt_to_sft --config examples/tiny-cpu-dpo.yaml   # and unshard_sft: SFT -> sft/hf, what DPO starts from

Every plugin can boost from an HF directory, so this is the one handoff between plugins. It is a
streaming conversion on the worker's CPU; the fingerprint proves the logits survived. cpt/hf's
config.json is base/'s with `cpt.context`'s RoPE and position settings in place, as CPT trained
(tasks/core/config/context.py); sft/hf's is cpt/hf's, which already carries them. unshard_sft is a
row of the dpo phase: a run without `dpo:` exports SFT's checkpoint directly.
With `sft.lora` the checkpoint holds an adapter: unshard_sft merges it onto cpt/hf in fp32 (the
export's merge, proven against peft), so sft/hf is a plain model for DPO, full or with its own adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.core.config.context import config_changes
from tasks.core.config.phases import PHASES, Phase
from tasks.core.config.schema import RunConfig
from tasks.core.data.stage_data import recorded_split
from tasks.core.run.stages import BASE, ROWS, SFT_HF, TRAINING
from tasks.flowkit import ui
from tasks.flowkit.stage import Stage, StageResult, stage_task


def _unshard(
    cfg: RunConfig, name: str, phase: Phase, ckpt_result: StageResult, rel: str, source_rel: str
) -> StageResult:
    """`phase`'s final checkpoint (`ckpt_result`) as an HF folder at `rel`, its config and tokenizer from `source_rel`."""
    stage = Stage(name, cfg, ckpt_result, rel=rel)
    if stage.skipped:
        return stage.result
    ckpt, source = stage.store.stage_in(ckpt_result.rel), stage.store.stage_in(source_rel)
    with stage.build() as out, ui.WorkProgress(name).reporting():  # shards, the proof: lines with an ETA
        built = hf_of_checkpoint(cfg, phase, ckpt, out.dir, source)
        out.manifest(
            kind="hf-model",
            parent=ckpt_result,
            fingerprint=built["fingerprint"],
            known_hashes=built["known_hashes"],
            meta={
                "from_checkpoint": ckpt_result.uri,
                "plugin": cfg.phase(phase).plugin.model_dump(mode="json"),
                "verification": built["verification"],
                "data_split": recorded_split(stage.store, phase),  # what the phase trained on and what it held out
                "context": built["context"],  # config.json fields CPT changed from base/'s
            },
        )
    return stage.done({"fingerprint_max_abs_diff": built["verification"]["fingerprint_max_abs_diff"]})


def hf_of_checkpoint(cfg: RunConfig, phase: Phase, ckpt: Path, dst: Path, source: Path) -> dict[str, Any]:
    """`phase`'s checkpoint `ckpt` as a plain HF folder `dst` (config and tokenizer from `source`); build_hf_dir's
    record, with the config.json fields it changed as `context`. A LoRA checkpoint (`sft.lora` before DPO) holds
    an adapter, not the model: it is merged onto `source` in fp32 (tasks/core/models/merge.py, proven against
    peft, every untouched tensor bitwise), so sft/hf is a whole model the dpo phase boosts, scores and compares,
    with its own new adapter or none."""
    # Imported here: the converter and the merge import torch, which a skipped stage never needs.
    from tasks.core.models.hf_artifact import build_hf_dir
    from tasks.core.models.merge import build_merged_dir

    section = cfg.phase(phase)
    if section.lora is not None:  # LoRA is refused where the phase sets the context (CPT): no context to apply
        built = build_merged_dir(
            ckpt, dst, source, cfg.export, work_dir=cfg.staging_dir, verify_memory_gb=cfg.verify_memory_gb, bridge=True
        )
        return {**built, "context": {}}
    # the RoPE and position settings of the phase that sets the model's context (CPT); a later phase's
    # source (cpt/hf) carries them already
    context: dict[str, Any] = config_changes(section.context) if PHASES[phase].context_refused is None else {}
    built = build_hf_dir(
        ckpt,
        dst,
        source,
        cfg.export,  # its shard size: otherwise the checkpoint as it is (bridge)
        weights_dtype=section.plugin.precision,
        bridge=True,
        verify_memory_gb=cfg.verify_memory_gb,
        config_updates=context,
    )
    return {**built, "context": context}


@stage_task(ROWS.unshard, task_run_name="unshard CPT -> HF")
def unshard(cfg: RunConfig, cpt: StageResult) -> StageResult:
    return _unshard(cfg, ROWS.unshard.name, "cpt", cpt, TRAINING["cpt"].hf, BASE)


@stage_task(ROWS.unshard_sft, task_run_name="unshard SFT -> HF (the model DPO starts from)")
def unshard_sft(cfg: RunConfig, sft: StageResult) -> StageResult:
    """SFT's final checkpoint -> sft/hf: the model reboost_dpo boosts, the reference scores and evaluate_dpo compares."""
    return _unshard(cfg, ROWS.unshard_sft.name, "sft", sft, SFT_HF, TRAINING["sft"].source)
