"""The two engine verbs, `shard` and `train`, as they run inside every torchrun rank.

    torchrun --nproc_per_node=2 -m tasks.engine shard --config JOB.json   # -> stage_dir/step-000000
    torchrun --nproc_per_node=2 -m tasks.engine train --config JOB.json   # resume, train, checkpoint

One optimizer step = micro_batch_size * grad_accum_steps sequences per data-parallel rank, dp_size
ranks (world / (tp * pp)); every rank computes the same global order (`ResumableSampler`) and takes
its slice. pp > 1: one `booster.execute_pipeline` call per step over num_microbatches micro-batches.
Otherwise grad_accum_steps forward/backward passes (`booster.no_sync` on all but the last where the
plugin allows it), each loss divided by grad_accum_steps. The logged loss is the mean of the
micro-batch losses, averaged over data-parallel replicas, in float64.

The plugin, booster, optimizer, schedule, checkpoint saving and fingerprints of a stage live in
`tasks.engine.boosted.Engine`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tasks.core.config.batching import BATCHING, micro_width
from tasks.core.config.elastic import keep_global_batch
from tasks.core.config.notices import worth_saving
from tasks.core.config.phases import PHASES
from tasks.core.config.sequence import sp_factor
from tasks.core.data.index import check_fits_model
from tasks.core.errors import ManifestError, Preempted
from tasks.core.launch.notice_watch import Watch, polls_here
from tasks.core.models.families import attention_note
from tasks.core.run import segments
from tasks.core.run.events import PREEMPTED, PROGRESS, STARTUP
from tasks.core.run.hostpeak import HostPeak
from tasks.core.run.stages import PEAK_FIELDS, STEP_RE, STEP_SUMMARY, SUMMARY_FIELDS
from tasks.engine import checkpoint as ckpt
from tasks.engine import hostmem, lora
from tasks.engine.boosted import Engine, emit, log
from tasks.engine.builders import plugin_meta
from tasks.engine.faults import Injector
from tasks.engine.metrics import StepMetrics, count_params
from tasks.engine.preconditions import Job

# When this rank's process started (epoch s): set by tasks/engine/__main__.py, before its imports.
RANK_STARTED: float | None = None

__all__ = ["StageData", "find_start", "shard", "train"]

PREFERENCE = "preference"  # train_state.json's per-step figures of a pair phase: {figure: [one a step]}
PREFERENCE_FIGURES = ("accuracy", "margin", "chosen_logp")


class StageData:
    """The stage's prepared token shards (memory-mapped) and the resumable global order.

    Start-up reads index.json and maps shards lazily, so its time and memory do not grow with the
    corpus; a batch gathers its rows from the page cache, which every rank on a node shares.

    A mixture (`data.sources`): the blended stream prepare_data wrote defines the epoch's item
    stream, which the sampler walks in place of a permutation, and the batching row composes with
    it as with a permutation (SFT `grouped` sorts and shuffles global batches inside chunks of the
    stream, `packed` packs chunks of it into rows). The blend is decided once, per position, so the
    order is the same on every rank, and a checkpoint's (epoch, offset) resumes it bitwise. Chosen
    over sampling a source per batch in the rank: the shares are exact over the planned steps and
    visible before training, and a resume needs no state but the offset.
    """

    def __init__(self, job: Job, dp_rank: int, dp_size: int):
        from tasks.core.data.blend import check_plan
        from tasks.core.data.dataset import TokenDataset
        from tasks.core.data.stage_data import blend_plan
        from tasks.engine.sampler import LengthGroups, Packs, ResumableSampler

        cfg = job.phase_cfg
        self.dataset = TokenDataset(job.data_dir, seq_len=cfg.seq_len)
        if self.dataset.kind != job.phase:
            raise ValueError(
                f"{job.data_dir} holds {self.dataset.kind} data, but this is the {job.phase} phase: point data_dir at "
                f"data/{job.phase}"
            )
        self.num_items = len(self.dataset)
        if self.num_items == 0:
            raise ValueError(
                f"{job.data_dir} has no training sequence of seq_len={cfg.seq_len} ({self.dataset.index['totals']}): "
                "add data or lower seq_len"
            )
        self.per_rank = cfg.micro_batch_size * cfg.grad_accum_steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.micro, self.seq_len = cfg.micro_batch_size, cfg.seq_len
        self.pipeline = cfg.plugin.pp_size > 1
        self.batching = BATCHING[cfg.batching]
        self.lengths = self.dataset.lengths()  # one offsets array per file: no token is read
        self.tokens = self.lengths  # real tokens of each unit the sampler walks
        self.rows_per_unit = 1
        # A pair phase: the sampler walks pairs (two rows each, batched whole with their reference
        # log-probabilities, tasks/engine/pairs.py); `lengths` are the pairs' widths, their longer row. A
        # mixture's blend counts pairs too (prepare's `_mixture`): its stream's item ids are pair ids.
        self.pairs = None
        if PHASES[self.dataset.kind].record == "pair":
            from tasks.engine.pairs import PairData

            self.pairs = PairData(self.dataset, job.reference_dir, job.data_dir)
            self.num_items, self.lengths = self.pairs.pairs, self.pairs.lengths
            self.tokens, self.rows_per_unit = self.pairs.tokens, 2
        group = None
        rows = PHASES[self.dataset.kind].rows  # a record a row: `batching` orders or packs the rows
        self.packs = rows and self.batching.packs and self.pairs is None  # pairs are never packed (pre-flight)
        # CPT blocks whose documents are kept apart (cpt.attention: document): the packed rows' inputs
        self.documents = not rows and cfg.attention == "document"
        if self.packs:
            group = Packs(self.lengths, self.seq_len)
        elif rows and self.batching.groups_by_length:
            group = LengthGroups(self.lengths, self.per_rank * dp_size)
        check_plan(self.dataset.index, blend_plan(cfg, job.phase), job.data_dir, job.phase)
        self.sampler = ResumableSampler(
            self.num_items, dp_rank, dp_size, seed=cfg.seed, group=group, stream=self.dataset.blend()
        )

    def check_vocab(self, vocab_size: int, job: Job) -> None:
        # The task compared the tokenizer fingerprints before launching; here the model as built.
        check_fits_model(
            self.dataset.index, job.data_dir, job.model_dir, job.phase, vocab_size=vocab_size, fingerprint=False
        )

    def next_batch(self) -> tuple[list[dict[str, torch.Tensor]], int, int]:
        """This rank's micro-batches of the next global batch (a pipeline: one batch of all its rows,
        which the schedule splits), the global count of real tokens, and of computed ones (rows x
        width, padding included), the same on every rank without a collective."""
        glob = self.sampler.next_global(self.per_rank * self.dp_size)  # packed: rows, each a tuple of conversations
        lens = np.array([int(self.lengths[list(u)].sum()) for u in glob]) if self.packs else self.lengths[glob]
        real = lens if self.packs else self.tokens[glob]
        step = self.per_rank if self.pipeline else self.micro
        widths = [
            micro_width(int(lens[i : i + step].max()), self.seq_len, self.batching, self.pipeline)
            for i in range(0, len(glob), step)
        ]
        first = self.dp_rank * self.per_rank // step
        mine = glob[self.dp_rank * self.per_rank : (self.dp_rank + 1) * self.per_rank]
        build = (
            self.dataset.batch_packed
            if self.packs
            else self.dataset.batch_documents
            if self.documents
            else self.dataset.batch
        )
        if self.pairs is not None:
            micro = [
                self.pairs.batch(mine[j * step : (j + 1) * step], widths[first + j]) for j in range(len(mine) // step)
            ]
        else:
            micro = [
                {
                    k: torch.from_numpy(v)
                    for k, v in build(mine[j * step : (j + 1) * step], width=widths[first + j]).items()
                }
                for j in range(len(mine) // step)
            ]
        return micro, int(real.sum()), sum(w * step * self.rows_per_unit for w in widths)


def _with_adapter(eng: Engine, job: Job, model: torch.nn.Module, adapter_dir: Path | None) -> torch.nn.Module:
    """`model` wrapped in peft by booster.enable_lora (before boost) when the stage trains LoRA; the
    trainable and total parameters go to the log, every progress record and the checkpoint meta."""
    if job.phase_cfg.lora is None:
        return model
    lora.check_targets(model, job.phase_cfg.lora, job.phase)
    model = lora.enable(eng.booster, model, job.phase_cfg.lora, adapter_dir)
    adapted = lora.record_adapted(model)
    counts = lora.param_counts(model)
    eng.lora_meta = {**lora.meta(job.phase_cfg.lora, job.model_dir, counts), "adapted_modules": adapted}
    log(
        f"LoRA r={job.phase_cfg.lora.r} alpha={job.phase_cfg.lora.alpha:g} on {', '.join(adapted)}: "
        f"{counts['trainable_params']:,} trainable of {counts['total_params']:,} parameters "
        f"({counts['trainable_pct']:.3g} %)"
    )
    return model


def _log_construction(peak: HostPeak, what: str) -> None:
    """Every rank: the host memory its model's construction took, as `construction peak N bytes`
    (benchmarks/scale.py and the engine tests read it)."""
    added = peak.added()
    if added is not None:
        log(
            f"construction peak {added[0]} bytes of host memory over the {added[1]} at its start ({what})",
            all_ranks=True,
            detail=True,
        )


def _initial_state(job: Job, sampler_state: dict[str, int], lr: float) -> dict[str, Any]:
    return {
        "phase": job.phase,
        "step": 0,
        "max_steps": job.phase_cfg.max_steps,
        "tokens_seen": 0,
        "sampler": sampler_state,
        "epoch": sampler_state["epoch"],
        "losses": [],
        "lrs": [],
        "lr": lr,
    }


# ------------------------------------------------------------------------------------------------
# verbs


def shard(job: Job, faults: Injector) -> Path:
    """Load the HF model, boost it under the stage's plugin, save step-000000."""
    from tasks.engine.sampler import ResumableSampler

    eng = Engine(job, faults)
    t0, peak = time.monotonic(), HostPeak()
    with hostmem.large_blocks_mapped():
        model = eng.load_pretrained()
        model = _with_adapter(eng, job, model, None)
        eng.boost(model)
        eng.load_pending_weights()  # a lazily built model: its weights, into the sharded model
    _log_construction(peak, "built and read its weights")
    eng.materialize_optimizer_state()
    log(
        f"boosted {job.model_dir} under {plugin_meta(eng.pcfg, eng.cfg)} on {eng.world} ranks "
        f"(dp={eng.layout.dp_size}) in {time.monotonic() - t0:.1f}s",
        detail=True,
    )
    if eng.rank == 0:
        job.stage_dir.mkdir(parents=True, exist_ok=True)
        ckpt.remove_leftovers(job.stage_dir)
    sampler_state = ResumableSampler(1, 0, 1, seed=eng.cfg.seed).state_dict()
    return eng.save(0, _initial_state(job, sampler_state, eng.scheduler.get_last_lr()[0]))


