"""The one storage seam: fsspec. Local paths, NFS paths and `s3://` go through here and nowhere else.

ColossalAI only ever sees a local directory. For a local (or NFS) run root that directory IS the
artifact: stages write in place and `publish` only verifies. For an `s3://bucket/prefix` run root:

- `publish` uploads the files in parallel (whole files and multipart parts at once), hashing every
  byte it sends once: the file's sha256 must equal the manifest's before an upload is completed,
  so a partial or altered object never becomes visible, and each request carries the CRC32 of its
  body (the AWS SDKs' default wire checksum), which the server checks; a multipart upload is
  accepted only if the server's composite CRC32 is that of exactly the parts we hashed, in order.
  (A per-part SHA-256 would hash every byte a second time here and once more on the server, for
  nothing the manifest's sha256 and the wire CRC do not already catch.) `.cpt-to-sft/manifest.json` goes up last, after every object has been
  confirmed by size and sha256; an old manifest is deleted first. A crash mid-publish therefore
  leaves no manifest, so the artifact does not exist, and a retry uploads only what is missing.
- `stage_in` downloads in parallel (ranged GETs for large files) into `.part` files, checks each
  file's sha256 against the manifest before renaming it into place, and writes the manifest last.
- `prune_staging` frees local staging space, deleting only artifacts whose remote manifest is
  byte-identical to the local one (safely published) and never unpublished work, which resume needs.

The object transfers themselves (parts, ranges, checksums) are in `tasks.core.storage.s3`;
this module decides what moves and in which order.

Endpoint, region and credentials come only from the standard AWS environment and config files
(AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3, AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/*), which botocore reads itself; nothing here logs them.

    python -c "from tasks.core.storage.fs import RunStore; print(RunStore('/tmp/r').local_path('cpt'))"
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import split_protocol, url_to_fs

from tasks.core.errors import ArtifactMissing, ManifestError
from tasks.core.run import stamp
from tasks.core.run.manifest import (
    MANIFEST,
    artifact_of,
    manifest_tmp,
    parse_manifest,
    read_manifest,
    safe_relpath,
    verify_artifact,
    write_atomic,
)
from tasks.core.run.stages import SUPERSEDED
from tasks.core.storage.s3 import (
    SHA256_META,
    S3Transfers,
    TransferError,
    all_or_nothing,
    b64,
    crc32,
    object_matches,
    run_transfer,
)

__all__ = [
    "DEFAULT_WORKERS",
    "PART_SIZE",
    "SHA256_META",
    "RunStore",
    "TransferError",
    "fetch_to_local",
    "fetch_tree",
    "filesystem",
    "is_local",
    "local_path_of",
    "open_uri",
]

_LOCAL_PROTOCOLS = {"file", "local"}
_S3_PROTOCOLS = {"s3", "s3a"}
PART_SIZE = 16 << 20  # multipart part / ranged-GET size; also the single-PUT threshold
DEFAULT_WORKERS = 8  # parts in flight at once (memory: PART_SIZE * workers)

# Every standard variable that changes which S3 endpoint/account a client talks to: an S3
# filesystem is reused only while these are unchanged (fsspec's own cache ignores the env).
_AWS_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
)
_S3_CACHE: dict[str, Any] = {}


# ---- filesystems ----------------------------------------------------------------------------
def _s3_filesystem():
    import s3fs

    env_key = hashlib.sha256("\0".join(os.environ.get(k, "") for k in _AWS_ENV).encode()).hexdigest()
    fs = _S3_CACHE.get(env_key)
    if fs is None:
        # No listings cache: other processes (ranks, retried tasks) write the same prefixes.
        # No SigV4 payload hashing: every upload here carries x-amz-checksum-crc32 (ours or
        # botocore's), a signed header the server checks the body against, so hashing each body a
        # second time for the signature (botocore does on plain-http endpoints) buys nothing.
        fs = s3fs.S3FileSystem(
            skip_instance_cache=True,
            use_listings_cache=False,
            config_kwargs={"max_pool_connections": 4 * DEFAULT_WORKERS, "s3": {"payload_signing_enabled": False}},
        )
        _S3_CACHE[env_key] = fs
    return fs


def filesystem(uri: str):
    """(fs, path) for a URI; s3:// gets a client configured from the AWS environment only."""
    protocol, _ = split_protocol(uri)
    if protocol in _S3_PROTOCOLS:
        fs = _s3_filesystem()
        return fs, fs._strip_protocol(uri)
    return url_to_fs(uri)


