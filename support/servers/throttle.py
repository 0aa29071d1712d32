"""A bandwidth-limiting TCP proxy on 127.0.0.1: a slow object store made of a real one.

Sits between a real client (s3fs/botocore) and a real server (SeaweedFS): bytes pass through
unchanged, so SigV4 signatures and CRC32 wire checksums hold. Each direction (client -> server
"up", server -> client "down") has one token bucket shared by every connection, like one link of
the given rate; the rate can be changed, paused and resumed while transfers run. `kill()` resets
every open connection and refuses new ones, as a vanished server does.

Bounded by construction: at most `max_connections` connections, each pump holds at most one
`chunk` of bytes, and the proxy closes itself after `lifetime_s` seconds so a test that forgets it
leaves no thread running for long.

    python -m support.servers.throttle 127.0.0.1:8333 2.0     # proxy to :8333 at 2 MB/s; prints its port
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time
from typing import Self

MB = 1 << 20


class Stopped(Exception):
    """The proxy is closed or killed: pumps end their connection."""


class TokenBucket:
    """`rate` bytes per second, bursts of at most `burst_s` seconds' worth (or one small chunk)."""

    def __init__(self, rate: float, burst_s: float = 0.05):
        self._cond = threading.Condition()
        self._burst_s = burst_s
        self._rate = float(rate)
        self._tokens = 0.0
        self._last = time.monotonic()
        self._paused = False
        self._stopped = False

    def _capacity(self) -> float:
        # At least a few KiB: with a tiny capacity every send is a few bytes and syscalls dominate.
        return max(self._rate * self._burst_s, 4096.0)

    def _refill(self) -> None:
        now = time.monotonic()
        if not self._paused:
            self._tokens = min(self._capacity(), self._tokens + (now - self._last) * self._rate)
        self._last = now

    def set_rate(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s (use pause() to stop traffic), got {rate}")
        with self._cond:
            self._refill()
            self._rate = float(rate)
            self._tokens = min(self._tokens, self._capacity())
            self._cond.notify_all()

    @property
    def rate(self) -> float:
        return self._rate

    def pause(self, paused: bool = True) -> None:
        with self._cond:
            self._refill()
            self._paused = paused
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # Bytes are released `quantum_s` worth at a time (or all of a smaller send). Released byte by
    # byte, a 1 MB/s link wakes its pump 1,000 times a second for 1 KB each: the proxy's own CPU
    # (and the GIL of whatever process hosts it) then shows up in what it measures.
    quantum_s = 0.01

    def _quantum(self, n: int) -> float:
        return max(1.0, min(float(n), self._capacity(), self._rate * self.quantum_s))

    def take(self, n: int) -> int:
        """Block until a quantum may pass; return how many of `n` may pass now (>= 1)."""
        with self._cond:
            while True:
                if self._stopped:
                    raise Stopped()
                self._refill()
                want = self._quantum(n)
                if not self._paused and self._tokens >= want:
                    k = int(min(n, self._tokens))
                    self._tokens -= k
                    return k
                # Wake up in time for the quantum, or sooner if the rate/pause state changes.
                wait = 0.1 if self._paused else min(0.1, (want - self._tokens) / self._rate)
                self._cond.wait(max(wait, 0.001))


class ThrottleProxy:
    """Forward 127.0.0.1:<port> to `upstream` at `rate` bytes/s in each direction."""

    def __init__(
        self,
        upstream: tuple[str, int],
        rate: float,
        *,
        max_connections: int = 64,
        chunk: int = 64 << 10,
        lifetime_s: float = 1800.0,
    ):
        self.upstream = upstream
        self.up = TokenBucket(rate)  # client -> server
        self.down = TokenBucket(rate)  # server -> client
        self.max_connections = max_connections
        self.chunk = chunk
        self.lifetime_s = lifetime_s
        self.bytes_up = 0
        self.bytes_down = 0
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=max_connections)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"throttle-{self.port}", daemon=True)
        self._deadline = time.monotonic() + lifetime_s

    # ---- control ----------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ThrottleProxy:
        self._acceptor.start()
        return self

    def set_rate(self, rate: float, direction: str = "both") -> None:
        """Change the rate (bytes/s) now; transfers in flight slow down or speed up at once."""
        for bucket in self._buckets(direction):
            bucket.set_rate(rate)

    def pause(self, direction: str = "both") -> None:
        """Let no byte through (connections stay open, as on a stalled link)."""
        for bucket in self._buckets(direction):
            bucket.pause(True)

    def resume(self, direction: str = "both") -> None:
        for bucket in self._buckets(direction):
            bucket.pause(False)

    def kill(self) -> None:
        """Reset every open connection (RST) and refuse new ones: the server is gone."""
        self._closed.set()
        self.up.stop()
        self.down.stop()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                # SO_LINGER 0: close() sends RST, so the client sees the connection die mid-request.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # close() alone wakes neither a thread blocked in recv() nor one blocked in
                # sendall() on a full buffer; shutdown of both directions wakes both.
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            _close(s)

    def close(self, timeout: float = 5.0) -> None:
        self.kill()
        if self._acceptor.is_alive() and self._acceptor is not threading.current_thread():
            self._acceptor.join(timeout)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns) // 2

    def _buckets(self, direction: str) -> list[TokenBucket]:
        if direction not in ("both", "up", "down"):
            raise ValueError(f"direction must be 'both', 'up' or 'down', got {direction!r}")
        return {"both": [self.up, self.down], "up": [self.up], "down": [self.down]}[direction]

    # ---- plumbing -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            if time.monotonic() > self._deadline:
                self.kill()  # the proxy's own end: nothing outlives a forgotten test by long
                return
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.open_connections >= self.max_connections:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                _close(client)
                continue
            for s in (client, server):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, server)
            with self._lock:
                # kill() sets _closed before it takes its snapshot under this lock: a connection
                # accepted just before kill() is either in that snapshot or refused here.
                refused = self._closed.is_set()
                if not refused:
                    self._conns.update((client, server))
            if refused:
                _close(client)
                _close(server)
                return
            for src, dst, bucket, attr in (
                (client, server, self.up, "bytes_up"),
                (server, client, self.down, "bytes_down"),
            ):
                t = threading.Thread(target=self._pump, args=(src, dst, bucket, attr, pair), daemon=True)
                with self._lock:
                    self._threads.add(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, bucket: TokenBucket, attr: str, pair: _Pair) -> None:
        try:
            while True:
                data = src.recv(self.chunk)
                if not data:
                    # Half-close: the other side may still be sending its answer.
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                view = memoryview(data)
                while view:
                    k = bucket.take(len(view))
                    # Counted before it is sent: once the far side has the bytes (and may answer),
                    # the count already holds them, so a reader who saw a transfer end sees it all.
                    with self._lock:
                        setattr(self, attr, getattr(self, attr) + k)
                    dst.sendall(view[:k])
                    view = view[k:]
        except (OSError, Stopped):
            # One direction broke: the other must not wait forever on a half-dead connection.
            # shutdown, not close: close() does not wake the other pump out of its recv(), and
            # once closed the socket cannot be shut down by kill() either (EBADF).
            _shutdown(pair.client)
            _shutdown(pair.server)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
                pair.pumps -= 1
                done = pair.pumps == 0
                if done:  # the connection is finished once neither direction's pump runs
                    self._conns.discard(pair.client)
                    self._conns.discard(pair.server)
            if done:
                _close(pair.client)
                _close(pair.server)


class _Pair:
    def __init__(self, client: socket.socket, server: socket.socket):
        self.client, self.server, self.pumps = client, server, 2


def _shutdown(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass


def _main(argv: list[str]) -> int:
    host, _, port = argv[0].rpartition(":")
    rate = float(argv[1]) * MB if len(argv) > 1 else 2 * MB
    with ThrottleProxy((host or "127.0.0.1", int(port)), rate) as proxy:
        print(f"{proxy.endpoint} -> {argv[0]} at {rate / MB:.2f} MB/s; Ctrl+C stops it", flush=True)
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
