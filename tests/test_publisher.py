"""The checkpoint publisher (tasks/core/storage/publisher.py): order, marker, remote retention, retries,
failure naming the checkpoint; on a local run root (unit tier) and on the real S3 server through
the bandwidth-limiting proxy (integration tier).

    .venv/bin/python -m pytest -q tests/test_publisher.py            # unit tier, ~2 s
    .venv/bin/python -m pytest -q -m "" tests/test_publisher.py      # + real S3 through the proxy, ~40 s
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from tasks.core.run.manifest import MANIFEST, write_manifest
from tasks.core.storage.fs import RunStore
from tasks.core.storage.handshake import PUBLISHED_MARKER, is_published
from tasks.core.storage.publisher import Publisher, PublishFailed

pytest_plugins = ["tests.conftest_servers"]
MB = 1 << 20


def make_checkpoint(store: RunStore, phase: str, step: int, size: int = 64 << 10) -> Path:
    root = store.local_path(f"{phase}/step-{step:06d}")
    (root / "model").mkdir(parents=True, exist_ok=True)
    (root / "model" / "weights.bin").write_bytes(os.urandom(size))
    (root / "train_state.json").write_text(f'{{"step": {step}}}')
    write_manifest(root, kind="test-checkpoint", meta={"step": step, "stage": phase})
    return root


# ---- unit tier: local run root -------------------------------------------------------------------
def test_local_root_marks_in_order_and_keeps_everything(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    dirs = [make_checkpoint(store, "cpt", s) for s in (1, 2, 3)]
    pub = Publisher(store, "cpt", keep_last=1).start()
    for s in (1, 2, 3, 2):  # a repeated report is published once
        pub.submit(s)
    done = pub.drain(timeout=30)
    assert [p.rel for p in done] == ["cpt/step-000001", "cpt/step-000002", "cpt/step-000003"]
    for d, p in zip(dirs, done):
        assert is_published(d) and p.digest == hashlib.sha256((d / MANIFEST).read_bytes()).hexdigest()
    # A local root is the artifact itself: retention is the engine's, the publisher removes nothing.
    assert all(d.is_dir() for d in dirs) and all(p.removed == () for p in done)


def test_marker_names_the_manifest(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    d = make_checkpoint(store, "cpt", 4)
    assert not is_published(d)
    pub = Publisher(store, "cpt", keep_last=2).start()
    pub.submit(4)
    pub.drain(timeout=30)
    assert is_published(d)
    make_checkpoint(store, "cpt", 4)  # re-saved with other bytes: the old marker no longer counts
    assert (d / PUBLISHED_MARKER).is_file() and not is_published(d)


def test_failure_is_retried_then_names_the_checkpoint_and_stops_the_order(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    bad = make_checkpoint(store, "sft", 1)
    (bad / "model" / "weights.bin").write_bytes(b"truncated")  # the manifest no longer matches
    good = make_checkpoint(store, "sft", 2)
    warnings: list[str] = []

    class Log:
        def warning(self, msg, *args):
            warnings.append(msg % args)

        def error(self, msg, *args):
            pass

        def info(self, msg, *args):
            pass

    pub = Publisher(store, "sft", keep_last=1, retries=2, backoff_s=0.01, log=Log()).start()
    pub.submit(1)
    pub.submit(2)
    with pytest.raises(PublishFailed, match=r"sft/step-000001 failed after 3 attempt") as err:
        pub.drain(timeout=30)
    assert err.value.rel == "sft/step-000001" and len(warnings) == 2
    # Nothing newer is published after a failure, and nothing is deleted.
    assert not is_published(good) and not is_published(bad) and bad.is_dir() and good.is_dir()


class _Log:
    def __init__(self):
        self.warnings: list[str] = []
        self.errors: list[str] = []

    def warning(self, msg, *args):
        self.warnings.append(msg % args)

    def error(self, msg, *args):
        self.errors.append(msg % args)

    def info(self, msg, *args):
        pass


def test_a_failing_on_published_callback_is_a_warning_and_publishing_goes_on(tmp_path):
    # The callback (the stage's TensorBoard copy) fails when the store is gone; a dead worker
    # thread would leave the engine waiting at its next save for a marker nobody writes.
    store = RunStore(str(tmp_path / "run"))
    dirs = [make_checkpoint(store, "cpt", s) for s in (1, 2)]
    log = _Log()

    def on_published(done):
        raise OSError(f"store gone after {done.rel}")

    pub = Publisher(store, "cpt", keep_last=1, log=log, on_published=on_published).start()
    pub.submit(1)
    pub.submit(2)
    assert [p.rel for p in pub.drain(timeout=30)] == ["cpt/step-000001", "cpt/step-000002"]
    assert all(is_published(d) for d in dirs)
    assert len(log.warnings) == 2 and "cpt/step-000001" in log.warnings[0] and "store gone" in log.warnings[0]


def test_an_unexpected_error_in_the_worker_is_the_failure_naming_the_checkpoint(tmp_path, monkeypatch):
    from tasks.core.storage import publisher

    store = RunStore(str(tmp_path / "run"))
    first, second = make_checkpoint(store, "cpt", 1), make_checkpoint(store, "cpt", 2)

    def no_space(checkpoint_dir, digest):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(publisher, "mark_published", no_space)
    log = _Log()
    pub = Publisher(store, "cpt", keep_last=1, log=log).start()
    pub.submit(1)
    pub.submit(2)
    deadline = time.monotonic() + 30
    while pub.failure is None and time.monotonic() < deadline:  # what the stage's watcher polls
        time.sleep(0.01)
    assert pub.failure is not None and "step-000001" in str(pub.failure) and "No space left" in str(pub.failure)
    with pytest.raises(RuntimeError, match=r"cpt/step-000001: OSError"):
        pub.drain(timeout=30)
    assert log.errors and first.is_dir() and second.is_dir() and not is_published(second)


def test_submit_never_blocks_and_a_full_queue_is_a_failure(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    for s in (1, 2, 3):
        make_checkpoint(store, "cpt", s)
    pub = Publisher(store, "cpt", keep_last=1, max_queue=2)  # not started: nothing is consumed
    pub.submit(1)
    pub.submit(2)
    pub.submit(3)
    assert pub.failure is not None and "step-000003" in str(pub.failure)
    with pytest.raises(RuntimeError, match="max_pending_publishes"):
        pub.drain(timeout=30)


def test_the_checkpoint_sink_is_chosen_once_from_the_run_root_and_the_nodes(tmp_path):
    """tasks/flowkit/checkpoints.py: a local run root keeps its checkpoints; a remote one on this worker's
    node(s) is published by the worker (the engine deletes only marked checkpoints); on nodes of a backend
    that places ranks elsewhere each node stages and publishes for itself."""
    from support.tiny import tiny_config_raw
    from tasks.core.config.load import parse_fields
    from tasks.flowkit.checkpoints import Local, NodesPublish, WorkerPublishes, checkpoint_sink

    def sink(run_root: str, **launch):
        raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
        raw["run_root"] = run_root
        raw["sft"]["launch"] = {**raw["sft"].get("launch", {}), **launch}
        cfg = parse_fields(raw)
        return checkpoint_sink(RunStore(cfg.run_uri), "sft", cfg.phase("sft"), "cpt/hf", str(tmp_path / "stage"))

    local = sink(str(tmp_path / "run"))
    assert type(local) is Local and local.nodes is None and not local.remote_run_root and local.failure is None
    worker = sink("s3://bucket/run")
    assert type(worker) is WorkerPublishes and worker.nodes is None and worker.remote_run_root
    assert (
        type(sink("s3://bucket/run", nnodes=2, nproc_per_node=1)) is WorkerPublishes
    )  # the local backend's nodes share it
    nodes = sink("s3://bucket/run", backend="slurm", nnodes=2, nproc_per_node=1, slurm={"partition": "debug"})
    assert type(nodes) is NodesPublish and not nodes.remote_run_root
    assert nodes.nodes.model_dump() == {
        "run_uri": "s3://bucket/run",
        "dir": f"{tmp_path / 'stage'}/cpt-to-sft-nodes/{{node}}",
        "model_rel": "cpt/hf",
        "data_rel": "data/sft",
        "stage_rel": "sft",
    }


# ---- integration tier: the real S3 server through the throttled proxy -----------------------------
def _direct_fs(weed):
    """An S3 client straight to the server, bypassing the proxy (to look while it is paused)."""
    import s3fs

    return s3fs.S3FileSystem(
        endpoint_url=weed.endpoint,
        key=weed.access_key,
        secret=weed.secret_key,
        client_kwargs={"region_name": "us-east-1"},
        skip_instance_cache=True,
        use_listings_cache=False,
    )


@pytest.mark.integration
def test_s3_publishes_in_order_and_retains_only_after_a_newer_commit(throttled_s3, weed, s3_root, tmp_path):
    store = RunStore(s3_root, staging_dir=str(tmp_path / "staging"), part_size=5 * MB)
    make_checkpoint(store, "cpt", 0, size=1024)
    store.publish("cpt/step-000000")
    dirs = {s: make_checkpoint(store, "cpt", s, size=3 * MB) for s in (1, 2, 3)}
    throttled_s3.set_rate(4 * MB)
    direct, root = _direct_fs(weed), store.root
    pub = Publisher(store, "cpt", keep_last=1).start()

    t0 = time.monotonic()
    pub.submit(1)
    assert time.monotonic() - t0 < 0.5  # the reader only enqueues; the upload takes ~1 s
    while not pub.published:
        assert pub.failure is None
        time.sleep(0.05)
    throttled_s3.pause()
    pub.submit(2)
    time.sleep(1.0)
    # step-000002 is in flight, stalled: step-000001 must still be committed remotely.
    assert direct.exists(f"{root}/cpt/step-000001/{MANIFEST}") and not is_published(dirs[2])
    throttled_s3.resume()
    pub.submit(3)
    done = pub.drain(timeout=120)

    assert [p.rel for p in done] == ["cpt/step-000001", "cpt/step-000002", "cpt/step-000003"]
    assert all(is_published(d) for d in dirs.values())
    # keep_last=1, step 0 kept. (SeaweedFS may list an emptied prefix as a directory: look at objects.)
    assert sorted(n for n in store.listdir("cpt") if store.exists(f"cpt/{n}/{MANIFEST}")) == [
        "step-000000",
        "step-000003",
    ]
    for gone in ("step-000001", "step-000002"):
        assert [p for p in direct.find(f"{root}/cpt/{gone}") if p.rstrip("/") != f"{root}/cpt/{gone}"] == []
    assert store.verify("cpt/step-000003", deep=True)["files"].keys() == {"model/weights.bin", "train_state.json"}
    assert [p.removed for p in done] == [(), ("cpt/step-000001",), ("cpt/step-000002",)]


@pytest.mark.integration
def test_s3_server_gone_during_publish_fails_naming_the_checkpoint(throttled_s3, s3_root, tmp_path):
    store = RunStore(s3_root, staging_dir=str(tmp_path / "staging"), part_size=5 * MB)
    d = make_checkpoint(store, "cpt", 5, size=6 * MB)
    throttled_s3.set_rate(1 * MB)
    pub = Publisher(store, "cpt", keep_last=1, retries=2, backoff_s=0.2).start()
    pub.submit(5)
    killer = threading.Timer(1.0, throttled_s3.kill)  # mid-upload: ~1 of 6 MB sent
    killer.start()
    with pytest.raises(PublishFailed, match=r"cpt/step-000005 failed after 3 attempt") as err:
        pub.drain(timeout=180)
    killer.join()
    assert store.uri("cpt/step-000005") in str(err.value)
    # The local copy is intact and unmarked: the engine keeps it and a retry resumes from it.
    assert d.is_dir() and (d / MANIFEST).is_file() and not is_published(d)


def test_unpublished_steps_are_what_a_failed_attempt_left(tmp_path):
    from tasks.core.storage.publisher import unpublished_steps

    store = RunStore(str(tmp_path / "run"))
    for s in (0, 2, 4, 6):
        make_checkpoint(store, "cpt", s)
    (store.local_path("cpt/step-000006") / MANIFEST).unlink()  # torn save: nothing to publish
    pub = Publisher(store, "cpt", keep_last=2).start()
    pub.submit(2)
    pub.drain(timeout=30)
    assert unpublished_steps(store.local_path("cpt")) == [4]  # step 0 is the shard stage's


def test_publish_retrying_retries_failures_but_lets_a_cancellation_through(tmp_path):
    from tasks.core.storage.publisher import PublishFailed, publish_retrying

    store = RunStore(str(tmp_path / "run"))
    make_checkpoint(store, "cpt", 1)
    calls: list[int] = []

    def flaky(rel):
        calls.append(1)
        if len(calls) < 3:
            raise OSError("connection reset")
        return store.publish(rel)

    log = _Log()
    digest, attempts = publish_retrying(store, "cpt/step-000001", flaky, retries=4, backoff_s=0.01, log=log)
    assert attempts == 3 and len(log.warnings) == 2 and "connection reset" in log.warnings[0]
    assert digest == store.manifest_digest("cpt/step-000001")

    with pytest.raises(PublishFailed, match=r"after 2 attempt\(s\): OSError: down"):
        publish_retrying(
            store,
            "cpt/step-000001",
            lambda rel: (_ for _ in ()).throw(OSError("down")),
            retries=1,
            backoff_s=0.01,
            log=_Log(),
        )

    class Cancelled(BaseException):  # what Prefect raises in a cancelled task (TerminationSignal)
        pass

    def cancelled(rel):
        calls.append(1)
        raise Cancelled()

    calls.clear()
    with pytest.raises(Cancelled):
        publish_retrying(store, "cpt/step-000001", cancelled, retries=4, backoff_s=0.01, log=_Log())
    assert len(calls) == 1  # not retried, not turned into a publish failure


@pytest.mark.integration
def test_s3_a_notice_during_an_async_publish_leaves_no_torn_checkpoint(throttled_s3, weed, s3_root, tmp_path):
    """What a preempted training stage does with its sink (tasks/stages/train.py `_preempted`): drain
    the publisher within the grace left. With time enough, the checkpoint committed on the notice is
    published whole; when the grace runs out mid-upload and the machine goes (uploads stall, the
    publisher is closed, the connection dies), the run root holds no manifest for it, so no torn
    checkpoint: the newest with a manifest is the last whole one, which the next attempt resumes from."""
    store = RunStore(s3_root, staging_dir=str(tmp_path / "staging"), part_size=5 * MB)
    direct, root = _direct_fs(weed), store.root
    throttled_s3.set_rate(8 * MB)
    pub = Publisher(store, "cpt", keep_last=3).start()
    make_checkpoint(store, "cpt", 4, size=2 * MB)
    pub.submit(4)  # the periodic checkpoint, in flight when the notice comes
    make_checkpoint(store, "cpt", 6, size=2 * MB)
    pub.submit(6)  # the checkpoint of the noticed step
    assert [p.rel for p in pub.drain(timeout=120)] == ["cpt/step-000004", "cpt/step-000006"]
    assert store.verify("cpt/step-000006", deep=True)["files"].keys() == {"model/weights.bin", "train_state.json"}

    throttled_s3.set_rate(1 * MB)
    late = Publisher(store, "cpt", keep_last=3, retries=0).start()
    d = make_checkpoint(store, "cpt", 9, size=6 * MB)
    late.submit(9)
    with pytest.raises(TimeoutError, match="still busy"):
        late.drain(timeout=1.0)  # the grace left: about 1 of 6 MB sent
    throttled_s3.pause()  # the machine goes: nothing more leaves it
    late.close(timeout=1.0)
    throttled_s3.kill()
    assert not direct.exists(f"{root}/cpt/step-000009/{MANIFEST}")  # never a checkpoint without its manifest
    assert direct.exists(f"{root}/cpt/step-000006/{MANIFEST}") and direct.exists(f"{root}/cpt/step-000004/{MANIFEST}")
    assert d.is_dir() and not is_published(d)  # the local copy stays unmarked: a retry on this node publishes it
