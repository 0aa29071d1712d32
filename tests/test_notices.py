"""Preemption notices without a launch: the registry rows, the cloud rows against the local metadata
double (support/servers/metadata.py), a rank's `Watch` (signal handler and poller), the launcher's
forwarding and its `Preempted` report, and the keep-the-global-batch rule.

    .venv/bin/python -m pytest -q tests/test_notices.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.servers.metadata import MetadataServer
from tasks.core.config.elastic import ElasticConfig, NoticeConfig, keep_global_batch, kept_accumulation
from tasks.core.config.notices import NOTICES, NoticeSource, register, signal_names
from tasks.core.errors import ConfigError, Preempted, StageFailed
from tasks.core.launch.notice_watch import Watch, http_fetch


@pytest.fixture(scope="module")
def double():
    with MetadataServer() as m:
        yield m


def _poll(name: str, url: str) -> str | None:
    return NOTICES[name].poll(http_fetch, url)


def test_every_row_has_a_grace_budget_and_one_way_to_arrive():
    for name, row in NOTICES.items():
        assert row.grace_s > 0 and row.summary, name
        assert (row.signal is None) != (row.poll is None), name
    assert signal_names(["sigterm", "slurm", "aws", "sigterm"]) == ["SIGTERM", "SIGUSR1"]


def test_the_cloud_rows_ask_as_documented_and_read_the_preemption(tmp_path):
    # Its own double: the module's one is preempted by the poller test below.
    with MetadataServer() as m:
        assert [_poll(n, m.url) for n in ("aws", "gcp", "azure")] == [None, None, None]
        m.preempt()
        aws, gcp, azure = (_poll(n, m.url) for n in ("aws", "gcp", "azure"))
        assert aws.startswith("aws spot terminate at 20") and aws.endswith("Z")
        assert gcp == "gcp instance preempted"
        assert azure.startswith("azure Preempt event 602d9444-d2cd-49c7-8624-8643e7171297 not before ")
        asked = [(r["method"], r["path"].split("?")[0]) for r in m.requests]
        assert ("PUT", "/latest/api/token") in asked and ("GET", "/computeMetadata/v1/instance/preempted") in asked
        tokens = [r for r in m.requests if r["path"] == "/latest/meta-data/spot/instance-action"]
        assert all(r["headers"].get("x-aws-ec2-metadata-token") for r in tokens)
        # The headers are the protocol: without them the double refuses, as the clouds do.
        assert http_fetch("GET", f"{m.url}/computeMetadata/v1/instance/preempted", {})[0] == 403
        assert http_fetch("GET", f"{m.url}/latest/meta-data/spot/instance-action", {})[0] == 401
        assert http_fetch("GET", f"{m.url}/metadata/scheduledevents?api-version=2020-07-01", {})[0] == 400
    with pytest.raises(OSError):
        _poll("gcp", m.url)  # stopped: unreachable is an error the poller reports, not a notice
    note = tmp_path / "notice"
    assert _poll("file", str(note)) is None
    note.write_text("drain for maintenance\n")
    assert _poll("file", str(note)) == f"notice file {note}: drain for maintenance"


def test_a_rank_s_poller_hears_the_double_and_keeps_the_first_notice(double):
    said: list[str] = []
    cfg = ElasticConfig(notices=[{"source": "gcp", "endpoint": double.url, "poll_s": 0.05, "grace_s": 20}])
    watch = Watch(cfg.notices, say=said.append).start()
    try:
        time.sleep(0.3)
        assert not watch.noticed and watch.remaining() == float("inf")
        double.preempt()
        deadline = time.monotonic() + 30
        while not watch.noticed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.first.source == "gcp" and watch.first.grace_s == 20
        assert 0 < watch.remaining() <= 20
        watch.notice("aws", 120, "later")  # a second notice does not move the budget
        assert watch.first.source == "gcp"
    finally:
        watch.close()
    assert said == ["preemption notice (gcp, grace 20s): gcp instance preempted"]


def test_a_rank_s_signal_handler_turns_sigusr1_into_a_notice_and_is_removed_after():
    before = signal.getsignal(signal.SIGUSR1)
    watch = Watch(ElasticConfig(notices=[{"source": "slurm"}]).notices).start()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert watch.first.source == "slurm" and watch.first.grace_s == 60.0
        assert watch.first.text == "SIGUSR1 received"
    finally:
        watch.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_dummy_row_is_all_a_new_source_needs():
    register(NoticeSource("dummy", "test", 7.0, poll=lambda fetch, where: f"dummy at {where}", endpoint="x"))
    try:
        cfg = ElasticConfig(notices=[{"source": "dummy", "poll_s": 0.01}])
        watch = Watch(cfg.notices).start()
        deadline = time.monotonic() + 10
        while not watch.noticed and time.monotonic() < deadline:
            time.sleep(0.01)
        watch.close()
        assert (watch.first.source, watch.first.grace_s, watch.first.text) == ("dummy", 7.0, "dummy at x")
    finally:
        NOTICES.pop("dummy")
    with pytest.raises(ValueError, match="unknown notice source 'dummy'"):
        NoticeConfig(source="dummy")


def test_notice_settings_are_checked():
    with pytest.raises(ValueError, match="'file' needs `endpoint`"):
        NoticeConfig(source="file")
    with pytest.raises(ValueError, match="is a signal"):
        NoticeConfig(source="sigterm", endpoint="http://x")
    assert NoticeConfig(source="aws").where == "http://169.254.169.254"
    assert ElasticConfig(notices=[{"source": "aws"}, {"source": "sigterm", "grace_s": 20}]).grace_s == 20


def test_keep_global_batch_sets_the_accumulation_or_names_the_setting():
    from support.engine import phase_raw
    from tasks.core.config.schema import PhaseConfig

    assert (kept_accumulation(8, 2, 1), kept_accumulation(8, 2, 2), kept_accumulation(8, 4, 4)) == (4, 2, None)
    cfg = PhaseConfig.model_validate(phase_raw("cpt", {"name": "torch_ddp", "precision": "fp32"}))
    kept = keep_global_batch(cfg, "cpt", 4, dp=1, world=1)
    assert (kept.grad_accum_steps, kept.launch.world_size, kept.micro_batch_size) == (2, 1, 2)
    from tasks.core.config.layout import global_batch

    assert global_batch(kept) == 4  # what the blend plan and the digest read
    with pytest.raises(ConfigError, match=r"cpt\.elastic\.keep_global_batch: the checkpoints' global batch of 3"):
        keep_global_batch(cfg, "cpt", 3, dp=1, world=1)


def test_the_launcher_reports_a_preempted_exit_distinctly():
    import logging

    from tasks.core.launch.torchrun import Router
    from tasks.core.run.events import PREEMPTED, format_event

    router = Router(logging.getLogger("test-notices"))
    router.line("[rank 1] injected notice 'term@step=4' (CPT_TO_SFT_FAULT): rank 1 signals itself")
    assert isinstance(router.failure("train", 1), StageFailed) and not isinstance(router.failure("train", 1), Preempted)
    rec = {"source": "sigterm", "noticed_step": 5, "checkpoint_step": 5, "steps_lost": 0, "notice_to_commit_s": 1.5}
    router.line("[rank 0] " + format_event(PREEMPTED, rec))
    exc = router.failure("train", 1)
    assert isinstance(exc, Preempted) and exc.record == rec
    assert (
        exc.cause == "engine verb 'train' preempted (sigterm) after step 5: checkpoint step 5 committed, steps lost 0"
    )
    import pickle

    assert pickle.loads(pickle.dumps(exc)).record == rec  # Prefect may pickle a task's exception


def test_the_launcher_passes_sigterm_on_to_the_ranks_as_a_notice(tmp_path):
    """A stand-in for torchrun whose child (the 'rank') records the SIGTERM it gets and lives on; the
    launcher's own SIGTERM goes to the rank, and the launcher is not ended by it."""
    from tasks.core.launch.proctree import StageProcesses, forward_notices, teardown

    got = tmp_path / "rank-got"
    rank = (
        "import signal, sys, time, pathlib; p = pathlib.Path(sys.argv[1]);"
        "signal.signal(signal.SIGTERM, lambda s, f: p.write_text(str(s)));"
        "pathlib.Path(sys.argv[1] + '.ready').write_text('');"
        "[time.sleep(0.05) for _ in range(1200) if not p.exists()]"
    )
    agent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {rank!r}, {str(got)!r}])"
    proc = subprocess.Popen([sys.executable, "-c", agent], start_new_session=True)
    stage = StageProcesses(proc.pid)
    said: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{got}.ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with forward_notices(stage, ["SIGTERM"], say=said.append) as on:
            assert on
            os.kill(os.getpid(), signal.SIGTERM)
            while not got.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        assert got.read_text() == str(int(signal.SIGTERM))
        assert said == ["SIGTERM: passed on to 1 rank(s) as a preemption notice"]
        assert proc.wait(timeout=60) == 0  # the rank finished on its own, the agent with it
    finally:
        teardown(stage)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_signal_handlers_come_back_however_the_block_ends_and_only_the_main_thread_installs():
    """The one install/restore that the launcher's forwarding and the stages' notices share."""
    import threading

    from tasks.core.launch.proctree import signal_handlers

    before = signal.getsignal(signal.SIGUSR2)
    got: list[int] = []
    with pytest.raises(RuntimeError), signal_handlers({signal.SIGUSR2: lambda s, f: got.append(s)}) as on:
        assert on
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.1)
        raise RuntimeError("the block fails")
    assert got == [signal.SIGUSR2] and signal.getsignal(signal.SIGUSR2) is before
    seen: list[bool] = []

    def elsewhere() -> None:
        with signal_handlers({signal.SIGUSR2: lambda s, f: None}) as on:
            seen.append(on)

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    with signal_handlers({}) as nothing:
        assert nothing is False
    assert seen == [False] and signal.getsignal(signal.SIGUSR2) is before


