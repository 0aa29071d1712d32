"""Publish committed training checkpoints beside training, never inside the log reader.

The task's log reader calls `Publisher.submit(step)` when the engine reports a committed
checkpoint; that only enqueues (no I/O), so the ranks can never block on a full stdout pipe. One
worker thread then, in commit order, for each checkpoint:

1. `RunStore.publish` (every object checked, `manifest.json` last);
2. reads the remote manifest back and checks it is byte-identical to the local one and that
   every object verifies (size + recorded sha256): the remote copy is committed;
3. writes the marker `.published` (the manifest's sha256) into the local staging checkpoint,
   atomically. This is the handshake with the engine: with a remote run root its local
   retention deletes only marked checkpoints, and it counts unmarked ones for backpressure;
4. applies remote retention (`retain_remote`): a remote checkpoint is removed only once a newer
   one is committed remotely; step-000000 (the shard stage's artifact) is always kept.

A failed publish is retried with exponential backoff a bounded number of times (a retry uploads
only what is missing). After the last attempt the failure is recorded, naming the checkpoint,
and the worker publishes nothing newer (order matters: a newer remote checkpoint must never exist
beside a missing older one that retention would then consider published). `drain()`, at the
end of a stage, waits for the queue to empty and raises the first failure. `publish_tensorboard`
copies the stage's TensorBoard files up beside each published checkpoint.

Pure: no prefect, no torch. Try it on a local run root:

    python -m tasks.core.storage.publisher /tmp/run cpt 4      # publish + mark runs/cpt/step-000004
"""

from __future__ import annotations

import hashlib
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tasks.core.errors import ArtifactMissing, ManifestError
from tasks.core.run.manifest import MANIFEST
from tasks.core.run.stages import STEP_RE, TENSORBOARD, step_name, step_rel
from tasks.core.storage.fs import RunStore, open_uri
from tasks.core.storage.handshake import PUBLISHED_MARKER, is_published, mark_published

_STOP = object()


# A failed upload is retried this many times, backing off from BACKOFF_S (doubling, at most
# BACKOFF_MAX_S): about a minute of an unreachable store before the stage gives up.
RETRIES = 4
BACKOFF_S = 2.0
BACKOFF_MAX_S = 30.0


class PublishFailed(RuntimeError):
    """An artifact could not be published after the bounded retries; names it."""

    def __init__(self, rel: str, uri: str, attempts: int, cause: BaseException, what: str = "checkpoint"):
        self.rel, self.uri, self.attempts, self.cause = rel, uri, attempts, cause
        kept = (
            (
                "Its local copy is kept (never deleted unpublished); a retried flow run resumes from the newest "
                "checkpoint complete remotely or locally."
            )
            if what == "checkpoint"
            else "Its local copy is kept in the staging directory; no manifest was written remotely, so a retried "
            "flow run redoes this stage."
        )
        super().__init__(
            f"publish of {what} {uri} failed after {attempts} attempt(s): {type(cause).__name__}: {cause}. {kept}"
        )


def publish_retrying(
    store: RunStore,
    rel: str,
    publish: Callable[[str], str] | None = None,
    *,
    retries: int = RETRIES,
    backoff_s: float = BACKOFF_S,
    backoff_max_s: float = BACKOFF_MAX_S,
    log: logging.Logger | logging.LoggerAdapter | None = None,
    abort: threading.Event | None = None,
    what: str = "checkpoint",
) -> tuple[str, int]:
    """`publish(rel)` (default `store.publish`) with bounded exponential backoff: (digest, attempts).

    A retry uploads only what is missing (RunStore.publish skips objects already whole remotely).
    Raises PublishFailed, naming the artifact, after the last attempt, at once when the local
    artifact is gone (nothing a retry could fix), or when `abort` is set. A BaseException that is
    not an Exception (a cancellation, Ctrl-C) passes through as it is: it is not a failed upload.
    """
    publish = publish or store.publish
    log = log or logging.getLogger(__name__)
    abort = abort or threading.Event()
    attempt = 0
    while True:
        attempt += 1
        try:
            return publish(rel), attempt
        except Exception as exc:
            permanent = isinstance(exc, ManifestError) and not store.local_path(rel).is_dir()
            if attempt > retries or permanent or abort.is_set():
                raise PublishFailed(rel, store.uri(rel), attempt, exc, what) from exc
            delay = min(backoff_max_s, backoff_s * 2 ** (attempt - 1))
            log.warning(
                "publish of %s failed (attempt %d of %d: %s: %s); retrying in %.1fs",
                store.uri(rel),
                attempt,
                retries + 1,
                type(exc).__name__,
                exc,
                delay,
            )
            if abort.wait(delay):
                raise PublishFailed(rel, store.uri(rel), attempt, exc, what) from exc


