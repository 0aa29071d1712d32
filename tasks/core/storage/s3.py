"""Parallel, checksummed S3 object transfers: what `RunStore.publish`, `stage_in` and `verify` run on s3://.

    python -c "from tasks.core.storage.fs import RunStore; print(RunStore('s3://bucket/run').publish('cpt/hf'))"

One `S3Transfers` per operation drives s3fs's event loop: whole-file PUTs or multipart uploads
whose every request carries the body's CRC32 (checked by the server) while the file's sha256 is
computed on the same bytes, and whole or ranged GETs hashed in order as they land. A single
semaphore bounds the parts in flight and so the memory. Why it is built this way (manifest last,
CRC32 rather than a per-part SHA-256) is in `tasks.core.storage.fs`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import zlib
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from tasks.core.errors import ManifestError
from tasks.core.run.manifest import sha256_file

SHA256_META = "sha256"  # object metadata key holding the whole file's sha256 (hex)


class TransferError(OSError):
    """An upload or download that did not complete (transient I/O); retrying is safe."""


def b64(digest: bytes) -> str:
    """A digest as S3's checksum headers carry it (base64)."""
    return base64.b64encode(digest).decode()


def crc32(data: bytes) -> bytes:
    """CRC32 (IEEE, zlib's) as S3's x-amz-checksum-crc32 carries it: 4 bytes, big-endian."""
    return zlib.crc32(data).to_bytes(4, "big")


def _hash_into(whole, chunk: bytes) -> bytes:
    """Feed the file's running sha256 and return the chunk's CRC32 (one thread hop)."""
    whole.update(chunk)
    return crc32(chunk)


def _read_at(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def _write_at(fd: int, offset: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


async def all_or_nothing(aws: Iterable[Awaitable[Any]]) -> list[Any]:
    """Run concurrently; on the first failure cancel the rest and raise that failure."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
    if failed is not None:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise failed.exception()
    return [t.result() for t in tasks]


class S3Transfers:
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
            except Exception:  # optional clean-up: an upload that cannot be aborted now is tried again next publish
                pass
        return len(uploads)

    async def put(self, local: Path, remote: str, entry: dict, sem: asyncio.Semaphore) -> str:
        """Upload one file unless the remote object already holds exactly it. 'uploaded'|'present'."""
        size, sha = entry["size"], entry["sha256"]
        head = await self.head(remote)
        if object_matches(head, size, sha):
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
                    "put_object",
                    Bucket=bucket,
                    Key=key,
                    Body=data,
                    ChecksumCRC32=b64(crc),
                    Metadata={SHA256_META: sha},
                )
        else:
            await self._put_multipart(local, bucket, key, entry, sem)
        head = await self.head(remote)
        if not object_matches(head, size, sha):
            got = None if head is None else (head.get("ContentLength"), (head.get("Metadata") or {}).get(SHA256_META))
            raise TransferError(
                f"{remote}: after upload the server reports (size, sha256) = {got}, expected ({size}, {sha})"
            )
        return "uploaded"

    async def _put_multipart(self, local: Path, bucket: str, key: str, entry: dict, sem: asyncio.Semaphore) -> None:
        size, sha = entry["size"], entry["sha256"]
        mpu = await self.call(
            "create_multipart_upload",
            Bucket=bucket,
            Key=key,
            Metadata={SHA256_META: sha},
            ChecksumAlgorithm="CRC32",
        )
        upload_id = mpu["UploadId"]
        tasks: list[asyncio.Future] = []

        async def send(number: int, chunk: bytes, digest: bytes) -> dict:
            try:
                resp = await self.call(
                    "upload_part",
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=chunk,
                    ChecksumCRC32=b64(digest),
                )
                return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32": b64(digest)}
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
                        raise ManifestError(
                            f"{local}: file is shorter than the {size} bytes its manifest lists (changed since the "
                            "manifest was written)"
                        )
                    digest = await asyncio.to_thread(_hash_into, whole, chunk)
                except BaseException:
                    sem.release()
                    raise
                number += 1
                offset += len(chunk)
                digests.append(digest)
                tasks.append(asyncio.ensure_future(send(number, chunk, digest)))
            if os.path.getsize(local) != size or whole.hexdigest() != sha:
                raise ManifestError(
                    f"{local}: content differs from its manifest entry (sha256/size changed since the manifest was "
                    "written); not uploaded"
                )
            parts = await all_or_nothing(tasks)
            done = await self.call(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
            # S3's composite checksum: the CRC32 of the parts' CRC32s, "-N". Servers that return
            # it thereby confirm they assembled exactly the parts we hashed, in order.
            composite = done.get("ChecksumCRC32")
            expected = f"{b64(crc32(b''.join(digests)))}-{len(digests)}"
            if composite and composite != expected:
                raise TransferError(f"s3://{bucket}/{key}: server assembled checksum {composite}, expected {expected}")
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:  # best effort: a dead server keeps the parts, the next publish aborts them
                await asyncio.wait_for(
                    self.call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id), 5
                )
            except BaseException:  # cancellation included: the original error re-raised below is what matters
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
                raise ManifestError(
                    f"{remote}: downloaded {got} bytes with sha256 {digest[:16]}…, manifest says {size} bytes, "
                    f"{sha[:16]}… (object altered or partial)"
                )
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


def run_transfer(xfer: S3Transfers, go: Callable[[], Awaitable[Any]], what: str, after: str) -> Any:
    """Run a transfer; a content problem (ManifestError) passes through, anything else (the
    server, the network) becomes a TransferError saying what failed and what that leaves."""
    try:
        return xfer.run(go)
    except ManifestError:
        raise
    except Exception as exc:
        raise TransferError(f"{what} failed ({type(exc).__name__}: {exc}); {after}") from exc


def object_matches(head: dict | None, size: int, sha: str) -> bool:
    """Whether a HEAD response describes exactly this file: its size and the sha256 we recorded."""
    return bool(head) and head.get("ContentLength") == size and (head.get("Metadata") or {}).get(SHA256_META) == sha


def _check_local(local: Path, size: int, sha: str, entry: dict) -> None:
    if size != entry["size"] or sha != entry["sha256"]:
        raise ManifestError(
            f"{local}: content differs from its manifest entry ({size} bytes, sha256 {sha[:16]}… vs {entry['size']} "
            f"bytes, {entry['sha256'][:16]}…); not uploaded"
        )