def _keep(raw: dict) -> dict:
    raw["cpt"]["elastic"] = {"keep_global_batch": True, "notices": [{"source": "sigterm"}]}
    return raw


def test_keep_global_batch_keeps_the_digest_on_another_number_of_ranks(tmp_path):
    from tasks.core.config.schema import RunConfig
    from tasks.core.run.digest import config_digest, digest_fields
    from tests.conftest import tiny_config_raw

    raw = _keep(tiny_config_raw(tmp_path / "model", tmp_path / "run"))
    parents = {"load_from_hf": "a", "prepare_cpt": "b"}
    two = RunConfig.model_validate(raw)
    raw["cpt"].update(plugin={"name": "torch_ddp", "precision": "fp32"}, launch={"nproc_per_node": 1})
    one = RunConfig.model_validate(raw)
    assert digest_fields(one, "boost_and_shard")["cpt.global_batch"] == "kept"
    assert config_digest(one, "boost_and_shard", parents) == config_digest(two, "boost_and_shard", parents)
    # the notices alone change no artifact
    raw["cpt"]["elastic"] = {"keep_global_batch": True}
    assert config_digest(RunConfig.model_validate(raw), "boost_and_shard", parents) == config_digest(
        one, "boost_and_shard", parents
    )


@pytest.mark.parametrize(
    "change, kind, text",
    [
        (
            lambda c: c.update(plugin={"name": "torch_ddp", "precision": "fp32"}, micro_batch_size=1),
            "ok",
            "cpt: elastic.keep_global_batch sets grad_accum_steps to 2: the global batch of step-000003 (4)",
        ),
        (
            lambda c: c.update(plugin={"name": "torch_ddp", "precision": "fp32"}),  # 4 x ? x dp 2 = 4: none
            "problem",
            "its checkpoints were trained at a global batch of 4 sequences",
        ),
    ],
)
def test_preflight_says_what_keep_global_batch_does(tmp_path, change, kind, text):
    import copy

    from tasks.core.preflight.checks import load_for_check
    from tasks.core.preflight.report import CheckContext, PreflightReport
    from tasks.core.preflight.resume import check_resume
    from tests.conftest import tiny_config_raw, write_config
    from tests.test_state_view import _run_root_with_checkpoint

    raw = _keep(tiny_config_raw(tmp_path / "model", tmp_path / "run"))
    _run_root_with_checkpoint(tmp_path, raw)
    new = copy.deepcopy(raw)
    change(new["cpt"])
    ctx = CheckContext(load_for_check(write_config(tmp_path / "c.yaml", new)), None, None, None, PreflightReport())
    check_resume(ctx)
    if kind == "ok":
        assert text in ctx.report.checked and not ctx.report.problems, (ctx.report.checked, ctx.report.problems)
    else:
        assert [w for w, _ in ctx.report.problems] == ["cpt.elastic.keep_global_batch"], ctx.report.problems
        assert text in ctx.report.problems[0][1]


