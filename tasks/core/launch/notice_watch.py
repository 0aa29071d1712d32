"""The ear for preemption notices, a rank's and the flow process's: the signal handlers and pollers of
`<phase>.elastic.notices`.

    python -m tasks.core.launch.notice_watch aws http://127.0.0.1:8080     # poll once, print the notice or None

`Watch` installs a handler for every signal row of the stage's notice sources
(tasks/core/config/notices.py; in the main thread, as Python requires) and, on each node's local
rank 0, a daemon thread per polled row that asks its endpoint every `poll_s` seconds. The first
notice is kept (source, when, grace budget, text); the training loop passes `noticed` into the
step's loss all-reduce (tasks/engine/boosted.py `Engine.reduce_loss`), so every rank agrees to
stop after the same step even when the notice reached one rank only. Torch-free: the unit tests
drive it against the local metadata double (support/servers/metadata.py) without a launch.

Each poll has one deadline for all of it (`POLL_DEADLINE_S`: every request, the answer read whole),
so an endpoint that answers a byte at a time cannot hold the poller; an endpoint that cannot be read
is said once, and the poller goes on asking. A notice's text reaches the log as printable
characters only. A SIGTERM that comes while the launcher tears the stage down (`torn_down`) ends the
rank at once, as it did before SIGTERM was a notice.
"""

from __future__ import annotations

import functools
import http.client
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tasks.core.config.notices import NOTICE_BYTES, NOTICES, POLL_DEADLINE_S, printable, torn_down


def http_fetch(
    method: str, url: str, headers: dict[str, str], timeout: float = 2.0, deadline: float | None = None
) -> tuple[int, str]:
    """(status, body) of one request, the body cut at NOTICE_BYTES; OSError when nothing answers in
    time. `timeout` bounds each socket operation; `deadline` (time.monotonic()) the whole request: the
    socket is shut when it passes, so an answer that trickles in a byte at a time ends there too."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OSError(f"{url}: not an http(s) URL")
    left = (deadline - time.monotonic()) if deadline is not None else math.inf
    if left <= 0:
        raise OSError(f"{url}: no time left of the poll's deadline")
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=min(timeout, left))
    cut = threading.Event()

    def shut() -> None:
        cut.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(left, shut) if left != math.inf else None
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        if timer is not None:
            timer.daemon = True
            timer.start()
        conn.request(method, path, body=b"" if method == "PUT" else None, headers=headers)
        resp = conn.getresponse()
        body = resp.read(NOTICE_BYTES)
        if cut.is_set():  # shut mid-answer: what came is not the whole answer
            raise OSError("cut at the deadline")
        return resp.status, body.decode(errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        if cut.is_set():
            raise OSError(f"{url}: no whole answer within the poll's deadline") from None
        raise OSError(f"{url}: {exc}") from None
    finally:
        if timer is not None:
            timer.cancel()
        conn.close()


@dataclass(frozen=True)
class Notice:
    source: str
    at: float  # time.monotonic() when it arrived
    wall: float  # time.time() when it arrived
    grace_s: float
    text: str


class Watch:
    """The notices one rank listens to; `start()` before training, `close()` after."""

    def __init__(
        self,
        notices: tuple[Any, ...],
        poll: bool = True,
        fetch: Callable[..., tuple[int, str]] = http_fetch,
        say: Callable[[str], None] | None = None,
        deadline_s: float = POLL_DEADLINE_S,
    ):
        # `fetch(method, url, headers, deadline=...)`; each poll ends by `deadline_s` seconds after it began
        self.notices, self.poll, self.fetch, self.deadline_s = tuple(notices), poll, fetch, deadline_s
        self.say = say or (lambda msg: None)
        self.first: Notice | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._old: dict[int, Any] = {}

    @property
    def noticed(self) -> bool:
        return self.first is not None

    def remaining(self) -> float:
        """Seconds left of the first notice's grace budget (inf before any notice)."""
        n = self.first
        return math.inf if n is None else n.grace_s - (time.monotonic() - n.at)

    def notice(self, source: str, grace_s: float, text: str) -> None:
        text = printable(text)  # a file's bytes, a server's answer: printable characters only reach the log
        with self._lock:
            if self.first is not None:
                return
            self.first = Notice(source, time.monotonic(), time.time(), grace_s, text)
        self.say(f"preemption notice ({source}, grace {grace_s:g}s): {text}")

    def start(self) -> Watch:
        for n in self.notices:
            row = NOTICES[n.source]
            if row.signal is not None:
                self._handle(getattr(signal, row.signal), n)
            elif row.poll is not None and self.poll:
                t = threading.Thread(target=self._poll, args=(n,), name=f"notice-{n.source}", daemon=True)
                t.start()
                self._threads.append(t)
        return self

    def _handle(self, sig: int, n: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"notice source {n.source!r}: signal handlers are installed from the main thread only")

        def handler(signum: int, frame: Any) -> None:
            if signum == signal.SIGTERM and torn_down():  # the launcher's teardown, not a notice: end now
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            self.notice(n.source, n.grace, f"{signal.Signals(signum).name} received")

        if sig not in self._old:
            self._old[sig] = signal.signal(sig, handler)

    def _poll(self, n: Any) -> None:
        row, where, failed = NOTICES[n.source], n.where, False
        while not self._stop.is_set() and self.first is None:
            fetch = functools.partial(self.fetch, deadline=time.monotonic() + self.deadline_s)
            try:
                text = row.poll(fetch, where)
            except (OSError, ValueError) as exc:  # unreachable, too slow, or an answer we cannot read: said once
                if not failed:
                    self.say(f"notice source {n.source} ({where}) not readable, polling on: {printable(str(exc))}")
                failed, text = True, None
            if text:
                self.notice(n.source, n.grace, text)
                return
            self._stop.wait(n.poll_s)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def polls_here() -> bool:
    """Polled sources are asked once per node (its local rank 0): the agreement spreads the answer."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in NOTICES or NOTICES[argv[0]].poll is None:
        polled = [n for n, s in NOTICES.items() if s.poll]
        print(f"usage: python -m tasks.core.launch.notice_watch {{{','.join(polled)}}} ENDPOINT", file=sys.stderr)
        return 2
    print(NOTICES[argv[0]].poll(functools.partial(http_fetch, deadline=time.monotonic() + POLL_DEADLINE_S), argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
