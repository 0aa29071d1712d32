"""A real Prefect server, a process worker and the `prefect` CLI, as the operator guide uses them.

Everything runs as subprocesses on 127.0.0.1 with a temporary PREFECT_HOME, each in its own
process group, stopped by PID (SIGTERM to the group, then SIGKILL). The API is read with plain
HTTP so the test process never changes its own Prefect settings. Headless Chromium (Debian's
`chromium`) loads pages of the server's UI.

    python -m support.servers.prefect_ops /tmp/prefect-home     # run a server by hand; Ctrl-C stops it
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from support.servers import prefect_quiet

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# Settings of the calling process that must not leak into the CLI, server or worker.
_DROP = ("PREFECT_", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "CPT_TO_SFT_FAULT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen | None, timeout: float = 20.0) -> None:
    """SIGTERM the process group `proc` leads, then SIGKILL whatever is left of it."""
    if proc is None:
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; its children (flow runs, torchrun) may not be: finish the group.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        break
    if proc.poll() is None:
        proc.wait(timeout=10)


class PrefectServer:
    """`prefect server start` on a free port of 127.0.0.1 with its own PREFECT_HOME; its database is
    SQLite there, or `database_url` (PostgreSQL: support/servers/postgres.py), as a shared server runs."""

    def __init__(self, home: Path, database_url: str | None = None):
        self.home = Path(home)
        self.database_url = database_url
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.children: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
        env.update(
            PREFECT_HOME=str(self.home),
            PREFECT_API_URL=self.api_url,
            PREFECT_UI_API_URL=self.api_url,
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_CLI_COLORS="false",
            PREFECT_CLI_WRAP_LINES="false",
            COLUMNS="200",
        )
        if self.database_url:
            env["PREFECT_API_DATABASE_CONNECTION_URL"] = self.database_url
        prefect_quiet.apply(env)
        env.update(extra)
        return env

    def start(self, timeout: float = 120.0) -> PrefectServer:
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.home / "server.log", "ab") as log:  # the server keeps its own copy of the handle
            self.proc = subprocess.Popen(
                [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port), "--analytics-off"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(),
                cwd=str(self.home),
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"prefect server did not answer on {self.api_url} within {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        path = self.home / "server.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def stop(self) -> None:
        for child in reversed(self.children):
            stop_group(child)
        self.children.clear()
        stop_group(self.proc)
        self.proc = None

    # --- the CLI, as an operator types it -------------------------------------------------------

    def cli(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 300.0,
        check: bool = True,
        cwd: Path = REPO,
    ) -> subprocess.CompletedProcess:
        # Own process group, so a timed-out command takes nothing of ours with it but itself.
        proc = subprocess.Popen(
            [PREFECT, "--no-prompt", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env or self.env(),
            cwd=str(cwd),
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc, timeout=5)
            out, _ = proc.communicate()
            raise AssertionError(f"`prefect {' '.join(args)}` timed out after {timeout:.0f}s:\n{out[-6000:]}")
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, None)
        if check and done.returncode != 0:
            raise AssertionError(f"`prefect {' '.join(args)}` exited {done.returncode}:\n{out[-6000:]}")
        return done

    def start_worker(self, pool: str, log_path: Path, **env: str) -> subprocess.Popen:
        with open(log_path, "ab") as log:  # the worker keeps its own copy of the handle
            proc = subprocess.Popen(
                [PREFECT, "--no-prompt", "worker", "start", "--pool", pool, "--type", "process"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(**env),
                cwd=str(REPO),
                start_new_session=True,
            )
        self.children.append(proc)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # a worker shows up in the pool once it has polled
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if self.api("POST", f"/work_pools/{pool}/workers/filter", {}):
                return proc
            time.sleep(0.5)
        raise RuntimeError(f"worker did not register with pool {pool}:\n{log_path.read_text()[-4000:]}")

    # --- the REST API --------------------------------------------------------------------------

    def api(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.api_url}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{method} {path} -> {exc.code}: {exc.read()[:2000]!r}") from None
        return json.loads(raw) if raw else None

    def flow_run(self, run_id: str) -> dict:
        return self.api("GET", f"/flow_runs/{run_id}")

    def wait_terminal(self, run_id: str, timeout: float = 600.0, not_state: str | None = None) -> dict:
        """The run once it is in a terminal state other than the state with id `not_state`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.flow_run(run_id)
            state = run["state"] or {}
            if state.get("type") in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") and state.get("id") != not_state:
                return run
            time.sleep(1.0)
        raise AssertionError(f"flow run {run_id} not finished after {timeout:.0f}s: {run['state']}")

    def artifacts(self, flow_run_id: str) -> list[dict]:
        return self.api(
            "POST",
            "/artifacts/filter",
            {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "CREATED_DESC", "limit": 200},
        )

    def task_runs(self, flow_run_id: str) -> list[dict]:
        return self.api(
            "POST",
            "/task_runs/filter",
            {"flow_runs": {"id": {"any_": [flow_run_id]}}, "sort": "EXPECTED_START_TIME_ASC", "limit": 200},
        )

    def logs(self, flow_run_id: str) -> list[dict]:
        out, offset = [], 0
        while True:
            page = self.api(
                "POST",
                "/logs/filter",
                {
                    "logs": {"flow_run_id": {"any_": [flow_run_id]}},
                    "sort": "TIMESTAMP_ASC",
                    "limit": 200,
                    "offset": offset,
                },
            )
            out += page
            if len(page) < 200:
                return out
            offset += 200

    def events(self, prefix: str) -> list[dict]:
        # Events reach the database through the server's event pipeline a moment after emission.
        body = {
            "filter": {"event": {"prefix": [prefix]}, "occurred": {"since": "2000-01-01T00:00:00Z"}, "order": "ASC"},
            "limit": 50,
        }
        page = self.api("POST", "/events/filter", body)
        events = list(page["events"])
        while page.get("next_page"):
            page = self.api("GET", page["next_page"].split("/api", 1)[1])
            events += page["events"]
        return events

    def run_events(self, prefix: str, flow_run_id: str, stages: set[str], timeout: float = 30.0) -> list[dict]:
        """Events related to one flow run; waits up to `timeout` until there is one for each of
        `stages` (payload "stage"), since the server persists events a moment after they arrive."""
        deadline = time.monotonic() + timeout
        while True:
            events = [
                e
                for e in self.events(prefix)
                if any(r["prefect.resource.id"] == f"prefect.flow-run.{flow_run_id}" for r in e["related"])
            ]
            if stages <= {e["payload"].get("stage") for e in events} or time.monotonic() > deadline:
                return events
            time.sleep(1.0)


