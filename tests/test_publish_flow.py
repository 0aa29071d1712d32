"""Checkpoints published to a remote run root while training runs, at the flow level: the real
stage tasks (tests/_publish_flow.py: load -> boost & shard -> train CPT) on an s3:// run root served
by the real SeaweedFS server through the bandwidth-limiting proxy (support/servers/throttle.py), real
torchrun ranks, a real Prefect server (the test harness).
The S3 tests share one shard: load, prepare and boost & shard run once for the module on a local
run root (`seed`), and each test publishes those artifacts to its own S3 run root with the run
store's publish, so its flow verifies and skips them and launches only training.

- keep_last 1, a checkpoint every step, a slow store (and a stalled link while steps 2-4 are
  committed, so uploads lag training on any machine): the stage completes, every checkpoint is
  published and verified in order, none is deleted before its upload, the final state is bitwise
  the local run root's (fp32), and the ranks' lines reach the Prefect log while uploads run (no
  gap beyond a step, the step time measured in the same run);
- a store that cannot keep up: the engine waits at saves, the Prefect log warns and the progress
  artifact says so; nothing unpublished is deleted;
- the S3 server killed during an upload: training keeps running (waiting at its next save) while
  the upload is retried, the stage fails after the bounded retries naming the checkpoint, no
  process of the stage is left 10 s later and the staging directory stays still;
  a retry of the flow resumes from the newest complete checkpoint;
- a cancellation (the flow run set Cancelling through the API, then SIGTERM to the process of the real
  flow's CLI, `--stop-after train_cpt`, as a Prefect runner does): the same teardown, and the run ends
  Cancelled (a SIGTERM while the run is not being cancelled is a preemption notice, tests/test_elastic_flow.py).

    .venv/bin/python -m pytest -q -s -m "" tests/test_publish_flow.py     # ~5-7 min on 2 busy cores
"""

from __future__ import annotations

import contextvars
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from support.servers.throttle import MB, ThrottleProxy
from tasks.core.run.manifest import MANIFEST, STAMP
from tasks.core.run.stages import step_name
from tasks.core.storage.fs import RunStore
from tests.conftest import REPO, tiny_config_raw, write_config

pytest_plugins = ["tests.conftest_servers"]
pytestmark = [pytest.mark.integration, pytest.mark.distributed]
# One CPT config (steps included: they are in boost_and_shard's digest) for every S3 test, so they
# all start from one shard (`seed`). The slow-store test throttles each checkpoint's upload to
# about UPLOAD_S and stalls the link from step 1's commit until step HOLD_UNTIL's, so uploads lag
# training on any machine. The stall, not the step count, makes the overlap: STEPS only needs a few
# steps after HOLD_UNTIL for the queued uploads to drain while training still runs.
STEPS = 7
UPLOAD_S = 0.75
HOLD_UNTIL = 4


class PrefectLog:
    """The flow run's log as the Prefect server stores it: (time the record was made, message, level)."""

    def __init__(self, state):
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
        from prefect.client.schemas.sorting import LogSort
        from prefect.logging.handlers import APILogHandler

        for name in ("prefect", "prefect.flow_runs", "prefect.task_runs"):
            for handler in logging.getLogger(name).handlers:
                if isinstance(handler, APILogHandler):
                    handler.flush()  # records still batched for the API
        self.records: list[tuple[float, str, int]] = []
        flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        with get_client(sync_client=True) as client:
            while True:
                page = client.read_logs(log_filter=flt, limit=200, offset=len(self.records), sort=LogSort.TIMESTAMP_ASC)
                self.records += [(log.timestamp.timestamp(), log.message, log.level) for log in page]
                if len(page) < 200:
                    break

    def text(self) -> str:
        return "\n".join(m for _, m, _ in self.records)


class Watch:
    """Polls the staging directory beside the flow and acts once a path appears."""

    def __init__(self, staging: Path, pattern: str, action):
        self.staging, self.pattern, self.action = staging, pattern, action
        self.fired, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            hits = list(self.staging.glob(self.pattern)) if self.staging.is_dir() else []
            if hits:
                self.action(hits[0])
                self.fired.set()
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _config(tmp: Path, model: Path, run_root: str, steps: int = STEPS, **cpt) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    raw = tiny_config_raw(model, run_root)  # type: ignore[arg-type]
    raw["run_root"] = run_root
    raw["staging_dir"] = str(tmp / "staging")
    raw["cpt"].update(
        plugin={"name": "torch_ddp", "precision": "fp32"},
        max_steps=steps,
        checkpoint_every=1,
        keep_last=1,
        micro_batch_size=2,
        seq_len=32,
        **cpt,
    )
    return write_config(tmp / "cfg.yaml", raw)


