"""Stage reference: the SFT model's log-probabilities of every DPO train pair, the artifact DPO trains against.

    python -m flows.cpt_to_sft --config examples/tiny-cpu-dpo.yaml   # runs it after unshard_sft

A row of the dpo phase (tasks/core/run/stages.py). The reference model (sft/hf, the model DPO starts
from) never changes, so its log-probabilities are computed once, here in the flow process as the
evaluations are (plain `transformers`, fp32, CUDA when the worker has one), and the training ranks
hold one model. The artifact is `tasks.core.evaluation.reference.write_reference`'s (logps.npy,
tokens.npy, the manifest last); its digest is made from sft/hf's and data/dpo's content, so another
SFT model or other pairs compute it again, and train_dpo's job names it (`Job.reference_dir`).
"""

from __future__ import annotations

from prefect import get_run_logger

from tasks.core.config.schema import RunConfig
from tasks.core.data.stage_data import prepared_dir
from tasks.core.run.stages import ROWS
from tasks.flowkit import ui
from tasks.flowkit.stage import Stage, StageResult, stage_task


@stage_task(ROWS.reference, task_run_name="reference: the SFT model's log-probabilities of the DPO pairs")
def reference(cfg: RunConfig, sft_model: StageResult, data: StageResult) -> StageResult:
    stage = Stage(ROWS.reference.name, cfg, sft_model, data)
    if stage.skipped:
        return stage.result
    # Imported when the stage runs: torch and transformers, which a skipped stage never needs.
    from tasks.core.evaluation.heldout import eval_device, load_model
    from tasks.core.evaluation.reference import write_reference

    store = stage.store
    model_dir, data_dir = store.stage_in(sft_model.rel), prepared_dir(store, "dpo")
    model = load_model(model_dir, "fp32", eval_device(), cfg.base_model.trust_remote_code)
    batch_pairs = max(1, cfg.phase("dpo").eval.batch_size // 2)  # the evaluation's rows a forward, in pairs
    with stage.build() as out, ui.WorkProgress(ROWS.reference.name).reporting():
        link = {"uri": sft_model.uri, "digest": sft_model.digest}
        m = write_reference(model, data_dir, out.dir, "train", batch_pairs, parent=link, config_digest=stage.digest)
        out.wrote_manifest = True  # write_reference writes it, last
    get_run_logger().info("reference: %d pairs scored by %s", m["meta"]["pairs"], sft_model.uri)
    return stage.done({"pairs": m["meta"]["pairs"]}, event={"pairs": m["meta"]["pairs"]})
