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

The CLI entry points call `prestart()` before their own imports: the server's start-up (about 4 s
of CPU: its imports, the database check) then runs beside the flow process's (about 1.7 s) on the
other core instead of after them, and `embedded_api()` adopts that server. A re-run that skips
every stage is mostly this start-up, so it is what a retry waits on.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

# Prefect's default (20 s) is too short for the database migrations on 2 loaded cores.
STARTUP_TIMEOUT_S = 180
TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
LOG_NAME = "embedded-api.log"  # under PREFECT_HOME: the server's own output, off the run's console
_PORT_IN_USE = 3  # uvicorn's exit status when the port was taken before it bound (and for any failed start-up)
_SERVER_FLAGS = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
NO_SERVER_ARGS = frozenset({"--check", "--break-lease", "-h", "--help"})  # CLI arguments that run no flow


class _Early(NamedTuple):
    """The server `prestart` started, and what it was started from (for `embedded_api` to adopt it
    only where it would have started the same one)."""

    proc: subprocess.Popen
    port: int
    environ: dict[str, str]
    log: Path


_early: _Early | None = None


class ApiUnavailable(RuntimeError):
    """The configured API does not answer, or the embedded server did not start; the message is
    one line naming the setting to change."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prefect_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("PREFECT_")}


def prestart(argv: Sequence[str] = ()) -> None:
    """Start the embedded server now, from a CLI process that has not imported Prefect yet (so
    nothing here may import it: that import alone is 1.3 s). Does nothing for arguments that run no
    flow (NO_SERVER_ARGS), with PREFECT_API_URL in the environment, or when called twice.
    `embedded_api` decides with Prefect's full settings (profiles included) and stops this server
    where they name an API or turn ephemeral mode off; the exit handler stops it when the process
    ends first (a config refused, say)."""
    import importlib.util

    global _early
    if _early is not None or NO_SERVER_ARGS & set(argv) or os.environ.get("PREFECT_API_URL"):
        return
    spec = importlib.util.find_spec("prefect")
    if spec is None or not spec.submodule_search_locations:
        return
    from tasks.core.launch.proctree import RUN_TOKEN_ENV, reap_on_exit

    env = {**os.environ, **_SERVER_FLAGS}
    env[RUN_TOKEN_ENV] = reap_on_exit()  # a SIGKILL of this process takes the server along
    log = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser() / LOG_NAME
    port = _free_port()
    proc = _start(port, env, log=log, app_dir=Path(next(iter(spec.submodule_search_locations))).parent)
    _early = _Early(proc, port, _prefect_environ(), log)
    atexit.register(lambda: _stop(proc))


def _adopt_early(log: Path) -> tuple[subprocess.Popen, int] | None:
    """The prestarted server, where this process's Prefect settings are the ones it was started
    from (the environment unchanged, no in-process override such as `temporary_settings`, the same
    log file); else it is stopped and None is returned. One that has already exited is adopted too:
    the start-up wait reports it (or retries a taken port) as it does a server started there."""
    global _early
    early, _early = _early, None
    if early is None:
        return None
    import prefect.context
    from prefect.settings import get_current_settings

    same = (
        early.environ == _prefect_environ()
        and early.log.resolve() == log.resolve()
        and get_current_settings() == prefect.context.GLOBAL_SETTINGS_CONTEXT.settings
    )
    if same:
        return early.proc, early.port
    _stop(early.proc)
    return None


def _stop_early() -> None:
    global _early
    if _early is not None:
        _stop(_early.proc)
        _early = None


def log_path() -> Path:
    """Where the embedded server writes: its background services' errors (e.g. a telemetry
    heartbeat that met a locked SQLite database on a busy machine) are its own, not the run's, and
    printed on the console they read as a failure of the run."""
    from prefect.settings import PREFECT_HOME

    return Path(PREFECT_HOME.value()) / LOG_NAME


def _start(port: int, env: dict[str, str], log: Path | None = None, app_dir: Path | None = None) -> subprocess.Popen:
    if app_dir is None:
        import prefect

        app_dir = prefect.__module_path__.parent
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(app_dir),
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]
    path = log or log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as out:
        out.write(
            f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} embedded API server on port {port} for pid {os.getpid()}\n".encode()
        )
        out.flush()
        return subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _warm_imports() -> None:
    """Import what Prefect's flow engine imports on a flow's first call (fastapi's JSON encoder for
    the parameters, the engines: about 0.2 s) while the server is still starting, not after."""
    import importlib

    for name in ("fastapi.encoders", "prefect.flow_engine", "prefect.task_engine", "prefect.utilities.visualization"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


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
    import httpx

    try:
        with httpx.Client(timeout=timeout) as client:
            client.get(f"{url.rstrip('/')}/health")
    except httpx.TransportError as exc:
        raise ApiUnavailable(
            f"the Prefect API at {url} (PREFECT_API_URL) does not answer ({type(exc).__name__}: {exc}); "
            "start that server, or unset PREFECT_API_URL to run on an embedded one"
        ) from None


@contextlib.contextmanager
def embedded_api() -> Iterator[str | None]:
    """Start the server and name it in Prefect's settings (PREFECT_API_URL) while the block runs;
    yields its URL, or None (starting nothing) when an API is configured or ephemeral mode is off.
    The server stops when this process exits. Raises ApiUnavailable when it does not answer
    within `startup_timeout()`."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        get_current_settings,
        temporary_settings,
    )

    if PREFECT_API_URL.value():
        check_answers(PREFECT_API_URL.value())
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        _stop_early()
        yield None
        return
    import httpx

    timeout, user_set = startup_timeout()
    env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True), **_SERVER_FLAGS}
    from tasks.core.launch.proctree import RUN_TOKEN_ENV, reap_on_exit

    env[RUN_TOKEN_ENV] = reap_on_exit()  # a SIGKILL of this process takes the server along
    adopted = _adopt_early(log_path())
    if adopted:
        proc, port = adopted
    else:
        port = _free_port()
        proc = _start(port, env)
    # Registered before any Prefect client exists: exit handlers run last-registered first, so
    # Prefect's event and log workers drain into a live server before it stops. `proc` is read at
    # exit: a server restarted below (its port taken) is the one stopped.
    atexit.register(lambda: _stop(proc))
    _warm_imports()
    try:
        url = f"http://127.0.0.1:{port}/api"
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5) as client:
            while True:
                if (
                    proc.poll() == _PORT_IN_USE and "address already in use" in _tail(log_path(), 20).lower()
                ):  # another process took the port first
                    port = _free_port()
                    proc = _start(port, env)
                    url = f"http://127.0.0.1:{port}/api"
                elif proc.poll() is not None:
                    tail = _tail(log_path())
                    raise ApiUnavailable(
                        f"the embedded Prefect API server exited with status {proc.returncode} while starting "
                        f"({log_path()}"
                        + (f": {tail}" if tail else "")
                        + "); set PREFECT_API_URL to a running Prefect server to use that instead"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{url}/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    how = f"{TIMEOUT_SETTING}={timeout:g}" if user_set else f"{timeout:g} s ({TIMEOUT_SETTING} unset)"
                    raise ApiUnavailable(
                        f"the embedded Prefect API server did not answer within {how}: the machine is busy; "
                        f"set {TIMEOUT_SETTING} higher, or PREFECT_API_URL to a running Prefect server"
                    )
                time.sleep(0.05)  # every run waits on this loop: a short interval
    except BaseException:
        _stop(proc)
        raise
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield url
