"""Artifact manifests: the contract between stages.

An artifact is a directory plus `.cpt-to-sft/manifest.json`, written LAST (tmp file + rename). A
directory without a manifest does not exist; a manifest whose files do not verify is an error naming the
file. Manifests are untrusted input when read back: every listed path must be relative and stay
inside the artifact directory, and it is checked before a byte of the file is read.

    python -m tasks.core.run.manifest verify runs/demo/cpt/hf     # verify an artifact by hand
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from tasks.core.errors import ArtifactMissing, ManifestError

# Provenance (manifest, fingerprint, verification record) lives in one hidden subfolder of every
# artifact, so an HF model folder holds only what a model repo should and no weight loader (vLLM's
# `*.safetensors` glob, the Hub's weight count) ever meets it. This is the one place it is spelled.
PROVENANCE_DIR = ".cpt-to-sft"
MANIFEST = f"{PROVENANCE_DIR}/manifest.json"
# Written after the manifest by a deep verification (tasks/core/run/stamp.py), never listed in it.
STAMP = f"{PROVENANCE_DIR}/verified-stamp.json"
# An HF artifact's own proof (tasks/core/models/hf_artifact.py writes it), beside the manifest.
VERIFICATION = f"{PROVENANCE_DIR}/verification.json"
SCHEMA = 1
_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def safe_relpath(rel: str, where: str = "manifest") -> str:
    """Refuse absolute paths, '..', backslashes, control characters and empty parts before anything touches the disk."""
    if not isinstance(rel, str) or not rel:
        raise ManifestError(f"{where}: empty or non-string file path {rel!r}")
    bad = sorted({c for c in rel if ord(c) < 32 or ord(c) == 127})
    if bad:
        # The OS would refuse it mid-verification (a NUL raises "embedded null byte" deep inside
        # os.stat); no stage ever writes such a name, so the manifest is corrupt or forged.
        chars = ", ".join(repr(c) for c in bad)
        raise ManifestError(
            f"{where}: file path {rel!r} is not a valid path (control character {chars}); no stage writes such a name, "
            "so this manifest is corrupt or was tampered with: delete the artifact directory and the stage is rebuilt"
        )
    if "\\" in rel or rel.startswith("/") or (len(rel) > 1 and rel[1] == ":"):
        raise ManifestError(
            f"{where}: file path {rel!r} is absolute; manifests may only list paths inside the artifact"
        )
    parts = PurePosixPath(rel).parts
    if any(p in ("..", "", ".") for p in parts) or rel != str(PurePosixPath(*parts)):
        raise ManifestError(f"{where}: file path {rel!r} leaves or escapes the artifact directory")
    return rel


def inside_artifact(root: Path, rel: str, where: str) -> Path:
    path = root / rel
    try:
        real_root = root.resolve()
        real = path.resolve()
    except (ValueError, OSError) as exc:  # e.g. a symlink loop; an unchecked name would be a bare ValueError
        raise ManifestError(
            f"{where}: {rel!r} cannot be resolved inside the artifact ({type(exc).__name__}: {exc}); delete the "
            "artifact directory and the stage is rebuilt"
        ) from None
    if real_root != real and real_root not in real.parents:
        raise ManifestError(f"{where}: {rel!r} resolves outside the artifact (symlink to {real})")
    return path


def list_files(root: Path, exclude: Iterable[str] = ()) -> list[str]:
    skip = {MANIFEST, STAMP, *exclude}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            rel = Path(dirpath, name).relative_to(root).as_posix()
            if rel not in skip and not name.endswith(".tmp"):
                out.append(rel)
    return out


def build_file_table(root: Path, known: dict[str, dict] | None = None, exclude: Iterable[str] = ()) -> dict[str, dict]:
    """{relpath: {size, sha256}}; `known` carries hashes computed while writing (no second read)."""
    known = known or {}
    table = {}
    for rel in list_files(root, exclude):
        size = (root / rel).stat().st_size
        entry = known.get(rel)
        if entry and entry.get("size") == size and entry.get("sha256"):
            table[rel] = {"size": size, "sha256": entry["sha256"]}
        else:
            table[rel] = {"size": size, "sha256": sha256_file(root / rel)}
    return table


def write_manifest(
    root: str | Path,
    *,
    kind: str,
    meta: dict[str, Any] | None = None,
    parent: dict[str, Any] | None = None,
    config_digest: str | None = None,
    fingerprint: dict[str, Any] | None = None,
    known_hashes: dict[str, dict] | None = None,
    exclude: Iterable[str] = (),
    other_files: dict[str, dict] | None = None,
) -> dict[str, Any]:
    """Hash every file under `root` and commit the manifest last, atomically. `other_files`
    lists files of the same artifact that live elsewhere (other nodes' parts, already published)."""
    root = Path(root)
    manifest = {
        "schema": SCHEMA,
        "kind": kind,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "meta": meta or {},
        "parent": parent,
        "config_digest": config_digest,
        "fingerprint": fingerprint,
        "files": {**(other_files or {}), **build_file_table(root, known_hashes, exclude)},
    }
    blob = json.dumps(manifest, indent=2, sort_keys=True).encode()
    tmp = manifest_tmp(root)
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(root / PROVENANCE_DIR)
    return manifest


def write_atomic(path: Path, data: str | bytes) -> None:
    """`path` written whole or not at all (tmp beside it + rename); the tmp never outlives a failure
    (a full disk, an interruption) of the write that made it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def amend_views(root: str | Path, views: dict[str, bytes]) -> bool:
    """Write `views` (name -> bytes: files rendered from the artifact's records, e.g. the export's
    model card) into a committed artifact and commit its manifest again, listing them with their
    sha256 and under `views`, which the content digest leaves out (`tasks.core.run.digest`): what
    the artifact is, and so what was made from it, does not change. Returns False when every view
    already holds those bytes. A crash between the two writes leaves the old manifest whole, the
    new view unlisted: the next call lists it."""
    root = Path(root)
    manifest = read_manifest(root)
    table = {name: {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()} for name, blob in views.items()}
    if all(manifest["files"].get(n) == e for n, e in table.items()) and set(views) <= set(manifest.get("views") or ()):
        return False
    for name, blob in views.items():
        write_atomic(inside_artifact(root, safe_relpath(name, str(root)), str(root)), blob)
    manifest["files"].update(table)
    manifest["views"] = sorted(set(manifest.get("views") or ()) | set(views))
    tmp = manifest_tmp(root)
    tmp.write_bytes(json.dumps(manifest, indent=2, sort_keys=True).encode())
    os.replace(tmp, root / MANIFEST)
    fsync_dir(root / PROVENANCE_DIR)
    return True


def manifest_tmp(root: Path) -> Path:
    """Where a manifest is written before its rename: beside it, so the rename is atomic."""
    (root / PROVENANCE_DIR).mkdir(parents=True, exist_ok=True)
    return root / PROVENANCE_DIR / f".manifest.json.{os.getpid()}.tmp"


def artifact_of(manifest_path: str) -> str:
    """The artifact directory of a manifest path (posix or fsspec string)."""
    suffix = "/" + MANIFEST
    if not manifest_path.endswith(suffix):
        raise ValueError(f"{manifest_path} is not a manifest path (…{suffix})")
    return manifest_path[: -len(suffix)]


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (best effort; not every filesystem can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def parse_manifest(blob: bytes, where: str) -> dict[str, Any]:
    try:
        manifest = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{where}: {MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ManifestError(f"{where}: {MANIFEST} has no 'files' table")
    for rel, entry in manifest["files"].items():
        safe_relpath(rel, where)
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get("sha256"), str)
        ):
            raise ManifestError(f"{where}: manifest entry for {rel!r} needs integer size and sha256")
    return manifest


def read_manifest(root: str | Path) -> dict[str, Any]:
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactMissing(f"{root}: no {MANIFEST}, so this artifact does not exist (incomplete or never written)")
    return parse_manifest(path.read_bytes(), str(root))


def manifest_digest(root: str | Path) -> str:
    return hashlib.sha256((Path(root) / MANIFEST).read_bytes()).hexdigest()


def verify_artifact(root: str | Path, deep: bool = True) -> dict[str, Any]:
    """Check every listed file exists inside the artifact with its size (and sha256 if deep)."""
    root = Path(root)
    manifest = read_manifest(root)
    for rel, entry in sorted(manifest["files"].items()):
        path = inside_artifact(root, rel, str(root))
        if not path.is_file():
            raise ManifestError(f"{root}: file {rel} listed in the manifest is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise ManifestError(
                f"{root}: file {rel} has {size} bytes, manifest says {entry['size']} (truncated or rewritten)"
            )
        if deep and sha256_file(path) != entry["sha256"]:
            raise ManifestError(f"{root}: file {rel} fails its sha256 check (corrupted)")
    return manifest


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "verify":
        print("usage: python -m tasks.core.run.manifest verify DIR", file=sys.stderr)
        return 2
    try:
        m = verify_artifact(argv[1])
    except ManifestError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"ok: {argv[1]} kind={m['kind']} files={len(m['files'])} digest={manifest_digest(argv[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