def is_local(uri: str) -> bool:
    protocol, _ = split_protocol(uri)
    if protocol is None or protocol in _LOCAL_PROTOCOLS:
        return True
    if protocol in _S3_PROTOCOLS:
        return False
    fs, _ = url_to_fs(uri)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in _LOCAL_PROTOCOLS for p in protocols)


def local_path_of(uri: str) -> Path:
    _, path = url_to_fs(uri)
    return Path(path)


class RunStore:
    """Artifacts of one run, addressed by a relative name like 'cpt/step-000010'."""

    def __init__(
        self,
        run_uri: str,
        staging_dir: str | None = None,
        max_workers: int = DEFAULT_WORKERS,
        part_size: int = PART_SIZE,
    ):
        self.run_uri = run_uri.rstrip("/")
        self.fs, self.root = filesystem(self.run_uri)
        self.local = is_local(self.run_uri)
        self.max_workers = max_workers
        self.part_size = part_size
        self.last_transfer: dict[str, Any] = {}  # what the latest publish/stage_in moved (benchmarks, logs)
        self.last_verify = ""  # how the latest verify decided (logs): by stamp, or hashed
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

    def _transfers(self) -> S3Transfers:
        return S3Transfers(self.fs, self.max_workers, self.part_size)

    # ---- small files ------------------------------------------------------------------------
    def read_text(self, rel: str) -> str:
        return self.fs.cat_file(self._remote(rel)).decode()

    def write_text(self, rel: str, text: str) -> None:
        """Atomic where the filesystem allows: tmp + rename locally, a single PUT on S3."""
        if self.local:
            path = Path(self._remote(rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text)
        else:
            self.fs.pipe_file(self._remote(rel), text.encode())

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
        dest = f"{rel}{SUPERSEDED}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        self.fs.mv(self._remote(rel), self._remote(dest), recursive=True)
        if not self.local and self.local_path(rel).exists():
            shutil.rmtree(self.local_path(rel))
        return dest

    # ---- manifests --------------------------------------------------------------------------
    def _manifest_bytes(self, rel: str) -> bytes:
        try:
            return self.fs.cat_file(self._remote(f"{rel}/{MANIFEST}"))
        except FileNotFoundError:
            raise ArtifactMissing(f"{self.uri(rel)}: no {MANIFEST}, so this artifact does not exist") from None

    def read_manifest(self, rel: str) -> dict[str, Any]:
        return parse_manifest(self._manifest_bytes(rel), self.uri(rel))

    def manifest_digest(self, rel: str) -> str:
        return hashlib.sha256(self._manifest_bytes(rel)).hexdigest()

    def verify(self, rel: str, deep: bool = True, trust_stamp: bool = False) -> dict[str, Any]:
        """Verify the artifact where it lives.

        Local: `trust_stamp` (the skip decision) accepts a current verification stamp
        (tasks/core/run/stamp.py) instead of hashing every file again; a deep verification writes one.

        Remote: every object exists with the manifest's size and (deep) the sha256 recorded when
        it was uploaded through `publish`, which the server checked on upload; an object uploaded
        by another tool has no recorded sha256 and is streamed and hashed instead.
        """
        if self.local:
            return self._verify_local(self.local_path(rel), deep, trust_stamp)
        manifest = self.read_manifest(rel)
        xfer = self._transfers()

        async def check(name: str) -> None:
            remote = self._remote(f"{rel}/{name}")
            entry = manifest["files"][name]
            head = await xfer.head(remote)
            if head is None:
                raise ManifestError(f"{self.uri(rel)}: file {name} listed in the manifest is missing")
            if head.get("ContentLength") != entry["size"]:
                raise ManifestError(
                    f"{self.uri(rel)}: file {name} has {head.get('ContentLength')} bytes, manifest says {entry['size']}"
                )
            if not deep:
                return
            recorded = (head.get("Metadata") or {}).get(SHA256_META)
            if recorded is None:
                recorded = await asyncio.to_thread(self._stream_sha256, remote)
            if recorded != entry["sha256"]:
                raise ManifestError(
                    f"{self.uri(rel)}: file {name} fails its sha256 check (object sha256 {recorded[:16]}…, manifest "
                    f"{entry['sha256'][:16]}…)"
                )

        xfer.run(lambda: all_or_nothing(check(n) for n in sorted(manifest["files"])))
        return manifest

    def _verify_local(self, root: Path, deep: bool = True, trust_stamp: bool = False) -> dict[str, Any]:
        if deep and trust_stamp:
            manifest = read_manifest(root)
            if stamp.current(root, manifest):
                self.last_verify = (
                    f"by its verification stamp ({len(manifest['files'])} files unchanged since they were hashed)"
                )
                return manifest
        started = time.monotonic()
        manifest = verify_artifact(root, deep=deep)
        self.last_verify = (
            f"hashed {len(manifest['files'])} files in {time.monotonic() - started:.1f}s" if deep else "sizes checked"
        )
        if deep:
            # A read-only run root cannot hold a stamp: every later skip decision hashes again, nothing worse.
            with contextlib.suppress(OSError):
                stamp.write_stamp(root, manifest)
        return manifest

    def _stream_sha256(self, remote: str) -> str:
        h = hashlib.sha256()
        with self.fs.open(remote, "rb", block_size=self.part_size) as f:
            while chunk := f.read(self.part_size):
                h.update(chunk)
        return h.hexdigest()

    # ---- transfers --------------------------------------------------------------------------
    def stage_in(self, rel: str) -> Path:
        """Make a verified local copy of artifact `rel` (no-op for a local run root).

        Files already staged with the right sha256 are kept; others are downloaded in parallel to
        `.part` files and renamed into place only after their sha256 matches; files the manifest
        does not list are removed; the manifest (the remote bytes) is written last.
        """
        local = self.local_path(rel)
        if self.local:
            self._verify_local(local)  # about to be read: every file hashed, whatever the stamp says
            return local
        blob = self._manifest_bytes(rel)
        manifest = parse_manifest(blob, self.uri(rel))
        names = sorted(manifest["files"])
        for name in names:
            safe_relpath(name, self.uri(rel))
        local.mkdir(parents=True, exist_ok=True)
        local_manifest = local / MANIFEST
        if local_manifest.is_file() and local_manifest.read_bytes() != blob:
            local_manifest.unlink()  # the staged copy is stale until every file is re-checked
        keep = set(names)
        for path in sorted(local.rglob("*"), reverse=True):
            relname = path.relative_to(local).as_posix()
            if path.is_file() and relname not in keep and relname != MANIFEST:
                path.unlink()
        xfer = self._transfers()
        started = time.monotonic()

        async def go():
            sem = asyncio.Semaphore(self.max_workers)
            return await all_or_nothing(
                xfer.get(self._remote(f"{rel}/{n}"), local / n, manifest["files"][n], sem) for n in names
            )

        outcome = run_transfer(xfer, go, f"stage-in of {self.uri(rel)}", "safe to retry")
        tmp = manifest_tmp(local)
        tmp.write_bytes(blob)
        os.replace(tmp, local_manifest)
        self.last_transfer = _summary("stage_in", rel, manifest, names, outcome, started)
        return local

    def publish(self, rel: str, release: bool = False) -> str:
        """Upload a locally complete artifact; manifest last. Returns the manifest digest.

        Remote objects that already hold a file (same size and recorded sha256) are not sent
        again, so a retry after a failure uploads only what is missing. `release=True` deletes
        the staged copy once the manifest is up.
        """
        local = self.local_path(rel)
        if self.local:
            self._verify_local(local)  # just built: hashed once more, and stamped for the skip decisions
            return self.manifest_digest(rel)
        local_manifest = local / MANIFEST
        if not local_manifest.is_file():
            raise ArtifactMissing(f"{local}: no {MANIFEST}, so there is no complete artifact to publish")
        blob = local_manifest.read_bytes()
        manifest = parse_manifest(blob, str(local))
        names = sorted(manifest["files"])
        for name in names:
            safe_relpath(name, str(local))
            path = local / name
            if not path.is_file():
                raise ManifestError(f"{local}: file {name} listed in the manifest is missing")
            if path.stat().st_size != manifest["files"][name]["size"]:
                raise ManifestError(
                    f"{local}: file {name} has {path.stat().st_size} bytes, manifest says "
                    f"{manifest['files'][name]['size']}"
                )
        remote_manifest = self._remote(f"{rel}/{MANIFEST}")
        xfer = self._transfers()
        started = time.monotonic()

        async def go():
            try:
                current = await self.fs._cat_file(remote_manifest)
            except FileNotFoundError:
                current = None
            if current == blob:
                heads = await all_or_nothing(xfer.head(self._remote(f"{rel}/{n}")) for n in names)
                if all(
                    object_matches(h, manifest["files"][n]["size"], manifest["files"][n]["sha256"])
                    for h, n in zip(heads, names)
                ):
                    return ["present"] * len(names)
            if current is not None:
                # The artifact stops existing until the new one is whole.
                bucket, key, _ = self.fs.split_path(remote_manifest)
                await xfer.call("delete_object", Bucket=bucket, Key=key)
            await xfer.abort_stale_uploads(self._remote(rel))
            sem = asyncio.Semaphore(self.max_workers)
            outcome = await all_or_nothing(
                xfer.put(local / n, self._remote(f"{rel}/{n}"), manifest["files"][n], sem) for n in names
            )
            bucket, key, _ = self.fs.split_path(remote_manifest)
            await xfer.call(
                "put_object",
                Bucket=bucket,
                Key=key,
                Body=blob,
                ChecksumCRC32=b64(crc32(blob)),
                ContentType="application/json",
            )
            return outcome

        outcome = run_transfer(xfer, go, f"publish of {self.uri(rel)}", "no manifest was written, safe to retry")
        self.last_transfer = _summary("publish", rel, manifest, names, outcome, started)
        if release:
            shutil.rmtree(local, ignore_errors=True)
        return hashlib.sha256(blob).hexdigest()

    def prune_staging(self, keep: Iterable[str] = ()) -> list[str]:
        """Delete staged artifacts that are safely published (remote manifest identical).

        Kept: everything under a `keep` prefix, and any directory without a published twin —
        unpublished checkpoints are what a resume needs. Returns the removed rel names.
        """
        if self.local or not self.staging.is_dir():
            return []
        keep = [k.strip("/") for k in keep]
        removed = []
        for manifest_path in sorted(self.staging.rglob(MANIFEST)):
            art = Path(artifact_of(manifest_path.as_posix()))
            rel = art.relative_to(self.staging).as_posix()
            if any(rel == k or rel.startswith(k + "/") for k in keep):
                continue
            try:
                published = self._manifest_bytes(rel) == manifest_path.read_bytes()
            except (ArtifactMissing, OSError):
                published = False
            if published:
                shutil.rmtree(art, ignore_errors=True)
                removed.append(rel)
        for path in sorted(self.staging.rglob("*.part")):
            path.unlink(missing_ok=True)
        return removed


def _summary(op: str, rel: str, manifest: dict, names: list[str], outcome: list[str], started: float) -> dict[str, Any]:
    moved = [n for n, o in zip(names, outcome) if o in ("uploaded", "downloaded")]
    return {
        "op": op,
        "rel": rel,
        "files": len(names),
        "transferred": len(moved),
        "bytes": sum(manifest["files"][n]["size"] for n in moved),
        "seconds": round(time.monotonic() - started, 3),
    }


def open_uri(uri: str, mode: str = "rb", **kwargs: Any):
    """Read a user-supplied URI (data files, config files) through fsspec.

    kwargs go to fsspec's open unchanged (encoding, compression="infer", ...).
    """
    if not is_local(uri):
        fs, path = filesystem(uri)
        return fs.open(path, mode, **kwargs)
    return fsspec.open(uri, mode, **kwargs)


def fetch_to_local(uri: str, dest_dir: Path) -> Path:
    """Local path for a data/config URI: itself when local, else a downloaded copy."""
    if is_local(uri):
        return local_path_of(uri)
    dest_dir.mkdir(parents=True, exist_ok=True)
    fs, path = filesystem(uri)
    dest = dest_dir / Path(path).name
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    fs.get_file(path, str(tmp))
    os.replace(tmp, dest)
    return dest


def fetch_tree(uri: str, dest: Path, skip: Callable[[str], bool] = lambda rel: False) -> list[str]:
    """Copy every file under a (remote or local) directory URI into `dest`; returns rel paths."""
    fs, root = filesystem(uri)
    root = root.rstrip("/")
    out = []
    for path in sorted(fs.find(root)):
        rel = path[len(root) :].lstrip("/")
        if not rel or skip(rel):
            continue
        safe_relpath(rel, uri)
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(target))
        out.append(rel)
    return out
