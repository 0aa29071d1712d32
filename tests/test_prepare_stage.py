"""The prepare_data stage under Prefect: mapped tokenize tasks on a process pool and on a real Dask
LocalCluster, skip and increment of a two-source mixture, bad records named by file and line before
any training process.

    python -m pytest -m integration tests/test_prepare_stage.py
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from tasks.core.run.manifest import MANIFEST, STAMP
from tests.conftest import REPO, prepare_cpt, tiny_config_raw, write_config

pytestmark = pytest.mark.integration


def _lines(n: int, tag: str) -> list[str]:
    return [json.dumps({"text": f"{tag} record {i}: Zorvath has {i % 7} moons and {i % 5} rings."}) for i in range(n)]


def _corpus(d: Path) -> Path:
    """Two sources: domain/ with a JSONL and a gzip'd JSONL shard, general/ with a JSONL shard
    holding a malformed line and a parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (d / "domain").mkdir(parents=True)
    (d / "general").mkdir(parents=True)
    (d / "domain" / "a.jsonl").write_text("\n".join(_lines(120, "a")) + "\n")
    with gzip.open(d / "domain" / "b.jsonl.gz", "wt") as f:
        f.write("\n".join(_lines(90, "b")) + "\n")
    c = _lines(80, "c")
    c[41] = '{"text": "cut off'  # line 42: skipped and counted (on_bad_record: skip)
    (d / "general" / "c.jsonl").write_text("\n".join(c) + "\n")
    pq.write_table(pa.table({"text": [json.loads(x)["text"] for x in _lines(60, "d")]}), d / "general" / "d.parquet")
    return d


def _files(root: Path) -> dict[str, bytes]:
    """Every file of a prepared artifact but its manifest (which records where the artifact lives)
    and its verification stamp (which records the files' inodes and times)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).as_posix() not in (MANIFEST, STAMP)
    }


def test_bad_sft_record_stops_the_run_before_boost_and_shard(prefect_harness, tiny_model_dir, tmp_path, capsys):
    from flows.cli import flow_main as main

    corpus = tmp_path / "sft"
    corpus.mkdir()
    rows = [json.loads(x) for x in (REPO / "data/sample/sft.jsonl").read_text().splitlines() if x.strip()]
    lines = [
        json.dumps(
            {"messages": [{"role": "user", "content": f"{i}: {r['messages'][0]['content']}"}, *r["messages"][1:]]}
        )
        for i, r in enumerate(rows * 8)
    ]
    (corpus / "part-0.jsonl").write_text("\n".join(lines[:320]) + "\n")
    second = lines[320:640]
    second[299] = json.dumps(
        {"messages": [{"role": "user", "content": "is anyone there?"}]}
    )  # line 300: no assistant turn
    (corpus / "part-1.jsonl").write_text("\n".join(second) + "\n")
    assert len(second) == 320
    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["sft"]["data"] = {"uri": str(corpus)}
    # The CLI ends with the failing stage and its cause, exit status 1, no traceback: the operator reads one line.
    assert main(["--config", str(write_config(tmp_path / "bad.yaml", raw))]) == 1
    out = capsys.readouterr()
    assert re.search(r"part-1\.jsonl:300: no assistant message", (out.out + out.err).strip().splitlines()[-1]), (
        out.out + out.err
    )[-2000:]
    stages = {s["stage"]: s for s in json.loads((tmp_path / "run/run.json").read_text())["stages"]}
    assert stages["prepare_cpt"]["status"] == "completed" and stages["prepare_sft"]["status"] == "failed"
    assert "part-1.jsonl:300" in stages["prepare_sft"]["detail"]["error"]
    assert (
        stages["boost_and_shard"]["status"] == "not-run" and not (tmp_path / "run/cpt").exists()
    )  # no training process started
    # The good file stays tokenized for the retry after the fix.
    assert len([p for p in (tmp_path / "run/data-cache/sft/shards").iterdir() if (p / "summary.json").is_file()]) == 1


def test_pool_and_dask_skip_increment_and_identical_shards(prefect_harness, tiny_model_dir, tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    sources = [
        {"name": "domain", "uri": str(corpus / "domain"), "weight": 0.7},
        {"name": "general", "uri": str(corpus / "general"), "weight": 0.3},
    ]
    data = {"sources": sources, "on_bad_record": "skip", "max_bad_records": 5, "tokenize": {"workers": 2}}
    raw = tiny_config_raw(tiny_model_dir, tmp_path / "pool")
    raw["cpt"]["data"] = data
    cfg = write_config(tmp_path / "pool.yaml", raw)

    first = prepare_cpt(cfg)
    assert first.status == "completed" and first.detail["files"] == 4 and first.detail["tokenized"] == 4
    manifest = json.loads((tmp_path / "pool/data/cpt" / MANIFEST).read_text())
    assert manifest["meta"]["totals"]["skipped"] == 1 == first.detail["skipped"]
    index = json.loads((tmp_path / "pool/data/cpt/index.json").read_text())
    assert [f["input"]["uri"].rsplit("/", 1)[-1] for f in index["files"]] == [
        "a.jsonl",
        "b.jsonl.gz",
        "c.jsonl",
        "d.parquet",
    ]
    assert "c.jsonl:42: malformed JSON" in index["files"][2]["bad_records"][0]
    # The blend of the 8 planned steps of 4 blocks, in the index, the manifest and the stage's result.
    assert [(s["name"], s["files"], s["samples"]) for s in index["sources"]] == [
        ("domain", [0, 2], 22),
        ("general", [2, 4], 10),
    ]
    assert manifest["meta"]["sources"] == index["sources"] and manifest["meta"]["blend"]["positions"] == 32
    assert first.detail["sources"]["general"]["token_share"] == 0.3125  # 10 of 32 blocks: the closest to 0.3
    blend = (tmp_path / "pool/data/cpt/blend.items").read_bytes()

    assert prepare_cpt(cfg).status == "skipped"  # same inputs, tokenizer and config

    (corpus / "domain" / "e.jsonl").write_text("\n".join(_lines(50, "e")) + "\n")
    grown = prepare_cpt(cfg)
    assert (
        grown.status == "completed" and grown.detail["files"] == 5 and grown.detail["tokenized"] == 1
    )  # only the new file
    index = json.loads((tmp_path / "pool/data/cpt/index.json").read_text())
    assert [s["files"] for s in index["sources"]] == [[0, 3], [3, 5]] and (
        tmp_path / "pool/data/cpt/blend.items"
    ).read_bytes() != blend

    # The same corpus on a real dask.distributed LocalCluster of 2 worker processes, its files cut in ~2 KB
    # chunks (JSONL byte ranges, the gzip'd stream spilled; the bad record's line counted): the same bytes.
    raw["run_root"] = str(tmp_path / "dask")
    raw["cpt"]["data"] = {**data, "tokenize": {"local_cluster": {"n_workers": 2}, "chunk_mb": 0.002}}
    on_dask = prepare_cpt(write_config(tmp_path / "dask.yaml", raw))
    assert on_dask.status == "completed" and on_dask.detail["tokenized"] == 5
    assert len(list((tmp_path / "dask/data-cache/cpt/chunks").glob("*/summary.json"))) >= 6
    pool_files, dask_files = _files(tmp_path / "pool/data/cpt"), _files(tmp_path / "dask/data/cpt")
    assert set(pool_files) == set(dask_files) and len(pool_files) > 5 * 4
    assert [k for k in pool_files if pool_files[k] != dask_files[k]] == []  # tokens, offsets, summaries, index.json


_EPHEMERAL_PROBE = """
import json, os
from prefect import flow, task
from prefect.settings import PREFECT_API_URL
from prefect.task_runners import ProcessPoolTaskRunner
from tasks.stages.prepare_data import worker_api