def unpublished_steps(stage_dir: Path) -> list[int]:
    """Complete local checkpoints (steps > 0) without the marker, oldest first: what a failed
    attempt left unpublished, to submit before training resumes."""
    out = []
    if stage_dir.is_dir():
        for p in stage_dir.iterdir():
            m = STEP_RE.match(p.name)
            if m and int(m.group(1)) > 0 and (p / MANIFEST).is_file() and not is_published(p):
                out.append(int(m.group(1)))
    return sorted(out)


def retain_remote(store: RunStore, phase: str, keep_last: int, newest_committed: int) -> list[str]:
    """keep_last retention of the remote copies, in the engine's order: only checkpoints older than
    `newest_committed` (whose remote manifest this process has just verified) are candidates, the
    newest `keep_last` committed ones stay, and step-000000 is never removed. Returns rel names."""
    committed = []
    for name in store.listdir(phase):
        m = STEP_RE.match(name)
        if not m or name == step_name(0):
            continue
        step = int(m.group(1))
        if step <= newest_committed and store.exists(f"{phase}/{name}/{MANIFEST}"):
            committed.append(step)
    removed = []
    for step in sorted(committed, reverse=True)[keep_last:]:
        rel = step_rel(phase, step)
        store.remove(rel)
        removed.append(rel)
    return removed


def publish_tensorboard(store: RunStore, phase: str) -> int:
    """Copy `<phase>/tensorboard/` from staging to a remote run root (a local run root already
    holds it: the engine writes there). Whole files each time: they are small and append-only."""
    if store.local:
        return 0
    local = store.local_path(f"{phase}/{TENSORBOARD}")
    n = 0
    for path in sorted(local.rglob("*")) if local.is_dir() else []:
        if path.is_file():
            with open_uri(store.uri(f"{phase}/{TENSORBOARD}/{path.relative_to(local).as_posix()}"), "wb") as f:
                f.write(path.read_bytes())
            n += 1
    return n


@dataclass(frozen=True)
class Published:
    rel: str
    digest: str
    seconds: float
    attempts: int
    bytes: int
    removed: tuple[str, ...]