def _run(cfg: Path):
    from tests._publish_flow import cpt_only

    return cpt_only(str(cfg), return_state=True)


@pytest.fixture(scope="module")
def seed(prefect_harness, tiny_model_dir, tmp_path_factory) -> Path:
    """load -> prepare -> boost & shard once for the module, on a local run root with the S3 tests'
    CPT config: a shard launch (~12 CPU-s, the ranks' imports) each S3 test would otherwise repeat."""
    from tests._publish_flow import shard_only

    tmp = tmp_path_factory.mktemp("publish-seed")
    state = shard_only(str(_config(tmp, tiny_model_dir, str(tmp / "run"))), return_state=True)
    assert state.is_completed(), state.message
    return tmp / "run"


def _seeded(seed: Path, run_root: str, staging: Path) -> None:
    """The seed's base, prepared data and step 0, published to `run_root` by the run store's own
    publish (from the staging dir the flow uses): the flow verifies them on S3 and skips those
    stages, as a re-run does, so its first launch is train_cpt's."""
    store = RunStore(run_root, staging_dir=str(staging))
    for rel in ("base", "data/cpt", f"cpt/{step_name(0)}"):
        shutil.copytree(seed / rel, store.local_path(rel), ignore=shutil.ignore_patterns(Path(STAMP).name))
        store.publish(rel)


def _throttle_after_shard(proxy: ThrottleProxy, staging: Path, seconds_per_upload: float) -> Watch:
    """Once step 0 is committed, slow the proxy so one checkpoint upload takes that long."""

    def slow(manifest: Path) -> None:
        # The checkpoint directory, not the manifest's own folder (MANIFEST is `.cpt-to-sft/manifest.json`):
        # sizing the rate from that folder alone (~70 kB) throttled to 64 KiB/s, and step 0's
        # publish then hit the client's read timeout before training began.
        checkpoint = manifest.parents[len(Path(MANIFEST).parts) - 1]
        assert checkpoint.name == step_name(0), checkpoint
        size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
        proxy.set_rate(max(size / seconds_per_upload, 64 << 10))

    return Watch(staging, f"*/cpt/{step_name(0)}/{MANIFEST}", slow)


def _published(text: str) -> list[str]:
    return re.findall(r"published \S+/cpt/(step-\d+) in ", text)


def _final_state(root: RunStore, steps: int) -> dict:
    return json.loads(root.read_text(f"cpt/{step_name(steps)}/train_state.json"))


