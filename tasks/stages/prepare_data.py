"""Stages prepare_cpt / prepare_sft: a training stage's corpus -> data/<phase>/ memory-mapped token shards.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # both run right after load_from_hf

Both run before any training process starts (before boost_and_shard), with the base model's
tokenizer, so a bad record anywhere in either corpus stops the run naming the user's file and line.
reboost checks that the CPT model's tokenizer is the one the SFT shards were made with.

- The skip rule is the stage protocol's: data/<phase>/manifest.json verifies and records this
  digest, which covers the data config (not the task runner), the split, seq_len, the tokenizer
  fingerprint and every input file's size and checksum/etag. Adding one file re-runs the stage,
  and inside it only that file is tokenized.
- The files still to tokenize are submitted as `tokenize_item` tasks in a subflow whose task runner
  comes from `data.tokenize`: Prefect's ProcessPoolTaskRunner (default; one unit: a thread here), or prefect-dask's
  DaskTaskRunner on a running scheduler or a `distributed.LocalCluster` it starts. A file larger than
  `data.tokenize.chunk_mb` is split at record boundaries into chunks, each a task, merged back into
  the file's shard byte for byte (tasks/core/data/chunks.py, tasks/core/data/schedule.py `drive`),
  so one large file keeps every worker busy.
- Shards are written into `<staging>/data-cache/<phase>/shards/<key>/` (key: input checksum,
  tokenizer, spec), summary last. A failed run keeps every file already tokenized there, and the
  retry reuses them, each only after its files match the sha256 recorded when it was made (a
  damaged one is dropped, with a warning naming it, and tokenized again). The artifact copies the
  shards it names (never a hard link, so damage to one never reaches the other; a reflink where the
  filesystem has them), writes index.json, then the manifest.
- prepare_cpt also checks `cpt.eval.heldout_sources` (held out only, never trained on) and copies
  their records into the artifact's `heldout-sources/` (tasks/core/data/heldout_only.py); their
  files' identity is part of the digest, like the corpus's.
- Input files that hold no record (0 bytes, blank lines only) are warned about and counted.
- Progress (files, records, tokens, MB/s) goes to a Prefect progress artifact; the token counts
  per split (and the skipped bad records) to a table artifact.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task

from tasks.core.config.data import TokenizeConfig
from tasks.core.config.phases import PHASES, Phase
from tasks.core.config.schema import RunConfig
from tasks.core.data import chunks, truncation
from tasks.core.data import prepare as prep
from tasks.core.data.blend import BLEND_FILE
from tasks.core.data.chunks import Chunk, Whole
from tasks.core.data.index import INDEX
from tasks.core.data.inputs import InputFile
from tasks.core.data.records import iter_file_records
from tasks.core.data.schedule import drive, run_item
from tasks.core.data.shard import ShardSpec, read_summary, shard_dir
from tasks.core.data.spec import prepare_spec
from tasks.core.data.stage_data import HELDOUT_SET
from tasks.core.run.stages import DATA_CACHE, PREPARE, STAGE
from tasks.flowkit import console_log, ui
from tasks.flowkit.stage import Stage, StageResult, stage_task, store_for


@contextmanager
def worker_api() -> Iterator[str]:
    """The Prefect API this process talks to, named in the settings while the block runs; yields its URL.

    Prefect hands the current settings to every task its runner starts elsewhere: a process-pool
    worker gets them as its environment, a Dask task in its serialized context. Without
    PREFECT_API_URL the flow runs on an ephemeral server that only this process knows; a worker
    left to itself would start one of its own (slow, and its task runs would land in another
    database), so the URL is set explicitly for the subflow and its workers.
    """
    import prefect.context
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with get_client(sync_client=True) as client:
        url = str(client.api_url).rstrip("/")
    # The process pool forwards its workers' logs and events from a thread of its own, which sees
    # Prefect's process-wide settings, not this thread's context: without the URL there, it started
    # a throwaway server and the workers' task-run logs (a failure's traceback) never reached the UI.
    prior = prefect.context.GLOBAL_SETTINGS_CONTEXT
    with temporary_settings(updates={PREFECT_API_URL: url}):
        prefect.context.GLOBAL_SETTINGS_CONTEXT = prefect.context.SettingsContext.get() or prior
        try:
            yield url
        finally:
            prefect.context.GLOBAL_SETTINGS_CONTEXT = prior


def _dask_workers(address: str, default: int = 4) -> int:
    """How many workers the running cluster at `address` has now (its width for the chunking)."""
    try:
        from distributed import Client

        with Client(address, timeout=10) as client:
            return max(1, len(client.scheduler_info().get("workers", {}))) or default
    except Exception:
        return default


def tokenize_width(tok: TokenizeConfig) -> int:
    """How many workers `data.tokenize` gives (a running Dask cluster: its workers now)."""
    if tok.dask_address:
        return _dask_workers(tok.dask_address)
    return tok.local_cluster.n_workers if tok.local_cluster else tok.workers


def task_runner_for(tok: TokenizeConfig, units: int, width: int | None = None):
    """The task runner `data.tokenize` names: a process pool, or Dask (a scheduler or a LocalCluster),
    for `units` files and chunks. Its workers reach this run's Prefect API when the subflow runs
    inside `worker_api()`."""
    width = min(width or tokenize_width(tok), units)
    if tok.dask_address or tok.local_cluster:
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError:
            raise ValueError(
                "data.tokenize names a Dask cluster but prefect-dask is not installed: pip install "
                "'prefect-dask==0.3.7'"
            ) from None
        if tok.dask_address:
            return DaskTaskRunner(address=tok.dask_address)
        # One thread per worker process: the tokenizer holds the GIL between its Rust calls.
        return DaskTaskRunner(
            cluster_class="distributed.LocalCluster",
            cluster_kwargs={"n_workers": width, "threads_per_worker": 1, "processes": True},
        )
    from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

    if width == 1:
        # One unit at a time: a worker process would only add its start-up (spawn, imports) to it.
        return ThreadPoolTaskRunner(max_workers=1)
    return ProcessPoolTaskRunner(max_workers=width)  # no idle worker to spawn


@task(name="tokenize_item", task_run_name="tokenize {item.label}")
def tokenize_item(item: Chunk | Whole, spec: ShardSpec, tokenizer_dir: str, out_dir: str) -> dict[str, Any]:
    console_log.from_environment()  # a pool or Dask worker prints to the run's console too
    if multiprocessing.parent_process() is not None:
        # A pool or Dask worker process = one core: the tokenizer's own thread pool would
        # oversubscribe the machine (set before its first use in this process).
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ.setdefault("RAYON_NUM_THREADS", "1")
    return run_item(item, spec, tokenizer_dir, out_dir)


class _Tasks:
    """schedule.drive's runner over Prefect: each file or chunk a `tokenize_item` task run."""

    def __init__(self, spec: ShardSpec, tokenizer_dir: str, out_dir: str):
        self.kw = {"spec": spec, "tokenizer_dir": tokenizer_dir, "out_dir": out_dir}

    def submit(self, item):
        return tokenize_item.submit(item, **self.kw)

    def wait(self, handles):
        from prefect.futures import as_completed

        return [next(iter(as_completed(handles)))]

    def result(self, future):
        return future.result()


