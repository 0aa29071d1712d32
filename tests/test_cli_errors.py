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

TINY = REPO / "deployments" / "configs" / "tiny-cpu.yaml"


def _raw() -> dict:
    return yaml.safe_load(TINY.read_text())


@pytest.mark.parametrize("path, key, near", [
    (("cpt",), "max_stepz", "max_steps"),
    (("cpt", "plugin"), "tp_sise", "tp_size"),
    (("sft", "data"), "on_bad_recrd", "on_bad_record"),
    ((), "hubb", "hub"),
])
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
    assert "- gate.zzqqxx: Extra inputs are not permitted; the keys here are: " in str(err.value) and "enabled" in str(err.value)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)


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
