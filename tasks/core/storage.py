"""The one storage seam: fsspec. Local paths, NFS paths and `s3://` go through here and nowhere else.

ColossalAI only ever sees a local directory. For a local (or NFS) run root that directory IS the
artifact: stages write in place and `publish` only verifies. For a remote run root, `stage_in`
downloads a verified artifact into the staging directory and `publish` uploads the files in
parallel, checks sizes and sha256, and uploads `manifest.json` last, so a crash mid-publish
leaves no manifest and therefore no artifact.

    python -c "from tasks.core.storage import RunStore; print(RunStore('/tmp/r').local_path('cpt'))"
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from tasks.core.errors import ArtifactMissing, ManifestError
from tasks.core.manifest import MANIFEST, parse_manifest, safe_relpath, verify_artifact

_LOCAL_PROTOCOLS = {"file", "local"}


def is_local(uri: str) -> bool:
    fs, _ = url_to_fs(uri)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in _LOCAL_PROTOCOLS for p in protocols)


def local_path_of(uri: str) -> Path:
    fs, path = url_to_fs(uri)
    return Path(path)


class RunStore:
    """Artifacts of one run, addressed by a relative name like 'cpt/step-000010'."""

    def __init__(self, run_uri: str, staging_dir: str | None = None, max_workers: int = 8):
        self.run_uri = run_uri.rstrip("/")
        self.fs, self.root = url_to_fs(self.run_uri)
        self.local = is_local(self.run_uri)
        self.max_workers = max_workers
        if self.local:
            self.staging = Path(self.root)
        else:
            base = Path(staging_dir) if staging_dir else Path(tempfile.gettempdir()) / "cpt-to-sft-staging"
            digest = hashlib.sha256(self.run_uri.encode()).hexdigest()[:12]
            self.staging = base / digest

    # ---- addressing -------------------------------------------------------------------------
    def uri(self, rel: str = "") -> str:
        return f"{self.run_uri}/{rel}".rstrip("/") if rel else self.run_uri

    def _remote(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}".rstrip("/")

    def local_path(self, rel: str) -> Path:
        """Where a stage reads/writes `rel` on this machine (the artifact itself when local)."""
        return self.staging / rel

    # ---- small files ------------------------------------------------------------------------
    def read_text(self, rel: str) -> str:
        with self.fs.open(self._remote(rel), "r") as f:
            return f.read()

    def write_text(self, rel: str, text: str) -> None:
        """Atomic where the filesystem allows: tmp + rename locally, a single PUT on S3."""
        if self.local:
            path = Path(self._remote(rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        else:
            with self.fs.open(self._remote(rel), "w") as f:
                f.write(text)

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._remote(rel))

    def listdir(self, rel: str) -> list[str]:
        try:
            entries = self.fs.ls(self._remote(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted(Path(e.rstrip("/")).name for e in entries)

    def remove(self, rel: str) -> None:
        if self.fs.exists(self._remote(rel)):
            self.fs.rm(self._remote(rel), recursive=True)

    def move_aside(self, rel: str, reason: str) -> str | None:
        """Keep superseded work instead of deleting it: rel -> rel.superseded-<UTC time>."""
        if not self.exists(rel):
            return None
        dest = f"{rel}.superseded-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        self.fs.mv(self._remote(rel), self._remote(dest), recursive=True)
        if not self.local and self.local_path(rel).exists():
            shutil.rmtree(self.local_path(rel))
        return dest

    # ---- manifests --------------------------------------------------------------------------
    def read_manifest(self, rel: str) -> dict[str, Any]:
        path = self._remote(f"{rel}/{MANIFEST}")
        if not self.fs.exists(path):
            raise ArtifactMissing(f"{self.uri(rel)}: no manifest.json, so this artifact does not exist")
        with self.fs.open(path, "rb") as f:
            return parse_manifest(f.read(), self.uri(rel))

    def manifest_digest(self, rel: str) -> str:
        with self.fs.open(self._remote(f"{rel}/{MANIFEST}"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def verify(self, rel: str, deep: bool = True) -> dict[str, Any]:
        """Verify the artifact where it lives. Remote: sizes always, sha256 after stage-in."""
        if self.local:
            return verify_artifact(self.local_path(rel), deep=deep)
        manifest = self.read_manifest(rel)
        for name, entry in manifest["files"].items():
            remote = self._remote(f"{rel}/{name}")
            try:
                size = self.fs.size(remote)
            except FileNotFoundError:
                raise ManifestError(f"{self.uri(rel)}: file {name} listed in the manifest is missing") from None
            if size != entry["size"]:
                raise ManifestError(f"{self.uri(rel)}: file {name} has {size} bytes, manifest says {entry['size']}")
        return manifest

    # ---- transfers --------------------------------------------------------------------------
    def stage_in(self, rel: str) -> Path:
        """Make a verified local copy of artifact `rel` (no-op for a local run root)."""
        local = self.local_path(rel)
        if self.local:
            verify_artifact(local)
            return local
        manifest = self.read_manifest(rel)
        local.mkdir(parents=True, exist_ok=True)

        def fetch(name: str) -> None:
            safe_relpath(name, self.uri(rel))
            dest = local / name
            entry = manifest["files"][name]
            if dest.is_file() and dest.stat().st_size == entry["size"]:
                return
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get(self._remote(f"{rel}/{name}"), str(dest))

        with ThreadPoolExecutor(self.max_workers) as pool:
            list(pool.map(fetch, sorted(manifest["files"])))
        (local / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        verify_artifact(local)
        return local

    def publish(self, rel: str) -> str:
        """Upload a locally complete artifact; manifest last. Returns the manifest digest."""
        local = self.local_path(rel)
        manifest = verify_artifact(local)
        if self.local:
            return self.manifest_digest(rel)
        remote_manifest = self._remote(f"{rel}/{MANIFEST}")
        if self.fs.exists(remote_manifest):
            self.fs.rm(remote_manifest)  # the artifact stops existing until the new one is whole

        def put(name: str) -> None:
            self.fs.put_file(str(local / name), self._remote(f"{rel}/{name}"))
            size = self.fs.size(self._remote(f"{rel}/{name}"))
            if size != manifest["files"][name]["size"]:
                raise ManifestError(f"publish {self.uri(rel)}/{name}: uploaded {size} bytes, expected {manifest['files'][name]['size']}")

        with ThreadPoolExecutor(self.max_workers) as pool:
            list(pool.map(put, sorted(manifest["files"])))
        self.fs.put_file(str(local / MANIFEST), remote_manifest)
        return self.manifest_digest(rel)


def open_uri(uri: str, mode: str = "rb"):
    """Read a user-supplied URI (data files, config files) through fsspec."""
    return fsspec.open(uri, mode)


def fetch_to_local(uri: str, dest_dir: Path) -> Path:
    """Local path for a data/config URI: itself when local, else a downloaded copy."""
    if is_local(uri):
        return local_path_of(uri)
    dest_dir.mkdir(parents=True, exist_ok=True)
    fs, path = url_to_fs(uri)
    dest = dest_dir / Path(path).name
    fs.get(path, str(dest))
    return dest
