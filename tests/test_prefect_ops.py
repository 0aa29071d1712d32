"""Operating with Prefect, exactly as the README's operator guide does it (e2e tier).

A real `prefect server start` on 127.0.0.1 (free port, temporary PREFECT_HOME, analytics off) whose
database is a real PostgreSQL cluster of the test's own (support/servers/postgres.py), as a shared
server runs (SQLite locks under concurrent writers), the
`gpu` process pool limited to one run, `prefect deploy --all --prefect-file
deployments/prefect.yaml`, a process worker, the Hub token in the Prefect Secret block `hf-token`
and a Hub-protocol server for the push. Then the operator's day, on the tiny config (4 steps per
stage, a checkpoint every 2):

1. `prefect deployment run cpt-to-sft/default --watch` with a fault injected at CPT step 3 (job
   variable env CPT_TO_SFT_FAULT): the run fails; the failing rank's last lines are in the error,
   its first error line (the cause) is the run's state message, the event's `cause` and the stage
   table's; a `cpt-to-sft.stage.failed` event names the stage directory, the stage table says `failed`;
2. `prefect flow-run retry <id>`: the verified stages are skipped, CPT resumes from step 2, the
   run completes, and the API holds every artifact the UI shows (stage table, progress and loss
   curves for CPT and SFT, export verification, the Hub commit link) and the completion events;
3. two `prefect deployment run ... --watch` at once on the same run root: the pool runs them one
   after the other (every stage verifies and is skipped, so they are quick);
4. headless Chromium opens the finished run's page and sees its artifacts; screenshots are kept
   under build/test-artifacts/prefect-ui/;
5. PostgreSQL holds the run: its row completed after the retry, its state history with the failure.

Every process is started in its own process group and stopped by PID.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from support.servers.metadata import MetadataServer
from support.servers.postgres import Postgres
from support.servers.prefect_ops import PrefectServer, chromium, ensure_chromium, run_id_from, stop_group
from support.servers.webhook import WebhookReceiver
from tests.conftest import REPO, tiny_config_raw, write_config

TOKEN = "hf_prefect_ops_test_token"
REPO_ID = "ops-org/tiny-ops"
FAULT = "fail@step=3@phase=cpt"
STEPS, EVERY = 4, 2
SCREENSHOTS = REPO / "build" / "test-artifacts" / "prefect-ui"
# The run form's typed overrides: the config file says 8 steps and another name, so every check
# below of the name "ops-tiny" and of 4 steps shows that a deployment run used them.
OVERRIDES = json.dumps({"run_name": "ops-tiny", "cpt": {"max_steps": STEPS}, "sft": {"max_steps": STEPS}})
ARTIFACT_KEYS = {
    "cpt-to-sft-stages",
    "cpt-progress",
    "sft-progress",
    "cpt-loss-curve",
    "sft-loss-curve",
    "export-verification",
    "hub-commit",
}


@dataclass
class Ops:
    server: PrefectServer
    tmp: Path
    config: Path
    run_root: Path
    webhook: WebhookReceiver
    postgres: Postgres
    timings: dict[str, float] = field(default_factory=dict)

    def run(self, *extra: str, timeout: float = 420.0) -> tuple[subprocess.CompletedProcess, str]:
        out = self.server.cli(
            "deployment",
            "run",
            "cpt-to-sft/default",
            "--watch",
            "--watch-interval",
            "2",
            "-p",
            f"config={self.config}",
            "-p",
            f"overrides={OVERRIDES}",
            *extra,
            check=False,
            timeout=timeout,
        )
        return out, run_id_from(out.stdout)


def _t(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)  # Python >= 3.11 reads the trailing Z itself


def _latest(artifacts: list[dict]) -> dict[str, dict]:
    """The newest artifact per key (a retried run holds one per attempt)."""
    out: dict[str, dict] = {}
    for a in sorted(artifacts, key=lambda a: a["created"]):
        if a.get("key"):
            out[a["key"]] = a
    return out


# --- unit tier: the deployment file and the UI helpers, no server ------------------------------


def test_prefect_yaml_declares_both_deployments_on_the_gpu_pool():
    import yaml

    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    assert spec["pull"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $CPT_TO_SFT_HOME }}"}}
    ]
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {"default", "nightly"}
    for d in deployments.values():
        assert d["entrypoint"] == "flows/cpt_to_sft/__init__.py:cpt_to_sft" and d["work_pool"]["name"] == "gpu"
        assert (REPO / d["parameters"]["config"]).is_file()
    assert "schedules" not in deployments["default"]
    assert deployments["nightly"]["parameters"]["overrides"] == {"run_name": "nightly"}
    assert deployments["nightly"]["schedules"] == [{"cron": "0 2 * * *", "timezone": "UTC", "active": False}]


def test_progress_throttles_and_flushes_the_last_step(monkeypatch):
    from tasks.flowkit import ui

    sent = []
    monkeypatch.setattr(ui, "create_progress_artifact", lambda progress, key, description: "artifact-id")
    monkeypatch.setattr(
        ui, "update_progress_artifact", lambda aid, progress, description: sent.append((progress, description))
    )
    progress = ui.Progress("cpt", 4, min_interval=3600)
    progress({"step": 1, "loss": 2.5})  # the first update goes out, the next ones wait for the interval
    progress({"step": 2, "loss": 2.25})
    progress({"step": 3, "loss": 2.0})
    assert sent == [(25.0, "CPT: step 1 / 4, loss 2.5000")]
    progress.flush()  # the launch ended (here: failed) after step 3
    assert sent[-1] == (75.0, "CPT: step 3 / 4, loss 2.0000")
    progress({"step": 4, "loss": float("nan")})  # the last step always goes out
    assert sent[-1] == (100.0, "CPT: step 4 / 4")
    progress.flush()
    assert len(sent) == 3


def test_loss_curve_png_saved_beside_the_stage_and_inlined(monkeypatch, tmp_path):
    from tasks.flowkit import ui

    made = {}
    monkeypatch.setattr(ui, "create_markdown_artifact", lambda md, key, description: made.update(md=md, key=key))
    png = tmp_path / "run" / "cpt" / "loss-curve.png"
    data = ui.loss_curve("cpt", [3.0, 2.5, 2.0], str(png))
    assert png.read_bytes() == data and data[:8] == b"\x89PNG\r\n\x1a\n"
    assert made["key"] == "cpt-loss-curve" and "data:image/png;base64," in made["md"] and str(png) in made["md"]
    assert "first 3.0000 → last 2.0000" in made["md"]


def test_stage_table_rows(monkeypatch):
    from tasks.flowkit import ui

    made = {}
    monkeypatch.setattr(ui, "create_table_artifact", lambda rows, key, description: made.update(rows=rows, key=key))
    ui.stage_table(
        [
            {
                "stage": "train_cpt",
                "status": "completed",
                "uri": "s3://b/run/cpt/step-000010",
                "digest": "ab" * 32,
                "seconds": 3725.2,
                "cpu_seconds": 7400.0,
            },
            {"stage": "export", "status": "not-run", "uri": None, "digest": None, "seconds": 0.0},
        ]
    )
    assert made["key"] == "cpt-to-sft-stages"
    assert made["rows"][0] == {
        "stage": "train_cpt",
        "status": "completed",
        "artifact": "s3://b/run/cpt/step-000010",
        "manifest digest": "ab" * 8,
        "duration": "1h 02m 05s",
        "CPU": "2h 03m 20s",
        "cause": "",
        "note": "",
    }
    assert made["rows"][1]["artifact"] == "" and made["rows"][1]["duration"] == "0.0 s"
    ui.stage_table(
        [
            {
                "stage": "train_sft",
                "status": "failed",
                "uri": None,
                "digest": None,
                "seconds": 1.0,
                "detail": {"error": "StageFailed: rank 1: engine train failed: boom"},
            }
        ]
    )
    assert made["rows"][0]["cause"] == "StageFailed: rank 1: engine train failed: boom"
    # A training stage continued under another layout: each segment's layout, beside run.json and the card.
    from tasks.core.run.segments import record

    two, one = record({"name": "low_level_zero", "zero": 2}, 2, 2, 4, 1), record({"name": "torch_ddp"}, 1, 1, 4, 2)
    row = {"stage": "train_sft", "status": "completed", "uri": None, "digest": None, "seconds": 1.0}
    for segs, note in (
        ([{"from_step": 0, **two}], ""),
        (
            [{"from_step": 0, **two}, {"from_step": 4, **one}],
            (
                "from step 0: low_level_zero zero=2 dp=2 on 2 ranks (4 x 1 a rank); "
                "from step 4: torch_ddp dp=1 on 1 rank (4 x 2 a rank)"
            ),
        ),
    ):
        ui.stage_table([{**row, "detail": {"segments": segs}}])
        assert made["rows"][0]["note"] == note


def test_run_form_overrides_are_typed_and_validated_like_the_yaml(tmp_path):
    from prefect.utilities.callables import parameter_schema
    from pydantic import ValidationError

    from flows.cpt_to_sft import cpt_to_sft, resolve_config
    from tasks.core.config.overrides import RunOverrides
    from tasks.core.errors import ConfigError

    schema = parameter_schema(cpt_to_sft.fn).model_dump()
    assert set(schema["properties"]) == {"config", "overrides", "stop_after"}
    form = schema["definitions"]["RunOverrides"]["properties"]
    assert form["run_root"]["title"] == "Run root" and "Empty: as in the config." in form["run_root"]["description"]
    assert schema["definitions"]["StageOverrides"]["properties"]["lr"]["description"].startswith("Peak learning rate.")
    # Objects and text fields are not optional: Prefect's form shows an optional one as a "None"
    # switch with its fields hidden. Left empty, they change nothing.
    assert "$ref" in schema["properties"]["overrides"] and all("$ref" in form[s] for s in ("cpt", "sft"))
    assert form["run_name"]["type"] == "string" and RunOverrides().dotted() == {}

    tiny = str(REPO / "examples" / "tiny-cpu.yaml")
    cfg = resolve_config(
        tiny,
        {
            "run_name": "form",
            "run_root": str(tmp_path),
            "base_model_revision": "v1",
            "cpt": {"max_steps": 3, "lr": 1e-4, "data_uri": "data/sample/cpt.jsonl"},
            "sft": {"max_steps": 2},
        },
    )
    assert (cfg.name, cfg.run_root, cfg.base_model.revision) == ("form", str(tmp_path), "v1")
    assert (cfg.cpt.max_steps, cfg.cpt.lr, cfg.cpt.data.uri, cfg.sft.max_steps) == (3, 1e-4, "data/sample/cpt.jsonl", 2)
    with pytest.raises(ValidationError, match="max_steps"):
        RunOverrides.model_validate({"cpt": {"max_steps": 0}})  # the form refuses it before a run exists
    with pytest.raises(ConfigError) as err:  # the config's own rules, naming the form's field and the config's
        resolve_config(tiny, RunOverrides(run_name="not a valid name!", run_root="", cpt={"data_uri": "x.jsonl"}))
    assert [field for field, _ in err.value.problems] == ["overrides.run_name (the config's name)"]
    with pytest.raises(ConfigError) as err:  # the form's own types, every wrong field at once
        resolve_config(tiny, {"run_nam": "x", "cpt": {"max_steps": 0, "lr": -1.0}})
    assert sorted(f for f, _ in err.value.problems) == [
        "overrides.cpt.lr",
        "overrides.cpt.max_steps",
        "overrides.run_nam",
    ]


def test_the_flow_validates_its_parameters_once_pickled_as_serve_sends_it():
    """`serve()` runs each flow run in a spawned process with the flow cloudpickled: its function by
    value, with only the globals its code names. A string annotation ("RunOverrides", under
    `from __future__ import annotations`) then resolved to nothing and every served run failed."""
    import cloudpickle

    from flows.cpt_to_sft import cpt_to_sft
    from tasks.core.config.overrides import RunOverrides

    sent = cloudpickle.loads(cloudpickle.dumps(cpt_to_sft))
    params = sent.validate_parameters({"config": "x.yaml", "overrides": {"run_name": "n", "cpt": {"max_steps": 2}}})
    assert params["overrides"] == RunOverrides(run_name="n", cpt={"max_steps": 2})


@pytest.mark.integration
def test_the_run_is_named_from_the_config_it_read_once(prefect_harness, tiny_model_dir, tmp_path, monkeypatch):
    """`<model>-<run name>-<id8>`, or `cpt-to-sft-<id8>` for a config
    that does not load; the flow reads its config once."""
    from prefect import get_client

    import flows.cpt_to_sft as flow_mod
    from tasks.core.config import load

    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["name"] = "named"
    cfg = write_config(tmp_path / "cfg.yaml", raw)
    reads: list[str] = []
    real_load = load.load_config
    monkeypatch.setattr(
        flow_mod,
        "load_for_check",
        lambda path, overrides=None: (reads.append(str(path)), real_load(path, overrides))[1],
    )
    ok = flow_mod.cpt_to_sft(config=str(cfg), stop_after="load_from_hf", return_state=True)
    bad = flow_mod.cpt_to_sft(config=str(tmp_path / "missing.yaml"), return_state=True)
    assert ok.is_completed() and bad.is_failed() and bad.name == "Refused", (ok.message, bad.message)
    assert len(reads) == 2, reads  # one per flow run
    with get_client(sync_client=True) as client:
        runs = [client.read_flow_run(s.state_details.flow_run_id) for s in (ok, bad)]
    assert runs[0].name == f"tiny-llama-named-{str(runs[0].id).split('-')[0]}"
    assert runs[1].name == f"cpt-to-sft-{str(runs[1].id).split('-')[0]}"


# --- e2e: a real server, worker and CLI --------------------------------------------------------


# A run form that is wrong twice over: a run name RunConfig refuses and a data file that is not there.
BAD_FORM = {"run_name": "not a valid name!", "cpt": {"data_uri": "/nonexistent/cpt-form.jsonl"}}


def assert_form_refused(message: str) -> None:
    """The form's own fields, every problem in the one refusal."""
    assert "overrides.run_name (the config's name)" in message, message
    assert "overrides.cpt.data_uri (the config's cpt.data.uri" in message, message
    assert "/nonexistent/cpt-form.jsonl" in message, message


