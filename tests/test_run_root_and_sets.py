"""Unit tier: what `cpt-to-sft run` hands the flow, `--set` into a list item, and the run root as a
user names it (`~`, `$VAR`, a symbolic link to another run's root, one that does not exist yet).

    .venv/bin/python -m pytest -q tests/test_run_root_and_sets.py

No flow, no Prefect server, no model: the CLI's own code up to the flow's call, the runbook's config
reading, and pre-flight's run-root check on a config that names a model folder it never opens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tasks.core.errors import ConfigError
from tests.conftest import tiny_config_raw, write_config


def _config(tmp_path: Path, **top) -> tuple[Path, dict]:
    raw = {**tiny_config_raw(tmp_path / "model", tmp_path / "run"), **top}
    return write_config(tmp_path / "run.yaml", raw), raw


def test_run_hands_the_flow_the_users_file_so_the_retry_reads_what_it_says_now(tmp_path, monkeypatch, capsys):
    """`cpt-to-sft run --set ...`: the flow gets the user's config and the --set items, not a resolved
    copy, so the config the retry reads after a preemption (`reread_config`: the same loader and
    overrides) is what the file says then: cpt.seq_len and cpt.lr edited while the run waits are
    listed as changed, and the --set still wins over the file."""
    from flows import cli
    from flows.cpt_to_sft import config_changes, resolve_config

    path, raw = _config(tmp_path)
    seen: dict = {}

    def the_flow(config, overrides, stop_after):  # the runbook's reads, first and on the retry
        first = resolve_config(config, overrides, rules=False)
        raw["cpt"].update(seq_len=32, lr=1e-4, max_steps=99)  # the operator's edit during retry_wait_s
        write_config(path, raw)
        seen.update(config=config, stop_after=stop_after, first=first)
        seen["retry"] = resolve_config(config, overrides, rules=False)
        return 0

    monkeypatch.setattr(cli, "run_flow", the_flow)
    argv = ["run", "--config", str(path), "--set", "cpt.max_steps=3", "--run-root", str(tmp_path / "2024")]
    assert cli.main([*argv, "--stop-after", "train_cpt"]) == 0
    first, retry = seen["first"], seen["retry"]
    assert (first.cpt.seq_len, first.cpt.lr, first.cpt.max_steps) == (64, 0.003, 3)
    assert (retry.cpt.seq_len, retry.cpt.lr, retry.cpt.max_steps) == (32, 1e-4, 3)  # the file now; the --set kept
    assert seen["config"] == str(path) and seen["stop_after"] == "train_cpt"
    assert first.run_uri == retry.run_uri == str(tmp_path / "2024")  # --run-root, read back as given
    assert config_changes(first, retry) == ["cpt.lr: 0.003 -> 0.0001", "cpt.seq_len: 64 -> 32"]
    assert "Traceback" not in capsys.readouterr().err


def test_set_names_a_list_item_by_its_index(tmp_path, capsys):
    """`--set cpt.elastic.notices.0.grace_s=5` changes that item; an index past the list's end, a
    word where an index goes, a list the config does not set, or a key into a number is refused
    naming the key and the fix, with no traceback."""
    from flows.cli import main, resolved_config

    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    raw["cpt"]["elastic"] = {"notices": [{"source": "sigterm", "grace_s": 20}]}
    path = write_config(tmp_path / "run.yaml", raw)
    (notice,) = resolved_config(str(path), ["cpt.elastic.notices.0.grace_s=5"]).cpt.elastic.notices
    assert (notice.source, notice.grace_s) == ("sigterm", 5.0)
    refused = {
        "cpt.elastic.notices.1.grace_s=5": "no item 1: cpt.elastic.notices is a list of 1 item(s) (index 0 to 0); "
        "name an item by its index (--set cpt.elastic.notices.0.<field>=...), or give the whole list "
        "(--set 'cpt.elastic.notices=[...]')",
        "cpt.elastic.notices.first.grace_s=5": "'first' is no index: cpt.elastic.notices is a list of 1 item(s)",
        "sft.elastic.notices.0.grace_s=5": "sft.elastic.notices is not set in the config, so it has no item 0; "
        "give the whole list (--set 'sft.elastic.notices=[...]')",
        "cpt.lr.peak=1": "cpt.lr is a number, not a mapping or a list, so it has no 'peak'; set cpt.lr itself",
    }
    for item, why in refused.items():
        assert main(["check", "--config", str(path), "--set", item]) == 1
        err = capsys.readouterr().err
        assert f"- {item.split('=')[0]}: {why}" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_run_root_expands_home_and_variables_and_refuses_an_unset_one(tmp_path, monkeypatch):
    from flows.cli import resolved_config

    path, _ = _config(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    monkeypatch.delenv("CPT_TO_SFT_NO_SUCH_VAR", raising=False)
    for given, want in (
        ("~/runs/a", tmp_path / "home" / "runs" / "a"),
        ("$RUNS/b", tmp_path / "runs" / "b"),
        ("${RUNS}/c", tmp_path / "runs" / "c"),
    ):
        cfg = resolved_config(str(path), [], run_root=given)
        assert cfg.run_uri == str(want), given  # absolute: never under the project's checkout
    for given, why in (
        (
            "$CPT_TO_SFT_NO_SUCH_VAR/x",
            (
                "the environment variable $CPT_TO_SFT_NO_SUCH_VAR is not set here: export CPT_TO_SFT_NO_SUCH_VAR "
                "before the run, or write the path out"
            ),
        ),
        ("${RUNS:-/tmp}/x", "'${RUNS:-/tmp}' is no environment variable: write $NAME or ${NAME}"),
        ("/tmp/$HF_TOKEN", "$HF_TOKEN is named like a secret"),
    ):
        with pytest.raises(ConfigError) as caught:
            resolved_config(str(path), [f"run_root={given}"])
        ((field, msg),) = caught.value.problems
        assert field == "run_root" and why in msg, msg


def _run_root_check(tmp_path: Path, run_root: Path, name: str = "run-b"):
    """Pre-flight's run-root check alone (tasks/core/preflight/storage.py): its report."""
    from tasks.core.config.load import parse_fields
    from tasks.core.preflight.checks import Machine
    from tasks.core.preflight.report import CheckContext, PreflightReport
    from tasks.core.preflight.storage import check_run_root

    raw = {**tiny_config_raw(tmp_path / "model", run_root), "name": name}
    ctx = CheckContext(
        parse_fields(raw), Machine(cuda_devices=0, cpu_count=2, free_bytes=10**13), None, None, PreflightReport()
    )
    check_run_root(ctx)
    return ctx.report


