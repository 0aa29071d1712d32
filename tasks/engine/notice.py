"""A rank's ear for preemption notices: the signal handlers and pollers of `<phase>.elastic.notices`.

    python -m tasks.engine.notice aws http://127.0.0.1:8080     # poll once, print the notice or None

`Watch` installs a handler for every signal row of the stage's notice sources
(tasks/core/config/notices.py; in the main thread, as Python requires) and, on each node's local
rank 0, a daemon thread per polled row that asks its endpoint every `poll_s` seconds. The first
notice is kept (source, when, grace budget, text); the training loop passes `noticed` into the
step's loss all-reduce (tasks/engine/boosted.py `Engine.reduce_loss`), so every rank agrees to
stop after the same step even when the notice reached one rank only. Torch-free: the unit tests
drive it against the local metadata double (support/servers/metadata.py) without a launch.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.core.config.notices import NOTICES


def http_fetch(method: str, url: str, headers: dict[str, str], timeout: float = 2.0) -> tuple[int, str]:
    """(status, body) of one request; OSError when nothing answers. The clouds' metadata services are
    link-local and answer in milliseconds, so a short timeout keeps a poll from outliving its period."""
    req = urllib.request.Request(url, method=method, headers=headers, data=b"" if method == "PUT" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(65536).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(65536).decode(errors="replace")
    except urllib.error.URLError as exc:
        raise OSError(f"{url}: {exc.reason}") from None


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
    ):
        self.notices, self.poll, self.fetch = tuple(notices), poll, fetch
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
            self.notice(n.source, n.grace, f"{signal.Signals(signum).name} received")

        if sig not in self._old:
            self._old[sig] = signal.signal(sig, handler)

    def _poll(self, n: Any) -> None:
        row, where, failed = NOTICES[n.source], n.where, False
        while not self._stop.is_set() and self.first is None:
            try:
                text = row.poll(self.fetch, where)
            except (OSError, ValueError) as exc:  # unreachable, or an answer we cannot read: say it once
                if not failed:
                    self.say(f"notice source {n.source} ({where}) not readable, polling on: {exc}")
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
        print(f"usage: python -m tasks.engine.notice {{{','.join(polled)}}} ENDPOINT", file=sys.stderr)
        return 2
    print(NOTICES[argv[0]].poll(http_fetch, argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
