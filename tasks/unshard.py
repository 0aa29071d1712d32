"""Stage unshard: the final CPT checkpoint (plugin A) -> `cpt/hf/`, the HF-format bridge.

Every plugin can boost from an HF directory, so this is the one handoff between plugins. It is a
streaming conversion on the worker's CPU; the fingerprint proves the logits survived.
"""

from __future__ import annotations

import time

from prefect import task

from tasks import ui
from tasks.common import StageResult, completed, done, fresh_dir, skipped, stage_digest, store_for
from tasks.core.config import RunConfig
from tasks.core.manifest import write_manifest
from tasks.evaluate import recorded_split
from tasks.hf_artifact import build_hf_dir


@task(name="unshard", task_run_name="unshard CPT -> HF")
def unshard(cfg: RunConfig, cpt: StageResult) -> StageResult:
    started = time.monotonic()
    store = store_for(cfg)
    rel = "cpt/hf"
    cdigest = stage_digest("unshard", {}, cpt.digest)
    if completed(store, rel, cdigest):
        return skipped("unshard", store, rel, started)
    ckpt = store.stage_in(cpt.rel)
    source = store.stage_in("base")
    with fresh_dir(store.local_path(rel)) as tmp:
        built = build_hf_dir(ckpt, tmp, source, dtype=None, max_shard_size=cfg.export.max_shard_size, weights_dtype=cfg.cpt.plugin.precision)
        write_manifest(
            tmp, kind="hf-model",
            meta={
                "from_checkpoint": cpt.uri, "plugin": cfg.cpt.plugin.model_dump(mode="json"), "verification": built["verification"],
                "data_split": recorded_split(store, "cpt"),  # what CPT trained on and what it held out
            },
            parent={"uri": cpt.uri, "digest": cpt.digest}, config_digest=cdigest,
            fingerprint=built["fingerprint"], known_hashes=built["known_hashes"],
        )
    result = done("unshard", store, rel, started, fingerprint_max_abs_diff=built["verification"]["fingerprint_max_abs_diff"])
    ui.stage_event("unshard", "completed", cfg.name, result.uri)
    return result
