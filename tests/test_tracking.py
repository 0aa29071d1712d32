"""MLflow tracking: the secret filter, the pre-flight refusal of an unreachable server, and a real
`mlflow server` (SQLite + local artifacts, 127.0.0.1) that dies in the middle of a stage.

    python -m pytest -q tests/test_tracking.py                   # unit tier
    python -m pytest -q -m integration tests/test_tracking.py    # + the server that dies

The whole flow against a live server (parent run, 2 stage runs, loss histories, params, tags) is
tests/test_tracking_flow.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from support.servers.prefect_ops import free_port
from tasks.core.config.load import load_config
from tasks.core.config.tracking import check_uri, flatten, redact
from tasks.flowkit.tracking import RunTracker
from tests.conftest import tiny_config_raw, write_config

STEPS = 4


def test_flatten_leaves_out_secrets_and_credentials_in_uris():
    flat = flatten(
        {
            "hub": {"repo_id": "o/n", "token": "hf_x"},
            "run_root": "s3://AKIA:sekrit@bucket/runs",
            "x": {"api_key": "k", "n": None},
        }
    )
    assert flat == {"hub.repo_id": "o/n", "run_root": "s3://***@bucket/runs", "x.n": "null"}
    assert redact("http://u:p@h:1/x") == "http://***@h:1/x"


def _cfg(tmp_path: Path, model_dir: Path, uri: str | None, name: str = "track"):
    raw = tiny_config_raw(model_dir, tmp_path / "run")
    raw["name"] = name
    if uri:
        raw["tracking"] = {"mlflow": {"uri": uri, "experiment": "tests"}}
    return load_config(write_config(tmp_path / "cfg.yaml", raw))


def test_check_refuses_an_unreachable_tracking_server_naming_field_and_uri(tmp_path, tiny_model_dir):
    from tasks.flowkit.preflight import check

    uri = f"http://127.0.0.1:{free_port()}"
    report = check(_cfg(tmp_path, tiny_model_dir, uri))
    (msg,) = [m for field, m in report.problems if field == "tracking.mlflow.uri"]
    assert uri in msg and "unreachable" in msg
    assert not report.ok
    assert "expected an http" in check_uri("ftp://h/x")


def _record(step: int) -> dict:
    return {
        "phase": "cpt",
        "step": step,
        "total": STEPS,
        "loss": 5.0 - step / 10,
        "lr": 1e-3,
        "tokens": 64 * step,
        "tokens_per_s": 100.0,
        "step_s": 0.5,
        "peak_mem_bytes": 2**30,
        "grad_norm": 1.5,
    }


@pytest.mark.integration
def test_server_dying_mid_stage_leaves_a_logged_gap_and_a_warning(tmp_path, tiny_model_dir):
    from mlflow import MlflowClient

    from support.servers.mlflow import MlflowServer

    server = MlflowServer(tmp_path / "mlflow").start()
    try:
        cfg = _cfg(tmp_path, tiny_model_dir, server.uri)
        warnings: list[str] = []
        tracker = RunTracker.start(cfg, warn=warnings.append)
        st = tracker.stage("cpt", retry_s=0.0)
        st(_record(1))
        deadline = time.monotonic() + 60
        while st.recorded < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [m.step for m in MlflowClient(server.uri).get_metric_history(st.run_id, "loss")] == [1]
        server.stop()
        for step in range(2, STEPS + 1):
            st(_record(step))
        gaps = st.close()
    finally:
        server.stop()
    assert gaps == [[2, STEPS]]
    assert any("stopped answering at cpt step 2" in w and server.uri in w for w in warnings)
    assert any(f"steps 2..{STEPS} not recorded" in w for w in warnings)


def test_the_tracker_handle_is_plain_data():
    from tasks.flowkit.tracking import TrackerHandle

    handle = TrackerHandle(uri="http://127.0.0.1:5000", experiment_id="1", run_id="abc")
    assert TrackerHandle.model_validate_json(handle.model_dump_json()) == handle and hash(handle) == hash(
        handle.model_copy()
    )
    with pytest.raises(Exception, match="frozen"):
        handle.run_id = "other"


def _stage_in_another_process(handle, steps: int) -> list[list[int]]:
    """A training task's side, run where a task runner might put it: only the handle crosses."""
    from tasks.flowkit.tracking import stage_tracker

    st = stage_tracker(handle, "cpt", warn=print)
    for step in range(1, steps + 1):
        st(_record(step))
    return st.close()


@pytest.mark.integration
def test_a_stage_in_another_process_reports_to_the_flow_runs_mlflow_run(tmp_path, tiny_model_dir, mlflow_server):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from mlflow import MlflowClient

    cfg = _cfg(tmp_path, tiny_model_dir, mlflow_server.uri, name="handle")
    tracker = RunTracker.start(cfg)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(_stage_in_another_process, tracker.handle, STEPS).result(timeout=300) == []
    client = MlflowClient(mlflow_server.uri)
    (child,) = client.search_runs([tracker.experiment_id], f"tags.`mlflow.parentRunId` = '{tracker.run_id}'")
    assert child.info.run_name == "cpt" and child.info.status == "FINISHED"
    assert [m.step for m in sorted(client.get_metric_history(child.info.run_id, "loss"), key=lambda m: m.step)] == list(
        range(1, STEPS + 1)
    )
    tracker.finish()