@pytest.mark.integration
def test_the_flow_serves_as_prefect_documents_it(prefect_harness, tiny_model_dir, tmp_path):
    """`cpt_to_sft.serve(name=...)` in a process of its own, a run of its deployment through the API:
    Prefect validates the served run's parameters (the RunOverrides model once failed with "not fully
    defined") and the flow answers the form with every problem at once. Then a second run of the same
    served process, preempted, waits for capacity and completes (`preempted_served_run`)."""
    import os

    from prefect.deployments import run_deployment
    from prefect.settings import get_current_settings

    config = write_config(tmp_path / "served.yaml", tiny_config_raw(tiny_model_dir, tmp_path / "run"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_API_URL=get_current_settings().api.url, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    log = tmp_path / "serve.log"
    serve = "from flows.cpt_to_sft import cpt_to_sft\ncpt_to_sft.serve(name='served')\n"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", serve],
            cwd=str(REPO),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while "is being served" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        run = run_deployment(
            "cpt-to-sft/served", parameters={"config": str(config), "overrides": BAD_FORM}, timeout=300
        )
        said = log.read_text(errors="replace")
        assert run.state.name == "Refused", (run.state, said[-3000:])
        assert_form_refused(run.state.message)
        assert "not fully defined" not in said and "Traceback" not in said, said[-3000:]
        preempted_served_run(tmp_path, tiny_model_dir, log, proc.pid)
    finally:
        stop_group(proc)


def preempted_served_run(tmp_path: Path, tiny_model_dir: Path, log: Path, serve_pid: int) -> None:
    """The preemption retry through the deployment: a served run preempted by a polled notice (the
    local metadata double's gcp answer, preempted from the start) waits for capacity AwaitingRetry, in
    its own process, while the runner keeps polling its deployment for scheduled runs (it would find
    this one: the runner's query does not read `retry_type`); the test withdraws the notice when it
    sees the wait, and the same process goes on to Completed: no second Submitting, no second
    process, no failure retry used. (A `file` notice already there at the start is refused by
    pre-flight: it would be read as a notice at once.)"""
    import uuid

    import psutil
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    double = MetadataServer().start()
    double.preempt()
    raw = tiny_config_raw(tiny_model_dir, tmp_path / "spot-run")
    raw["name"] = f"served-spot-{uuid.uuid4().hex[:6]}"
    raw["cpt"]["elastic"] = {
        "notices": [{"source": "gcp", "endpoint": double.url, "poll_s": 0.1}],
        "retry_wait_s": 12.0,  # the test sees the wait (it polls every 0.5 s) even on a loaded machine
        "max_preemptions": 2,
    }
    config = write_config(tmp_path / "spot.yaml", raw)
    # prepare_cpt is the last stage: no torchrun launch
    params = {"config": str(config), "stop_after": "prepare_cpt"}
    served = psutil.Process(serve_pid)

    def children() -> set[int]:  # the runner starts each flow run in a child process of its own
        return {c.pid for c in served.children()}

    before, started = children(), set()  # before: the first run's multiprocessing resource tracker
    run = run_deployment("cpt-to-sft/served", parameters=params, timeout=0)
    seen, deadline = [], time.monotonic() + 600  # the correct run takes well under a minute
    with get_client(sync_client=True) as client:
        while True:
            started |= children() - before  # a process lives seconds: a 0.5 s sampling sees each one
            now = client.read_flow_run(run.id)
            if now.state is not None and now.state.is_final():
                break
            assert time.monotonic() < deadline, (now.state, log.read_text(errors="replace")[-3000:])
            if now.state is not None and now.state.name == "AwaitingRetry":
                seen.append(now.empirical_policy.retry_type)
                double.preempted = False  # capacity comes back
            time.sleep(0.5)
        while children() - before:  # the run's process ends (stopping the runner before would cancel it)
            assert time.monotonic() < deadline, (children(), before, log.read_text(errors="replace")[-3000:])
            time.sleep(0.5)
        now = client.read_flow_run(run.id)
        history = [s.name for s in sorted(client.read_flow_run_states(run.id), key=lambda s: s.timestamp)]
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])),
        )
    double.stop()
    said = log.read_text(errors="replace")
    assert now.state.is_completed(), (now.state, history, said[-3000:])
    # submitted once by the runner, waited in its one process, never Crashed nor Failed
    want = ["Scheduled", "Pending", "Submitting", "Running", "AwaitingRetry", "Running", "Completed"]
    assert history == want, history
    assert len(started) == 1, started
    assert seen and set(seen) == {"in_process"}, seen
    assert now.run_count == 1 and now.empirical_policy.retry_type is None, now  # no failure attempt used
    assert said.count(f"flow-run/{run.id}") == 1, said[-3000:]  # one process began it ("View at ...")
    assert said.count("Beginning flow run") == 2 and "Traceback" not in said, said[-3000:]  # the refused run + this
    summary = json.loads((tmp_path / "spot-run" / "run.json").read_text())
    (rec,) = summary["preemptions"]
    assert (rec["source"], rec["steps_lost"]) == ("gcp", 0), rec
    first = rec["stage"]
    assert first == "load_from_hf", rec  # the notice is there from the start: the first stage stops
    states = sorted((t.name, t.state.name) for t in task_runs if t.name.startswith(first))
    assert [s for _, s in states] == ["Completed", "Preempted"], states  # preempted once, then finished
    status = {s["stage"]: s["status"] for s in summary["stages"]}
    assert status[first] == "completed" and status["prepare_cpt"] == "completed", status