def test_torchrun_is_told_to_pass_the_notices_on_and_wait_the_grace():
    from tasks.core.config.notices import torchrun_env

    cfg = ElasticConfig(notices=[{"source": "slurm", "grace_s": 90.5}, {"source": "sigterm"}])
    assert torchrun_env(cfg.notices) == {
        "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "PET_SHUTDOWN_TIMEOUT": "91",
    }
    assert torchrun_env(()) == {}
    # torch.distributed.run reads them as its --signals-to-handle and --shutdown-timeout flags
    from torch.distributed.run import get_args_parser

    os.environ.update(torchrun_env(cfg.notices))
    try:
        args = get_args_parser().parse_args(["-m", "tasks.engine"])
    finally:
        for k in torchrun_env(cfg.notices):
            os.environ.pop(k)
    assert (args.signals_to_handle, args.shutdown_timeout) == ("SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", 91)


def test_a_save_that_would_outlast_the_grace_is_not_started():
    from tasks.core.config.notices import worth_saving

    assert worth_saving(20.0, None)  # no save in this launch yet: try (a save never commits torn)
    assert worth_saving(20.0, 5.0) and not worth_saving(5.0, 5.0) and not worth_saving(1.0, 30.0)


# --- untrusted notices: bounded reads, printable text, endpoints checked before launch ----------------