def test_keep_last_1_every_step_through_a_slow_store(prefect_harness, weed, seed, tiny_model_dir, tmp_path, s3_root):
    proxy = ThrottleProxy(("127.0.0.1", weed.ports["s3.port"]), 200 * MB, lifetime_s=900).start()
    os.environ["AWS_ENDPOINT_URL"], saved = proxy.endpoint, os.environ["AWS_ENDPOINT_URL"]
    try:
        cfg = _config(tmp_path / "s3", tiny_model_dir, s3_root, max_pending_publishes=STEPS)
        staging = tmp_path / "s3" / "staging"
        _seeded(seed, s3_root, staging)
        # A stalled link (no byte either way) while steps 2..HOLD_UNTIL are committed: whatever
        # training's speed, an upload is in flight while newer checkpoints land, and keep_last 1
        # must not delete it.
        with (
            _throttle_after_shard(proxy, staging, UPLOAD_S),
            Watch(staging, f"*/cpt/{step_name(1)}/{MANIFEST}", lambda _: proxy.pause()) as held,
            Watch(staging, f"*/cpt/{step_name(HOLD_UNTIL)}/{MANIFEST}", lambda _: proxy.resume()) as resumed,
        ):
            state = _run(cfg)
        assert state.is_completed(), state.message
        assert held.fired.is_set() and resumed.fired.is_set()
        log = PrefectLog(state)
        store = RunStore(s3_root)
        # Every checkpoint was published and verified, in order; retention kept only the newest.
        assert _published(log.text()) == [step_name(s) for s in range(1, STEPS + 1)]
        assert {step_name(0), step_name(STEPS)} <= set(store.listdir("cpt"))
        for name in (step_name(0), step_name(STEPS)):
            store.verify(f"cpt/{name}", deep=True)
        assert not any(store.exists(f"cpt/{step_name(s)}/{MANIFEST}") for s in range(1, STEPS))
        assert "@@backpressure" not in log.text() and "waits before saving" not in log.text()

        # While an upload ran, the ranks' lines kept reaching the Prefect log.
        rec = log.records
        starts = {
            int(m.group(1)): t
            for t, msg, _ in rec
            if (m := re.search(r"\[rank 0\] checkpoint \{.*\"step\": (\d+)", msg))
        }
        ends = {
            int(m.group(1)[5:]): t for t, msg, _ in rec if (m := re.search(r"published \S+/cpt/(step-\d+) in ", msg))
        }
        # The stall worked: a checkpoint older than step HOLD_UNTIL was still unpublished when it was
        # committed (so retention had to keep it), and it was published whole afterwards.
        assert any(ends[s] > starts[HOLD_UNTIL] for s in range(1, HOLD_UNTIL)), (starts, ends)
        rank_times = [t for t, msg, _ in rec if msg.startswith("[rank ")]
        progress = [json.loads(msg.split(" ", 3)[3]) for _, msg, _ in rec if msg.startswith("[rank 0] progress ")]
        elapsed = [p["elapsed_s"] for p in progress]
        step_time = max(b - a for a, b in itertools.pairwise(elapsed))  # measured in this run, save included
        train_end = starts[STEPS]  # the last checkpoint committed: training lines end here
        overlapped = 0
        for step, t0 in starts.items():
            inside = [t for t in rank_times if t0 <= t <= min(ends.get(step, t0), train_end)]
            if len(inside) >= 2:  # training ran during this upload
                overlapped += 1
                gap = max(b - a for a, b in itertools.pairwise(inside))
                assert gap <= step_time + 1.0, (
                    f"log gap {gap:.2f}s during the upload of step {step} (step time {step_time:.2f}s)"
                )
        print(
            f"\nslow store: {len(ends)} uploads, {overlapped} overlapped training, step time {step_time:.2f}s, rate "
            f"{proxy.up.rate / MB:.2f} MB/s"
        )
        assert overlapped >= 1, "no upload overlapped training"
    finally:
        os.environ["AWS_ENDPOINT_URL"] = saved
        proxy.close()

    # The same stage on a local run root: bitwise the same losses and weights (fp32).
    store = RunStore(s3_root)  # the one above talked to the proxy, closed now: straight to the server
    local_root = tmp_path / "local-run"
    # Its load, prepare and shard stages are the S3 run's (same digests): start from their staged
    # copies, so only training runs again, from the very same step 0.
    staged = next((tmp_path / "s3" / "staging").glob(f"*/cpt/{step_name(0)}")).parent.parent
    shutil.copytree(staged / "base", local_root / "base")
    shutil.copytree(staged / "data" / "cpt", local_root / "data" / "cpt")
    shutil.copytree(
        staged / "cpt" / step_name(0), local_root / "cpt" / step_name(0), ignore=shutil.ignore_patterns(".published")
    )
    local_state = _run(_config(tmp_path / "local", tiny_model_dir, str(local_root)))
    assert local_state.is_completed(), local_state.message
    assert "boost_and_shard: skipped" in PrefectLog(local_state).text(), "the local run re-made step 0"
    assert _final_state(RunStore(str(local_root)), STEPS)["losses"] == _final_state(store, STEPS)["losses"]
    remote_files = store.read_manifest(f"cpt/{step_name(STEPS)}")["files"]
    local_files = RunStore(str(local_root)).read_manifest(f"cpt/{step_name(STEPS)}")["files"]
    weights = [k for k in local_files if k.startswith("model/")]
    assert weights and {k: local_files[k]["sha256"] for k in weights} == {k: remote_files[k]["sha256"] for k in weights}


def _progress_descriptions(stop: threading.Event, seen: list[str]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        while not stop.wait(0.3):
            try:
                for art in client.read_artifacts(
                    artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["cpt-progress"]))
                ):
                    if art.description and art.description not in seen:
                        seen.append(art.description)
            except Exception:  # noqa: S112 - a poll that races the server's write is retried
                continue


