"""Preempted is not failed: the stages that do not train stop at a safe point on a notice
(tasks/flowkit/notices.py), the preemption records and the flow's retry policy
(tasks/core/run/preemptions.py), and what shows them (the end-of-run table, the stage table's note, the card).

    .venv/bin/python -m pytest -q tests/test_preemption_flow.py

The flow-level run (a 2-rank CPT stage preempted, retried by the flow, bitwise at the end) is
tests/test_elastic_flow.py's, on a copy of the session's demo run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from support.servers.metadata import MetadataServer
from tasks.core.config.elastic import ElasticConfig
from tasks.core.errors import Preempted
from tasks.core.run import preemptions
from tasks.flowkit.notices import POLL_SIGNAL, critical, polled_sources, signal_sources, stop_on_notice


def _cfg(*notices: dict, sigterm: bool = True) -> SimpleNamespace:
    """`notices` in cpt; `sigterm` (on by default, as in a config) in both phases."""
    el, other = ElasticConfig(notices=list(notices), sigterm=sigterm), ElasticConfig(sigterm=sigterm)
    phases = {"cpt": SimpleNamespace(elastic=el), "sft": SimpleNamespace(elastic=other)}  # what the run trains
    return SimpleNamespace(phase=phases.__getitem__, phases=phases)


def test_signal_sources_are_the_signal_rows_any_phase_lists():
    cfg = _cfg({"source": "sigterm", "grace_s": 20}, {"source": "slurm"}, {"source": "gcp"})
    assert signal_sources(cfg) == {"SIGTERM": ("sigterm", 20.0), "SIGUSR1": ("slurm", 60.0)}
    # SIGTERM is a notice by default (at the source's 30 s); `sigterm: false` and no notices: none
    assert signal_sources(_cfg()) == {"SIGTERM": ("sigterm", 30.0)}
    assert signal_sources(_cfg(sigterm=False)) == {}


def test_a_notice_stops_the_stage_with_preempted_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as caught, stop_on_notice("prepare_cpt", _cfg({"source": "sigterm", "grace_s": 20})):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000_000):  # the handler raises at the next bytecode
            pass
    rec = caught.value.record
    assert (rec["stage"], rec["source"], rec["grace_s"], rec["steps_lost"]) == ("prepare_cpt", "sigterm", 20.0, 0)
    assert 0 <= rec["notice_to_commit_s"] < 20
    assert signal.getsignal(signal.SIGTERM) is before
    with stop_on_notice("export", _cfg(sigterm=False)) as listening:  # no notice listed: nothing installed
        assert listening is False and signal.getsignal(signal.SIGTERM) is before


def test_a_notice_inside_a_critical_stretch_is_raised_when_it_ends():
    done = []
    with pytest.raises(Preempted), stop_on_notice("export", _cfg({"source": "slurm", "grace_s": 5})):
        with critical():
            os.kill(os.getpid(), signal.SIGUSR1)
            done.append("swapped")
        done.append("after")  # never reached: raised as the stretch ends
    assert done == ["swapped"]


def test_a_notice_during_the_artifact_swap_leaves_the_new_artifact_whole(tmp_path, monkeypatch):
    """fresh_dir: a notice while the artifact is built removes the build and keeps the old artifact;
    one during the swap lets the swap finish, then stops the stage: never a torn artifact."""
    from tasks.flowkit import stage as stage_mod

    monkeypatch.setattr(stage_mod, "set_aside", lambda path: None)  # no Prefect logger outside a run
    art = tmp_path / "export"
    art.mkdir()
    (art / "old.txt").write_text("old")
    cfg = _cfg({"source": "sigterm", "grace_s": 20})
    with pytest.raises(Preempted), stop_on_notice("export", cfg), stage_mod.fresh_dir(art) as tmp:
        (tmp / "half.txt").write_text("half")
        os.kill(os.getpid(), signal.SIGTERM)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"] and (art / "old.txt").read_text() == "old"

    real_rename = Path.rename

    def rename_then_notice(self, target):  # the notice lands in the middle of the swap
        os.kill(os.getpid(), signal.SIGTERM)
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename_then_notice)
    with pytest.raises(Preempted), stop_on_notice("export", cfg), stage_mod.fresh_dir(art) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert [p.name for p in art.iterdir()] == ["new.txt"]


def _pollers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("notice-") and t.is_alive()]


def _gone(deadline_s: float = 30.0) -> bool:
    """Whether the stage's poller thread ended (it is not joined: a poll in flight finishes first)."""
    end = time.monotonic() + deadline_s
    while _pollers() and time.monotonic() < end:
        time.sleep(0.02)
    return not _pollers()