@pytest.fixture(scope="module")
def ops(tmp_path_factory, tiny_model_dir):
    from support.servers.hub_server import HubServer

    tmp = tmp_path_factory.mktemp("prefect-ops")
    run_root = tmp / "run"
    raw = tiny_config_raw(tiny_model_dir, run_root)
    for phase in ("cpt", "sft"):
        raw[phase].update(max_steps=2 * STEPS, checkpoint_every=EVERY)  # OVERRIDES sets STEPS
    raw["name"] = "ops-config"
    raw["hub"] = {"repo_id": REPO_ID, "private": True}
    # 4 steps of a random model do not earn a push; the gate has its own tests (test_evaluate.py).
    raw.setdefault("gate", {})["enabled"] = False
    config = write_config(tmp / "tiny-ops.yaml", raw)

    started = time.monotonic()
    postgres = Postgres()
    server = PrefectServer(tmp / "prefect-home", database_url=postgres.url)
    hub = HubServer(tmp / "hub", token=TOKEN)
    webhook = WebhookReceiver().start()
    try:
        postgres.start()
        server.start(timeout=240)  # Prefect migrates the empty database first
        hub.start()
        timings = {"server_start_s": time.monotonic() - started}
        server.cli("work-pool", "create", "gpu", "--type", "process")
        server.cli("work-pool", "set-concurrency-limit", "gpu", "1")
        t = time.monotonic()
        server.cli("deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
        timings["deploy_s"] = time.monotonic() - t
        # The Hub token as the README says: a Secret block named hf-token (no HF_TOKEN on the worker).
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"from prefect.blocks.system import Secret; Secret(value={TOKEN!r}).save('hf-token', overwrite=True)",
            ],
            env=server.env(),
            cwd=str(tmp),
            check=True,
            capture_output=True,
            timeout=120,
        )
        # Failure notifications as the README applies them: a webhook block + the automation file.
        subprocess.run(
            [sys.executable, "-m", "flows.cli", "notifications", "--webhook-url", webhook.url],
            env=server.env(),
            cwd=str(REPO),
            check=True,
            capture_output=True,
            timeout=180,
        )
        server.start_worker(
            "gpu",
            tmp / "worker.log",
            CPT_TO_SFT_HOME=str(REPO),
            PREFECT_WORKER_QUERY_SECONDS="1",
            HF_ENDPOINT=hub.endpoint,
            HF_HUB_DISABLE_TELEMETRY="1",
        )
        yield Ops(server, tmp, config, run_root, webhook, postgres, timings)
    finally:
        server.stop()  # worker first (its flow runs and torchrun are in its process group), then the server
        postgres.stop()
        hub.stop()
        webhook.stop()
        for name in ("worker.log",):
            if (tmp / name).exists():
                sys.stderr.write(f"--- {name} (tail) ---\n{(tmp / name).read_text(errors='replace')[-3000:]}\n")