def test_backpressure_is_said_aloud_and_deletes_nothing_unpublished(
    prefect_harness, throttled_s3, seed, tiny_model_dir, tmp_path, s3_root
):
    throttled_s3.set_rate(200 * MB)
    cfg = _config(tmp_path, tiny_model_dir, s3_root, max_pending_publishes=1)
    _seeded(seed, s3_root, tmp_path / "staging")
    seen: list[str] = []
    stop = threading.Event()
    # The harness's API settings live in context variables, which a new thread does not inherit.
    poller = threading.Thread(
        target=contextvars.copy_context().run, args=(_progress_descriptions, stop, seen), daemon=True
    )
    poller.start()
    try:
        # 2 s an upload against steps of ~0.1 s: training waits at its saves (as in
        # tests/test_publish_handshake.py), each wait long enough for the 0.3 s poller to see it.
        with _throttle_after_shard(throttled_s3, tmp_path / "staging", 2.0):
            state = _run(cfg)
    finally:
        stop.set()
        poller.join()
    assert state.is_completed(), state.message
    log = PrefectLog(state)
    text = log.text()
    warnings = [m for _, m, lvl in log.records if lvl == logging.WARNING and "waits before saving step" in m]
    assert warnings, text[-3000:]
    assert re.search(r"resumed after waiting \d+\.\ds", text)
    assert any("waiting for 1 checkpoint upload(s)" in d for d in seen), seen
    # Nothing was dropped: every checkpoint went up, in order (an unpublished one deleted early
    # would have failed its publish), while local retention did delete the published ones.
    assert _published(text) == [step_name(s) for s in range(1, STEPS + 1)]
    assert re.search(rf"retention keep_last=1: removed {step_name(1)}\b", text), text[-3000:]