def test_polled_sources_are_the_polled_rows_once_per_endpoint():
    el = ElasticConfig(notices=[{"source": "gcp", "grace_s": 20}, {"source": "sigterm"}, {"source": "aws"}])
    phases = {
        "cpt": SimpleNamespace(elastic=el),
        "sft": SimpleNamespace(elastic=ElasticConfig(notices=[{"source": "gcp", "grace_s": 9}])),
    }
    cfg = SimpleNamespace(phase=phases.__getitem__, phases=phases)
    got = sorted((n.source, n.where, n.grace) for n in polled_sources(cfg))
    assert got == [("aws", "http://169.254.169.254", 120.0), ("gcp", "http://169.254.169.254", 9.0)]


@pytest.mark.parametrize("source", ["aws", "gcp", "azure"])
def test_a_polled_cloud_notice_stops_the_stage_even_in_a_blocking_wait(source):
    """The stage's poller asks the local metadata double as the ranks do; once the double says
    preempted, the notice is raised in the stage (here a 60 s sleep, cut short) as a signal's is,
    and the poller and its handler are gone after."""
    before = signal.getsignal(POLL_SIGNAL)
    with MetadataServer() as m:
        cfg = _cfg({"source": source, "endpoint": m.url, "poll_s": 0.05, "grace_s": 25})
        with pytest.raises(Preempted) as caught, stop_on_notice("evaluate_cpt", cfg) as listening:
            assert listening and _pollers() == [f"notice-{source}"]
            time.sleep(0.3)  # polled, nothing yet
            m.preempt()
            t0 = time.monotonic()
            time.sleep(60)
        waited = time.monotonic() - t0
        asked = {r["path"].split("?")[0] for r in m.requests}
    rec = caught.value.record
    assert (rec["stage"], rec["source"], rec["grace_s"], rec["steps_lost"]) == ("evaluate_cpt", source, 25.0, 0)
    assert waited < 30 and 0 <= rec["notice_to_commit_s"] < 25, (waited, rec)
    assert f"evaluate_cpt preempted ({source}: {source}" in caught.value.cause
    path = {"aws": "/latest/meta-data/spot/instance-action", "gcp": "/computeMetadata/v1/instance/preempted"}
    assert path.get(source, "/metadata/scheduledevents") in asked, asked
    assert signal.getsignal(POLL_SIGNAL) is before and _gone()


def test_a_notice_file_inside_a_critical_stretch_is_raised_when_it_ends(tmp_path):
    notice = tmp_path / "preempt-notice"
    done = []
    cfg = _cfg({"source": "file", "endpoint": str(notice), "poll_s": 0.05})
    with pytest.raises(Preempted) as caught, stop_on_notice("export", cfg):
        with critical():
            notice.write_text("node drains at 18:00\n")
            assert _gone()  # the poller read the file, signalled and ended: the notice waits for the swap
            time.sleep(0.1)
            done.append("swapped")
        done.append("after")  # never reached: raised as the stretch ends
    assert done == ["swapped"]
    assert (
        caught.value.record["source"] == "file" and f"notice file {notice}: node drains at 18:00" in caught.value.cause
    )
    assert _gone()


def test_an_unreadable_endpoint_is_said_once_a_process_not_once_a_stage(caplog):
    import socket

    with socket.socket() as sock:  # a port nothing listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    cfg = _cfg({"source": "gcp", "endpoint": url, "poll_s": 0.05})
    for stage in ("export", "evaluate_sft"):
        with stop_on_notice(stage, cfg):
            time.sleep(0.3)
        assert _gone()
    said = [r.getMessage() for r in caplog.records if "not readable" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"notice source gcp ({url}) not readable, polling on: "), said