@pytest.fixture(scope="module")
def failed_run(ops):
    t = time.monotonic()
    out, run_id = ops.run("--job-variable", "env=" + json.dumps({"CPT_TO_SFT_FAULT": FAULT}))
    ops.timings["failed_run_s"] = time.monotonic() - t
    run = ops.server.wait_terminal(run_id, timeout=60)
    task_runs = ops.server.task_runs(run_id)
    artifacts = ops.server.artifacts(run_id)
    return {"out": out, "id": run_id, "run": run, "task_runs": task_runs, "artifacts": artifacts}


@pytest.fixture(scope="module")
def retried_run(ops, failed_run):
    run_id = failed_run["id"]
    t = time.monotonic()
    ops.server.cli("flow-run", "retry", run_id)
    # `retry` reschedules the same flow run for the worker. (`prefect flow-run watch` replays the
    # run's old events, Failed included, and may stop early, so the API is polled instead.)
    run = ops.server.wait_terminal(run_id, timeout=480, not_state=failed_run["run"]["state"]["id"])
    ops.timings["retried_run_s"] = time.monotonic() - t
    return {"id": run_id, "run": run}


@pytest.mark.e2e
@pytest.mark.integration
def test_deployments_pool_and_schedule(ops):
    s = ops.server
    pool = s.api("GET", "/work_pools/gpu")
    assert pool["type"] == "process" and pool["concurrency_limit"] == 1
    deployments = {d["name"]: d for d in s.api("POST", "/deployments/filter", {})}
    assert set(deployments) == {"default", "nightly"}
    for d in deployments.values():
        assert d["work_pool_name"] == "gpu" and d["entrypoint"] == "flows/cpt_to_sft/__init__.py:cpt_to_sft"
        # Resolved on the worker when a run starts, not frozen at deploy time.
        assert d["pull_steps"] == [
            {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $CPT_TO_SFT_HOME }}"}}
        ]
    assert deployments["default"]["schedules"] == []
    (schedule,) = deployments["nightly"]["schedules"]
    assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["active"] is False
    # An inactive schedule creates no runs.
    assert s.api("POST", "/flow_runs/filter", {"deployments": {"id": {"any_": [deployments["nightly"]["id"]]}}}) == []


