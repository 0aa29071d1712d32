"""Stages boost_and_shard / reboost (engine verb `shard`) and train CPT / SFT (engine verb `train`).

Both launch `python -m tasks.engine <verb> --config JOB.json` under torchrun with the stage's
layout. Training is never retried by Prefect: the engine resumes from the newest checkpoint
whose manifest verifies, so a retried flow run continues where it broke.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

from prefect import get_run_logger

from tasks import tracking, ui
from tasks.core.config.backends import BACKENDS
from tasks.core.config.schema import RunConfig
from tasks.core.data.stage_data import check_against_model, corpus_of, record_split, split_info
from tasks.core.launch.torchrun import run_engine, stage_fault_env
from tasks.core.run.events import BACKPRESSURE, CHECKPOINT, KERNELS
from tasks.core.run.job import Job, NodeStaging, Parent
from tasks.core.run.stages import (
    PREPARE,
    STAGE,
    TRAIN_STATE,
    TRAINING,
    is_step_name,
    job_file,
    loss_curve_rel,
    step_medians,
)
from tasks.core.run.trainlog import TrainLog
from tasks.core.storage.fs import RunStore
from tasks.core.storage.handshake import manifest_sha256, mark_published
from tasks.core.storage.publisher import Publisher, retain_remote, unpublished_steps
from tasks.prepare_data import prepared_dir
from tasks.stage import Stage, StageResult, stage_task, store_for


def _supersede_foreign(store: RunStore, stage: str, cdigest: str) -> None:
    """Checkpoints made from another config/parent must not be resumed: move the stage dir aside."""
    logger = get_run_logger()
    for name in store.listdir(stage):
        if not is_step_name(name):
            continue
        try:
            foreign = store.read_manifest(f"{stage}/{name}").get("config_digest") != cdigest
        except Exception:  # noqa: S112 - no readable manifest: not a committed checkpoint (manifests come last), so nothing to resume
            continue
        if foreign:
            dest = store.move_aside(stage, "config changed")
            logger.warning(
                "%s holds checkpoints of another config or parent; kept as %s and starting this stage afresh",
                store.uri(stage),
                dest,
            )
            return


def _node_staging(cfg: RunConfig, store: RunStore, stage: str, model_rel: str) -> NodeStaging | None:
    """Per-node staging when the run root is remote and the backend runs ranks on other nodes:
    those nodes see neither the worker's staging nor each other's, so they stage from the run
    root themselves (tasks/engine/node_staging.py): the model, the prepared data artifact
    (`data/<stage>/`, already published by prepare_data) and the newest checkpoint."""
    launch = getattr(cfg, stage).launch
    if store.local or launch.nnodes == 1 or not BACKENDS[launch.backend].remote_nodes:
        return None
    data_rel = STAGE[PREPARE[stage]].artifact
    base = cfg.staging_dir or tempfile.gettempdir()
    return NodeStaging(
        run_uri=cfg.run_uri,
        dir=f"{base}/cpt-to-sft-nodes/{{node}}",
        model_rel=model_rel,
        data_rel=data_rel,
        stage_rel=TRAINING[stage].checkpoints,
    )


def _job(cfg: RunConfig, store: RunStore, stage: str, verb: str, parent: StageResult, cdigest: str) -> Job:
    source_rel = TRAINING[stage].source
    source = (
        store.stage_in(parent.rel if verb == "shard" else source_rel)
        if not store.local
        else store.local_path(source_rel)
    )
    # Before any launch: the shards must have been made with this model's tokenizer (prepare_sft
    # ran with the base model's; the CPT model's must be the same) and fit its vocabulary.
    data = prepared_dir(cfg, stage)
    check_against_model(data, source, stage)
    if verb == "train":
        record_split(store, stage, split_info(data, corpus_of(getattr(cfg, stage).data)))
    nodes = _node_staging(cfg, store, stage, parent.rel if verb == "shard" else source_rel)
    return Job(
        verb=verb,
        stage=stage,
        stage_cfg=getattr(cfg, stage),
        trust_remote_code=cfg.base_model.trust_remote_code,
        verify_memory_gb=cfg.verify_memory_gb,
        model_dir=source,
        tokenizer_dir=source,
        data_dir=data,
        stage_dir=store.local_path(TRAINING[stage].checkpoints),
        parent=Parent(uri=parent.uri, digest=parent.digest),
        config_digest=cdigest,
        nodes=nodes,
        # The engine deletes only checkpoints the publisher marked, and waits when uploads lag.
        remote_run_root=not store.local and nodes is None,
    )


def _launch(cfg: RunConfig, store: RunStore, job: Job, **kwargs: Any) -> None:
    st = job.stage_cfg
    path = store.staging / job_file(job.stage, job.verb)
    run_engine(job.verb, job, path, st.launch, f"{cfg.name}-{job.stage}-{job.verb}", get_run_logger(), **kwargs)


def _shard(cfg: RunConfig, stage: str, parent: StageResult, data: StageResult, task_name: str) -> StageResult:
    # The prepared data's content stands for the corpus itself (a file added to a directory
    # changes it, while the config does not change).
    st = Stage(task_name, cfg, parent, data, rel=TRAINING[stage].step(0))
    cdigest = st.digest
    if st.skipped:
        return st.result
    _supersede_foreign(st.store, stage, cdigest)
    job = _job(cfg, st.store, stage, "shard", parent, cdigest)
    _launch(cfg, st.store, job)
    if job.nodes is not None:  # the nodes published it; done() finds it whole remotely
        st.store.stage_in(st.rel)
    return st.done({"plugin": getattr(cfg, stage).plugin.name})


@stage_task(name="boost_and_shard", task_run_name="boost_and_shard [{cfg.cpt.plugin.name}]")
def boost_and_shard(cfg: RunConfig, base: StageResult, data: StageResult) -> StageResult:
    """Boost the base model under plugin A and save the starting checkpoint cpt/step-000000."""
    return _shard(cfg, "cpt", base, data, "boost_and_shard")


@stage_task(name="reboost", task_run_name="reboost [{cfg.sft.plugin.name}]")
def reboost(cfg: RunConfig, bridge: StageResult, data: StageResult) -> StageResult:
    """Boost the unsharded CPT model under plugin B and save sft/step-000000."""
    return _shard(cfg, "sft", bridge, data, "reboost")


def _train(cfg: RunConfig, stage: str, start: StageResult, tracker: tracking.TrackerHandle | None) -> StageResult:
    st = getattr(cfg, stage)
    store = store_for(cfg)
    run = Stage(f"train_{stage}", cfg, start, rel=TRAINING[stage].step(st.max_steps))  # start's digest, carried on
    cdigest = run.digest
    if run.skipped:
        return run.result
    job = _job(cfg, store, stage, "train", start, cdigest)
    logger = get_run_logger()
    publisher = None
    if not store.local and job.nodes is None:
        _stage_in_latest(store, stage)
        # Uploads run beside the log reader (tasks/core/storage/publisher.py); the reader only enqueues.
        # The stage's TensorBoard files go up beside each published checkpoint, on the publisher's thread.
        # A failed upload is retried with the publisher's bounded backoff (about a minute), then the
        # stage fails naming the checkpoint.
        publisher = Publisher(
            store,
            stage,
            st.keep_last,
            max_queue=st.keep_last + st.max_pending_publishes + 4,
            log=logger,
            on_published=lambda _done: tracking.publish_tensorboard(store, stage),
        ).start()
        for step in unpublished_steps(store.local_path(stage)):  # left by a failed attempt
            publisher.submit(step)
    mlflow_run = tracking.stage_tracker(tracker, stage, warn=logger.warning)
    progress = ui.Progress(stage, st.max_steps, links={"MLflow run": mlflow_run.url} if mlflow_run else None)
    # The console's training log: a line every log_every steps (every step is in TensorBoard, MLflow and the artifact).
    console = TrainLog(stage, st.max_steps, st.log_every)
    p = st.plugin
    logger.info(
        console.start(
            f"{p.name} tp={p.tp_size} pp={p.pp_size} zero={p.zero_stage} {p.precision} | {st.launch.world_size} ranks"
            f" | seq_len {st.seq_len}" + (f", {st.attention} attention" if st.attention != "causal" else "")
        )
    )

    def to_console(record: dict[str, Any]) -> None:
        line = console(record)
        if line:
            logger.info(line)

    def on_event(kind: str, record: dict[str, Any]) -> None:
        if kind == CHECKPOINT and publisher is not None:
            publisher.submit(int(record["step"]))
        elif kind == CHECKPOINT and not store.local:  # per-node staging: the nodes published it themselves
            retain_remote(store, stage, st.keep_last, int(record["step"]))
            tracking.publish_tensorboard(store, stage)
        elif kind == BACKPRESSURE:
            progress.backpressure(record)
        elif kind == KERNELS:
            progress.kernels(record)

    failed = True
    try:
        _launch(
            cfg,
            store,
            job,
            on_progress=tracking.fan_out(progress, mlflow_run, to_console),
            on_event=on_event,
            env=stage_fault_env(stage),
            failure=(lambda: publisher.failure) if publisher is not None else None,
        )
        if publisher is not None:
            publisher.drain()  # every checkpoint up, in order; raises PublishFailed naming one
        failed = False
    finally:
        if publisher is not None:
            publisher.close()
        progress.flush()  # a failed stage shows the step it reached
        if mlflow_run is not None:
            mlflow_run.close(status="FAILED" if failed else "FINISHED")
    if job.nodes is not None:
        store.stage_in(run.rel)
    state = json.loads((store.local_path(run.rel) / TRAIN_STATE).read_text())
    losses = [float(x) for x in state.get("losses", [])]
    # Beside the stage's checkpoints, in the run root itself (S3 included), not only in staging.
    ui.loss_curve(stage, losses, store.uri(loss_curve_rel(stage)))
    final = losses[-1] if losses else None
    medians = step_medians(state)
    logger.info(console.end(run.elapsed, medians))
    peak = {"peak_mem_bytes": console.peak[0], "peak_mem_rank": console.peak[1]} if console.peak else {}
    # "segments": the layout each stretch of steps ran under, when the stage continued under another one (docs/resume.md)
    return run.done(
        {
            "steps": st.max_steps,
            "first_loss": losses[0] if losses else None,
            "final_loss": final,
            "medians": medians,
            # the stage's throughput at its sequence length (long-context stages are compared by both)
            "seq_len": st.seq_len,
            "tokens_per_s": medians.get("tokens_per_s"),
            "segments": state.get("segments") or [],
            **peak,
        },
        event={"final_loss": final},
    )


def _stage_in_latest(store: RunStore, stage: str) -> None:
    names = sorted((n for n in store.listdir(stage) if is_step_name(n)), reverse=True)
    for name in names:
        try:
            local = store.stage_in(f"{stage}/{name}")
            # Verified against its remote manifest: committed remotely, so the engine may delete it.
            mark_published(local, manifest_sha256(local))
            return
        except Exception as exc:  # a checkpoint that fails to stage in is skipped for the next older one
            get_run_logger().warning("not resuming from %s: %s", store.uri(f"{stage}/{name}"), exc)


@stage_task(name="train_cpt", task_run_name="train CPT [{cfg.cpt.plugin.name}]")
def train_cpt(cfg: RunConfig, start: StageResult, tracker: tracking.TrackerHandle | None = None) -> StageResult:
    """Train CPT from `start`; `tracker`: the flow run's MLflow run, which gets a nested run of the steps."""
    return _train(cfg, "cpt", start, tracker)


@stage_task(name="train_sft", task_run_name="train SFT [{cfg.sft.plugin.name}]")
def train_sft(cfg: RunConfig, start: StageResult, tracker: tracking.TrackerHandle | None = None) -> StageResult:
    """Train SFT from `start`; `tracker`: the flow run's MLflow run, which gets a nested run of the steps."""
    return _train(cfg, "sft", start, tracker)