def test_a_training_stage_leaves_the_polled_rows_to_its_ranks():
    with MetadataServer() as m:
        m.preempt()
        cfg = _cfg({"source": "gcp", "endpoint": m.url, "poll_s": 0.05}, sigterm=False)
        with stop_on_notice("train_cpt", cfg) as listening:
            time.sleep(0.3)
        assert listening is False and m.requests == [] and not _pollers()


def test_records_restart_and_policy():
    eng = {"source": "sigterm", "grace_s": 20.0, "noticed_step": 5, "checkpoint_step": 5, "steps_lost": 0}
    rec = preemptions.record(eng | {"notice_to_commit_s": 0.5, "grace_left_s": 19.5, "checkpoint": "x"}, "cpt", 1e9)
    assert rec["at"] == preemptions.utc(1e9 - 0.5) and rec["restart_to_first_step_s"] is None
    late = preemptions.record(eng | {"notice_to_commit_s": None, "grace_left_s": 2.0, "steps_lost": 1}, "cpt", 1e9)
    assert late["at"] == preemptions.utc(1e9 - 18.0)  # nothing saved: the grace spent dates the notice
    log = preemptions.restarted([rec, late], 12.25)
    assert [r["restart_to_first_step_s"] for r in log] == [None, 12.25]
    assert [r["restart_to_first_step_s"] for r in preemptions.restarted(log, 3.0)] == [3.0, 12.25]
    assert preemptions.parse(preemptions.dump(log)) == log and preemptions.parse("{torn") == []
    assert (
        preemptions.short(log)
        == "preempted 2x, steps lost 1, notice to commit <= 0.5 s, restart to first step <= 12.2 s"
    )
    assert "checkpoint step 5, steps lost 0, notice to commit 0.5 s of 20.0 s grace" in preemptions.describe(rec)
    assert "no save fitted the 20.0 s grace" in preemptions.describe(late)
    policy = preemptions.Policy(max_preemptions=2, wait_s=0)
    assert [policy.retry(n) for n in (1, 2, 3)] == [True, True, False]


def test_a_record_carries_its_recovery_part_by_part_from_the_notice_to_the_next_first_step():
    """The engine's notice and commit, the stage's exit, then the next attempt's marks (the flow's rerun and
    launch, the ranks' start-up): each part of RECOVERY in seconds and as a share of notice -> first step.
    A mark older than the record's exit is an earlier attempt's and stays out."""
    t = 1e9
    eng = {"source": "sigterm", "grace_s": 20.0, "noticed_step": 5, "checkpoint_step": 5, "steps_lost": 0}
    eng |= {"notice_to_commit_s": 0.5, "grace_left_s": 19.5, "timeline": {"notice": t, "commit": t + 0.5}}
    rec = preemptions.record(eng, "cpt", t + 0.5)
    rec["timeline"]["exit"] = t + 1.5
    rec["recovery"] = preemptions.recovery(rec["timeline"])
    assert rec["recovery"] == {"notice_to_commit_s": 0.5, "exit_s": 1.0}  # no first step yet: no total, no shares
    marks = {"rerun": t + 2.0, "launch": t + 3.0, "rank_start": t + 3.5, "ready": t + 9.0, "found": t + 9.5}
    marks |= {"restore_begin": t + 10.0, "restore_end": t + 11.0, "first_step": t + 11.5, "stale": t, "pid": 7}
    (got,) = preemptions.restarted([rec], 8.5, marks | {"rerun": t - 60.0})
    assert "rerun" not in got["timeline"] and "stale" not in got["timeline"] and "pid" not in got["timeline"]
    (got,) = preemptions.restarted([rec], 8.5, marks)
    r = got["recovery"]
    parts = {p: r[f"{p}_s"] for p, _, _ in preemptions.RECOVERY}
    assert parts == {
        "notice_to_commit": 0.5,
        "exit": 1.0,
        "retry": 0.5,
        "stage_skip": 1.0,
        "launch": 6.0,
        "find": 0.5,
        "build": 0.5,
        "restore": 1.0,
        "first_step": 0.5,
    }
    assert r["total_s"] == 11.5 == sum(parts.values()) and r["rank_imports_s"] == 5.5
    assert r["launch_share"] == round(6.0 / 11.5, 4) and abs(sum(r[f"{p}_share"] for p in parts) - 1) < 1e-3
    assert preemptions.parse(preemptions.dump([got])) == [got]  # run.json and preemptions.json keep it as is
    assert preemptions.describe(got).endswith(
        "recovery 11.5 s = notice to commit 0.5 s (4%) + exit 1.0 s (9%) + retry 0.5 s (4%) + stage skip 1.0 s (9%)"
        " + launch 6.0 s (52%) + find 0.5 s (4%) + build 0.5 s (4%) + restore 1.0 s (9%) + first step 0.5 s (4%)"
    )