@pytest.mark.e2e
@pytest.mark.integration
def test_a_refused_run_form_names_its_fields_without_a_traceback(ops):
    """A deployment run whose form is wrong twice over: one refusal naming both of the form's
    fields, and the worker's log holds no traceback (a refusal is not a crash)."""
    log = ops.tmp / "worker.log"
    start = len(log.read_text(errors="replace"))  # this run's lines only: a failed run's traceback may precede them
    out = ops.server.cli(
        "deployment", "run", "cpt-to-sft/default", "--watch", "--watch-interval", "2",
        "-p", f"config={ops.config}", "-p", f"overrides={json.dumps(BAD_FORM)}",
        check=False, timeout=300,
    )  # fmt: skip
    run = ops.server.wait_terminal(run_id_from(out.stdout), timeout=60)
    assert run["state"]["name"] == "Refused", out.stdout[-3000:]
    assert_form_refused(run["state"]["message"])
    worker = log.read_text(errors="replace")[start:]
    assert "Refused" in worker and "Traceback" not in worker, worker[-4000:]


@pytest.mark.e2e
@pytest.mark.integration
def test_failed_run_shows_failing_rank_event_and_stage_table(ops, failed_run):
    out, run = failed_run["out"], failed_run["run"]
    assert out.returncode != 0 and "Failed" in out.stdout, out.stdout[-3000:]
    assert run["state"]["type"] == "FAILED"
    # The run name carries the model and the run id.
    assert run["name"] == f"tiny-llama-ops-tiny-{failed_run['id'].split('-')[0]}"
    failed_tasks = [t for t in failed_run["task_runs"] if t["state"]["type"] == "FAILED"]
    assert [t["task_key"].split("-")[0] for t in failed_tasks] == ["train_cpt"], [
        t["name"] for t in failed_run["task_runs"]
    ]
    message = failed_tasks[0]["state"]["message"]
    assert "last lines per process" in message and "--- rank" in message and "injected failure" in message, message[
        -3000:
    ]

    events = ops.server.run_events("cpt-to-sft.stage.failed", failed_run["id"], {"train_cpt"})
    assert [e["payload"]["stage"] for e in events] == ["train_cpt"]
    assert events[0]["payload"]["artifact_uri"] == f"{ops.run_root}/cpt"
    assert "injected failure" in events[0]["payload"]["error"]
    assert (
        events[0]["payload"]["cause"].startswith("StageFailed: rank ")
        and "engine train failed: RuntimeError: injected failure" in events[0]["payload"]["cause"]
    )
    assert run["state"]["message"] == f"stage train_cpt failed: {events[0]['payload']['cause']}"

    # The automation of deployments/automations.yaml turned that event into a webhook message.
    got = ops.webhook.wait(lambda r: "train_cpt" in r["json"].get("subject", ""), timeout=120)
    (note,) = [r["json"] for r in got if "train_cpt" in r["json"].get("subject", "")]
    assert note["subject"] == "cpt-to-sft: stage train_cpt failed in run ops-tiny"
    body = dict(line.split(": ", 1) for line in note["body"].splitlines())
    assert body["Run"] == "ops-tiny" and body["Stage"] == "train_cpt" and body["Artifact"] == f"{ops.run_root}/cpt"
    assert body["Error"] == events[0]["payload"]["cause"] and "injected failure" in body["Error"], body["Error"]

    latest = _latest(failed_run["artifacts"])
    assert latest["cpt-progress"]["description"].startswith(f"CPT: step 3 / {STEPS}, loss ")  # the step it reached
    assert float(latest["cpt-progress"]["data"]) == 75.0
    table = latest["cpt-to-sft-stages"]
    rows = {r["stage"]: r for r in json.loads(table["data"])}
    assert rows["load_from_hf"]["status"] == rows["boost_and_shard"]["status"] == "completed"
    assert rows["train_cpt"]["status"] == "failed" and rows["train_cpt"]["artifact"] == f"{ops.run_root}/cpt"
    assert rows["train_cpt"]["cause"] == events[0]["payload"]["cause"]
    assert rows["unshard"]["status"] == "not-run"

    logs = ops.server.logs(failed_run["id"])
    ranked = [entry for entry in logs if entry["message"].startswith(("[rank 0]", "[rank 1]"))]
    assert {e["message"][:8] for e in ranked} == {"[rank 0]", "[rank 1]"}
    progress = [e for e in ranked if e["message"].startswith("[rank 0] progress ")]
    assert progress and all(e["level"] == 20 for e in progress)
    steps = [json.loads(e["message"].split(" ", 3)[3])["step"] for e in progress if '"phase": "cpt"' in e["message"]]
    assert steps == sorted(steps) and steps[:3] == [1, 2, 3], steps  # in order
    # Levels as the ranks marked them: the failure is error, nothing is guessed from words.
    errors = [e for e in ranked if e["level"] == 40]
    assert errors and "engine train failed: RuntimeError: injected failure" in errors[0]["message"]
    assert all(
        e["level"] == 20 for e in ranked if e["message"].split("] ", 1)[1].startswith(("engine train cpt:", "launch:"))
    )