def _stage_processes(job_path: Path) -> list[psutil.Process]:
    """Test-side check: live processes whose command line names the stage's job file."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(job_path) in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _tree(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in sorted(d.rglob("*")) if p.is_file()}


def _nothing_left(job_path: Path, stage_dir: Path, reported_at: float) -> None:
    assert _stage_processes(job_path) == [], "a process of the stage outlived the failure report"
    before = _tree(stage_dir)
    time.sleep(max(0.0, 10.0 - (time.monotonic() - reported_at)))
    assert _stage_processes(job_path) == [], "a process of the stage exists 10 s after the failure"
    assert _tree(stage_dir) == before, "the stage directory changed after the failure was reported"


def _until_readable(store: RunStore, rel: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            store.read_manifest(rel)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_store_killed_during_upload_fails_naming_it_then_a_retry_resumes(
    prefect_harness, fresh_weed, seed, tiny_model_dir, tmp_path, monkeypatch
):
    from tasks.core.storage.publisher import Publisher

    # The publisher's own default backoff, which train_cpt's Publisher uses: 4 retries in ~4 s instead of ~1 min
    # (the ranks wait at the next save however long the retries take).
    monkeypatch.setitem(Publisher.__init__.__kwdefaults__, "backoff_s", 0.25)
    proxy = ThrottleProxy(("127.0.0.1", fresh_weed.ports["s3.port"]), 200 * MB, lifetime_s=900).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    # One botocore try per publisher attempt (botocore reads AWS_MAX_ATTEMPTS; the run store keys its
    # client on it): against a dead server its own retries only add ~5 s to each of the 5 attempts
    # counted below. The retry run after the restart gets botocore's default again.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    root = f"s3://cpt-tests/killed-{os.getpid()}"
    # max_pending_publishes 1: training cannot run ahead of the store, so when the publisher gives
    # up the ranks are still alive (waiting to save step 3) and the failure must tear them down.
    cfg = _config(tmp_path, tiny_model_dir, root, max_pending_publishes=1)
    staging = tmp_path / "staging"
    _seeded(seed, root, staging)
    try:
        # Step 1 is committed remotely (marked); step 2 is saved next and its upload fails.
        with (
            _throttle_after_shard(proxy, staging, 2.0),
            Watch(staging, f"*/cpt/{step_name(1)}/.published", lambda _: fresh_weed.kill()) as killed,
        ):
            state = _run(cfg)
        reported_at = time.monotonic()
        assert killed.fired.is_set() and state.is_failed(), state.message
        log = PrefectLog(state)
        stage_dir = next(staging.rglob("jobs")).parent / "cpt"
        job_path = next(staging.rglob("jobs/cpt-train.json"))
        message = str(state.message) + log.text()
        assert re.search(r"publish of checkpoint s3://\S+/cpt/step-000002 failed after 5 attempt\(s\)", message), (
            message[-3000:]
        )
        # The ranks lived through every retry (waiting at the next save) and were stopped only once
        # the retries were spent, by the publish failure, not by finishing.
        msgs = [m for _, m, _ in sorted(log.records, key=lambda r: r[0])]
        last_retry = max(
            i for i, m in enumerate(msgs) if re.search(r"publish of \S+/cpt/step-000002 failed \(attempt 4 of 5", m)
        )
        stopped = min(i for i, m in enumerate(msgs) if m.startswith("stopping the stage: publish of checkpoint"))
        assert last_retry < stopped, msgs[-40:]
        assert any("training waits before saving step 3" in m for m in msgs[:stopped]), msgs[-40:]
        assert not any("engine train cpt: done" in m for m in msgs), (
            "training finished before the failure: no teardown was tested"
        )
        _nothing_left(job_path, stage_dir, reported_at)
        local_complete = sorted(p.name for p in stage_dir.glob("step-*") if (p / MANIFEST).is_file())
        assert step_name(2) in local_complete, "an unpublished checkpoint was deleted"

        # The retry: the server is back; training resumes from the newest complete checkpoint
        # (local and unpublished here), publishes what the failed attempt left, and completes.
        fresh_weed.start()
        monkeypatch.delenv("AWS_MAX_ATTEMPTS")
        proxy.set_rate(200 * MB)
        _until_readable(RunStore(root), "base")  # S3 answers before its filer serves reads again
        state2 = _run(cfg)
        assert state2.is_completed(), state2.message
        log2 = PrefectLog(state2)
        newest = local_complete[-1]
        assert f"resuming cpt from {newest}" in log2.text(), log2.text()[-3000:]
        published = _published(log2.text())
        assert published[0] == step_name(2) and published[-1] == step_name(STEPS), published
        RunStore(root).verify(f"cpt/{step_name(STEPS)}", deep=True)
    finally:
        proxy.close()


def test_cancellation_leaves_no_process_and_no_write(prefect_harness, tiny_model_dir, tmp_path):
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Cancelling

    run_root = tmp_path / "run"
    raw_cfg = _config(tmp_path, tiny_model_dir, str(run_root))
    # Long enough that the cancellation lands mid-training.
    text = raw_cfg.read_text().replace(f"max_steps: {STEPS}", "max_steps: 5000", 1)
    raw_cfg.write_text(text)
    # The real flow's CLI, up to train_cpt, on the session's Prefect server (no server of its own to start).
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PREFECT_API_URL": PREFECT_API_URL.value()}
    env.pop("CPT_TO_SFT_FAULT", None)
    out_path = tmp_path / "driver.log"
    # Its own session, so whatever the driver started goes with it at the end (this pytest process
    # may be a subreaper after the tests above, and would otherwise inherit it).
    driver = subprocess.Popen(
        [sys.executable, "-m", "flows.cpt_to_sft", "--config", str(raw_cfg), "--stop-after", "train_cpt"],
        cwd=REPO,
        env=env,
        stdout=out_path.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    # the ranks of the shared launch (cpt-shard.json) train_cpt adopted, or of its own (cpt-train.json)
    stage_dir, job_path = run_root / "cpt", run_root / "jobs" / "cpt-"
    try:
        deadline = time.monotonic() + 480
        # keep_last 1 deletes step 2 within a step: wait for any checkpoint from step 2 on.
        while not any(int(p.name[5:]) >= 2 for p in stage_dir.glob("step-*")):
            assert driver.poll() is None, out_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "training never reached step 2"
            time.sleep(0.2)
        assert _stage_processes(job_path), "the stage's processes should be running now"
        # What a Prefect cancel is: the state first (the UI, `prefect flow-run cancel`), then the runner's
        # SIGTERM. A SIGTERM alone would be a preemption notice (elastic.sigterm is on by default).
        run_id = _running_flow_run()
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(run_id, Cancelling(message="cancelled from the UI"), force=True)
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=120)
        reported_at = time.monotonic()
        out = out_path.read_text()
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)  # whatever of the driver's own is left
        except ProcessLookupError:
            pass
        driver.wait()
    assert "torn down the train stage" in out, out[-4000:]
    assert driver.returncode == 130 and "cancelled from Prefect (the flow run is Cancelling)" in out, out[-4000:]
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run_id).state.is_cancelled(), client.read_flow_run(run_id).state
    _nothing_left(job_path, stage_dir, reported_at)


def _running_flow_run():
    """The id of the one Running flow run (the session's Prefect server runs one test at a time)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    running = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])))
    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(flow_run_filter=running)
    return run.id