@task
def probe(i):
    return {"pid": os.getpid(), "api": PREFECT_API_URL.value()}

@flow
def fan_out():
    return [f.result() for f in probe.map(range(2))]

@flow
def outer():
    with worker_api() as url:
        return {"url": url, "parent": os.getpid(), "workers": fan_out.with_options(task_runner=ProcessPoolTaskRunner(max_workers=2))()}

print("PROBE " + json.dumps(outer()))
"""


def test_pool_workers_reach_the_ephemeral_api_of_the_flow_process(tmp_path):
    """Without PREFECT_API_URL (an ephemeral server only the flow's process knows), the URL that
    `worker_api` puts in the settings is the one every process-pool worker talks to."""
    import os
    import subprocess
    import sys

    from flows.embedded_api import STARTUP_TIMEOUT_S, TIMEOUT_SETTING
    from support.servers.prefect_home import seeded_home

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(seeded_home(tmp_path / "prefect-home")),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=str(REPO),
    )
    # The probe is a plain Prefect flow, not the flow CLI: give its ephemeral server the start-up
    # time the CLI gives (flows/embedded_api.py) instead of Prefect's 20 s, which a loaded 2-core
    # machine can exceed.
    env[TIMEOUT_SETTING] = str(STARTUP_TIMEOUT_S)
    out = subprocess.run(
        [sys.executable, "-c", _EPHEMERAL_PROBE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PROBE "))[len("PROBE ") :])
    assert probe["url"].startswith("http://127.0.0.1:")
    workers = probe["workers"]
    assert len(workers) == 2 and all(w["pid"] != probe["parent"] for w in workers), probe
    assert {w["api"] for w in workers} == {probe["url"]}, probe