def find_start(job: Job) -> ckpt.ResumePoint:
    """Rank 0 verifies; every rank gets the same answer."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        removed = ckpt.remove_leftovers(job.stage_dir)
        if removed:
            log(f"removed unfinished saves: {', '.join(removed)}")
        box[0] = ckpt.find_resume(job.stage_dir, job.phase, job.config_digest)
    dist.broadcast_object_list(box, src=0)
    rp: ckpt.ResumePoint = box[0]
    for name, why in rp.skipped:
        log(f"not resuming from {name}: {why}")
    if rp.step is None:
        raise ManifestError(
            f"{job.stage_dir}: no complete checkpoint to start {job.phase} training from"
            + (
                f" ({len(rp.skipped)} incomplete or corrupt: {', '.join(n for n, _ in rp.skipped)})"
                if rp.skipped
                else ""
            )
            + "; run the shard verb (boost_and_shard / reboost) first"
        )
    log(rp.announce(job.phase))
    try:  # a family row's word on the attention it trains with, beside transformers' warning at the first step
        note = attention_note(json.loads((job.model_dir / "config.json").read_text()))
    except (OSError, ValueError):
        note = ""  # no config.json to read here: the model's own load names that
    if note:
        log(note)
    return rp


def train(job: Job, faults: Injector) -> Path | None:
    # Listening from the start: a notice during the load is acted on after the first step.
    watch = Watch(job.phase_cfg.elastic.notices, poll=polls_here(), say=lambda m: log(m, all_ranks=True)).start()
    try:
        return _train(job, faults, watch)
    finally:
        watch.close()


def _kept(job: Job, rp: ckpt.ResumePoint) -> Job:
    """The job at the checkpoint's global batch when `elastic.keep_global_batch` asks for it and the
    number of ranks changed it (ConfigError naming the field when no whole accumulation does)."""
    cfg = job.phase_cfg
    was = (rp.manifest.get("meta", {}).get("layout") or {}).get("global_batch")
    if not cfg.elastic.keep_global_batch or was is None:
        return job
    p, world = cfg.plugin, dist.get_world_size()
    dp = max(1, world // (p.tp_size * p.pp_size * sp_factor(p)))
    if cfg.micro_batch_size * cfg.grad_accum_steps * dp == was:
        return job
    kept = keep_global_batch(cfg, job.phase, was, dp, world)
    log(
        f"{job.phase}.elastic.keep_global_batch: grad_accum_steps {cfg.grad_accum_steps} -> {kept.grad_accum_steps} "
        f"on {world} rank(s) (dp {dp}), the global batch of {rp.path.name}: {was} sequences"
    )
    return job.model_copy(update={"phase_cfg": kept})


def _train(job: Job, faults: Injector, watch: Watch) -> Path | None:
    cfg = job.phase_cfg
    # This launch's start-up, rank 0's clock (epoch s): the preemption record's timeline (events.STARTUP)
    marks = {"rank_start": RANK_STARTED, "ready": time.time()}
    faults.at_start()
    rp = find_start(job)
    marks["found"] = time.time()
    if rp.step >= cfg.max_steps:
        log(
            f"{rp.path.name} is at step {rp.step} >= max_steps={cfg.max_steps}: {job.phase} training is complete, "
            "nothing to do"
        )
        return rp.path

    job = _kept(job, rp)
    cfg = job.phase_cfg
    eng = Engine(job, faults)
    data = StageData(job, eng.layout.dp_rank, eng.layout.dp_size)
    t0, peak = time.monotonic(), HostPeak()
    with hostmem.large_blocks_mapped():
        if cfg.lora is not None:  # the frozen base is the job's model_dir, the adapter the checkpoint's
            lora.check_base(rp.manifest, rp.path, job.model_dir)
            model = _with_adapter(eng, job, eng.load_pretrained(), rp.path / lora.ADAPTER)
        else:
            model = eng.from_config()
        n_params = count_params(model)  # before the plugin shards it
        data.check_vocab(model.config.vocab_size, job)
        eng.boost(model)
        marks["restore_begin"] = time.time()
        eng.load(rp.path)
    _log_construction(peak, f"built and loaded {rp.path.name}")
    state = ckpt.read_train_state(rp.path)
    if state.get("step") != rp.step:
        raise ManifestError(
            f"{rp.path}: train_state.json says step {state.get('step')}, the directory is {rp.path.name}"
        )
    now = eng.layout_record()
    was = rp.manifest.get("meta", {}).get("layout") or now  # a checkpoint from before layouts were recorded: this one
    problem = segments.global_batch_problem(was["global_batch"], now)
    if problem:
        raise ManifestError(f"{rp.path}: {problem}")
    runs = list(state.get("segments") or [{"from_step": 0, **was}])
    if not segments.same_layout(runs[-1], now):
        log(
            f"{job.phase}: resuming {rp.path.name}, written under {segments.describe(was)}, under "
            f"{segments.describe(now)}: "
            "model and optimizer re-sharded from the checkpoint's whole tensors"
        )
        runs.append({"from_step": rp.step, **now})
    data.sampler.load_state_dict(state["sampler"])
    if not ckpt.restore_rng(rp.path / "rng", eng.rank):
        log(
            f"{rp.path.name} has no RNG state for rank {eng.rank} (saved with another world size): keeping the launch "
            "seed",
            all_ranks=True,
        )
    marks["restore_end"] = time.time()
    log(
        f"loaded {rp.path.name} in {time.monotonic() - t0:.1f}s; {data.num_items} sequences of {cfg.seq_len} tokens, "
        f"global batch {data.per_rank * data.dp_size} = micro_batch_size {cfg.micro_batch_size} x grad_accum_steps "
        f"{cfg.grad_accum_steps} x dp {data.dp_size}"
    )

    losses, lrs = list(state["losses"]), list(state.get("lrs", []))
    # Per-step figures the stage's summary and the model card report as medians (STEP_SUMMARY).
    summary = {k: list(v) for k, v in (state.get(STEP_SUMMARY) or {}).items()}
    # A pair phase's per-step preference figures (tasks.core.models.preference.metrics), beside the losses.
    preference = {k: list(v) for k, v in (state.get(PREFERENCE) or {}).items()}
    tokens = int(state["tokens_seen"])
    last = rp.path
    started = time.monotonic()
    # purge_step: the steps after the resumed checkpoint are trained again; TensorBoard (and
    # tasks.core.run.tbevents) hide the points an earlier launch wrote for them.
    meter = StepMetrics(
        job.stage_dir,
        rank=eng.rank,
        world=eng.world,
        n_params=n_params,
        model_config=eng.config,
        seq_len=cfg.seq_len,
        precision=eng.pcfg.precision,
        purge_step=rp.step + 1,
    )
    for step in range(rp.step + 1, cfg.max_steps + 1):
        faults.after_step(step - 1, noticed=lambda: watch.noticed)
        micro, ntok, computed = data.next_batch()
        lr = float(eng.scheduler.get_last_lr()[0])
        meter.start()
        loss = eng.train_step(micro, noticed=lambda: watch.noticed)
        metrics = meter.stop(
            step, loss=loss, lr=lr, tokens=ntok, computed=computed, optimizer=eng.optimizer, clip_norm=eng.clip_norm
        )
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"{job.phase} loss is {loss} at step {step} (lr {lr}); lower {job.phase}.lr or check the data"
            )
        losses.append(loss)
        lrs.append(lr)
        figures = {k: eng.pair_metrics[k] for k in PREFERENCE_FIGURES} if eng.pair_metrics else {}
        for key, value in figures.items():
            preference.setdefault(key, []).append(value)
        for key in (*SUMMARY_FIELDS, *PEAK_FIELDS):
            summary.setdefault(key, []).append(metrics.get(key))
        tokens += ntok
        emit(
            PROGRESS,
            {
                "phase": job.phase,
                "step": step,
                "total": cfg.max_steps,
                "loss": loss,
                "lr": lr,
                "tokens": tokens,
                "elapsed_s": round(elapsed := time.monotonic() - started, 3),
                "eta_s": round(elapsed / (step - rp.step) * (cfg.max_steps - step), 1),
                **metrics,
                **figures,
                **(
                    {k: eng.lora_meta[k] for k in ("trainable_params", "total_params", "trainable_pct")}
                    if eng.lora_meta
                    else {}
                ),
            },
        )
        if step == rp.step + 1:
            emit(STARTUP, {k: round(v, 3) for k, v in (marks | {"first_step": time.time()}).items() if v is not None})
        periodic = step % cfg.checkpoint_every == 0 or step == cfg.max_steps
        if periodic or eng.notice_agreed:
            sampler_state = data.sampler.state_dict()
            state = {
                "phase": job.phase,
                "step": step,
                "max_steps": cfg.max_steps,
                "tokens_seen": tokens,
                "sampler": sampler_state,
                "epoch": sampler_state["epoch"],
                "losses": losses,
                "lrs": lrs,
                "lr": float(eng.scheduler.get_last_lr()[0]),
                STEP_SUMMARY: summary,
                "segments": runs,  # the layout of each stretch of steps (tasks/core/run/segments.py)
                **({PREFERENCE: preference} if preference else {}),
            }
        if periodic:
            last = eng.save(step, state)
        if eng.notice_agreed and step < cfg.max_steps:
            meter.close()
            last = _stop_on_notice(eng, watch, step, state, last, periodic)
    meter.close()
    return last


def _stop_on_notice(eng: Engine, watch: Watch, step: int, state: dict[str, Any], last: Path, saved: bool) -> Path:
    """Every rank agreed on a notice after `step`: commit its checkpoint (unless this step's periodic
    one is already committed, or the grace left is shorter than this launch's last save took, when
    the newest committed checkpoint stands), say so in a `@@preempted` event and raise Preempted."""
    # Each rank's notice, if any: the one whose grace ends first sets the budget (a notice may reach one rank only).
    mine = (watch.first.source, time.monotonic() - watch.first.at, watch.first.grace_s) if watch.first else None
    heard: list[Any] = [None] * eng.world
    dist.all_gather_object(heard, mine)
    source, age, grace = min((h for h in heard if h is not None), key=lambda h: h[2] - h[1])  # the nearest end
    t0, left = time.monotonic(), grace - age
    noticed_at = time.time() - age  # epoch s, for the record's timeline
    if not saved and worth_saving(left, eng.save_s):
        last, saved = eng.save(step, state), True
    # From the name: under per-node staging another node's copy holds its own parts only.
    m = STEP_RE.match(Path(str(last)).name)
    committed = int(m.group(1)) if m else None
    record = {
        "phase": eng.job.phase,
        "source": source,
        "grace_s": grace,
        "noticed_step": step,
        "checkpoint_step": committed,
        "checkpoint": str(last),
        "steps_lost": step - committed if committed is not None else step,
        "notice_to_commit_s": round(age + time.monotonic() - t0, 3) if saved else None,
        "grace_left_s": round(left - (time.monotonic() - t0), 3),
        # epoch s (tasks/core/run/preemptions.py): the commit only when this notice saved one
        "timeline": {"notice": round(noticed_at, 3), **({"commit": round(time.time(), 3)} if saved else {})},
    }
    if not saved:
        log(
            f"preemption: {left:.1f}s of grace left after step {step}, the last save took {eng.save_s:.1f}s: "
            f"not saving; {Path(str(last)).name} stands"
        )
    emit(PREEMPTED, record)
    raise Preempted(
        f"{eng.job.phase} preempted ({source}) after step {step}: {Path(str(last)).name} committed "
        + (f"{record['notice_to_commit_s']:.1f}s after the notice, " if saved else "before the notice, ")
        + f"grace {grace:g}s; steps lost {record['steps_lost']}",
        record=record,
    )
