"""The engine's side of the publish handshake: retention that waits for `.published`, the
backpressure count, the `remote_run_root` job key and the `max_pending_publishes` field (unit
tier); and one real 2-rank torchrun whose checkpoints are published to the real S3 server through
the throttled proxy by the real Publisher (distributed tier).

    .venv/bin/python -m pytest -q tests/test_publish_handshake.py                  # unit, ~3 s
    .venv/bin/python -m pytest -q -s -m distributed tests/test_publish_handshake.py  # ~2-3 min on 2 busy cores
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.core.config.schema import PhaseConfig
from tasks.core.errors import ConfigError
from tasks.core.run.manifest import MANIFEST, write_manifest
from tasks.core.storage.handshake import is_published, manifest_sha256, mark_published
from tasks.engine import checkpoint as ckpt
from tasks.engine.preconditions import parse_job

pytest_plugins = ["tests.conftest_servers"]
MB = 1 << 20


def _ckpt(stage_dir: Path, step: int, published: bool = False) -> Path:
    d = stage_dir / ckpt.step_name(step)
    d.mkdir(parents=True)
    (d / "train_state.json").write_text(json.dumps({"step": step}))
    write_manifest(d, kind=ckpt.KIND, meta={"phase": "cpt", "step": step})
    if published:
        mark_published(d, manifest_sha256(d))
    return d


def _names(stage_dir: Path) -> list[str]:
    return sorted(p.name for _, p in ckpt.list_steps(stage_dir))


@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_remote_retention_never_deletes_an_unpublished_checkpoint(tmp_path, keep_last):
    _ckpt(tmp_path, 0)
    for s in range(1, 7):
        _ckpt(tmp_path, s, published=s in (1, 4))  # 2, 3, 5, 6 still uploading
    removed = ckpt.retain(tmp_path, keep_last, require_published=True)
    kept_newest = {ckpt.step_name(s) for s in range(7 - keep_last, 7)}
    assert set(removed) == {"step-000001", "step-000004"} - kept_newest
    assert set(_names(tmp_path)) == {ckpt.step_name(s) for s in range(7)} - set(removed)
    assert ckpt.unpublished(tmp_path) == ["step-000006", "step-000005", "step-000003", "step-000002"]
    # A local run root (no marker needed: nothing is uploaded) keeps exactly keep_last.
    local = tmp_path / "local"
    for s in range(7):
        _ckpt(local, s)
    ckpt.retain(local, keep_last)
    assert _names(local) == ["step-000000"] + sorted(ckpt.step_name(s) for s in range(7 - keep_last, 7))


def test_marker_of_another_manifest_does_not_count(tmp_path):
    d = _ckpt(tmp_path, 2, published=True)
    assert is_published(d) and ckpt.unpublished(tmp_path) == []
    (d / MANIFEST).write_text((d / MANIFEST).read_text().replace('"step": 2', '"step": 2 '))
    assert not is_published(d) and ckpt.unpublished(tmp_path) == ["step-000002"]
    _ckpt(tmp_path, 3)
    assert ckpt.retain(tmp_path, 1, require_published=True) == []  # step 2 is not deletable now


def _job(**extra) -> dict:
    from support.engine import phase_raw

    section = phase_raw("cpt", {"name": "torch_ddp", "precision": "fp32"})
    return {
        "verb": "train",
        "phase": "cpt",
        "phase_cfg": section,
        "trust_remote_code": False,
        "model_dir": "/m",
        "tokenizer_dir": "/m",
        "stage_dir": "/s",
        "parent": None,
        "config_digest": "0" * 64,
        **extra,
    }


def test_job_key_remote_run_root():
    assert parse_job(_job()).remote_run_root is False
    assert parse_job(_job(remote_run_root=True)).remote_run_root is True
    with pytest.raises(ConfigError) as exc:
        parse_job(_job(remote_run_root="yes"))
    assert [f for f, m in exc.value.problems if "boolean" in m] == ["remote_run_root"], exc.value.problems


def test_max_pending_publishes_field():
    field = PhaseConfig.model_fields["max_pending_publishes"]
    assert field.default == 2 and "upload" in field.description
    section = _job()["phase_cfg"]
    section["max_pending_publishes"] = 0
    with pytest.raises(ConfigError) as exc:
        parse_job(_job(phase_cfg=section))
    assert any(f == "phase_cfg.max_pending_publishes" for f, _ in exc.value.problems), exc.value.problems


# ---- distributed tier: real torchrun, real Publisher, real S3 through the throttled proxy ----------
def _train_job(path: Path, section: dict, model_dir: Path, stage_dir: Path, remote: bool) -> Path:
    from support.engine import write_job

    write_job(path, verb="train", phase="cpt", phase_cfg=section, model_dir=model_dir, stage_dir=stage_dir)
    job = json.loads(path.read_text())
    job["remote_run_root"] = remote
    path.write_text(json.dumps(job, indent=2))
    return path


@pytest.mark.distributed
def test_backpressure_waits_for_slow_uploads_and_deletes_nothing_unpublished(
    throttled_s3, s3_root, tmp_path, tiny_model_dir
):
    from support.engine import REPO, engine, phase_raw, train_state, write_job
    from tasks.core.storage.fs import RunStore
    from tasks.core.storage.publisher import Publisher

    store = RunStore(s3_root, staging_dir=str(tmp_path / "staging"))
    stage_dir = store.local_path("cpt")
    section = phase_raw(
        "cpt",
        {"name": "torch_ddp", "precision": "fp32"},
        max_steps=4,
        checkpoint_every=1,
        keep_last=1,
        max_pending_publishes=1,
    )
    engine(
        "shard",
        write_job(
            tmp_path / "shard.json",
            verb="shard",
            phase="cpt",
            phase_cfg=section,
            model_dir=tiny_model_dir,
            stage_dir=stage_dir,
        ),
    )
    local_twin = tmp_path / "local" / "cpt"
    shutil.copytree(stage_dir / "step-000000", local_twin / "step-000000")
    store.publish("cpt/step-000000")
    mark_published(stage_dir / "step-000000", manifest_sha256(stage_dir / "step-000000"))
    size = sum(f.stat().st_size for f in (stage_dir / "step-000000").rglob("*") if f.is_file())
    # Slow enough that one upload (~1 s) spans several training steps (~0.1 s each): the engine must wait.
    throttled_s3.set_rate(max(size / 1.0, 256 << 10))

    job = _train_job(tmp_path / "train.json", section, tiny_model_dir, stage_dir, remote=True)
    pub = Publisher(store, "cpt", keep_last=1, backoff_s=0.5).start()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "tasks.engine",
        "train",
        "--config",
        str(job),
    ]
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines, seen_dirs = [], set()
    try:
        for line in proc.stdout:  # the reader only enqueues, as tasks/core/launch/torchrun.py does
            lines.append(line)
            m = re.match(r"^\[rank 0\] @@checkpoint (.*)$", line)
            if m:
                pub.submit(int(json.loads(m.group(1))["step"]))
                seen_dirs.update(p.name for _, p in ckpt.list_steps(stage_dir))
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    output = "".join(lines)
    assert rc == 0, output[-4000:]
    done = pub.drain(timeout=300)
    print(
        f"\ncheckpoint {size / MB:.2f} MB, proxy {throttled_s3.up.rate / MB:.2f} MB/s; publishes: "
        + ", ".join(f"{p.rel.split('/')[-1]} {p.seconds:.1f}s" for p in done)
    )

    # Every committed checkpoint was published, in order: none was deleted before its upload.
    assert [p.rel for p in done] == [f"cpt/step-{s:06d}" for s in range(1, 5)]
    waits = [json.loads(m) for m in re.findall(r"^\[rank 0\] @@backpressure (.*)$", output, re.MULTILINE)]
    assert any(w["state"] == "waiting" for w in waits) and any(
        w["state"] == "resumed" and w["waited_s"] > 0 for w in waits
    ), output[-3000:]
    assert re.search(r"backpressure: waited \d+\.\d+s for uploads before saving step \d", output)
    assert sorted(n for n in store.listdir("cpt") if store.exists(f"cpt/{n}/{MANIFEST}")) == [
        "step-000000",
        "step-000004",
    ]
    store.verify("cpt/step-000004", deep=True)
    for _, p in ckpt.list_steps(stage_dir):  # what staging still holds is whole
        ckpt.check_checkpoint(p, int(p.name[5:]), "cpt", "0" * 64)

    # The same steps on a local run root: bitwise the same losses (fp32), whatever the uploads did.
    local = engine(
        "train", _train_job(tmp_path / "train-local.json", section, tiny_model_dir, local_twin, remote=False)
    )
    assert "@@backpressure" not in local.output
    assert train_state(local_twin / "step-000004")["losses"] == train_state(stage_dir / "step-000004")["losses"]


def test_staging_estimate_counts_checkpoints_waiting_for_upload():
    from support.engine import run_raw
    from tasks.core.config.load import parse_config
    from tasks.core.preflight.model_info import estimate_parameters
    from tasks.core.preflight.storage import estimate_local_bytes

    mc = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    n = estimate_parameters(mc)
    assert n

    def remote(keep_last: int, pending: int) -> int:
        raw = run_raw(
            Path("/m"),
            Path("/r"),
            "cpt",
            {"name": "torch_ddp", "precision": "fp32"},
            keep_last=keep_last,
            max_pending_publishes=pending,
        )
        raw["run_root"] = "s3://bucket/run"
        raw["sft"].update(
            plugin={"name": "torch_ddp", "precision": "fp32"}, keep_last=1, max_pending_publishes=1
        )  # cpt is the larger
        need, how = estimate_local_bytes(parse_config(raw), mc, local_run_root=False)
        assert "max_pending_publishes" in how
        return need

    per_ckpt = n * (4 + 8)  # fp32 weights + Adam moments
    assert remote(1, 2) - remote(1, 1) == per_ckpt
    assert remote(3, 2) - remote(1, 2) == 2 * per_ckpt