@pytest.mark.e2e
@pytest.mark.integration
def test_retry_resumes_and_shows_every_artifact(ops, failed_run, retried_run):
    s = ops.server
    run_id = retried_run["id"]
    assert retried_run["run"]["state"]["type"] == "COMPLETED", retried_run["run"]["state"]
    summary = json.loads((ops.run_root / "run.json").read_text())
    status = {st["stage"]: st["status"] for st in summary["stages"]}
    assert summary["complete"] is True
    assert status["load_from_hf"] == status["boost_and_shard"] == "skipped"
    assert {status[k] for k in ("train_cpt", "unshard", "reboost", "train_sft", "export", "push_to_hub")} == {
        "completed"
    }
    messages = [e["message"] for e in s.logs(run_id)]
    assert any("resuming cpt from step-000002" in m for m in messages), [m for m in messages if "resum" in m]

    latest = _latest(s.artifacts(run_id))
    assert ARTIFACT_KEYS <= set(latest), sorted(latest)
    rows = {r["stage"]: r for r in json.loads(latest["cpt-to-sft-stages"]["data"])}
    assert rows["train_cpt"]["artifact"] == f"{ops.run_root}/cpt/step-{STEPS:06d}"
    assert rows["export"]["manifest digest"] and rows["export"]["duration"].endswith("s")
    for phase in ("cpt", "sft"):
        progress = latest[f"{phase}-progress"]
        assert progress["type"] == "progress" and float(progress["data"]) == 100.0
        assert progress["description"].startswith(f"{phase.upper()}: step {STEPS} / {STEPS}, loss ")
        curve = latest[f"{phase}-loss-curve"]
        assert curve["type"] == "markdown" and "data:image/png;base64," in curve["data"]
        png = ops.run_root / phase / "loss-curve.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in curve["data"]
    verification = latest["export-verification"]["data"]
    assert (
        "Export verification" in verification
        and "✅ match" in verification
        and "model.embed_tokens.weight" in verification
    )
    link = latest["hub-commit"]
    assert f"[{REPO_ID}@main](" in link["data"] and f"/{REPO_ID}/commit/" in link["data"]  # a link artifact is markdown

    # load_from_hf, the prepare stages and boost_and_shard completed in the first attempt, the others in the retry.
    expected = {
        "load_from_hf",
        "prepare_cpt",
        "prepare_sft",
        "boost_and_shard",
        "train_cpt",
        "unshard",
        "reboost",
        "train_sft",
        "export",
        "push_to_hub",
    }
    by_stage = {
        e["payload"]["stage"]: e["payload"] for e in s.run_events("cpt-to-sft.stage.completed", run_id, expected)
    }
    assert expected <= set(by_stage), sorted(by_stage)
    assert f"/{REPO_ID}/commit/" in by_stage["push_to_hub"]["artifact_uri"]
    assert by_stage["train_cpt"]["artifact_uri"] == f"{ops.run_root}/cpt/step-{STEPS:06d}"
    assert by_stage["export"]["artifact_uri"] == f"{ops.run_root}/export"