def _in_time(fn, seconds: float = 5.0):
    """fn()'s value, or a failure naming the hang: a read that blocks must not hang the suite."""
    import threading

    box: list = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert box, f"{fn} did not return within {seconds} s"
    return box[0]


def test_a_notice_file_is_never_read_blocking_and_only_its_printable_first_line_is_said(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # a device and a FIFO are notices by being there, and are never read (a FIFO's read would block)
    assert _in_time(lambda: _poll("file", "/dev/zero")) == "notice file /dev/zero (a character device, not read)"
    assert _in_time(lambda: _poll("file", str(fifo))) == f"notice file {fifo} (a FIFO, not read)"
    assert _in_time(lambda: _poll("file", str(tmp_path))) == f"notice file {tmp_path} (a directory, not read)"
    dirty = tmp_path / "dirty"
    dirty.write_bytes(b"\x00" * 5000 + b"spot\x1b[2J\x07 reclaimed\x00\tnow\r\nsecond line\n")
    text = _poll("file", str(dirty))
    assert text == f"notice file {dirty}", text  # its first NOTICE_BYTES are NULs: nothing printable to say
    dirty.write_bytes(b"\x00\x01spot\x1b[2J\x07 reclaimed\x00\tnow\r\nsecond line\n")
    assert _poll("file", str(dirty)) == f"notice file {dirty}: spot[2J reclaimed now"
    said: list[str] = []
    watch = Watch((), say=said.append)
    watch.notice("file", 30, "a\x00b\x1b]0;title\x07c\nd" + "x" * 500)
    assert watch.first.text == "ab]0;titlec d" + "x" * 187 and said[0].isprintable(), said


def test_preflight_refuses_a_notice_file_endpoint_that_is_a_device_fifo_directory_or_existing_file(tmp_path):
    from types import SimpleNamespace

    from tasks.core.preflight.notices import check_notices
    from tasks.core.preflight.report import CheckContext, PreflightReport

    fifo, existing, link = tmp_path / "fifo", tmp_path / "notice", tmp_path / "link"
    os.mkfifo(fifo)
    existing.write_text("old notice\n")
    link.symlink_to("/dev/zero")
    ends = ["/dev/zero", str(fifo), str(tmp_path), str(existing), str(link), str(tmp_path / "fresh"), "/dev/null/x"]
    el = ElasticConfig(notices=[{"source": "file", "endpoint": e} for e in ends])
    phases = {"cpt": SimpleNamespace(elastic=el), "sft": SimpleNamespace(elastic=ElasticConfig())}
    cfg = SimpleNamespace(phase=phases.__getitem__, phases=phases)
    ctx = CheckContext(cfg, None, None, None, PreflightReport())
    _in_time(lambda: check_notices(ctx))
    got = dict(ctx.report.problems)
    field = "cpt.elastic.notices.{}.endpoint".format
    assert set(got) == {field(i) for i in (0, 1, 2, 3, 4, 6)}, got  # 5: nothing there yet, the one that passes
    assert "/dev/zero is a character device, not a file path: name a path where a notice file" in got[field(0)]
    assert "is a FIFO, not a file path" in got[field(1)] and "is a directory, not a file path" in got[field(2)]
    assert "already exists: it would be read as a notice at once; remove it" in got[field(3)]
    assert "is a symbolic link, not a file path" in got[field(4)]
    assert "/dev/null is not a directory" in got[field(6)]


def test_a_polled_endpoint_must_be_an_http_url_and_a_file_endpoint_an_absolute_path(tmp_path):
    from tasks.core.config.load import parse_fields
    from tests.conftest import tiny_config_raw

    for source, endpoint, says in [
        ("aws", "file:///etc/passwd", "is not an http(s) URL: give the metadata service's base URL"),
        ("gcp", "169.254.169.254", "is not an http(s) URL"),
        ("azure", "http://", "is not an http(s) URL"),
        ("file", "notice", "is not an absolute file path"),
        ("file", "http://127.0.0.1/notice", "is not an absolute file path"),
    ]:
        raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
        raw["sft"]["elastic"] = {"notices": [{"source": "slurm"}, {"source": source, "endpoint": endpoint}]}
        with pytest.raises(ConfigError) as caught:
            parse_fields(raw)
        assert [w for w, _ in caught.value.problems] == ["sft.elastic.notices.1.endpoint"], caught.value.problems
        assert says in caught.value.problems[0][1], caught.value.problems
    with pytest.raises(OSError, match="not an http"):
        http_fetch("GET", "ftp://127.0.0.1/x", {})


def test_a_trickling_metadata_endpoint_is_cut_at_each_poll_s_deadline_and_said_once():
    """The double answers a byte every 0.2 s (a whole answer would take over 20 s): each poll ends at
    its 0.5 s deadline, the poller says so once and goes on polling, and hears the notice once the
    endpoint answers again."""
    said: list[str] = []
    with MetadataServer() as m:
        m.trickle_s = 0.2
        cfg = ElasticConfig(notices=[{"source": "gcp", "endpoint": m.url, "poll_s": 0.05}], sigterm=False)
        watch = Watch(cfg.notices, say=said.append, deadline_s=0.5).start()
        try:
            t0 = time.monotonic()
            while len(m.requests) < 4:  # each request a new poll: none of them hangs
                assert time.monotonic() - t0 < 10, m.requests
                time.sleep(0.05)
            assert not watch.noticed
            m.trickle_s, _ = 0.0, m.preempt()
            while not watch.noticed:
                assert time.monotonic() - t0 < 15, said
                time.sleep(0.05)
        finally:
            watch.close()
    cut = f"{m.url}/computeMetadata/v1/instance/preempted: no whole answer within the poll's deadline"
    assert said == [
        f"notice source gcp ({m.url}) not readable, polling on: {cut}",
        "preemption notice (gcp, grace 30s): gcp instance preempted",
    ], said


def test_a_sigterm_that_cancels_goes_to_the_handler_it_replaced_not_to_the_ranks(tmp_path):
    """The launcher asks `cancelled()` (the flow run's state, tasks/flowkit/notices.py) on a SIGTERM:
    a cancel goes on as before SIGTERM was a notice, to the handler the forwarding replaced."""
    from tasks.core.launch.proctree import StageProcesses, forward_notices

    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    try:
        with forward_notices(StageProcesses(rank.pid), ["SIGTERM"], cancelled=lambda: True) as on:
            assert on
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
        assert got == [signal.SIGTERM] and rank.poll() is None  # the cancel's handler ran; no rank was signalled
    finally:
        signal.signal(signal.SIGTERM, previous)
        rank.kill()
        rank.wait()


RANK = """
import os, signal, sys, time
from tasks.core.config.elastic import ElasticConfig
from tasks.core.launch.notice_watch import Watch
watch = Watch(ElasticConfig().notices).start()   # nothing configured: SIGTERM is a notice by default
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print(watch.first.text if watch.first else None)
"""


def test_a_rank_takes_sigterm_as_a_notice_unless_its_launcher_is_tearing_the_stage_down(tmp_path):
    from tasks.core.config.notices import TEARDOWN_ENV
    from tests.conftest import REPO

    marker = tmp_path / "job.json.teardown"
    env = {**os.environ, "PYTHONPATH": str(REPO), TEARDOWN_ENV: str(marker)}
    run = {"env": env, "capture_output": True, "text": True, "timeout": 60}
    noticed = subprocess.run([sys.executable, "-c", RANK], check=False, **run)
    assert (noticed.returncode, noticed.stdout.strip()) == (0, "SIGTERM received"), noticed.stderr[-2000:]
    marker.touch()  # what the launcher's teardown writes before its SIGTERM
    torn = subprocess.run([sys.executable, "-c", RANK], check=False, **run)
    assert (torn.returncode, torn.stdout) == (-signal.SIGTERM, ""), torn.stderr[-2000:]
