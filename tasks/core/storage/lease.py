"""One writer per run root: a lease object `<run_root>/.lease.json` kept alive by a heartbeat.

A second flow run over the same run root fails at once with an error naming the holder (flow
run, host, pid, since when) — it does not wait. A lease whose heartbeat is older than its TTL
belongs to a dead run and is taken over with a warning; so is, at once, a lease whose holder ran
on this host under a pid that no longer exists (`holder_is_dead`). An operator can also break it:

    python -m flows.cpt_to_sft --config FILE --break-lease

Local and NFS paths use an exclusive create (O_EXCL); object stores have no portable
create-if-absent, so there we write, then read back and check we are the holder.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Any, Self

from tasks.core.run.stages import LEASE
from tasks.core.storage.fs import RunStore

DEFAULT_TTL_S = 600.0
HEARTBEAT_S = 60.0


class LeaseHeld(RuntimeError):
    """Another live flow run holds the run root."""


class Lease:
    def __init__(self, store: RunStore, holder: str, ttl_s: float = DEFAULT_TTL_S, heartbeat_s: float = HEARTBEAT_S):
        self.store, self.ttl_s, self.heartbeat_s = store, ttl_s, heartbeat_s
        self.record = {
            "holder": holder,
            "token": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "acquired_at": time.time(),
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- state ------------------------------------------------------------------------------
    def current(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.store.read_text(LEASE))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, OSError):
            return {"holder": "unreadable lease", "heartbeat_at": 0}

    def _payload(self) -> str:
        return json.dumps({**self.record, "heartbeat_at": time.time(), "ttl_s": self.ttl_s}, sort_keys=True)

    def _create_exclusive(self) -> bool:
        if self.store.local:
            path = self.store.staging / LEASE
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(self._payload())
            return True
        if self.store.exists(LEASE):
            return False
        self.store.write_text(LEASE, self._payload())
        time.sleep(0.2)
        cur = self.current()
        return bool(cur and cur.get("token") == self.record["token"])

    # ---- protocol ---------------------------------------------------------------------------
    def acquire(self, log=None) -> Lease:
        for _ in range(2):
            if self._create_exclusive():
                self._start_heartbeat()
                return self
            cur = self.current() or {}
            age = time.time() - float(cur.get("heartbeat_at", 0))
            if cur.get("token") == self.record["token"]:
                self._start_heartbeat()
                return self
            dead = holder_is_dead(cur)
            if dead or age > float(cur.get("ttl_s", self.ttl_s)):
                if log:
                    why = (
                        f"its process no longer exists on this host ({dead})"
                        if dead
                        else f"no heartbeat for {age:.0f}s"
                    )
                    log(f"breaking stale lease of {describe(cur)}: {why}; taking it over")
                self.store.remove(LEASE)
                continue
            raise LeaseHeld(
                f"{self.store.uri()} is being written by {describe(cur)} (heartbeat {age:.0f}s ago). "
                "Wait for that run to finish, use another run_root, or if it is dead run "
                "`python -m flows.cpt_to_sft --config FILE --break-lease`."
            )
        raise LeaseHeld(f"could not take the lease on {self.store.uri()}")

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(self.heartbeat_s):
                try:
                    cur = self.current()
                    if cur and cur.get("token") == self.record["token"]:
                        self.store.write_text(LEASE, self._payload())
                except Exception:  # a missed beat is retried next interval; the heartbeat thread must not die
                    pass

        self._thread = threading.Thread(target=beat, name="run-root-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        cur = self.current()
        if cur and cur.get("token") == self.record["token"]:
            self.store.remove(LEASE)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def pid_exists(pid: int) -> bool:
    """Whether a process with this pid exists here (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def holder_is_dead(record: dict[str, Any]) -> str | None:
    """Why the holder is provably dead, or None: only for a holder on this host whose pid is gone.

    Another host's pids mean nothing here, so remote holders keep the heartbeat rule. A reused pid
    (a new process under the dead holder's number) reads as alive: the lease is refused, never
    wrongly taken.
    """
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    if pid == os.getpid() or pid_exists(pid):
        return None
    return f"host {record['host']}, pid {pid} not running"


def describe(record: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(float(record.get("acquired_at", 0))))
    return f"{record.get('holder', '?')} on {record.get('host', '?')} (pid {record.get('pid', '?')}, since {since})"


def break_lease(store: RunStore) -> dict[str, Any] | None:
    lease = Lease(store, holder="operator")
    cur = lease.current()
    store.remove(LEASE)
    return cur