class Publisher:
    """One worker thread publishing one stage's checkpoints in order (see the module docstring).

    `max_queue` bounds the checkpoints waiting (the engine's backpressure keeps the real number at
    most max_pending_publishes + 1); a submit beyond it is recorded as a failure, never dropped
    silently. `on_published(Published)` and `log` are called from the worker thread; an exception
    from `on_published` is logged as a warning (the checkpoint is committed by then), and any other
    unexpected one becomes the failure: the worker never ends silently.
    """

    def __init__(
        self,
        store: RunStore,
        phase: str,
        keep_last: int,
        *,
        max_queue: int = 8,
        retries: int = RETRIES,
        backoff_s: float = BACKOFF_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        log: logging.Logger | logging.LoggerAdapter | None = None,
        on_published: Callable[[Published], None] | None = None,
    ):
        if retries < 0 or max_queue < 1:
            raise ValueError(f"retries must be >= 0 and max_queue >= 1, got retries={retries}, max_queue={max_queue}")
        self.store, self.phase, self.keep_last = store, phase, keep_last
        self.retries, self.backoff_s, self.backoff_max_s = retries, backoff_s, backoff_max_s
        self.log = log or logging.getLogger(__name__)
        self.on_published = on_published
        self.published: list[Published] = []
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._abort = threading.Event()
        self._submitted: set[int] = set()
        self._thread = threading.Thread(target=self._run, name=f"publisher-{phase}", daemon=True)
        self._started = False

    # ---- the reader's side: never blocks, never does I/O -------------------------------------
    def start(self) -> Publisher:
        if not self._started:
            self._thread.start()
            self._started = True
        return self

    def submit(self, step: int) -> None:
        """Enqueue a committed checkpoint (idempotent per step). Never blocks."""
        with self._lock:
            if step in self._submitted or self._failure is not None:
                return
            try:
                self._queue.put_nowait(step)
            except queue.Full:
                self._failure = RuntimeError(
                    f"{self.store.uri(step_rel(self.phase, step))}: {self._queue.maxsize} checkpoints already wait for "
                    "upload; the engine's backpressure (max_pending_publishes) should have held it back"
                )
                return
            self._submitted.add(step)

    @property
    def failure(self) -> BaseException | None:
        """The first failure, once the bounded retries are spent (the reader polls this)."""
        return self._failure

    @property
    def pending(self) -> int:
        return self._queue.unfinished_tasks

    # ---- end of stage -------------------------------------------------------------------------
    def drain(self, timeout: float | None = None) -> list[Published]:
        """Wait until every submitted checkpoint is published, stop the worker, raise the first failure."""
        self.start()
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(
                f"publisher of {self.store.uri(self.phase)} still busy after {timeout:.0f}s ({self.pending - 1} "
                "checkpoint(s) left)"
            )
        if self._failure is not None:
            raise self._failure
        return list(self.published)

    def close(self, timeout: float = 30.0) -> None:
        """Stop without publishing what is still queued (teardown of a failed stage); the upload in
        flight ends at its next attempt boundary. Unpublished checkpoints stay on the local disk."""
        self._abort.set()
        if self._started:
            try:
                self._queue.put_nowait(_STOP)
            except queue.Full:
                pass
            self._thread.join(timeout)

    # ---- the worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP or self._abort.is_set():
                    return
                if self._failure is None:
                    self._publish_one(int(item))
            except BaseException as exc:
                # The worker must never end silently: the engine would wait at its next save for a
                # marker nobody writes, and drain() would report nothing. Record it as the failure,
                # so the stage stops naming the checkpoint.
                rel = step_rel(self.phase, int(item))
                self._failure = RuntimeError(
                    f"publisher stopped while handling checkpoint {self.store.uri(rel)}: {type(exc).__name__}: {exc}. "
                    "Its local copy is kept; a retried flow run resumes from the newest checkpoint complete remotely "
                    "or locally."
                )
                self.log.error("%s", self._failure)
            finally:
                self._queue.task_done()

    def _publish_one(self, step: int) -> None:
        rel = step_rel(self.phase, step)
        started = time.monotonic()
        try:
            digest, attempt = publish_retrying(
                self.store,
                rel,
                self._publish_and_verify,
                retries=self.retries,
                backoff_s=self.backoff_s,
                backoff_max_s=self.backoff_max_s,
                log=self.log,
                abort=self._abort,
            )
        except PublishFailed as exc:
            self._failure = exc
            if not self._abort.is_set():
                self.log.error("%s", exc)
            return
        mark_published(self.store.local_path(rel), digest)
        removed: list[str] = []
        if not self.store.local:
            try:
                removed = retain_remote(self.store, self.phase, self.keep_last, step)
            except Exception as exc:
                self.log.warning(
                    "remote retention after %s failed (%s: %s); older copies stay until the next one",
                    self.store.uri(rel),
                    type(exc).__name__,
                    exc,
                )
        for r in removed:
            self.log.info("retention: removed %s (keep_last=%d)", self.store.uri(r), self.keep_last)
        moved = self.store.last_transfer.get("bytes", 0) if self.store.last_transfer.get("rel") == rel else 0
        done = Published(rel, digest, round(time.monotonic() - started, 3), attempt, moved, tuple(removed))
        self.published.append(done)
        self.log.info(
            "published %s in %.1fs (%d attempt(s), %.1f MB sent)",
            self.store.uri(rel),
            done.seconds,
            attempt,
            moved / 1e6,
        )
        if self.on_published:
            # Best effort (the stage's TensorBoard files): the checkpoint is committed whatever it does,
            # and a failure here must not stop the worker (the next checkpoint's publish retries and,
            # if the store is really gone, fails naming it).
            try:
                self.on_published(done)
            except Exception as exc:
                self.log.warning(
                    "after publishing %s: %s: %s (the checkpoint is committed; retried after the next one)",
                    self.store.uri(rel),
                    type(exc).__name__,
                    exc,
                )

    def _publish_and_verify(self, rel: str) -> str:
        digest = self.store.publish(rel)
        local = (self.store.local_path(rel) / MANIFEST).read_bytes()
        try:
            remote_digest = self.store.manifest_digest(rel)
        except ArtifactMissing as exc:
            raise ManifestError(f"{self.store.uri(rel)}: no manifest after publish ({exc})") from exc
        if remote_digest != hashlib.sha256(local).hexdigest() or remote_digest != digest:
            raise ManifestError(f"{self.store.uri(rel)}: the remote manifest differs from the local one after publish")
        # Shallow for a local root (publish already hashed every file); remote: HEADs compare the
        # sha256 recorded at upload, which the server checked, with the manifest's.
        self.store.verify(rel, deep=not self.store.local)
        return digest


def _main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m tasks.core.storage.publisher RUN_URI STAGE STEP", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    store = RunStore(argv[0])
    pub = Publisher(store, argv[1], keep_last=10**6).start()
    pub.submit(int(argv[2]))
    try:
        for p in pub.drain():
            print(f"{p.rel}: published, manifest sha256 {p.digest[:16]}…, marker {PUBLISHED_MARKER} written")
    except Exception as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
