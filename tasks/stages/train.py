"""Stages boost_and_shard / reboost / reboost_dpo (engine verb `shard`) and train CPT / SFT / DPO (engine verb `train`).

Both launch `python -m tasks.engine <verb> --config JOB.json` under torchrun with the stage's
layout, or share one launch (verb `shard-train`: the train stage adopts the ranks that committed
step 0, tasks/core/launch/shared.py); where the checkpoints go (stay local, published by this worker, published by each node) is
the stage's checkpoint sink, chosen once (tasks/flowkit/checkpoints.py). Training is never retried by Prefect: the engine resumes from the newest checkpoint
whose manifest verifies, so a retried flow run continues where it broke.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml
"""

from __future__ import annotations

import json
import time
from typing import Any

from prefect import get_run_logger

from tasks.core.config.phases import Phase
from tasks.core.config.schema import RunConfig
from tasks.core.data.stage_data import check_against_model, corpus_of, prepared_dir, record_split, split_info
from tasks.core.errors import Preempted
from tasks.core.launch import shared
from tasks.core.launch.torchrun import phase_fault_env, run_engine
from tasks.core.run import preemptions
from tasks.core.run.events import BACKPRESSURE, CHECKPOINT, KERNELS, STARTUP
from tasks.core.run.job import Job, Parent
from tasks.core.run.stages import ROWS, TRAIN_STATE, TRAINING, is_step_name, job_file, loss_curve_rel, step_medians
from tasks.core.run.trainlog import TrainLog
from tasks.core.storage.fs import RunStore
from tasks.flowkit import tracking, ui
from tasks.flowkit.checkpoints import CheckpointSink, checkpoint_sink
from tasks.flowkit.notices import RERUN, cancel_requested
from tasks.flowkit.stage import Stage, StageResult, stage_task


def _supersede_foreign(store: RunStore, phase: str, cdigest: str) -> None:
    """Checkpoints made from another config/parent must not be resumed: move the stage dir aside."""
    logger = get_run_logger()
    for name in store.listdir(phase):
        if not is_step_name(name):
            continue
        try:
            foreign = store.read_manifest(f"{phase}/{name}").get("config_digest") != cdigest
        except Exception:  # noqa: S112 - no readable manifest: not a committed checkpoint (manifests come last), so nothing to resume
            continue
        if foreign:
            dest = store.move_aside(phase, "config changed")
            logger.warning(
                "%s holds checkpoints of another config or parent; kept as %s and starting this stage afresh",
                store.uri(phase),
                dest,
            )
            return


def _job(
    cfg: RunConfig,
    sink: CheckpointSink,
    verb: str,
    parent: StageResult,
    cdigest: str,
    reference: StageResult | None = None,
) -> Job:
    phase, store = sink.phase, sink.store
    model_rel = parent.rel if verb == "shard" else TRAINING[phase].source
    source = sink.stage_in(model_rel)
    # Before any launch: the shards must have been made with this model's tokenizer (prepare_sft
    # ran with the base model's; the CPT model's must be the same) and fit its vocabulary.
    data = prepared_dir(store, phase)
    check_against_model(data, source, phase)
    if verb == "train":
        record_split(store, phase, split_info(data, corpus_of(sink.section.data)))
    return Job(
        verb=verb,
        phase=phase,
        phase_cfg=sink.section,
        trust_remote_code=cfg.base_model.trust_remote_code,
        verify_memory_gb=cfg.verify_memory_gb,
        model_dir=source,
        tokenizer_dir=source,
        data_dir=data,
        stage_dir=store.local_path(TRAINING[phase].checkpoints),
        parent=Parent(uri=parent.uri, digest=parent.digest),
        config_digest=cdigest,
        nodes=sink.nodes,
        remote_run_root=sink.remote_run_root,
        # a pair phase trains against the reference model's log-probabilities (the reference stage's artifact)
        **({"reference_dir": sink.stage_in(reference.rel)} if reference is not None and verb == "train" else {}),
    )


def _launch(store: RunStore, job: Job, run_name: str, **kwargs: Any) -> None:
    path = store.staging / job_file(job.phase, job.verb)
    # a SIGTERM while the ranks train is a notice to them, unless it is Prefect cancelling the run
    run_engine(
        job.verb,
        job,
        path,
        job.phase_cfg.launch,
        f"{run_name}-{job.phase}-{job.verb}",
        get_run_logger(),
        cancelled=cancel_requested,
        **kwargs,
    )


