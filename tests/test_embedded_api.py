"""The embedded Prefect API server started ahead of the CLI's imports (flows/embedded_api.py `prestart`).

python -m pytest -q -m "" tests/test_embedded_api.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

import flows.embedded_api as api
from tests.conftest import REPO


@pytest.fixture
def no_server(monkeypatch):
    """prestart may decide, but must not start a server in these tests."""

    def refuse(*a, **k):
        raise AssertionError("a server was started")

    monkeypatch.setattr(api, "_start", refuse)
    monkeypatch.setattr(api, "_early", None)


@pytest.mark.parametrize(
    "argv", [["--config", "x.yaml", "--check"], ["--break-lease", "--config", "x.yaml"], ["--help"]]
)
def test_prestart_starts_nothing_for_arguments_that_run_no_flow(no_server, argv):
    api.prestart(argv)
    assert api._early is None


def test_prestart_starts_nothing_where_the_environment_names_an_api(no_server, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    api.prestart(["--config", "x.yaml"])
    assert api._early is None


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_an_early_server_is_adopted_only_under_the_settings_it_was_started_with(monkeypatch):
    """Same environment, no in-process override: adopted. An override (`temporary_settings`, as a
    test harness or a caller sets) or a changed PREFECT_* variable: stopped, so `embedded_api`
    starts one that sees them."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    log = api.log_path()
    first = _sleeper()
    monkeypatch.setattr(api, "_early", api._Early(first, 1234, api._prefect_environ(), log))
    assert api._adopt_early(log) == (first, 1234) and api._early is None
    first.kill()

    for change in ("override", "environment"):
        proc = _sleeper()
        monkeypatch.setattr(api, "_early", api._Early(proc, 1234, api._prefect_environ(), log))
        if change == "override":
            with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 7}):
                assert api._adopt_early(log) is None
        else:
            monkeypatch.setenv("PREFECT_SOME_NEW_SETTING", "1")
            assert api._adopt_early(log) is None
        assert proc.poll() is not None, change  # stopped, not left running beside the new one
        assert api._early is None


PROBE = r"""
import json, sys
import flows.embedded_api as api

api.prestart(sys.argv[1:])
early = {"pid": api._early.proc.pid, "port": api._early.port}
from flows.embedded_api import embedded_api

with embedded_api() as url:
    import psutil
    servers = [c.pid for c in psutil.Process().children() if "uvicorn" in " ".join(c.cmdline())]
    print(json.dumps({"early": early, "url": url, "servers": servers}), flush=True)
"""


@pytest.mark.integration
def test_the_cli_prestarted_server_is_the_one_the_flow_uses_and_it_stops_with_the_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-c", PROBE, "--config", "x.yaml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["url"] == f"http://127.0.0.1:{out['early']['port']}/api", out
    assert out["servers"] == [out["early"]["pid"]], out  # one server: the early one, none started beside it
    deadline = time.monotonic() + 30
    while (
        psutil.pid_exists(out["early"]["pid"]) and psutil.Process(out["early"]["pid"]).status() != psutil.STATUS_ZOMBIE
    ):
        assert time.monotonic() < deadline, "the prestarted server outlived its process"
        time.sleep(0.2)