def test_the_end_of_run_table_and_the_card_show_each_preemption():
    from tasks.core.run.trainlog import summary_table

    rec = preemptions.restarted(
        [
            preemptions.record(
                {"source": "aws", "grace_s": 120.0, "noticed_step": 7, "checkpoint_step": 7}
                | {"steps_lost": 0, "notice_to_commit_s": 1.5, "grace_left_s": 118.5},
                "cpt",
                1e9,
            )
        ],
        30.0,
    )
    stages = [{"stage": "train_cpt", "status": "completed", "seconds": 3.0, "detail": {"preemptions": rec}}]
    table = summary_table(stages, "/runs/x")
    assert preemptions.describe(rec[0]) in table.splitlines()
    from tasks.core.hub.card import preemption_cell

    line = preemption_cell({"cpt": {"preemptions": rec}}, "cpt")
    assert "step 7 checkpointed, 0 lost, 1.5 s notice to commit (grace 120.0 s), 30.0 s restart to first step" in line
    assert preemption_cell({"cpt": {}}, "cpt") == "none"


@pytest.mark.integration
def test_the_flow_run_shows_awaiting_retry_while_it_waits_for_capacity(
    prefect_harness, tiny_model_dir, tmp_path, monkeypatch
):
    """A polled notice (the metadata double's gcp answer) preempts prepare_cpt in a fresh run; the
    flow run's state history, read from the Prefect API, shows the wait: AwaitingRetry at the retry's
    time with a message naming the preemption (seen while the run waits, when the double is switched
    back), then Running again, Completed at the end; no attempt counted, no worker could take it."""
    import datetime as dt
    import json
    import uuid

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    import flows.cpt_to_sft as flow_mod
    import tasks.core.data.prepare as prep
    from support.tiny import tiny_config_raw, write_config

    wait_s = 3.0
    name = f"spot{uuid.uuid4().hex[:8]}"
    seen: list = []
    stop = threading.Event()
    with MetadataServer() as m:
        raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
        raw["name"] = name
        raw["cpt"]["elastic"] = {
            "notices": [{"source": "gcp", "endpoint": m.url, "poll_s": 0.05}],
            "retry_wait_s": wait_s,
            "max_preemptions": 2,
        }
        config = write_config(tmp_path / "spot.yaml", raw)

        real, sent = prep.copy_shard, []

        def copy_then_notice(src, dest):  # the double says preempted while prepare_cpt copies a shard
            real(src, dest)
            if not sent:
                sent.append(time.monotonic())
                m.preempt()
                time.sleep(120)  # the stage's poller cuts this short

        monkeypatch.setattr(prep, "copy_shard", copy_then_notice)

        def capacity_comes_back() -> None:  # what the operator sees meanwhile, then the notice withdrawn
            with get_client(sync_client=True) as client:
                while not stop.is_set() and not seen:
                    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"like_": name}))
                    seen.extend(
                        (r.state, r.empirical_policy.retry_type) for r in runs if r.state.name == "AwaitingRetry"
                    )
                    stop.wait(0.1)
            m.preempted = False

        watcher = threading.Thread(target=capacity_comes_back, daemon=True)
        watcher.start()
        try:
            state = flow_mod.cpt_to_sft(config=str(config), stop_after="prepare_cpt", return_state=True)
        finally:
            stop.set()
            watcher.join(timeout=30)
    assert state.is_completed(), (state.name, state.message)
    (waiting, retry_type), *_ = seen
    assert retry_type == "in_process"  # what keeps a work pool's worker from starting the run a second time
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        history = sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)
        run = client.read_flow_run(run_id)
    names = [s.name for s in history]
    i = names.index("AwaitingRetry")
    assert names.count("AwaitingRetry") == 1 and names[i - 1 : i + 2] == ["Running", "AwaitingRetry", "Running"]
    assert names[-1] == "Completed", names
    awaiting, resumed = history[i], history[i + 1]
    assert awaiting.id == waiting.id and awaiting.type.value == "SCHEDULED"
    sched = awaiting.state_details.scheduled_time
    assert abs((sched - awaiting.timestamp).total_seconds() - wait_s) < 1.0, (sched, awaiting.timestamp)
    assert resumed.timestamp >= sched - dt.timedelta(seconds=0.5)
    assert "preempted (1 of at most 2 retries, no failure retry used): retrying the run in 3 s" in awaiting.message
    assert "prepare_data preempted (gcp: gcp instance preempted)" in awaiting.message, awaiting.message
    assert run.run_count == 1 and run.empirical_policy.retry_type is None  # the wait counted no attempt
    summary = json.loads((tmp_path / "run" / "run.json").read_text())
    (rec,) = summary["preemptions"]
    assert (rec["stage"], rec["source"], rec["steps_lost"]) == ("prepare_cpt", "gcp", 0), rec
    assert rec["at"] >= preemptions.utc(sent[0] - time.monotonic() + time.time() - 1)
    status = {s["stage"]: s["status"] for s in summary["stages"]}
    assert (status["load_from_hf"], status["prepare_cpt"]) == ("skipped", "completed"), status  # nothing redone


