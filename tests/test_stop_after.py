"""`stop_after`: the flow runs the stages up to and including the named one, records the rest as
not-run in run.json and ends Completed; an unknown name is refused before anything runs. A stage
added as one row plus its task runs in the flow (and stop_after takes its name).

    .venv/bin/python -m pytest -q -m "" tests/test_stop_after.py     # ~1 min (one Prefect test server)
"""

from __future__ import annotations

import json

import pytest

import flows.cpt_to_sft  # noqa: F401 - Prefect sets up its console logging on import: not under a test's capsys
from tasks.core.run.stages import STAGE_NAMES, run_stages
from tests._dummy_stage import DUMMY, add_dummy_stage
from tests.conftest import tiny_config_raw, write_config


@pytest.mark.parametrize("which", ["flow", "cli"])
def test_an_unknown_stage_is_refused_by_the_command_line_naming_the_stages(which, capsys):
    from flows.cli import flow_main
    from flows.cli import main as cli_main

    argv = ["--config", "nowhere.yaml", "--stop-after", "exprt"]
    with pytest.raises(SystemExit) as exc:
        flow_main(argv) if which == "flow" else cli_main(["run", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--stop-after: invalid choice: 'exprt'" in err and all(name in err for name in STAGE_NAMES), err


def test_check_stop_after_names_the_field_and_the_stages():
    from flows.cpt_to_sft import check_stop_after
    from tasks.core.errors import ConfigError

    for ok in (None, "", *STAGE_NAMES):
        check_stop_after(ok)
    with pytest.raises(ConfigError) as err:
        check_stop_after("exprt")
    ((field, message),) = err.value.problems
    assert field == "stop_after" and "'exprt' is no stage" in message and ", ".join(STAGE_NAMES) in message


@pytest.mark.integration
def test_the_flow_stops_after_the_stage_and_records_the_rest_as_not_run(
    prefect_harness, tiny_model_dir, tmp_path, monkeypatch
):
    from flows.cli import flow_main as main
    from flows.cpt_to_sft import cpt_to_sft

    # An unknown name: refused before anything runs (not even the run root is made).
    refused_root = tmp_path / "refused"
    cfg = write_config(tmp_path / "refused.yaml", tiny_config_raw(tiny_model_dir, refused_root))
    state = cpt_to_sft(config=str(cfg), stop_after="exprt", return_state=True)
    assert state.is_failed() and state.name == "Refused"
    assert "stop_after: 'exprt' is no stage; use one of: " + ", ".join(STAGE_NAMES) in state.message, state.message
    assert not refused_root.exists()

    # Through the CLI: the stages up to prepare_sft run, the CLI exits 0.
    run_root = tmp_path / "run"
    cfg = write_config(tmp_path / "tiny.yaml", tiny_config_raw(tiny_model_dir, run_root))
    assert main(["--config", str(cfg), "--stop-after", "prepare_sft"]) == 0
    summary = json.loads((run_root / "run.json").read_text())
    names = [s.name for s in run_stages(("cpt", "sft"))]  # no dpo section: its rows are not in the run
    ran = names[: names.index("prepare_sft") + 1]
    assert {s["stage"]: s["status"] for s in summary["stages"]} == {
        name: "completed" if name in ran else "not-run" for name in names
    }
    assert summary["stopped_after"] == "prepare_sft" and summary["complete"] is False
    assert summary["gate"] == {"status": "not-run"} and summary["export"] is None
    assert (run_root / "data" / "sft").is_dir() and not (run_root / "cpt").exists()

    # The flow itself, with a stage added as docs/extending.md says (its row after load_from_hf, reading
    # it, plus its task): Completed, load_from_hf skipped now, the new stage run on its result, stopped there.
    add_dummy_stage(monkeypatch)
    state = cpt_to_sft(config=str(cfg), stop_after=DUMMY, return_state=True)
    assert state.is_completed() and state.name == "Completed", state
    summary = state.result()
    rows = {s["stage"]: s for s in summary["stages"]}
    assert list(rows)[:2] == ["load_from_hf", DUMMY] and rows[DUMMY]["detail"] == {
        "read": "load_from_hf",
        "run": "tiny-demo",
    }
    statuses = {name: row["status"] for name, row in rows.items()}
    assert statuses.pop("load_from_hf") == "skipped" and statuses.pop(DUMMY) == "completed", statuses
    assert set(statuses.values()) == {"not-run"} and summary["stopped_after"] == DUMMY