def _shard(
    cfg: RunConfig, phase: Phase, parent: StageResult, data: StageResult, task_name: str, *more: StageResult
) -> StageResult:
    # The prepared data's content stands for the corpus itself (a file added to a directory
    # changes it, while the config does not change). `more`: the row's other parents (dpo: the reference).
    st = Stage(task_name, cfg, parent, data, *more, rel=TRAINING[phase].step(0))
    if st.skipped:
        return st.result
    _supersede_foreign(st.store, phase, st.digest)
    section = cfg.phase(phase)
    sink = checkpoint_sink(st.store, phase, section, parent.rel, cfg.staging_dir)
    job = _job(cfg, sink, "shard", parent, st.digest)
    if not shared.can_share(section.launch, st.store.local):
        _launch(st.store, job, cfg.name)
        sink.finish(st.rel)  # nodes that published it: staged in here; done() finds it whole remotely
        return st.done({"plugin": section.plugin.name})
    # One launch for this stage and the training after it: the ranks wait once step 0 is committed.
    path = st.store.staging / job_file(phase, job.verb)
    shared.start(job, path, f"{cfg.name}-{phase}-{shared.VERB}", get_run_logger())
    try:
        sink.finish(st.rel)
        return st.done({"plugin": section.plugin.name, "launch": "shared"})
    except BaseException:  # not verified: no training may go on from it
        shared.release(phase, get_run_logger(), f"{task_name} failed", graceful=False)
        raise


@stage_task(ROWS.boost_and_shard, task_run_name="boost_and_shard [{cfg.cpt.plugin.name}]")
def boost_and_shard(cfg: RunConfig, base: StageResult, data: StageResult) -> StageResult:
    """Boost the base model under plugin A and save the starting checkpoint cpt/step-000000."""
    return _shard(cfg, "cpt", base, data, ROWS.boost_and_shard.name)


@stage_task(ROWS.reboost, task_run_name="reboost [{cfg.sft.plugin.name}]")
def reboost(cfg: RunConfig, bridge: StageResult, data: StageResult) -> StageResult:
    """Boost the unsharded CPT model under plugin B and save sft/step-000000."""
    return _shard(cfg, "sft", bridge, data, ROWS.reboost.name)


def _train(
    cfg: RunConfig,
    phase: Phase,
    start: StageResult,
    tracker: tracking.TrackerHandle | None,
    reference: StageResult | None = None,
) -> StageResult:
    section = cfg.phase(phase)
    run = Stage(f"train_{phase}", cfg, start, rel=TRAINING[phase].step(section.max_steps))  # start's digest, carried on
    if run.skipped:
        return run.result
    store = run.store
    sink = checkpoint_sink(store, phase, section, TRAINING[phase].source, cfg.staging_dir)
    job = _job(cfg, sink, "train", start, run.digest, reference)
    logger = get_run_logger()
    mlflow_run = tracking.stage_tracker(tracker, phase, warn=logger.warning)
    progress = ui.Progress(phase, section.max_steps, links={"MLflow run": mlflow_run.url} if mlflow_run else None)
    # The console's training log: a line every log_every steps (every step is in TensorBoard, MLflow and the artifact).
    console = TrainLog(phase, section.max_steps, section.log_every)
    p = section.plugin
    logger.info(
        console.start(
            f"{p.name} tp={p.tp_size} pp={p.pp_size} zero={p.zero_stage} {p.precision} | {section.launch.world_size} ranks"
            f" | seq_len {section.seq_len}"
            + (f", {section.attention} attention" if section.attention != "causal" else "")
        )
    )

    first_step: list[float] = []  # when the first step of this attempt ended (restart to first step)
    # This attempt's marks of a preemption's recovery (epoch s): the flow's rerun, the launch, the ranks' start-up
    marks: dict[str, float] = {k: v for k, v in (("rerun", RERUN.get("at")),) if v is not None}

    def to_console(record: dict[str, Any]) -> None:
        if not first_step:
            first_step.append(time.monotonic())
        line = console(record)
        if line:
            logger.info(line)

    def on_event(kind: str, record: dict[str, Any]) -> None:
        if kind == CHECKPOINT:
            sink.on_checkpoint(int(record["step"]))
        elif kind == BACKPRESSURE:
            progress.backpressure(record)
        elif kind == KERNELS:
            progress.kernels(record)
        elif kind == STARTUP:
            marks.update(record)

    # The ranks that sharded step 0, when they wait for this stage (tasks/core/launch/shared.py); else a launch.
    marks["launch"] = time.time()
    live = shared.adopt(job, logger)
    failed = True
    try:
        with sink.start():  # a remote run root: the newest checkpoint staged in, uploads beside training
            try:
                follow = dict(
                    on_progress=tracking.fan_out(progress, mlflow_run, to_console),
                    on_event=on_event,
                    env=phase_fault_env(phase),
                    failure=sink.failure,
                )
                if live is None:
                    _launch(store, job, cfg.name, **follow)
                else:
                    logger.info("%s: adopted the %s launch, whose ranks committed step 0", run.name, live.phase)
                    path = store.staging / job_file(job.phase, job.verb)
                    shared.follow_train(live, job, path, logger, cancelled=cancel_requested, **follow)
            except Preempted as exc:  # inside the sink: its publisher drains before the stage says preempted
                _preempted(
                    store, run.name, phase, sink, exc, first_step[0] - run.started if first_step else None, marks
                )
                raise
            sink.finish(run.rel)
        failed = False
    finally:
        if live is not None:  # adopted but never followed (sink.start failed, say): its ranks must not wait on
            live.discard()
        progress.flush()  # a failed stage shows the step it reached
        if mlflow_run is not None:
            mlflow_run.close(status="FAILED" if failed else "FINISHED")
    state = json.loads((store.local_path(run.rel) / TRAIN_STATE).read_text())
    losses = [float(x) for x in state.get("losses", [])]
    # Beside the stage's checkpoints, in the run root itself (S3 included), not only in staging.
    ui.loss_curve(phase, losses, store.uri(loss_curve_rel(phase)))
    final = losses[-1] if losses else None
    medians = step_medians(state)
    logger.info(console.end(run.elapsed, medians))
    peak = {"peak_mem_bytes": console.peak[0], "peak_mem_rank": console.peak[1]} if console.peak else {}
    # This attempt's start to its first step closes the previous preemption's record.
    preempted = _log(store, phase, first_step[0] - run.started if first_step else None, marks=marks)
    # "segments": the layout each stretch of steps ran under, when the stage continued under another one (docs/resume.md)
    return run.done(
        {
            "steps": section.max_steps,
            "first_loss": losses[0] if losses else None,
            "final_loss": final,
            "medians": medians,
            # the stage's throughput at its sequence length (long-context stages are compared by both)
            "seq_len": section.seq_len,
            "tokens_per_s": medians.get("tokens_per_s"),
            "segments": state.get("segments") or [],
            # "adopted": trained in the ranks the shard stage started (no launch of its own); "own": launched
            "launch": "own" if live is None else "adopted",
            **({"preemptions": preempted} if preempted else {}),
            **peak,
        },
        event={"final_loss": final},
    )


