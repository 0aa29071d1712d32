"""The session Prefect harness as tests/conftest.py starts it: on an already migrated database, without
the event services no test on it reads (support/servers/prefect_quiet.py `HARNESS_ONLY`), and with what
the harness tests do read still recorded.

    .venv/bin/python -m pytest -q -m "" tests/test_prefect_harness.py
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.integration


def test_the_harness_server_runs_without_the_event_services_and_still_records_task_runs_and_logs(prefect_harness):
    from prefect import flow, get_client, get_run_logger, task
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterTaskRunId

    @task
    def say() -> int:
        get_run_logger().info("said by the task")
        return 1

    @flow
    def one_task() -> int:
        return say()

    state = one_task(return_state=True)
    assert state.is_completed(), state
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        # the server's own settings (GET /admin/settings), as HARNESS_ONLY in its environment set them
        services = client.request("GET", "/admin/settings").json()["server"]["services"]
        assert services["event_persister"]["enabled"] is False, services["event_persister"]
        assert services["triggers"]["enabled"] is False, services["triggers"]
        assert services["task_run_recorder"]["enabled"] is True, services["task_run_recorder"]
        # the task-run recorder and the log endpoint, which the console and log tests read
        deadline = time.monotonic() + 60
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
            if (runs and runs[0].state and runs[0].state.is_completed()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert [r.state.type.value for r in runs] == ["COMPLETED"], runs
        logs = []
        while not logs and time.monotonic() < deadline:
            logs = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[runs[0].id])))
            time.sleep(0.5)
        assert "said by the task" in [log.message for log in logs], logs