@pytest.mark.e2e
@pytest.mark.integration
def test_two_runs_at_once_run_one_after_the_other(ops, retried_run):
    s = ops.server
    t = time.monotonic()
    argv = [
        "deployment",
        "run",
        "cpt-to-sft/default",
        "--watch",
        "--watch-interval",
        "2",
        "-p",
        f"config={ops.config}",
        "-p",
        f"overrides={OVERRIDES}",
    ]
    procs = [
        subprocess.Popen(
            [str(Path(sys.executable).parent / "prefect"), "--no-prompt", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=s.env(),
            cwd=str(REPO),
            start_new_session=True,
        )
        for _ in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=420)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                stop_group(p, timeout=5)
    ops.timings["two_runs_s"] = time.monotonic() - t
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-2000:] for o in outs)
    runs = sorted((s.flow_run(run_id_from(o)) for o in outs), key=lambda r: r["start_time"])
    assert all(r["state"]["type"] == "COMPLETED" for r in runs)
    first, second = runs
    assert _t(first["end_time"]) <= _t(second["start_time"]), (
        first["start_time"],
        first["end_time"],
        second["start_time"],
        second["end_time"],
    )
    summary = json.loads((ops.run_root / "run.json").read_text())
    # (benchmark: not configured here, tests/conftest.py tiny_config_raw)
    assert {st["status"] for st in summary["stages"] if st["stage"] not in ("gate", "push_to_hub", "benchmark")} == {
        "skipped"
    }


