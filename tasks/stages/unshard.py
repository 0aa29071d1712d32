"""Stage unshard: the final CPT checkpoint (plugin A) -> `cpt/hf/`, the HF-format bridge.

Every plugin can boost from an HF directory, so this is the one handoff between plugins. It is a
streaming conversion on the worker's CPU; the fingerprint proves the logits survived. config.json is
base/'s with `cpt.context`'s RoPE and position settings in place, as CPT trained (tasks/core/config/context.py).
"""

from __future__ import annotations

from tasks.core.config.context import config_changes
from tasks.core.config.schema import RunConfig
from tasks.core.data.stage_data import recorded_split
from tasks.core.run.stages import BASE, ROWS, TRAINING
from tasks.flowkit import ui
from tasks.flowkit.stage import Stage, StageResult, stage_task


@stage_task(ROWS.unshard, task_run_name="unshard CPT -> HF")
def unshard(cfg: RunConfig, cpt: StageResult) -> StageResult:
    stage = Stage(ROWS.unshard.name, cfg, cpt, rel=TRAINING["cpt"].hf)
    if stage.skipped:
        return stage.result
    from tasks.core.models.hf_artifact import (
        build_hf_dir,
    )  # here: the converter imports torch, which a skipped stage never needs

    ckpt, source = stage.store.stage_in(cpt.rel), stage.store.stage_in(BASE)
    with stage.build() as out, ui.WorkProgress(ROWS.unshard.name).reporting():  # shards, the proof: lines with an ETA
        built = build_hf_dir(
            ckpt,
            out.dir,
            source,
            cfg.export,  # its shard size: otherwise the checkpoint as it is (bridge)
            weights_dtype=cfg.cpt.plugin.precision,
            bridge=True,
            verify_memory_gb=cfg.verify_memory_gb,
            # the RoPE and position settings CPT trained with, which its checkpoints' config.json holds
            config_updates=config_changes(cfg.cpt.context),
        )
        out.manifest(
            kind="hf-model",
            parent=cpt,
            fingerprint=built["fingerprint"],
            known_hashes=built["known_hashes"],
            meta={
                "from_checkpoint": cpt.uri,
                "plugin": cfg.cpt.plugin.model_dump(mode="json"),
                "verification": built["verification"],
                "data_split": recorded_split(stage.store, "cpt"),  # what CPT trained on and what it held out
                "context": config_changes(cfg.cpt.context),  # config.json fields CPT changed from base/'s
            },
        )
    return stage.done({"fingerprint_max_abs_diff": built["verification"]["fingerprint_max_abs_diff"]})
