"""RunStore against a real S3 server (SeaweedFS `weed mini` on 127.0.0.1), never a mock.

.venv/bin/python -m pytest -q tests/test_storage_s3.py            # ~1 min
.venv/bin/python -m pytest -q tests/test_storage_s3.py -m e2e     # the whole flow on S3
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from tasks.core.errors import ArtifactMissing, ManifestError
from tasks.core.run.manifest import MANIFEST, sha256_file, write_manifest
from tasks.core.storage.fs import SHA256_META, RunStore, TransferError
from tasks.core.storage.s3 import S3Transfers

pytest_plugins = ["tests.conftest_servers"]
pytestmark = pytest.mark.integration

MB = 1 << 20
PART = 5 * MB  # S3's smallest part, so multipart paths run on small files


def make_artifact(root: Path, sizes: dict[str, int], seed: int = 0) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    for i, (name, size) in enumerate(sorted(sizes.items())):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        block = hashlib.sha256(f"{seed}-{i}".encode()).digest() * 32  # 1 KiB, distinct per file
        with open(path, "wb") as f:
            f.writelines(block for _ in range(size // len(block)))
            f.write(os.urandom(size % len(block)))
    return write_manifest(root, kind="test-checkpoint", meta={"seed": seed})


SIZES = {
    "model/model-00001.safetensors": 12 * MB + 17,
    "model/model-00002.safetensors": 6 * MB,
    "optimizer/state.bin": 3 * MB,
    "train_state.json": 300,
    "empty.txt": 0,
}


def remote_objects(store: RunStore, rel: str) -> dict[str, int]:
    base = store._remote(rel)
    return {p[len(base) + 1 :]: store.fs.size(p) for p in store.fs.find(base)}


def test_publish_stage_in_round_trip_with_checksums(s3_root, tmp_path):
    store = RunStore(s3_root, staging_dir=str(tmp_path / "stage-a"), part_size=PART)
    rel = "cpt/step-000004"
    manifest = make_artifact(store.local_path(rel), SIZES)

    digest = store.publish(rel)
    assert store.last_transfer["transferred"] == len(SIZES)
    assert digest == hashlib.sha256((store.local_path(rel) / MANIFEST).read_bytes()).hexdigest()
    assert store.manifest_digest(rel) == digest
    assert remote_objects(store, rel) == {
        **{n: e["size"] for n, e in manifest["files"].items()},
        MANIFEST: (store.local_path(rel) / MANIFEST).stat().st_size,
    }
    for name, entry in manifest["files"].items():  # each object carries the sha256 the server checked
        bucket, key, _ = store.fs.split_path(store._remote(f"{rel}/{name}"))
        head = store.fs.call_s3("head_object", Bucket=bucket, Key=key)
        assert head["ContentLength"] == entry["size"] and head["Metadata"][SHA256_META] == entry["sha256"], name
    assert store.verify(rel, deep=True)["files"] == manifest["files"]

    # An unchanged re-publish sends nothing.
    assert store.publish(rel) == digest
    assert store.last_transfer["transferred"] == 0

    # Another machine stages it in: same bytes, same manifest digest, files checked by sha256.
    other = RunStore(s3_root, staging_dir=str(tmp_path / "stage-b"), part_size=PART)
    local = other.stage_in(rel)
    assert other.last_transfer["transferred"] == len(SIZES)
    for name, entry in manifest["files"].items():
        assert sha256_file(local / name) == entry["sha256"], name
    assert (local / MANIFEST).read_bytes() == (store.local_path(rel) / MANIFEST).read_bytes()
    assert not list(local.rglob("*.part"))
    # Staging in again keeps verified files; a stray local file is removed.
    (local / "stray.bin").write_bytes(b"x")
    other.stage_in(rel)
    assert other.last_transfer["transferred"] == 0 and not (local / "stray.bin").exists()


def test_corrupted_remote_object_is_named(s3_root, tmp_path):
    store = RunStore(s3_root, staging_dir=str(tmp_path / "a"), part_size=PART)
    rel = "export"
    make_artifact(store.local_path(rel), {"w.safetensors": 6 * MB, "config.json": 100})
    store.publish(rel)
    # Same size, different bytes, written by another tool (no recorded sha256).
    path = store._remote(f"{rel}/config.json")
    store.fs.pipe_file(path, b"y" * 100)
    with pytest.raises(ManifestError, match="config.json"):
        store.verify(rel, deep=True)
    other = RunStore(s3_root, staging_dir=str(tmp_path / "b"), part_size=PART)
    with pytest.raises(ManifestError, match="config.json"):
        other.stage_in(rel)
    assert not (other.local_path(rel) / MANIFEST).exists()
    assert not list(other.local_path(rel).rglob("*.part"))


def test_local_change_after_manifest_is_refused(s3_root, tmp_path):
    store = RunStore(s3_root, staging_dir=str(tmp_path / "a"), part_size=PART)
    rel = "cpt/hf"
    make_artifact(store.local_path(rel), {"big.bin": 11 * MB, "small.json": 50})
    with open(store.local_path(rel) / "big.bin", "r+b") as f:  # same size, one byte flipped
        f.seek(7 * MB)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    with pytest.raises(ManifestError, match="big.bin"):
        store.publish(rel)
    assert not store.exists(f"{rel}/{MANIFEST}")
    assert "big.bin" not in remote_objects(store, rel)  # the multipart upload was aborted


def test_manifest_goes_last_and_old_manifest_goes_first(s3_root, tmp_path, monkeypatch):
    store = RunStore(s3_root, staging_dir=str(tmp_path / "a"), part_size=PART)
    rel = "sft/step-000002"
    make_artifact(store.local_path(rel), {"a.bin": 7 * MB, "b.json": 10}, seed=1)
    store.publish(rel)
    make_artifact(store.local_path(rel), {"a.bin": 7 * MB, "b.json": 10}, seed=2)  # new content

    calls: list[tuple[str, str]] = []
    real_call = S3Transfers.call

    async def recording(self, method, **kw):
        if method in ("put_object", "delete_object", "create_multipart_upload", "complete_multipart_upload"):
            calls.append((method, kw["Key"].rsplit("/", 1)[-1]))
        return await real_call(self, method, **kw)

    monkeypatch.setattr(S3Transfers, "call", recording)
    store.publish(rel)
    writes = [c for c in calls if c[0] != "create_multipart_upload"]
    name = MANIFEST.rsplit("/", 1)[-1]  # the calls record the last key segment
    assert writes[0] == ("delete_object", name)
    assert writes[-1] == ("put_object", name)
    assert [c for c in writes if c[1] == name] == [writes[0], writes[-1]]
    assert {("complete_multipart_upload", "a.bin"), ("put_object", "b.json")} <= set(writes)


def test_failed_republish_leaves_no_manifest_then_completes(s3_root, tmp_path, monkeypatch):
    store = RunStore(s3_root, staging_dir=str(tmp_path / "a"), part_size=PART)
    rel = "cpt/step-000008"
    make_artifact(store.local_path(rel), {"a.bin": 12 * MB, "b.bin": 2 * MB, "c.json": 10}, seed=1)
    store.publish(rel)
    v2 = make_artifact(store.local_path(rel), {"a.bin": 12 * MB, "b.bin": 2 * MB, "c.json": 10}, seed=2)

    real_call = S3Transfers.call
    parts = {"n": 0}

    async def flaky(self, method, **kw):
        if method == "upload_part":
            parts["n"] += 1
            if parts["n"] == 2:
                raise ConnectionResetError("injected: connection dropped mid-part")
        return await real_call(self, method, **kw)

    monkeypatch.setattr(S3Transfers, "call", flaky)
    with pytest.raises(TransferError, match="no manifest was written"):
        store.publish(rel)
    # The v1 manifest is gone, so nothing points at the half-replaced objects.
    assert not store.exists(f"{rel}/{MANIFEST}")
    with pytest.raises(ArtifactMissing):
        store.read_manifest(rel)

    monkeypatch.setattr(S3Transfers, "call", real_call)
    store.publish(rel)
    assert 0 < store.last_transfer["transferred"] <= 3
    fresh = RunStore(s3_root, staging_dir=str(tmp_path / "b"), part_size=PART)
    local = fresh.stage_in(rel)
    assert {n: sha256_file(local / n) for n in v2["files"]} == {n: e["sha256"] for n, e in v2["files"].items()}


@pytest.mark.parametrize("method", ["upload_part", "put_object"])
def test_bytes_corrupted_on_the_wire_are_refused_by_the_server(s3_root, tmp_path, monkeypatch, method):
    """Every request carries the CRC32 of the body we hashed; a body altered after that (on the
    wire) is refused by the real server, so the publish fails with no manifest, then completes."""
    store = RunStore(s3_root, staging_dir=str(tmp_path / "a"), part_size=PART)
    rel = f"cpt/step-wire-{method}"
    manifest = make_artifact(store.local_path(rel), {"a.bin": 12 * MB, "b.json": 3000}, seed=3)
    real_call = S3Transfers.call
    seen = {"n": 0}

    async def corrupting(self, m, **kw):
        if m == method and not kw["Key"].endswith("/" + MANIFEST):
            seen["n"] += 1
            if seen["n"] == 1:
                body = bytearray(kw["Body"])
                body[len(body) // 2] ^= 0xFF  # one bit pattern flipped after the checksum was taken
                kw = {**kw, "Body": bytes(body)}
        return await real_call(self, m, **kw)

    monkeypatch.setattr(S3Transfers, "call", corrupting)
    with pytest.raises(TransferError, match="did not match|BadDigest") as err:
        store.publish(rel)
    assert "no manifest was written" in str(err.value)
    assert not store.exists(f"{rel}/{MANIFEST}")
    monkeypatch.setattr(S3Transfers, "call", real_call)
    store.publish(rel)
    assert store.verify(rel, deep=True)["files"] == manifest["files"]


def test_server_killed_mid_publish_then_publish_completes(fresh_weed, tmp_path, monkeypatch, caplog):
    """A checkpoint-sized artifact; the S3 server is SIGKILLed while parts are in flight."""
    from tests.conftest_servers import BUCKET

    root = f"s3://{BUCKET}/killed"
    store = RunStore(root, staging_dir=str(tmp_path / "stage"), part_size=PART, max_workers=4)
    rel = "cpt/step-000010"
    sizes = {
        "model/shard-1.safetensors": 30 * MB,
        "model/shard-2.safetensors": 30 * MB,
        "optim/shard-1.bin": 20 * MB,
        "config.json": 500,
        "train_state.json": 200,
    }
    manifest = make_artifact(store.local_path(rel), sizes)

    real_call = S3Transfers.call
    done_parts = {"n": 0}

    async def kill_after_parts(self, method, **kw):
        result = await real_call(self, method, **kw)
        if method == "upload_part":
            done_parts["n"] += 1
            if done_parts["n"] == 4:
                fresh_weed.kill()  # a crash, while other parts are on the wire
        return result

    monkeypatch.setattr(S3Transfers, "call", kill_after_parts)
    started = time.monotonic()
    with pytest.raises(TransferError) as excinfo:
        store.publish(rel)
    assert time.monotonic() - started < 120
    assert done_parts["n"] >= 4 and fresh_weed.proc.poll() is not None  # it died mid-publish
    assert fresh_weed.secret_key not in str(excinfo.value) and fresh_weed.secret_key not in caplog.text
    monkeypatch.setattr(S3Transfers, "call", real_call)

    fresh_weed.start()  # same data dir and ports
    assert not store.exists(f"{rel}/{MANIFEST}")
    # Whatever did land is whole: every visible object is a complete, checksummed file.
    for name, size in remote_objects(store, rel).items():
        assert size == manifest["files"][name]["size"], name

    store.publish(rel)
    assert store.last_transfer["transferred"] >= 1
    assert store.verify(rel, deep=True)
    fresh = RunStore(root, staging_dir=str(tmp_path / "fresh"), part_size=PART)
    local = fresh.stage_in(rel)
    for name, entry in manifest["files"].items():
        assert sha256_file(local / name) == entry["sha256"], name


def test_a_stage_artifact_publish_outlasts_a_store_outage_or_names_it(fresh_weed, tmp_path, caplog):
    """Every stage's final publish (tasks/flowkit/stage.py Stage.done) goes through publish_retrying: the S3
    server down for a few seconds costs a retry, not the stage's work; down for good, the stage
    fails after the bounded retries naming the artifact, and no manifest exists remotely."""
    import threading

    from tasks.core.storage.publisher import PublishFailed, publish_retrying
    from tests.conftest_servers import BUCKET

    store = RunStore(f"s3://{BUCKET}/outage", staging_dir=str(tmp_path / "stage"), part_size=PART)
    rel = "cpt/hf"
    manifest = make_artifact(store.local_path(rel), {"model.safetensors": 6 * MB, "config.json": 300})
    fresh_weed.kill()
    restarted = threading.Timer(2.0, fresh_weed.start)
    restarted.start()
    try:
        digest, attempts = publish_retrying(
            store, rel, retries=6, backoff_s=0.5, backoff_max_s=2.0, what="the unshard artifact"
        )
    finally:
        restarted.join()
    assert attempts >= 2 and "publish of s3://" in caplog.text and "retrying in" in caplog.text
    assert store.verify(rel, deep=True)["files"] == manifest["files"]
    assert digest == store.manifest_digest(rel)

    rel2 = "sft/hf"
    make_artifact(store.local_path(rel2), {"model.safetensors": MB}, seed=1)
    fresh_weed.kill()
    with pytest.raises(PublishFailed) as excinfo:
        publish_retrying(store, rel2, retries=2, backoff_s=0.2, what="the unshard artifact")
    msg = str(excinfo.value)
    assert excinfo.value.attempts == 3 and f"s3://{BUCKET}/outage/sft/hf" in msg and "the unshard artifact" in msg
    assert "redoes this stage" in msg and fresh_weed.secret_key not in msg
    fresh_weed.start()
    assert not store.exists(f"{rel2}/{MANIFEST}")


def test_prune_staging_keeps_unpublished_work(s3_root, tmp_path):
    store = RunStore(s3_root, staging_dir=str(tmp_path / "a"), part_size=PART)
    for rel in ("cpt/step-000004", "cpt/step-000008", "base"):
        make_artifact(store.local_path(rel), {"x.bin": 1000})
    store.publish("cpt/step-000004")
    store.publish("base")
    make_artifact(store.local_path("cpt/step-000012"), {"x.bin": 1000})  # written, not yet published
    removed = store.prune_staging(keep=["base"])
    assert removed == ["cpt/step-000004"]
    assert (
        store.local_path("base").is_dir()
        and store.local_path("cpt/step-000008").is_dir()
        and store.local_path("cpt/step-000012").is_dir()
    )
    # A released publish drops its staged copy straight away.
    store.publish("cpt/step-000008", release=True)
    assert not store.local_path("cpt/step-000008").exists() and store.exists(f"cpt/step-000008/{MANIFEST}")


def test_small_files_listing_and_endpoint_from_standard_env(s3_root, weed):
    store = RunStore(s3_root)
    assert not store.local and store.uri("run.json") == f"{s3_root}/run.json"
    store.write_text("run.json", json.dumps({"ok": True}))
    assert json.loads(store.read_text("run.json")) == {"ok": True}
    assert store.exists("run.json") and store.listdir("") == ["run.json"] and store.listdir("nothing") == []
    store.remove("run.json")
    assert not store.exists("run.json")
    with pytest.raises(FileNotFoundError):
        store.read_text("run.json")
    # Nothing but the standard AWS variables points the client at the server.
    assert os.environ["AWS_ENDPOINT_URL"] == weed.endpoint and os.environ["AWS_DEFAULT_REGION"]
    client = store.fs.s3
    assert client.meta.endpoint_url == weed.endpoint and client.meta.region_name == os.environ["AWS_DEFAULT_REGION"]


@pytest.mark.e2e
def test_full_tiny_flow_with_run_root_on_s3_and_push_to_hub(
    weed, hub_env, prefect_harness, tiny_model_dir, tmp_path, monkeypatch
):
    """The whole flow: every artifact on S3 (staged through a local dir), the export pushed to the
    test Hub in one commit, run.json (on S3) recording the commit URL."""
    from huggingface_hub import HfApi

    from flows.cli import flow_main as main
    from tests.conftest import tiny_config_raw, write_config
    from tests.conftest_servers import BUCKET

    hub = hub_env
    monkeypatch.setenv("HF_TOKEN", hub.token)
    root = f"s3://{BUCKET}/e2e-flow"
    raw = tiny_config_raw(tiny_model_dir, root)
    raw["staging_dir"] = str(tmp_path / "staging")
    raw["hub"] = {"repo_id": "org/e2e-s3", "private": True, "commit_message": "e2e export", "license": "apache-2.0"}
    cfg = write_config(tmp_path / "tiny-s3.yaml", raw)
    assert main(["--config", str(cfg)]) == 0

    store = RunStore(root, staging_dir=str(tmp_path / "check"))
    summary = json.loads(store.read_text("run.json"))
    assert summary["complete"] is True and summary["run_root"] == root
    for stage in summary["stages"]:
        if stage["status"] in ("completed", "skipped") and stage["rel"]:
            store.verify(stage["rel"], deep=True)
            assert store.manifest_digest(stage["rel"]) == stage["digest"], stage["stage"]
    export = store.stage_in("export")
    manifest = json.loads((export / MANIFEST).read_text())
    assert (export / "config.json").is_file() and any(n.endswith(".safetensors") for n in manifest["files"])

    api = HfApi(token=hub.token)
    commits = api.list_repo_commits("org/e2e-s3")
    assert [c.title for c in commits] == ["e2e export", "initial commit"]
    assert summary["hub"]["commit_url"] == f"{hub.endpoint}/org/e2e-s3/commit/{commits[0].commit_id}"
    tree = {f.path: f for f in api.list_repo_tree("org/e2e-s3", recursive=True) if hasattr(f, "size")}
    assert set(manifest["files"]) | {"README.md", ".gitattributes", MANIFEST} == set(tree)
    for name, entry in manifest["files"].items():
        assert tree[name].size == entry["size"], name
        if tree[name].lfs is not None:
            assert tree[name].lfs.sha256 == entry["sha256"], name
