"""A Hugging Face Hub-protocol server owned by the tests: Starlette + uvicorn, repos as files on disk.

It implements what `huggingface_hub<1.0` uses for `create_repo`, `create_branch`, `create_commit`
(validate-yaml, preupload, the LFS batch API with basic and multipart transfers, the ndjson commit
endpoint), `whoami` (for `login`), `repo_info`/`model_info`, `list_repo_tree`, `list_repo_refs`, `list_repo_commits`,
`hf_hub_download`/`snapshot_download` (resolve HEAD/GET with X-Repo-Commit, ETag, X-Linked-Etag and
X-Linked-Size). The real client talks to it over HTTP through `HF_ENDPOINT`.

Test-only controls live under `/_test/`: `faults` (drop the TCP connection in the middle of an LFS
upload, or of a multipart completion, the next N times) and `stats` (bytes and objects received,
commits made). Commits are atomic: a commit that names an LFS object the server does not hold
whole is refused, and the branch ref moves only when the commit is written.

    HUB_SERVER_TOKEN=secret python -m support.servers.hub_server --root /tmp/hub --port 8765
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from support.servers.hub_storage import HubStorage


class HubServer:
    """The server as a subprocess, started and stopped by PID, plus its test controls."""

    def __init__(self, root: Path, token: str, multipart_threshold: int = 1 << 20, chunk_size: int = 512 << 10):
        from support.servers.seaweed import free_ports

        self.root, self.token = Path(root), token
        self.port = free_ports(1)[0]
        self.multipart_threshold, self.chunk_size = multipart_threshold, chunk_size
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> HubServer:
        self.root.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HUB_SERVER_TOKEN": self.token}
        repo = Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = f"{repo}{os.pathsep}{env.get('PYTHONPATH', '')}"
        with open(self.root / "server.log", "ab") as log:  # the server keeps its own copy of the handle
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "support.servers.hub_server",
                    "--root",
                    str(self.root / "data"),
                    "--port",
                    str(self.port),
                    "--multipart-threshold",
                    str(self.multipart_threshold),
                    "--chunk-size",
                    str(self.chunk_size),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(repo),
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"hub server exited with {self.proc.returncode}: {(self.root / 'server.log').read_text()[-2000:]}"
                )
            try:
                urllib.request.urlopen(f"{self.endpoint}/_test/health", timeout=2)
                return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("hub server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _call(self, path: str, body: dict | None = None) -> Any:
        req = urllib.request.Request(
            f"{self.endpoint}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def set_faults(self, **faults: int) -> dict:
        """e.g. set_faults(lfs_put=1): drop the next LFS upload mid-body; lfs_complete=N: drop N completions."""
        return self._call("/_test/faults", faults)

    def stats(self) -> dict:
        return self._call("/_test/stats")


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from support.servers.hub_routes import build_app

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--multipart-threshold", type=int, default=1 << 20)
    p.add_argument("--chunk-size", type=int, default=512 << 10)
    a = p.parse_args(argv)
    storage = HubStorage(Path(a.root), os.environ.get("HUB_SERVER_TOKEN") or None, a.multipart_threshold, a.chunk_size)
    uvicorn.run(build_app(storage), host="127.0.0.1", port=a.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