@pytest.mark.e2e
@pytest.mark.integration
def test_browser_shows_the_runs_artifacts(ops, retried_run, tmp_path):
    binary, why = ensure_chromium()
    if binary is None:
        pytest.skip(f"headless Chromium unavailable: {why}")
    s = ops.server
    run_id = retried_run["id"]
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page = f"{s.url}/v2/runs/flow-run/{run_id}?tab=Artifacts"
    # Each page's DOM is read from the load that takes its screenshot.
    dom = chromium(
        binary, page, tmp_path / "profile", screenshot=SCREENSHOTS / "flow-run-artifacts.png", window="1440,1800"
    )
    missing = [k for k in sorted(ARTIFACT_KEYS) if k not in dom]
    assert not missing, f"artifact keys missing from {page}: {missing}\n{dom[-3000:]}"
    assert retried_run["run"]["name"] in dom

    latest = _latest(s.artifacts(run_id))
    curve = f"{s.url}/v2/artifacts/artifact/{latest['cpt-loss-curve']['id']}"
    dom = chromium(
        binary, curve, tmp_path / "profile", screenshot=SCREENSHOTS / "cpt-loss-curve.png", window="1280,1000"
    )
    assert 'alt="cpt loss" src="data:image/png;base64,' in dom
    table = f"{s.url}/v2/artifacts/artifact/{latest['cpt-to-sft-stages']['id']}"
    chromium(binary, table, tmp_path / "profile", screenshot=SCREENSHOTS / "stage-table.png", window="1440,1000")
    for name in ("flow-run-artifacts.png", "cpt-loss-curve.png", "stage-table.png"):
        assert (SCREENSHOTS / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (SCREENSHOTS / "timings.json").write_text(
        json.dumps({k: round(v, 1) for k, v in ops.timings.items()}, indent=2) + "\n"
    )


@pytest.mark.integration
def test_browser_renders_the_typed_run_form(ops, retried_run, tmp_path):
    binary, why = ensure_chromium()
    if binary is None:
        pytest.skip(f"headless Chromium unavailable: {why}")
    s = ops.server
    # The typed run form: the overrides as labelled fields with the config's descriptions.
    deployment = s.api("GET", "/deployments/name/cpt-to-sft/default")
    form = f"{s.url}/v2/deployments/deployment/{deployment['id']}/run"
    dom = chromium(binary, form, tmp_path / "profile", budget_ms=30000)
    # The overrides object is not optional, so its fields show without a "None" switch to flip.
    for label in (
        "overrides",
        "Run name",
        "Run root",
        "Base model URI",
        "Base model revision",
        "Max steps",
        "Learning rate",
        "Data URI",
        "Peak learning rate.",
    ):
        assert label in dom, f"{label!r} not in the run form at {form}\n{dom[-3000:]}"


@pytest.mark.e2e
@pytest.mark.integration
def test_the_server_keeps_the_run_and_its_retry_in_postgresql(ops, failed_run, retried_run):
    import asyncio
    import uuid

    import asyncpg

    async def read() -> tuple[dict, list[str]]:
        conn = await asyncpg.connect(ops.postgres.dsn)
        try:
            run_id = uuid.UUID(failed_run["id"])
            row = dict(await conn.fetchrow("SELECT state_type, run_count FROM flow_run WHERE id = $1", run_id))
            history = [
                r["type"]
                for r in await conn.fetch(
                    "SELECT type FROM flow_run_state WHERE flow_run_id = $1 ORDER BY timestamp", run_id
                )
            ]
            return row, history
        finally:
            await conn.close()

    row, history = asyncio.run(read())
    assert str(row["state_type"]) == "COMPLETED" and row["run_count"] >= 2, (
        row
    )  # the retry ran it again, on this database
    assert "FAILED" in map(str, history) and str(history[-1]) == "COMPLETED", history
    assert not list(ops.server.home.glob("*.db"))  # no SQLite file beside it
