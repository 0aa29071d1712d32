"""Config errors on the command line: both CLI forms give one exit status, and an unknown key names the nearest valid one.

python -m pytest -q tests/test_cli_errors.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tasks.core.config.load import parse_fields
from tasks.core.errors import ConfigError
from tests.conftest import REPO, write_config

TINY = REPO / "examples" / "tiny-cpu.yaml"


def _raw() -> dict:
    return yaml.safe_load(TINY.read_text())


@pytest.mark.parametrize(
    "path, key, near",
    [
        (("cpt",), "max_stepz", "max_steps"),
        (("cpt", "plugin"), "tp_sise", "tp_size"),
        (("sft", "data"), "on_bad_recrd", "on_bad_record"),
        ((), "hubb", "hub"),
    ],
)
def test_an_unknown_key_suggests_the_nearest_field_at_its_path(path, key, near):
    raw = _raw()
    node = raw
    for part in path:
        node = node.setdefault(part, {})
    node[key] = 1
    with pytest.raises(ConfigError) as err:
        parse_fields(raw)
    assert f"- {'.'.join((*path, key))}: Extra inputs are not permitted; did you mean {near!r}?" in str(err.value)


def test_an_unknown_key_with_no_near_one_lists_the_keys_there():
    raw = _raw()
    raw["gate"] = {**(raw.get("gate") or {}), "zzqqxx": 1}
    with pytest.raises(ConfigError) as err:
        parse_fields(raw)
    assert "- gate.zzqqxx: Extra inputs are not permitted; the keys here are: " in str(err.value) and "enabled" in str(
        err.value
    )


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_both_cli_forms_exit_1_on_a_config_error_and_suggest_the_key(tmp_path):
    """`cpt-to-sft check|run` and `python -m flows.cpt_to_sft [--check]` on the same bad file: one
    status (1, the documented refusal), the same suggestion, no traceback."""
    raw = _raw()
    raw["run_root"] = str(tmp_path / "run")
    raw["cpt"]["max_stepz"] = 3
    cfg = str(write_config(tmp_path / "bad.yaml", raw))
    forms = {
        "cpt-to-sft check": ("-m", "flows.cli", "check", "--config", cfg),
        "cpt-to-sft run": ("-m", "flows.cli", "run", "--config", cfg),
        "python -m flows.cpt_to_sft --check": ("-m", "flows.cpt_to_sft", "--check", "--config", cfg),
    }
    for form, args in forms.items():
        r = _cli(*args)
        out = r.stdout + r.stderr
        assert r.returncode == 1, (form, r.returncode, out[-2000:])
        assert "cpt.max_stepz: Extra inputs are not permitted; did you mean 'max_steps'?" in out, (form, out[-2000:])
        assert "Traceback" not in out, (form, out[-2000:])


def test_the_embedded_server_waits_long_enough_for_a_busy_machine_unless_told_otherwise():
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    from flows.embedded_api import STARTUP_TIMEOUT_S, startup_timeout

    if "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" not in os.environ:
        assert (
            startup_timeout() == (STARTUP_TIMEOUT_S, False) and STARTUP_TIMEOUT_S > 20
        )  # Prefect's own default is 20 s
    with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 7}):
        assert startup_timeout() == (7, True)


def _flow_cli(tmp_path, **env_updates) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false", **env_updates)
    return subprocess.run(
        [sys.executable, "-m", "flows.cpt_to_sft", "--config", str(TINY), "--run-root", str(tmp_path / "run")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.integration
def test_an_embedded_server_too_slow_to_start_is_one_line_naming_the_setting(tmp_path):
    r = _flow_cli(
        tmp_path, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1"
    )  # a fresh database needs longer than 1 s
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert (
        "did not answer within PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=1" in r.stderr.strip().splitlines()[-1]
    ), out[-3000:]
    assert "Traceback" not in out and not (tmp_path / "run").exists(), out[-3000:]
    # The server's own output (here: its migrations cut short) is in its log, not on the run's console.
    assert (tmp_path / "prefect" / "embedded-api.log").read_text().startswith("--- "), out[-3000:]


@pytest.mark.integration
def test_an_embedded_server_that_cannot_start_says_why_in_one_line(tmp_path):
    bad = f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/prefect.db"
    r = _flow_cli(tmp_path, PREFECT_API_DATABASE_CONNECTION_URL=bad)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert (
        "embedded Prefect API server exited with status 3 while starting" in last
        and "unable to open database file" in last
    ), out[-3000:]
    assert "Traceback" not in out and not (tmp_path / "run").exists(), out[-3000:]


@pytest.mark.integration
def test_an_unreachable_api_is_one_line_naming_it(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/api"
    r = _flow_cli(tmp_path, PREFECT_API_URL=url)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert f"the Prefect API at {url} (PREFECT_API_URL) does not answer" in r.stderr.strip().splitlines()[-1], out[
        -3000:
    ]
    assert "Traceback" not in out and not (tmp_path / "run").exists(), out[-3000:]