def test_a_preempted_hub_stage_takes_no_task_retry():
    """load_from_hf and push_to_hub retry what may heal (tasks/flowkit/retry.py); a preemption is the
    flow's to retry, by its own policy: a task retry would wait 15 s and count a failure."""
    from prefect.states import Failed

    from tasks.flowkit.retry import transient

    exc = Preempted("load_from_hf preempted (gcp)", cause="load_from_hf preempted (gcp)", record={})
    assert transient(None, None, Failed(name="Preempted", data=exc)) is False
    assert transient(None, None, Failed(data=ConnectionResetError("reset by peer"))) is True


@pytest.mark.integration
def test_a_run_cancelled_while_it_waits_for_capacity_is_not_taken_back(prefect_harness):
    """The server lets Running follow Cancelled: the wait reads the state each second and gives the run
    up (the runbook then ends it Cancelled) instead of retrying a run the operator cancelled."""
    from prefect import flow, get_client
    from prefect.runtime import flow_run
    from prefect.states import Cancelled

    from tasks.flowkit.notices import await_capacity

    said: list = []

    @flow(name="await-capacity-test")
    def waits() -> Any:
        run_id = flow_run.id

        def operator() -> None:
            time.sleep(1)
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(run_id, Cancelled(message="cancelled from the UI"))

        threading.Thread(target=operator, daemon=True).start()
        t0 = time.monotonic()
        said.append((await_capacity(120, "preempted (1 of at most 3 retries)"), time.monotonic() - t0))
        return Cancelled(message="the flow run was cancelled while it waited for capacity")

    state = waits(return_state=True)
    (kept, waited), *_ = said
    assert kept is False and waited < 60, said  # given up within a second or so of the cancel, not after 120 s
    with get_client(sync_client=True) as client:
        names = [
            s.name
            for s in sorted(client.read_flow_run_states(state.state_details.flow_run_id), key=lambda s: s.timestamp)
        ]
    assert names[-3:] == ["AwaitingRetry", "Cancelled", "Cancelled"] and "Running" not in names[-2:], names


