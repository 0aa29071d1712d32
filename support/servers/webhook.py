"""A local HTTP receiver on 127.0.0.1 that records every request body: the far end of a webhook
notification block in the tests.

    python -m support.servers.webhook          # prints its URL, then every body it receives
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

from support.servers import LocalHTTPServer


class WebhookReceiver(LocalHTTPServer):
    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    data = json.loads(body)
                except ValueError:
                    data = {"raw": body.decode(errors="replace")}
                with receiver._cond:
                    receiver.received.append({"path": self.path, "json": data})
                    receiver._cond.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._serve(Handler, "webhook-receiver")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def wait(self, predicate, timeout: float = 120.0) -> list[dict[str, Any]]:
        """The received requests once one satisfies `predicate`; whatever arrived on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(predicate(r) for r in self.received):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self.received)


if __name__ == "__main__":
    with WebhookReceiver() as r:
        print(r.url, flush=True)
        seen = 0
        while True:
            got = r.wait(lambda _, n=seen: len(r.received) > n, timeout=3600)
            for item in got[seen:]:
                print(json.dumps(item), flush=True)
            seen = len(got)
