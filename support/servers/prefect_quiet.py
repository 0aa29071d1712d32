"""Prefect server loop services the tests never wait for, run every 5 minutes instead of every 5-15 s.

    python -m support.servers.prefect_quiet      # prints the settings, as the test processes get them

An idle Prefect 3.9 server (SQLite) spends about 5 CPU-s a minute here, most of it in loop
services polling the database: late runs and pause expirations every 5 s, the cleanup reconciler
every 5 s, the repossessor and the foreman every 15 s. The suite keeps several servers alive at once
(the session harness per worker, `prefect server start` in the operations tests, the embedded
server of every flow run started from the CLI) on a 2-core machine that is otherwise busy with
torchrun ranks. Measured on one idle server, CPU over 60 s: 5.1 s with the defaults, 1.75 s with
these five at 300 s.

No test depends on them: no run is scheduled to start late, no flow pauses, no concurrency lease
outlives its holder, and no test reads a worker's or pool's health, which is what those five act on.
The services a test does wait for keep Prefect's defaults: the scheduler (an inactive schedule
creates no runs), cancellation cleanup, the event persister and the task-run recorder.
Set only for the tests' servers; a user's server is untouched.

The session harness (tests/conftest.py `prefect_harness`, one per pytest-xdist worker, serving every
flow that worker runs in-process and the benchmark smokes' flows pointed at it) is an ephemeral
server: of the services above it runs none, but it runs the event services, and `HARNESS_ONLY` turns
off two of them there alone. Every event a flow sends (each task run's state changes, each stage
event) was written to the events table by the event persister and matched against automations by
the triggers service (its setting also turns off the actions service). No test on the harness reads
events back from the database or defines an automation (tests/test_prefect_ops.py does both, on a
server of its own that keeps them). What the harness tests do read keeps running: the task-run
recorder (task runs, read by the console and log tests), the log distributor, and the live event
stream (the distributor), which the flow engine's cancellation observer subscribes to. Measured on a
harness (the conftest's `prepare_cpt` flow, two tasks, three times): the server's CPU per flow
0.71-0.75 s with both on, 0.34-0.43 s with both off.
"""

from __future__ import annotations

import os

QUIET_SERVICES: dict[str, str] = {
    f"PREFECT_SERVER_SERVICES_{name}_LOOP_SECONDS": "300"
    for name in ("LATE_RUNS", "PAUSE_EXPIRATIONS", "CLEANUP_RECONCILER", "REPOSSESSOR", "FOREMAN")
}

HARNESS_ONLY: dict[str, str] = {
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
}


def apply(env: dict[str, str] | os._Environ) -> None:
    """Add the settings to `env` where it does not set them already."""
    for key, value in QUIET_SERVICES.items():
        env.setdefault(key, value)


if __name__ == "__main__":
    for key, value in QUIET_SERVICES.items():
        print(f"{key}={value}")
    print("# the session harness only:")
    for key, value in HARNESS_ONLY.items():
        print(f"{key}={value}")