def run_id_from(output: str) -> str:
    """The flow run id that `prefect deployment run` printed ("UUID: ...")."""
    m = re.search(r"UUID:\s*(" + UUID.pattern + ")", output) or UUID.search(output)
    if not m:
        raise AssertionError(f"no flow run id in:\n{output[-3000:]}")
    return m.group(1) if m.groups() else m.group(0)


# --- headless Chromium ------------------------------------------------------------------------

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
)


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def ensure_chromium(timeout: float = 900.0) -> tuple[str | None, str]:
    """Debian's `chromium`, installed with apt-get when missing. Returns (binary, why-not)."""
    found = chromium_binary()
    if found:
        return found, ""
    if not shutil.which("apt-get"):
        return None, "chromium is not installed and apt-get is not available to install it"
    if os.geteuid() != 0:
        return None, "chromium is not installed and installing it with apt-get needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return None, f"`{' '.join(argv)}` timed out after {timeout:.0f}s"
        if done.returncode != 0:
            return None, f"`{' '.join(argv)}` failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}"
    found = chromium_binary()
    return (found, "") if found else (None, "apt-get installed chromium but no chromium binary is on PATH")


def chromium(
    binary: str,
    url: str,
    profile_dir: Path,
    *,
    screenshot: Path | None = None,
    budget_ms: int = 15000,
    window: str = "1440,2000",
    timeout: float = 120.0,
) -> str:
    """Load `url` headless; return the DOM after `budget_ms` of virtual time, and write a PNG of the
    same load when `screenshot` is given (one browser start for both: a start costs seconds of CPU)."""
    argv = [
        binary,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile_dir}",
        f"--virtual-time-budget={budget_ms}",
        f"--window-size={window}",
        "--dump-dom",
    ]
    argv += [f"--screenshot={screenshot}"] if screenshot else []
    proc = subprocess.Popen(
        argv + [url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc, timeout=5)
        raise AssertionError(f"chromium did not finish loading {url} in {timeout:.0f}s")
    if proc.returncode != 0:
        raise AssertionError(f"chromium exited {proc.returncode} on {url}: {err[-2000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    home = Path((argv or sys.argv[1:] or ["/tmp/prefect-ops-home"])[0])
    server = PrefectServer(home).start()
    print(f"PREFECT_API_URL={server.api_url}\nUI: {server.url}", flush=True)
    try:
        while server.proc and server.proc.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
