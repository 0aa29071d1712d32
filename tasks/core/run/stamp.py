"""Verification stamps: a deep verification remembered by each file's identity, so deciding that a
finished stage can be skipped does not read its artifact again.

    python -m tasks.core.run.stamp runs/demo/cpt/hf      # is the stamp current? names what changed

Once every file of a local artifact was hashed against its manifest (`verify_artifact(deep=True)`),
`write_stamp` records, per file, its identity: size, mtime and ctime in nanoseconds, inode and
device, beside the sha256 of the manifest it was checked against. `current` is true only while every
listed file still has that identity and the manifest is the same bytes. A file rewritten in place
changes its ctime, which no user call can set back (`utime` sets atime and mtime only), so even an
edit that restores the mtime is seen and sends the skip decision back to a full hash; so does a
copied or restored artifact (new inodes). What a stamp cannot see is a change below the file system
(bit rot, a raw write to the device): that is caught where an artifact is read, since staging it
in (`RunStore.stage_in`) and the engine's resume still hash every file they read, and `cpt-to-sft
verify` hashes on demand.

Measured here (`benchmarks/skip.py`, page cache warm): a 2 GB artifact of 33 files is hashed in
2.02 s and its stamp checked in 2.1 ms; the stamp's time follows the file count, not the bytes. At
70B the artifacts upstream of SFT hold terabytes, which a retry no longer reads.

The stamp lives in the artifact's provenance folder, written after the manifest and not listed in
it: a push sends manifest-listed files only, the model-folder rule judges top-level names only, and
removing the artifact removes its stamp. Remote run roots need none: their verification compares the
sha256 recorded on each object at upload (a HEAD request), without reading the data.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from tasks.core.run.manifest import MANIFEST, STAMP, inside_artifact, read_manifest, write_atomic

SCHEMA = 1


def identity(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _manifest_sha(root: Path) -> str:
    return hashlib.sha256((root / MANIFEST).read_bytes()).hexdigest()


def write_stamp(root: str | Path, manifest: dict[str, Any]) -> None:
    """Record the identity of every file of `manifest`, just hashed against it; atomic."""
    root = Path(root)
    stamp = {
        "schema": SCHEMA,
        "manifest_sha256": _manifest_sha(root),
        "files": {rel: identity(inside_artifact(root, rel, str(root))) for rel in sorted(manifest["files"])},
    }
    write_atomic(root / STAMP, json.dumps(stamp, sort_keys=True))


def changed(root: str | Path, manifest: dict[str, Any] | None = None) -> list[str]:
    """Why the stamp does not stand for a deep verification now ([] when it does)."""
    root = Path(root)
    try:
        stamp = json.loads((root / STAMP).read_text())
        manifest = manifest if manifest is not None else read_manifest(root)
        if stamp.get("schema") != SCHEMA or stamp.get("manifest_sha256") != _manifest_sha(root):
            return ["the manifest changed since the stamp (or no stamp of this schema)"]
        recorded = stamp["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return ["no readable stamp"]
    if set(recorded) != set(manifest["files"]):
        return ["the stamp lists other files than the manifest"]
    out = []
    for rel in sorted(manifest["files"]):
        try:
            now = identity(inside_artifact(root, rel, str(root)))
        except OSError:
            now = None
        if now != recorded[rel]:
            out.append(
                f"{rel} {'is missing' if now is None else 'changed (size, time, inode or device)'} since it was hashed"
            )
    return out


def current(root: str | Path, manifest: dict[str, Any] | None = None) -> bool:
    return not changed(root, manifest)


def _main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tasks.core.run.stamp ARTIFACT_DIR", file=sys.stderr)
        return 2
    why = changed(argv[0])
    print(
        f"current: {argv[0]}"
        if not why
        else f"stale: {argv[0]}: " + "; ".join(why[:5]) + (f"; and {len(why) - 5} more" if len(why) > 5 else "")
    )
    return 0 if not why else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