@flow(name="tokenize-files", flow_run_name="tokenize {phase}: {n} files", validate_parameters=False)
def tokenize_files(
    phase: Phase,
    n: int,
    inputs: list[InputFile],
    todo: list[int],
    spec: ShardSpec,
    tokenizer_dir: str,
    out_dir: str,
    chunk_bytes: int,
    width: int,
) -> list[dict]:
    """inputs[todo], a file larger than `chunk_bytes` in chunks, at most `width` task runs in flight (one queued
    beyond the workers); all finish (their shards stay) before the first error, in corpus order, is raised."""
    report = ui.DataProgress(phase, n, sum(inputs[i].size for i in todo))
    work = chunks.work(inputs, todo, spec, Path(out_dir), chunk_bytes, largest_first=width > 1)
    done = drive(work, _Tasks(spec, tokenizer_dir, out_dir), width + 1 if width > 1 else 1, spec, out_dir, report)
    return [done[i] for i in todo]


@stage_task(*(STAGE[n] for n in PREPARE.values()), name="prepare_data", task_run_name="{phase}: tokenize data")
def prepare_data(cfg: RunConfig, phase: Phase, source: StageResult) -> StageResult:
    """Tokenize `phase`'s corpus with `source`'s tokenizer into data/<phase>/ (token shards, index, held-out
    records)."""
    logger = get_run_logger()
    phase_cfg = cfg.phase(phase)
    name = PREPARE[phase]
    store = store_for(cfg)
    tok_dir = store.local_path(source.rel) if store.local else store.stage_in(source.rel)
    cache = store.staging / DATA_CACHE / phase
    d = phase_cfg.data
    spec = prepare_spec(phase_cfg, phase)
    sources, only, plan_steps = spec.sources, spec.heldout_sources, spec.blend_plan
    p = prep.plan(spec, tok_dir, cache)
    # A mixture's blend is made for the planned steps: they are inputs of this digest, and only then.
    inputs = {"spec": p.spec.key_fields(), "files": [f.to_json() for f in p.inputs]}
    if plan_steps is not None:
        inputs["blend"] = {
            "plan": plan_steps.to_json(),
            "sources": [[s.name, s.weight, list(p.ranges[i])] for i, s in enumerate(sources)],
        }
    if only:  # evaluated, never trained on: their files' identity, like the corpus's
        inputs["heldout_sources"] = [
            [s.name, [f.to_json() for f in files]] for s, files in zip(only, p.heldout_only_inputs)
        ]
    st = Stage(name, cfg, inputs=inputs)
    if st.skipped:  # the counts run.json and the stage table show, as the artifact's index recorded them
        st.result.detail.update(_recorded_truncation(store, STAGE[name].artifact, phase, phase_cfg.seq_len))
        return st.result
    (cache / "shards").mkdir(parents=True, exist_ok=True)
    chunks.clean_stale(cache)  # a worker killed mid-file or mid-chunk; its summary never landed
    if p.not_data:  # pre-flight named them too: never read, and said once more where the stage's log is kept
        logger.info(
            "%s: skipped %d file(s) that are not data (%s.data.formats: %s): %s",
            name,
            len(p.not_data),
            phase,
            ", ".join(d.formats),
            ", ".join(p.not_data[:10]) + (f" and {len(p.not_data) - 10} more" if len(p.not_data) > 10 else ""),
        )
    for damaged in p.dropped:
        logger.warning("%s: %s", name, damaged)
    logger.info(
        "%s: %d input files (%.1f MB), %d to tokenize, %d reused from %s",
        name,
        len(p.inputs),
        sum(f.size for f in p.inputs) / 1e6,
        len(p.todo),
        len(p.inputs) - len(p.todo),
        cache,
    )
    if p.todo:
        width = tokenize_width(d.tokenize)
        sizes = [p.inputs[i].size for i in p.todo]
        c = chunks.chunk_size(sizes, width, int(d.tokenize.chunk_mb * 2**20))
        units = chunks.units(sizes, c)
        runner = task_runner_for(d.tokenize, units, width)
        with worker_api():
            tokenize_files.with_options(task_runner=runner)(
                phase, len(p.todo), p.inputs, p.todo, p.spec, str(tok_dir), str(cache), c, min(width, units)
            )
    summaries = {i: read_summary(shard_dir(cache, p.keys[i])) for i in range(len(p.inputs))}
    index = prep.finalize(p, summaries, workers=1)
    t = index["totals"]
    with st.build() as out:
        for f in index["files"]:
            prep.copy_shard(cache / f["shard"], out.dir / f["shard"])
        shutil.copy2(cache / INDEX, out.dir / INDEX)
        if index["blend"]:
            shutil.copy2(cache / BLEND_FILE, out.dir / BLEND_FILE)
        for src in index.get("heldout_sources") or []:  # checked records of each held-out-only source
            (out.dir / src["file"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cache / src["file"], out.dir / src["file"])
        if p.heldout_inputs:  # evaluation reads eval.heldout_uri's records from the artifact, not the source
            with open(out.dir / HELDOUT_SET, "w", encoding="utf-8") as fh:
                for f in p.heldout_inputs:
                    fh.writelines(
                        json.dumps(rec, ensure_ascii=False, default=str) + "\n"
                        for _, rec in iter_file_records(f.uri, f.fmt, d.max_record_chars)
                    )
        out.manifest(
            kind="token-shards",
            parent=source,
            meta={
                "phase": phase,
                "tokenizer_sha256": index["tokenizer_sha256"],
                "dtype": index["dtype"],
                "split": index["split"],
                "totals": t,
                "on_bad_record": d.on_bad_record,
                "sources": index["sources"],
                "blend": index["blend"] and {k: v for k, v in index["blend"].items() if k != "file"},
                **({"heldout_sources": index["heldout_sources"]} if only else {}),
            },
        )
    prep.prune(cache, index)
    ui.token_table(phase, t)
    ui.mixture_table(phase, index["sources"], index["blend"], index.get("heldout_sources") or [])
    for src in index["sources"]:
        if src.get("epochs", 0) > d.max_source_epochs:
            logger.warning(
                "%s: source %r is repeated %.1f times over the %d planned steps (more than "
                "%s.data.max_source_epochs=%g): "
                "give it more data, a lower weight, or fewer steps",
                name,
                src["name"],
                src["epochs"],
                phase_cfg.max_steps,
                phase,
                d.max_source_epochs,
            )
    # Records longer than seq_len, said once per source: what the rule made of them.
    notes = []
    for src in index["sources"]:
        line = truncation.describe(src.get("truncation"), phase, index["truncation"]["rule"], phase_cfg.seq_len)
        if line:
            notes.append(line if len(index["sources"]) == 1 else f"source {src['name']!r}: {line}")
    for line in notes:
        # a row-per-record phase drops or cuts what is over seq_len; a block stream only continues it
        (logger.warning if PHASES[phase].rows else logger.info)("%s: %s", name, line)
    empty = prep.empty_files(index["files"])
    if empty:
        logger.warning(
            "%s: %d input file(s) hold no record (0 bytes or blank lines only): %s", name, len(empty), ", ".join(empty)
        )
    if t["skipped"]:
        logger.warning(
            "%s: %d bad records skipped (data.on_bad_record: skip); the first: %s",
            name,
            t["skipped"],
            next(b for f in index["files"] for b in f["bad_records"]),
        )
    return st.done(
        {
            "files": t["files"],
            "tokenized": len(p.todo),
            "empty_files": t["empty_files"],
            "cache_dropped": p.dropped,
            "sources": {
                src["name"]: {
                    k: src[k] for k in ("weight", "token_share", "epochs", "tokens_available", "truncation") if k in src
                }
                for src in index["sources"]
            },
            **(
                {
                    "heldout_sources": {
                        src["name"]: {"records": src["records"], "tokens": src["tokens"]}
                        for src in index["heldout_sources"]
                    }
                }
                if only
                else {}
            ),
            "records": t["records"],
            "skipped": t["skipped"],
            "train_tokens": t["train_tokens"],
            "heldout_tokens": t["heldout_tokens"],
            "truncation": {**index["truncation"], **t["truncation"]},
            **({"note": "; ".join(notes)} if notes else {}),
        },
        event={"train_tokens": t["train_tokens"], "skipped": t["skipped"]},
    )


def _recorded_truncation(store: Any, rel: str, phase: Phase, seq_len: int) -> dict[str, Any]:
    try:
        index = json.loads(store.read_text(f"{rel}/{INDEX}"))
    except Exception:  # a view only: the artifact verified, its index is the record
        return {}
    if "truncation" not in index:
        return {}
    line = truncation.describe(index["totals"]["truncation"], phase, index["truncation"]["rule"], seq_len)
    return {"truncation": {**index["truncation"], **index["totals"]["truncation"]}, **({"note": line} if line else {})}


__all__ = [
    "prepare_data",
    "task_runner_for",
    "tokenize_files",
    "tokenize_item",
    "tokenize_width",
    "worker_api",
]
