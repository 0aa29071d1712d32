"""Verification stamps (tasks/core/run/stamp.py): the skip decision trusts a current stamp instead
of hashing; any change a file's identity shows sends it back to a full hash, and what a stamp
cannot see is caught where the artifact is read.

    .venv/bin/python -m pytest -q tests/test_stamp.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tasks.core.errors import ManifestError
from tasks.core.run import stamp
from tasks.core.run.manifest import write_manifest
from tasks.core.storage.fs import RunStore


def _artifact(store: RunStore, rel: str, size: int = 1 << 20) -> Path:
    d = store.local_path(rel)
    (d / "model").mkdir(parents=True)
    (d / "model" / "weights.bin").write_bytes(os.urandom(size))
    (d / "config.json").write_text('{"a": 1}')
    write_manifest(d, kind="test", config_digest="abc")
    return d


def _flip(path: Path, keep_mtime: bool = True) -> None:
    st = os.stat(path)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))
    if keep_mtime:  # what a careful tamperer or a restore tool does; ctime still moves
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _forge(root: Path) -> None:
    """What bit rot looks like to a stamp: the bytes changed and the identity did not."""
    data = json.loads((root / stamp.STAMP).read_text())
    data["files"] = {rel: stamp.identity(root / rel) for rel in data["files"]}
    (root / stamp.STAMP).write_text(json.dumps(data))


def test_a_published_artifact_is_stamped_and_the_skip_decision_does_not_hash_it(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    root = _artifact(store, "cpt/hf", size=32 << 20)
    store.publish("cpt/hf")  # a local run root: hashed once more, and stamped
    assert stamp.current(root) and "hashed 2 files" in store.last_verify
    t0 = time.perf_counter()
    m = store.verify("cpt/hf", trust_stamp=True)
    trusted = time.perf_counter() - t0
    assert m["kind"] == "test" and store.last_verify.startswith("by its verification stamp (2 files")
    t0 = time.perf_counter()
    store.verify("cpt/hf")  # deep, stamp not trusted: every byte read
    hashed = time.perf_counter() - t0
    assert "hashed 2 files" in store.last_verify
    assert trusted < hashed / 5, (trusted, hashed)  # 32 MB: ~0.1 s hashed here vs well under 10 ms


def test_a_byte_flipped_with_its_mtime_restored_is_seen_and_caught_by_the_hash(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    root = _artifact(store, "cpt/step-000004")
    store.publish("cpt/step-000004")
    time.sleep(0.01)  # ctime has nanosecond resolution here, but not every file system's clock ticks that fast
    _flip(root / "model" / "weights.bin")
    assert stamp.changed(root) == ["model/weights.bin changed (size, time, inode or device) since it was hashed"]
    with pytest.raises(ManifestError, match="model/weights.bin fails its sha256 check"):
        store.verify("cpt/step-000004", trust_stamp=True)


def test_what_a_stamp_cannot_see_is_caught_where_the_artifact_is_read(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    root = _artifact(store, "cpt/step-000004")
    store.publish("cpt/step-000004")
    _flip(root / "model" / "weights.bin")
    _forge(root)
    assert stamp.current(root)
    store.verify("cpt/step-000004", trust_stamp=True)  # the skip decision cannot tell
    with pytest.raises(ManifestError, match="model/weights.bin fails its sha256 check"):
        store.stage_in("cpt/step-000004")  # resume, unshard and export read through here: hashed


def test_a_copied_artifact_or_a_new_manifest_is_hashed_again(tmp_path):
    import shutil

    store = RunStore(str(tmp_path / "run"))
    root = _artifact(store, "a")
    store.publish("a")
    shutil.copytree(root, store.local_path("b"))  # new inodes: the copy's stamp is not its own
    assert stamp.changed(store.local_path("b"))
    store.verify("b", trust_stamp=True)
    assert "hashed 2 files" in store.last_verify and stamp.current(store.local_path("b"))
    (root / "extra.txt").write_text("x")
    write_manifest(root, kind="test", config_digest="abc")  # rewritten manifest: the old stamp is void
    assert stamp.changed(root) == ["the manifest changed since the stamp (or no stamp of this schema)"]
    (root / stamp.STAMP).unlink()
    assert stamp.changed(root) == ["no readable stamp"]
    os.chmod(root / ".cpt-to-sft", 0o500)  # a read-only artifact: verified, just not stamped
    try:
        store.verify("a", trust_stamp=True)
    finally:
        os.chmod(root / ".cpt-to-sft", 0o700)


def test_the_stamp_is_not_part_of_the_artifact(tmp_path):
    from tasks.core.models.folder import folder_problems
    from tasks.core.run.manifest import read_manifest

    store = RunStore(str(tmp_path / "run"))
    root = _artifact(store, "export")
    store.publish("export")
    assert (root / stamp.STAMP).is_file() and stamp.STAMP not in read_manifest(root)["files"]
    assert folder_problems(root) == []
