"""Untrusted input is parsed and rendered under bounds: YAML aliases, chat templates, safetensors
headers, and a model folder's `auto_map` (issue 50, item 2). Each input here would take hours, or
run code, without its bound; the tests' timeouts are seconds.

    .venv/bin/python -m pytest -q tests/test_untrusted_bounds.py
"""

from __future__ import annotations

import time

import pytest

from tasks.core.config.bounded_yaml import load_bounded
from tasks.core.config.load import read_raw_config
from tasks.core.errors import ConfigError


def alias_bomb(levels: int, fanout: int = 10) -> str:
    """~60 bytes a level; `levels` nested aliases expand to fanout**levels values."""
    lines = ["a0: &a0 [" + ", ".join(["x"] * fanout) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fanout) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def merge_bomb(levels: int, fanout: int = 10) -> str:
    """The same through merge keys, which PyYAML's constructor flattens into copies."""
    text = "m0: &m0 {x: 1, y: 2}\n"
    for i in range(1, levels + 1):
        text += f"m{i}: &m{i}\n  <<: [" + ", ".join([f"*m{i - 1}"] * fanout) + "]\n"
    return text


@pytest.mark.timeout(30)
def test_nested_yaml_aliases_are_refused_before_they_expand(tmp_path, capsys):
    from tasks.preflight import run_check_cli

    path = tmp_path / "bomb.yaml"
    path.write_text("name: x\n" + alias_bomb(9))  # 1e9 values: hours for the old duplicate-key scan
    assert path.stat().st_size < 1024
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        read_raw_config(path)
    assert time.monotonic() - start < 5
    assert str(path) in str(info.value) and "aliases expand to more than 100,000 values" in str(info.value)
    assert run_check_cli(str(path)) == 1  # --check: the refusal, no hang, no traceback
    out = capsys.readouterr()
    assert str(path) in out.out and "aliases expand" in out.out and "Traceback" not in out.out + out.err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "text, why",
    [
        (merge_bomb(9), "aliases expand to more than"),
        ("a: &a [1, *a]\n", "refers to a node that contains it"),
        ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
        ("a: " + "[" * 70 + "]" * 70 + "\n", "nested more than 64 levels"),
        ("a: '" + "x" * (1 << 20) + "'\n", "over the 1,048,576 a YAML file here may hold"),
    ],
    ids=["merge-keys", "recursive-alias", "deep-nesting", "nesting-over-the-bound", "size"],
)
def test_yaml_bounds_name_the_file(text, why):
    with pytest.raises(ConfigError) as info:
        load_bounded(text, "/cfg/run.yaml")
    assert "/cfg/run.yaml" in str(info.value) and why in str(info.value)


def test_set_values_are_bounded_too():
    from flows.cli import parse_sets

    with pytest.raises(ConfigError) as info:
        parse_sets(["cpt.data.uri=" + "{" + alias_bomb(9).replace("\n", ", ").rstrip(", ") + "}"])
    assert "--set cpt.data.uri" in str(info.value) and "aliases expand" in str(info.value)


def test_aliases_within_the_bound_load_as_before():
    assert load_bounded(alias_bomb(3), "ok.yaml")["a3"][0][0][0][0] == "x"  # 1,111 values: fine
    assert load_bounded("b: &b {x: 1}\no:\n  <<: *b\n  y: 2\n", "ok.yaml") == {"b": {"x": 1}, "o": {"x": 1, "y": 2}}
