"""A real MLflow tracking server: `mlflow server` with a SQLite backend and a local artifact
directory under the given folder, on a free port of 127.0.0.1, in its own process group.

    python -m support.servers.mlflow /tmp/mlflow-home     # run one by hand; Ctrl-C stops it

`mlflow-skinny` plus Flask, flask-cors, graphene and huey is enough for the server (the test extra
installs them); the full `mlflow` package would add ~750 MiB (pandas, scikit-learn, scipy) and
downgrade pyarrow. The server's background job runner (genai scorers, which need pandas) is off.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Self

from support.servers.prefect_ops import free_port, stop_group

MLFLOW = str(Path(sys.executable).parent / "mlflow")


class MlflowServer:
    def __init__(self, home: Path, port: int | None = None):
        self.home = Path(home)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.home / "server.log"

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 900.0) -> Self:
        self.home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        argv = [
            MLFLOW,
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.home / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.home / "artifacts"),
        ]
        self.proc = subprocess.Popen(
            argv, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with {self.proc.returncode}; log {self.log}:\n{self.log.read_text()[-3000:]}"
                )
            if self.healthy():
                return self
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"mlflow server on {self.uri} not healthy after {timeout:.0f}s; log {self.log}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        stop_group(self.proc)
        self.proc = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    with MlflowServer(Path(sys.argv[1])) as server:
        print(f"MLflow at {server.uri} (home {server.home}); Ctrl-C stops it", flush=True)
        try:
            server.proc.wait()
        except KeyboardInterrupt:
            pass
