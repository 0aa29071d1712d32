"""Real-protocol servers owned by the tests, bound to 127.0.0.1 on free ports: SeaweedFS (`weed
mini`, S3) and a Hugging Face Hub-protocol server (Starlette + uvicorn, files on disk)."""

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


@contextlib.contextmanager
def patched_env(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (str) or unset (None) environment variables, restoring the previous values after."""
    saved = {k: os.environ.get(k) for k in values}

    def apply(vals: Mapping[str, str | None]) -> None:
        for k, v in vals.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    apply(values)
    try:
        yield
    finally:
        apply(saved)


class LocalHTTPServer:
    """A stdlib HTTP server on 127.0.0.1 at a free port, served by a daemon thread: start/stop or `with`."""

    def _serve(self, handler: type[BaseHTTPRequestHandler], name: str) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
