"""The one storage seam: fsspec. Local paths, NFS paths and `s3://` go through here and nowhere else.

ColossalAI only ever sees a local directory. For a local (or NFS) run root that directory IS the
artifact: stages write in place and `publish` only verifies. For an `s3://bucket/prefix` run root:

- `publish` uploads the files in parallel (whole files and multipart parts at once), hashing every
  byte it sends once: the file's sha256 must equal the manifest's before an upload is completed,
  so a partial or altered object never becomes visible, and each request carries the CRC32 of its
  body (the AWS SDKs' default wire checksum), which the server checks; a multipart upload is
  accepted only if the server's composite CRC32 is that of exactly the parts we hashed, in order.
  (A per-part SHA-256 would hash every byte a second time here and once more on the server, for
  nothing the manifest's sha256 and the wire CRC do not already catch.) `manifest.json` goes up last, after every object has been
  confirmed by size and sha256; an old manifest is deleted first. A crash mid-publish therefore
  leaves no manifest, so the artifact does not exist, and a retry uploads only what is missing.
- `stage_in` downloads in parallel (ranged GETs for large files) into `.part` files, checks each
  file's sha256 against the manifest before renaming it into place, and writes the manifest last.
- `prune_staging` frees local staging space, deleting only artifacts whose remote manifest is
  byte-identical to the local one (safely published) and never unpublished work, which resume needs.

Endpoint, region and credentials come only from the standard AWS environment and config files
(AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3, AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/*), which botocore reads itself; nothing here logs them.

    python -c "from tasks.core.storage import RunStore; print(RunStore('/tmp/r').local_path('cpt'))"
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

import fsspec
from fsspec.core import split_protocol, url_to_fs

from tasks.core.errors import ArtifactMissing, ManifestError
from tasks.core.manifest import MANIFEST, parse_manifest, safe_relpath, sha256_file, verify_artifact

_LOCAL_PROTOCOLS = {"file", "local"}
_S3_PROTOCOLS = {"s3", "s3a"}
PART_SIZE = 16 << 20  # multipart part / ranged-GET size; also the single-PUT threshold
DEFAULT_WORKERS = 8  # parts in flight at once (memory: PART_SIZE * workers)
SHA256_META = "sha256"  # object metadata key holding the whole file's sha256 (hex)

# Every standard variable that changes which S3 endpoint/account a client talks to: an S3
# filesystem is reused only while these are unchanged (fsspec's own cache ignores the env).
_AWS_ENV = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_DEFAULT_REGION",
    "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
    "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE",
)
_S3_CACHE: dict[str, Any] = {}


class TransferError(OSError):
    """An upload or download that did not complete (transient I/O); retrying is safe."""


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
            skip_instance_cache=True, use_listings_cache=False,
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


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def _crc32(data: bytes) -> bytes:
    """CRC32 (IEEE, zlib's) as S3's x-amz-checksum-crc32 carries it: 4 bytes, big-endian."""
    return zlib.crc32(data).to_bytes(4, "big")


def _hash_into(whole, chunk: bytes) -> bytes:
    """Feed the file's running sha256 and return the chunk's CRC32 (one thread hop)."""
    whole.update(chunk)
    return _crc32(chunk)


def _read_at(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def _write_at(fd: int, offset: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


async def _all_or_nothing(aws: Iterable[Awaitable[Any]]) -> list[Any]:
    """Run concurrently; on the first failure cancel the rest and raise that failure."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
    if failed is not None:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise failed.exception()
    return [t.result() for t in tasks]


class _S3Transfers:
    """Parallel, checksummed object transfers on s3fs's event loop (one semaphore bounds memory)."""

    def __init__(self, fs, workers: int, part_size: int):
        self.fs, self.workers, self.part_size = fs, max(1, workers), max(5 << 20, part_size)

    def run(self, make_coro: Callable[[], Awaitable[Any]]):
        from fsspec.asyn import sync

        return sync(self.fs.loop, make_coro)

    async def call(self, method: str, **kwargs):
        return await self.fs._call_s3(method, **kwargs)

    async def head(self, path: str) -> dict | None:
        bucket, key, _ = self.fs.split_path(path)
        try:
            return await self.call("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None

    # ---- upload -----------------------------------------------------------------------------
    async def abort_stale_uploads(self, prefix: str) -> int:
        """Abort unfinished multipart uploads under `prefix` (left by a crashed publish)."""
        bucket, key, _ = self.fs.split_path(prefix)
        try:
            listing = await self.call("list_multipart_uploads", Bucket=bucket, Prefix=key.rstrip("/") + "/")
        except Exception:
            return 0  # optional clean-up; servers without the call simply keep the parts
        uploads = listing.get("Uploads") or []
        for up in uploads:
            try:
                await self.call("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
            except Exception:
                pass
        return len(uploads)

    async def put(self, local: Path, remote: str, entry: dict, sem: asyncio.Semaphore) -> str:
        """Upload one file unless the remote object already holds exactly it. 'uploaded'|'present'."""
        size, sha = entry["size"], entry["sha256"]
        head = await self.head(remote)
        if _object_matches(head, size, sha):
            return "present"
        bucket, key, _ = self.fs.split_path(remote)
        if size <= self.part_size:
            async with sem:
                data = await asyncio.to_thread(_read_at, local, 0, size + 1)
                whole = hashlib.sha256()
                crc = await asyncio.to_thread(_hash_into, whole, data)
                _check_local(local, len(data), whole.hexdigest(), entry)
                # The server recomputes the body's CRC32 and refuses the PUT if it differs.
                await self.call(
                    "put_object", Bucket=bucket, Key=key, Body=data, ChecksumCRC32=_b64(crc), Metadata={SHA256_META: sha},
                )
        else:
            await self._put_multipart(local, bucket, key, entry, sem)
        head = await self.head(remote)
        if not _object_matches(head, size, sha):
            got = None if head is None else (head.get("ContentLength"), (head.get("Metadata") or {}).get(SHA256_META))
            raise TransferError(f"{remote}: after upload the server reports (size, sha256) = {got}, expected ({size}, {sha})")
        return "uploaded"

    async def _put_multipart(self, local: Path, bucket: str, key: str, entry: dict, sem: asyncio.Semaphore) -> None:
        size, sha = entry["size"], entry["sha256"]
        mpu = await self.call(
            "create_multipart_upload", Bucket=bucket, Key=key, Metadata={SHA256_META: sha}, ChecksumAlgorithm="CRC32",
        )
        upload_id = mpu["UploadId"]
        tasks: list[asyncio.Future] = []

        async def send(number: int, chunk: bytes, digest: bytes) -> dict:
            try:
                resp = await self.call(
                    "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=chunk,
                    ChecksumCRC32=_b64(digest),
                )
                return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32": _b64(digest)}
            finally:
                sem.release()

        try:
            whole = hashlib.sha256()
            digests: list[bytes] = []
            offset, number = 0, 0
            while offset < size:
                await sem.acquire()
                try:
                    chunk = await asyncio.to_thread(_read_at, local, offset, min(self.part_size, size - offset))
                    if not chunk:
                        raise ManifestError(f"{local}: file is shorter than the {size} bytes its manifest lists (changed since the manifest was written)")
                    digest = await asyncio.to_thread(_hash_into, whole, chunk)
                except BaseException:
                    sem.release()
                    raise
                number += 1
                offset += len(chunk)
                digests.append(digest)
                tasks.append(asyncio.ensure_future(send(number, chunk, digest)))
            if os.path.getsize(local) != size or whole.hexdigest() != sha:
                raise ManifestError(f"{local}: content differs from its manifest entry (sha256/size changed since the manifest was written); not uploaded")
            parts = await _all_or_nothing(tasks)
            done = await self.call(
                "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts},
            )
            # S3's composite checksum: the CRC32 of the parts' CRC32s, "-N". Servers that return
            # it thereby confirm they assembled exactly the parts we hashed, in order.
            composite = done.get("ChecksumCRC32")
            expected = f"{_b64(_crc32(b''.join(digests)))}-{len(digests)}"
            if composite and composite != expected:
                raise TransferError(f"s3://{bucket}/{key}: server assembled checksum {composite}, expected {expected}")
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:  # best effort: a dead server keeps the parts, the next publish aborts them
                await asyncio.wait_for(self.call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id), 5)
            except BaseException:
                pass
            raise

    # ---- download ---------------------------------------------------------------------------
    async def get(self, remote: str, dest: Path, entry: dict, sem: asyncio.Semaphore) -> str:
        """Download one file into place with its sha256 checked. 'downloaded'|'present'."""
        size, sha = entry["size"], entry["sha256"]
        if dest.is_file() and dest.stat().st_size == size:
            async with sem:
                if await asyncio.to_thread(sha256_file, dest) == sha:
                    return "present"
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        try:
            if size <= self.part_size:
                async with sem:
                    data = await self.fs._cat_file(remote)
                    digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
                    await asyncio.to_thread(tmp.write_bytes, data)
                got = len(data)
            else:
                got, digest = await self._get_ranges(remote, tmp, size, sem)
            if got != size or digest != sha:
                raise ManifestError(f"{remote}: downloaded {got} bytes with sha256 {digest[:16]}…, manifest says {size} bytes, {sha[:16]}… (object altered or partial)")
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return "downloaded"

    async def _get_ranges(self, remote: str, tmp: Path, size: int, sem: asyncio.Semaphore) -> tuple[int, str]:
        whole = hashlib.sha256()
        queue: asyncio.Queue = asyncio.Queue()

        async def fetch(start: int, end: int) -> bytes:
            return await self.fs._cat_file(remote, start=start, end=end)

        async def produce() -> None:
            for start in range(0, size, self.part_size):
                await sem.acquire()
                await queue.put(asyncio.ensure_future(fetch(start, min(start + self.part_size, size))))
            await queue.put(None)

        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        producer = asyncio.ensure_future(produce())
        got = 0
        try:
            while (task := await queue.get()) is not None:  # consumed in order: hashing is sequential
                try:
                    data = await task
                    await asyncio.to_thread(_write_at, fd, got, data)
                    await asyncio.to_thread(whole.update, data)
                    got += len(data)
                finally:
                    sem.release()
            await producer
        except BaseException:
            producer.cancel()
            while not queue.empty():
                task = queue.get_nowait()
                if task is not None:
                    task.cancel()
                    sem.release()
            await asyncio.gather(producer, return_exceptions=True)
            raise
        finally:
            os.close(fd)
        return got, whole.hexdigest()


def _run_transfer(xfer: "_S3Transfers", go: Callable[[], Awaitable[Any]], what: str, after: str) -> Any:
    """Run a transfer; a content problem (ManifestError) passes through, anything else (the
    server, the network) becomes a TransferError saying what failed and what that leaves."""
    try:
        return xfer.run(go)
    except ManifestError:
        raise
    except Exception as exc:
        raise TransferError(f"{what} failed ({type(exc).__name__}: {exc}); {after}") from exc


def _object_matches(head: dict | None, size: int, sha: str) -> bool:
    return bool(head) and head.get("ContentLength") == size and (head.get("Metadata") or {}).get(SHA256_META) == sha


def _check_local(local: Path, size: int, sha: str, entry: dict) -> None:
    if size != entry["size"] or sha != entry["sha256"]:
        raise ManifestError(f"{local}: content differs from its manifest entry ({size} bytes, sha256 {sha[:16]}… vs {entry['size']} bytes, {entry['sha256'][:16]}…); not uploaded")


class RunStore:
    """Artifacts of one run, addressed by a relative name like 'cpt/step-000010'."""

    def __init__(self, run_uri: str, staging_dir: str | None = None, max_workers: int = DEFAULT_WORKERS, part_size: int = PART_SIZE):
        self.run_uri = run_uri.rstrip("/")
        self.fs, self.root = filesystem(self.run_uri)
        self.local = is_local(self.run_uri)
        self.max_workers = max_workers
        self.part_size = part_size
        self.last_transfer: dict[str, Any] = {}  # what the latest publish/stage_in moved (benchmarks, logs)
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

    def _transfers(self) -> _S3Transfers:
        return _S3Transfers(self.fs, self.max_workers, self.part_size)

    # ---- small files ------------------------------------------------------------------------
    def read_text(self, rel: str) -> str:
        return self.fs.cat_file(self._remote(rel)).decode()

    def write_text(self, rel: str, text: str) -> None:
        """Atomic where the filesystem allows: tmp + rename locally, a single PUT on S3."""
        if self.local:
            path = Path(self._remote(rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
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
        dest = f"{rel}.superseded-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        self.fs.mv(self._remote(rel), self._remote(dest), recursive=True)
        if not self.local and self.local_path(rel).exists():
            shutil.rmtree(self.local_path(rel))
        return dest

    # ---- manifests --------------------------------------------------------------------------
    def _manifest_bytes(self, rel: str) -> bytes:
        try:
            return self.fs.cat_file(self._remote(f"{rel}/{MANIFEST}"))
        except FileNotFoundError:
            raise ArtifactMissing(f"{self.uri(rel)}: no manifest.json, so this artifact does not exist") from None

    def read_manifest(self, rel: str) -> dict[str, Any]:
        return parse_manifest(self._manifest_bytes(rel), self.uri(rel))

    def manifest_digest(self, rel: str) -> str:
        return hashlib.sha256(self._manifest_bytes(rel)).hexdigest()

    def verify(self, rel: str, deep: bool = True) -> dict[str, Any]:
        """Verify the artifact where it lives.

        Remote: every object exists with the manifest's size and (deep) the sha256 recorded when
        it was uploaded through `publish`, which the server checked on upload; an object uploaded
        by another tool has no recorded sha256 and is streamed and hashed instead.
        """
        if self.local:
            return verify_artifact(self.local_path(rel), deep=deep)
        manifest = self.read_manifest(rel)
        xfer = self._transfers()

        async def check(name: str) -> None:
            remote = self._remote(f"{rel}/{name}")
            entry = manifest["files"][name]
            head = await xfer.head(remote)
            if head is None:
                raise ManifestError(f"{self.uri(rel)}: file {name} listed in the manifest is missing")
            if head.get("ContentLength") != entry["size"]:
                raise ManifestError(f"{self.uri(rel)}: file {name} has {head.get('ContentLength')} bytes, manifest says {entry['size']}")
            if not deep:
                return
            recorded = (head.get("Metadata") or {}).get(SHA256_META)
            if recorded is None:
                recorded = await asyncio.to_thread(self._stream_sha256, remote)
            if recorded != entry["sha256"]:
                raise ManifestError(f"{self.uri(rel)}: file {name} fails its sha256 check (object sha256 {recorded[:16]}…, manifest {entry['sha256'][:16]}…)")

        xfer.run(lambda: _all_or_nothing(check(n) for n in sorted(manifest["files"])))
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
            verify_artifact(local)
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
            return await _all_or_nothing(xfer.get(self._remote(f"{rel}/{n}"), local / n, manifest["files"][n], sem) for n in names)

        outcome = _run_transfer(xfer, go, f"stage-in of {self.uri(rel)}", "safe to retry")
        tmp = local / f".{MANIFEST}.{os.getpid()}.tmp"
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
            verify_artifact(local)
            return self.manifest_digest(rel)
        local_manifest = local / MANIFEST
        if not local_manifest.is_file():
            raise ArtifactMissing(f"{local}: no manifest.json, so there is no complete artifact to publish")
        blob = local_manifest.read_bytes()
        manifest = parse_manifest(blob, str(local))
        names = sorted(manifest["files"])
        for name in names:
            safe_relpath(name, str(local))
            path = local / name
            if not path.is_file():
                raise ManifestError(f"{local}: file {name} listed in the manifest is missing")
            if path.stat().st_size != manifest["files"][name]["size"]:
                raise ManifestError(f"{local}: file {name} has {path.stat().st_size} bytes, manifest says {manifest['files'][name]['size']}")
        remote_manifest = self._remote(f"{rel}/{MANIFEST}")
        xfer = self._transfers()
        started = time.monotonic()

        async def go():
            try:
                current = await self.fs._cat_file(remote_manifest)
            except FileNotFoundError:
                current = None
            if current == blob:
                heads = await _all_or_nothing(xfer.head(self._remote(f"{rel}/{n}")) for n in names)
                if all(_object_matches(h, manifest["files"][n]["size"], manifest["files"][n]["sha256"]) for h, n in zip(heads, names)):
                    return ["present"] * len(names)
            if current is not None:
                # The artifact stops existing until the new one is whole.
                bucket, key, _ = self.fs.split_path(remote_manifest)
                await xfer.call("delete_object", Bucket=bucket, Key=key)
            await xfer.abort_stale_uploads(self._remote(rel))
            sem = asyncio.Semaphore(self.max_workers)
            outcome = await _all_or_nothing(xfer.put(local / n, self._remote(f"{rel}/{n}"), manifest["files"][n], sem) for n in names)
            bucket, key, _ = self.fs.split_path(remote_manifest)
            await xfer.call(
                "put_object", Bucket=bucket, Key=key, Body=blob, ChecksumCRC32=_b64(_crc32(blob)),
                ContentType="application/json",
            )
            return outcome

        outcome = _run_transfer(xfer, go, f"publish of {self.uri(rel)}", "no manifest was written, safe to retry")
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
            art = manifest_path.parent
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
        "op": op, "rel": rel, "files": len(names), "transferred": len(moved),
        "bytes": sum(manifest["files"][n]["size"] for n in moved), "seconds": round(time.monotonic() - started, 3),
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
        rel = path[len(root):].lstrip("/")
        if not rel or skip(rel):
            continue
        safe_relpath(rel, uri)
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(target))
        out.append(rel)
    return out