def _log(
    store: RunStore, phase: Phase, restart_s: float | None, add: dict | None = None, marks: dict | None = None
) -> list[dict]:
    """The stage's preemption records (tasks/core/run/preemptions.py), with this attempt's restart
    time and marks and a new record `add` written in; a log that cannot be written is a warning, not a failure."""
    rel = preemptions.log_rel(TRAINING[phase].checkpoints)
    try:
        records = preemptions.parse(store.read_text(rel)) if store.exists(rel) else []
    except OSError:
        records = []
    if not records and add is None:
        return []
    if restart_s is not None:
        records = preemptions.restarted(records, restart_s, marks)
    if add is not None:
        records.append(add)
    try:
        store.write_text(rel, preemptions.dump(records))
    except OSError as exc:
        get_run_logger().warning("%s not written: %s", store.uri(rel), exc)
    return records


def _preempted(
    store: RunStore,
    stage: str,
    phase: Phase,
    sink: CheckpointSink,
    exc: Preempted,
    restart_s: float | None,
    marks: dict,
) -> None:
    """The stage (`stage`, training `phase`) stopped on a notice: publish what it committed (within the
    grace left), keep the record."""
    exited = time.time()  # the launcher raised: ranks and torchrun are gone
    logger = get_run_logger()
    try:
        sink.drain(timeout=max(float(exc.record.get("grace_left_s") or 0.0), 1.0))
    except Exception as err:  # the machine may go first: the newest checkpoint published stands
        logger.warning("the preempted checkpoint was not published in the grace left: %s", err)
    rec = preemptions.record(exc.record, stage, time.time())
    rec["timeline"]["exit"] = round(exited, 3)
    rec["recovery"] = preemptions.recovery(rec["timeline"])
    exc.record.update(rec, preemptions=_log(store, phase, restart_s, rec, marks))
    logger.warning(preemptions.describe(rec))


@stage_task(ROWS.train_cpt, task_run_name="train CPT [{cfg.cpt.plugin.name}]")
def train_cpt(cfg: RunConfig, start: StageResult, tracker: tracking.TrackerHandle | None = None) -> StageResult:
    """Train CPT from `start`; `tracker`: the flow run's MLflow run, which gets a nested run of the steps."""
    return _train(cfg, "cpt", start, tracker)


@stage_task(ROWS.train_sft, task_run_name="train SFT [{cfg.sft.plugin.name}]")
def train_sft(cfg: RunConfig, start: StageResult, tracker: tracking.TrackerHandle | None = None) -> StageResult:
    """Train SFT from `start`; `tracker`: the flow run's MLflow run, which gets a nested run of the steps."""
    return _train(cfg, "sft", start, tracker)


@stage_task(ROWS.reboost_dpo, task_run_name="reboost DPO [{cfg.dpo.plugin.name}]")
def reboost_dpo(cfg: RunConfig, bridge: StageResult, data: StageResult, reference: StageResult) -> StageResult:
    """Boost the unsharded SFT model (sft/hf) under the dpo plugin and save dpo/step-000000, made from the reference too."""
    return _shard(cfg, "dpo", bridge, data, ROWS.reboost_dpo.name, reference)


@stage_task(ROWS.train_dpo, task_run_name="train DPO [{cfg.dpo.plugin.name}]")
def train_dpo(
    cfg: RunConfig, start: StageResult, reference: StageResult, tracker: tracking.TrackerHandle | None = None
) -> StageResult:
    """Train DPO from `start` against `reference`'s log-probabilities; `tracker`: as train_sft's."""
    return _train(cfg, "dpo", start, tracker, reference)