def test_the_retry_reads_the_config_again_and_refuses_another_run_root(tmp_path):
    """After a preemption's wait the runbook reads the config again (the capacity that came back is said
    there): unchanged, the run's own config comes back and nothing is checked again; a run root that
    changed is refused, naming the field, before anything launches (tests/test_elastic_flow.py runs the
    retry on one rank that a changed config asks for)."""
    import logging

    from flows.cpt_to_sft import reread_config, resolve_config
    from tasks.core.errors import ConfigError
    from tests.conftest import tiny_config_raw, write_config

    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    path = str(write_config(tmp_path / "run.yaml", raw))
    cfg = resolve_config(path, None, rules=False)
    log = logging.getLogger("test-reread")
    assert reread_config(path, None, cfg, log) is cfg
    raw["run_root"] = str(tmp_path / "elsewhere")
    write_config(tmp_path / "run.yaml", raw)
    with pytest.raises(ConfigError) as caught:
        reread_config(path, None, cfg, log)
    ((field, why),) = caught.value.problems
    assert field == "run_root" and why.startswith(f"changed from {tmp_path / 'run'} to {tmp_path / 'elsewhere'}"), why


@pytest.mark.integration
def test_sigterm_is_a_notice_by_default_and_a_cancel_when_the_flow_run_reads_cancelling(prefect_harness):
    """A stage of a real flow run with no notice configured: a SIGTERM while the run is Running is a
    preemption notice (Preempted, the stage's safe point); once the flow run reads Cancelling (what
    `prefect flow-run cancel` and the UI set before anything signals the process) the same SIGTERM is
    a cancel (`CancelRequested`), and the run ends Cancelled. Read from the API, not guessed."""
    from prefect import flow, get_client
    from prefect.runtime import flow_run
    from prefect.states import Cancelled, Cancelling

    from tasks.flowkit.notices import CancelRequested

    seen: list[str] = []

    def sigterm(stage: str, swap: bool = False) -> None:
        with stop_on_notice(stage, _cfg()) as listening:  # `sigterm` on by default: nothing listed
            assert listening
            if swap:  # a cancel during an artifact's swap, as a notice, is raised once the swap ended
                with critical():
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.2)
                    seen.append("swapped")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # cut short by the handler's exception

    @flow(name="sigterm-default-test")
    def run() -> Any:
        try:
            sigterm("prepare_cpt")
        except Preempted as exc:
            seen.append(f"preempted: {exc.record['source']} {exc.record['grace_s']:g}")
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Cancelling(message="cancelled from the UI"), force=True)
        try:
            sigterm("export", swap=True)
        except CancelRequested as exc:  # the runbook catches it as it does Ctrl-C
            seen.append(str(exc))
            return Cancelled(message=str(exc))
        return None

    before = signal.getsignal(signal.SIGTERM)
    state = run(return_state=True)
    assert seen == ["preempted: sigterm 30", "swapped", "cancelled from Prefect (the flow run is Cancelling)"], seen
    assert state.is_cancelled(), state
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_notice_inside_an_import_is_raised_once_the_import_is_over(tmp_path, monkeypatch):
    """Raised inside an import, a notice would leave the package half-built for every later import
    in the process (the flow's retry of the stage too): it waits for the import to end."""
    pkg = tmp_path / "halfbuilt"
    pkg.mkdir()
    (pkg / "part.py").write_text("VALUE = 1\n")
    (pkg / "__init__.py").write_text(
        "import os, signal, time\n"
        "from halfbuilt import part\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "deadline = time.monotonic() + 0.3\n"
        "while time.monotonic() < deadline:  # the handler runs here, inside the import\n"
        "    pass\n"
        "COMPLETE = part.VALUE\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    done = []
    with pytest.raises(Preempted), stop_on_notice("export", _cfg({"source": "slurm", "grace_s": 5})):
        import halfbuilt

        done.append("imported")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pass
    assert done == ["imported"]
    import halfbuilt

    assert halfbuilt.COMPLETE == 1
