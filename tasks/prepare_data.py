"""Stage prepare_data (integration draft, issue 14): a stage's corpus -> data/<stage>/ token shards.

    python -m flows.cpt_to_sft --config deployments/configs/tiny-cpu.yaml   # once wired into the flow

DRAFT: not yet called by the flow, no config fields yet, not run under a Prefect API in a test.
It fixes the shape the stage will have:
- prepare_data(cfg, stage, tokenizer_dir) runs before boost_and_shard (CPT) / reboost (SFT).
  Skip rule: the manifest of data/<stage>/ verifies and its config digest matches; the digest
  covers the data and split config, the tokenizer fingerprint and every input's checksum/etag,
  so adding a file re-runs the stage, and inside it only the new file is tokenized.
- The files still to tokenize are mapped as `tokenize_shard` tasks in a subflow whose task runner
  comes from the config: Prefect's ProcessPoolTaskRunner (default), or prefect-dask's
  DaskTaskRunner with a scheduler address or a `distributed.LocalCluster` of n worker processes.
  Shards land under the stage's staging dir keyed by content, so a retry after a failure reuses
  every file already done.
- Progress (files, records, tokens, MB/s) goes to a Prefect progress artifact; the token counts per
  split to a table artifact.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task

from tasks.common import StageResult, completed, done, stage_digest, store_for
from tasks.core.dataprep import prepare as prep
from tasks.core.dataprep.inputs import InputFile
from tasks.core.dataprep.shard import ShardSpec, tokenize_file
from tasks.core.manifest import write_manifest

TOKENS_TABLE_KEY = "cpt-to-sft-data"


def task_runner_for(runner: dict[str, Any] | None):
    """{"kind": "process", "workers": N} | {"kind": "dask", "address": "tcp://..."} | {"kind": "dask", "workers": N}."""
    runner = runner or {"kind": "process"}
    if runner["kind"] == "process":
        from prefect.task_runners import ProcessPoolTaskRunner

        return ProcessPoolTaskRunner(max_workers=runner.get("workers"), initializer=prep._init_worker)
    if runner["kind"] == "dask":
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError:
            raise ValueError("data.prepare.runner.kind is 'dask' but prefect-dask is not installed: pip install 'prefect-dask==0.3.7' (it brings distributed)") from None
        if runner.get("address"):
            return DaskTaskRunner(address=runner["address"])
        # One thread per worker process: the tokenizer holds the GIL between its Rust calls.
        return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs={"n_workers": runner.get("workers", 2), "threads_per_worker": 1, "processes": True})
    raise ValueError(f"data.prepare.runner.kind={runner['kind']!r}: use 'process' or 'dask'")


@task(name="tokenize_shard", task_run_name="tokenize {inp.uri}", retries=1)
def tokenize_shard(inp: InputFile, spec: ShardSpec, tokenizer_dir: str, out_dir: str) -> dict[str, Any]:
    return tokenize_file(inp, spec, tokenizer_dir, out_dir)


@flow(name="prepare_data files", flow_run_name="tokenize {n} files")
def tokenize_files(p: prep.Plan, n: int) -> dict[int, dict]:
    from prefect.futures import as_completed

    report = _progress_reporter(n, sum(p.inputs[i].size for i in p.todo))
    futures = tokenize_shard.map([p.inputs[i] for i in p.todo], spec=p.spec, tokenizer_dir=p.tokenizer_dir, out_dir=str(p.out_dir))
    which = {f.task_run_id: i for f, i in zip(futures, p.todo)}
    out: dict[int, dict] = {}
    for f in as_completed(futures):
        out[which[f.task_run_id]] = summary = f.result()
        report(summary)
    return out


def _progress_reporter(total_files: int, total_bytes: int):
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    aid = create_progress_artifact(0.0, description=f"prepare_data: {total_files} files to tokenize")
    state = {"files": 0, "bytes": 0, "records": 0, "tokens": 0, "t0": time.monotonic()}

    def report(summary: dict) -> None:
        state["files"] += 1
        state["bytes"] += summary["input"]["size"]
        state["records"] += summary["records"]
        state["tokens"] += summary["train"]["tokens"] + summary["heldout"]["tokens"]
        mbs = state["bytes"] / 1e6 / max(1e-9, time.monotonic() - state["t0"])
        update_progress_artifact(aid, 100.0 * state["bytes"] / max(1, total_bytes),
                                 description=f"{state['files']}/{total_files} files, {state['records']:,} records, {state['tokens']:,} tokens, {mbs:.1f} MB/s")

    return report


@task(name="prepare_data", task_run_name="prepare data: {stage}")
def prepare_data(cfg, stage: str, tokenizer_dir: Path, runner: dict[str, Any] | None = None, parent: StageResult | None = None) -> StageResult:
    logger = get_run_logger()
    started = time.monotonic()
    store = store_for(cfg)
    rel = f"data/{stage}"
    st = getattr(cfg, stage)
    kind_field = st.data.text_field if stage == "cpt" else st.data.messages_field
    out = store.local_path(rel)
    p = prep.plan(
        st.data.uri, tokenizer_dir, out, kind=stage, field=kind_field, seq_len=st.seq_len,
        heldout_fraction=st.eval.heldout_fraction if not st.eval.heldout_uri else 0.0, heldout_uri=st.eval.heldout_uri,
        on_bad_record=getattr(st.data, "on_bad_record", "error"), max_bad_records=getattr(st.data, "max_bad_records", 100),
    )
    section = {"data": st.data.model_dump(mode="json"), "split": st.eval.split_section() if hasattr(st.eval, "split_section") else None,
               "seq_len": st.seq_len, "spec": p.spec.key_fields(), "inputs": [f.to_json() for f in p.inputs]}
    cdigest = stage_digest("prepare_data", section, parent.digest if parent else None)
    if completed(store, rel, cdigest):
        logger.info("prepare_data %s: skipped, %s verifies and its inputs, tokenizer and config match", stage, store.uri(rel))
        return StageResult(f"prepare_data_{stage}", "skipped", rel, store.uri(rel), store.manifest_digest(rel), time.monotonic() - started)
    (out / "shards").mkdir(parents=True, exist_ok=True)
    logger.info("prepare_data %s: %d input files, %d to tokenize, %d reused", stage, len(p.inputs), len(p.todo), len(p.inputs) - len(p.todo))
    fresh = tokenize_files.with_options(task_runner=task_runner_for(runner))(p, len(p.todo)) if p.todo else {}
    summaries = {i: fresh.get(i) or prep.read_summary(prep.shard_dir(out, p.keys[i])) for i in range(len(p.inputs))}
    index = prep.finalize(p, summaries)
    prep.prune(out, index)
    write_manifest(out, kind="data", meta={"stage": stage, "totals": index["totals"], "tokenizer_sha256": index["tokenizer_sha256"]}, config_digest=cdigest)
    try:
        from prefect.artifacts import create_table_artifact

        t = index["totals"]
        create_table_artifact([
            {"split": "train", "records": t["train_records"], "tokens": t["train_tokens"]},
            {"split": "held-out", "records": t["heldout_records"], "tokens": t["heldout_tokens"]},
            {"split": "skipped (bad)", "records": t["skipped"], "tokens": 0},
        ], key=f"{TOKENS_TABLE_KEY}-{stage}", description=f"{stage.upper()} data: tokens per split")
    except Exception as exc:  # noqa: BLE001 - the UI table is a view; the manifest holds the counts
        logger.warning("token table artifact unavailable: %s", exc)
    return done(f"prepare_data_{stage}", store, rel, started, totals=index["totals"])
