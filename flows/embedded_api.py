"""The embedded Prefect API server of `python -m flows.cpt_to_sft` when no PREFECT_API_URL is set.

    python -c "from flows.embedded_api import embedded_api; print(embedded_api().__enter__())"

Prefect would start the same server (uvicorn on `prefect.server.api.server:create_app`, the UI off,
ephemeral mode) on its first API call, but in the flow's process group: the terminal's Ctrl-C
reaches it too, it shuts down, and the flow's cleanup then waits on an API that is gone. Started
here it runs in a session of its own, is stopped when the flow process exits, after Prefect's own
exit handlers have sent their last events and logs (`reap_on_exit` in tasks/core/launch/proctree.py
covers a SIGKILL), and is waited for at start-up as long as a busy machine needs: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS when set, else STARTUP_TIMEOUT_S.
A configured PREFECT_API_URL is asked once whether it answers at all. Either failure is one line
(`ApiUnavailable`) naming the setting to change, never a traceback. The server's own output goes to
`$PREFECT_HOME/embedded-api.log` (`log_path()`), not the run's console.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

# Prefect's default (20 s) is too short for the database migrations on 2 loaded cores.
STARTUP_TIMEOUT_S = 180
TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
LOG_NAME = "embedded-api.log"  # under PREFECT_HOME: the server's own output, off the run's console
_PORT_IN_USE = 3  # uvicorn's exit status when the port was taken before it bound (and for any failed start-up)


class ApiUnavailable(RuntimeError):
    """The configured API does not answer, or the embedded server did not start; the message is
    one line naming the setting to change."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_path() -> Path:
    """Where the embedded server writes: its background services' errors (e.g. a telemetry
    heartbeat that met a locked SQLite database on a busy machine) are its own, not the run's, and
    printed on the console they read as a failure of the run."""
    from prefect.settings import PREFECT_HOME

    return Path(PREFECT_HOME.value()) / LOG_NAME


def _start(port: int, env: dict[str, str]) -> subprocess.Popen:
    import prefect

    argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory", "prefect.server.api.server:create_app",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"]
    path = log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as out:
        out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} embedded API server on port {port} for pid {os.getpid()}\n".encode())
        out.flush()
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    last = [ln.strip() for ln in text[-lines:] if ln.strip() and not ln.startswith("--- ")]
    return " | ".join(last)[-600:]


def startup_timeout() -> tuple[float, bool]:
    """(seconds, whether the user set them): the setting when set, else STARTUP_TIMEOUT_S."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, get_current_settings

    if TIMEOUT_SETTING in get_current_settings().to_environment_variables(exclude_unset=True):
        return float(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()), True
    return float(STARTUP_TIMEOUT_S), False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)  # it waits for open websockets (Prefect's event client) before exiting
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def check_answers(url: str, timeout: float = 10.0) -> None:
    """Raise ApiUnavailable when nothing answers HTTP at `url` (any HTTP answer, an error status
    included, means a server is there: Prefect's client reports those itself)."""
    try:
        with httpx.Client(timeout=timeout) as client:
            client.get(f"{url.rstrip('/')}/health")
    except httpx.TransportError as exc:
        raise ApiUnavailable(f"the Prefect API at {url} (PREFECT_API_URL) does not answer ({type(exc).__name__}: {exc}); "
                             "start that server, or unset PREFECT_API_URL to run on an embedded one") from None


@contextlib.contextmanager
def embedded_api() -> Iterator[str | None]:
    """Start the server and name it in Prefect's settings (PREFECT_API_URL) while the block runs;
    yields its URL, or None (starting nothing) when an API is configured or ephemeral mode is off.
    The server stops when this process exits. Raises ApiUnavailable when it does not answer
    within `startup_timeout()`."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, get_current_settings, temporary_settings

    if PREFECT_API_URL.value():
        check_answers(PREFECT_API_URL.value())
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        yield None
        return
    timeout, user_set = startup_timeout()
    env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
           "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    from tasks.core.launch.proctree import RUN_TOKEN_ENV, reap_on_exit

    env[RUN_TOKEN_ENV] = reap_on_exit()  # a SIGKILL of this process takes the server along
    port = _free_port()
    proc = _start(port, env)
    # Registered before any Prefect client exists: exit handlers run last-registered first, so
    # Prefect's event and log workers drain into a live server before it stops.
    atexit.register(lambda: _stop(proc))
    try:
        url = f"http://127.0.0.1:{port}/api"
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5) as client:
            while True:
                if proc.poll() == _PORT_IN_USE and "address already in use" in _tail(log_path(), 20).lower():  # another process took the port first
                    port = _free_port()
                    proc = _start(port, env)
                    url = f"http://127.0.0.1:{port}/api"
                elif proc.poll() is not None:
                    tail = _tail(log_path())
                    raise ApiUnavailable(f"the embedded Prefect API server exited with status {proc.returncode} while starting ({log_path()}"
                                           + (f": {tail}" if tail else "") + "); set PREFECT_API_URL to a running Prefect server to use that instead")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{url}/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    how = f"{TIMEOUT_SETTING}={timeout:g}" if user_set else f"{timeout:g} s ({TIMEOUT_SETTING} unset)"
                    raise ApiUnavailable(f"the embedded Prefect API server did not answer within {how}: the machine is busy; "
                                           f"set {TIMEOUT_SETTING} higher, or PREFECT_API_URL to a running Prefect server")
                time.sleep(0.2)
    except BaseException:
        _stop(proc)
        raise
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield url