def test_a_run_root_linked_to_another_runs_root_is_refused_saying_where_it_leads(tmp_path):
    a = tmp_path / "runs" / "a"
    a.mkdir(parents=True)
    record = json.dumps({"run": "run-a", "run_root": str(a), "stages": []})
    (a / "run.json").write_text(record)
    (tmp_path / "b").symlink_to(a)
    report = _run_root_check(tmp_path, tmp_path / "b")
    ((field, msg),) = report.problems
    assert field == "run_root" and msg.startswith(
        f"{tmp_path / 'b'} is a symbolic link to {a} ({a}), and its run.json "
        f"is run 'run-a''s (run_root {a}): this run (run-b) would overwrite"
    )
    assert "point run_root at a directory of this run's own, or set name: run-a to continue that run" in msg
    (tmp_path / "linked").symlink_to(tmp_path / "runs")  # a link above the root is said too
    ((_, msg),) = _run_root_check(tmp_path, tmp_path / "linked" / "a").problems
    assert f"is under the symbolic link {tmp_path / 'linked'} -> {tmp_path / 'runs'} ({a})" in msg, msg
    assert (a / "run.json").read_text() == record and sorted(p.name for p in a.iterdir()) == ["run.json"]

    assert _run_root_check(tmp_path, tmp_path / "b", name="run-a").ok  # the same run, through the link: its own
    named = _run_root_check(tmp_path, a)  # named directly: the config says that directory, a warning
    assert named.ok and f"run root {a}: its run.json is run 'run-a''s" in " ".join(named.warnings), named.warnings
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    ((_, msg),) = _run_root_check(tmp_path, tmp_path / "dangling").problems
    assert f"is a symbolic link to {tmp_path / 'gone'}" in msg and "which does not exist" in msg, msg


def test_the_write_probe_goes_inside_a_run_root_that_does_not_exist_yet(tmp_path, monkeypatch):
    """The probe is written inside the run root (created for it), never in a parent; the check
    leaves nothing behind: not the probe, not the root, not the parents it made."""
    written: list[Path] = []
    real = Path.write_text

    def record(self, *args, **kwargs):
        written.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", record)
    root = tmp_path / "new" / "deeper" / "run"
    report = _run_root_check(tmp_path, root)
    assert report.ok and "probe object written, read back and deleted" in " ".join(report.checked)
    (probe,) = [p for p in written if p.name.startswith(".preflight-probe-")]
    assert probe.parent == root, probe
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
