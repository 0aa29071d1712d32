"""A training stage continued through the flow under another layout (docs/resume.md), on copies of the
session's demo run (tests/conftest.py `demo_run`: CPT under hybrid_parallel tp=2 fp32, SFT under
low_level_zero ZeRO-2 bf16, both on 2 ranks, 8 steps, checkpoints at 4 and 8), whose uninterrupted
losses are the reference. Eleven launches in all.

    .venv/bin/python -m pytest -q -m "" tests/test_elastic_flow.py

- CPT: step-000008 removed, the stage re-run under tp=2 and killed after step 6 (its newest checkpoint
  is step 4), then the flow re-run under torch_ddp on 1 rank: pre-flight and the engine say it in one
  line, the state step 5 starts from is the checkpoint's re-sharded for one rank, bitwise, the losses
  continue the uninterrupted run's within fp32 reduction-order noise, run.json and the stage table
  record both segments.
- SFT: step-000008 removed, the flow re-run with one rank at 4 x 2 (the same global batch of 8): only
  train_sft runs, from the checkpoint's fp32 masters cut for one rank, bitwise.
- Preemption (docs/spot.md): CPT from step 4 gets a SIGTERM notice as step 6 begins (and another in the
  middle of that step's save); the stage commits step 6, ends preempted, the flow retries by itself and
  step 8 is the uninterrupted run's, bitwise (two launches). A notice during export and during
  prepare_cpt (no launch): preempted, nothing torn, the retry redoes nothing finished.
- SFT (2 ranks, ZeRO-2 bf16) from step 4 with no notice configured: a Prefect cancel (the run set
  Cancelling, then SIGTERM to this process) ends it Cancelled with nothing committed; then a machine's
  shutdown, SIGTERM to every process of the run (this one, torchrun, both ranks) as step 6 begins: step 6
  is committed, the flow retries by itself and step 8 is the uninterrupted run's, bitwise (three launches).
- The same with `cpt.elastic.keep_global_batch` (so from step 0, three launches): SIGTERM on 2 ranks as step 3
  begins, the config says one rank came back while the run waits, and the flow's retry reads it and trains
  steps 4-8 on 1 rank at the checkpoint's global batch: losses within 1e-6 of the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import console_capture, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

CPT_LINE = (
    "cpt: resuming step-000004, written under hybrid_parallel tp=2 dp=1 on 2 ranks (4 x 1 a rank), under "
    "torch_ddp dp=1 on 1 rank (4 x 1 a rank): model and optimizer re-sharded"
)
SFT_LINE = (
    "sft: resuming step-000004, written under low_level_zero zero=2 dp=2 on 2 ranks (4 x 1 a rank), under "
    "low_level_zero zero=2 dp=1 on 1 rank (4 x 2 a rank): model and optimizer re-sharded"
)


def _state(step_dir: Path) -> dict:
    return json.loads((step_dir / "train_state.json").read_text())


def _check(config: Path) -> str:
    """What `--check` prints (pre-flight only, nothing started)."""
    from flows.cli import flow_main as main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--config", str(config), "--check"]) == 0, out.getvalue()
    return out.getvalue()


def _run(config: Path, stop_after: str, sets: tuple[str, ...] | None = None) -> tuple[int, dict, str]:
    """`python -m flows.cpt_to_sft`, or with `sets`, `cpt-to-sft run` with those --set items."""
    from flows.cli import flow_main, main

    with console_capture() as console:
        if sets is None:
            rc = flow_main(["--config", str(config), "--stop-after", stop_after])
        else:
            rc = main(["run", "--config", str(config), "--stop-after", stop_after, *(f"--set={s}" for s in sets)])
    return rc, json.loads((config.parent / "run" / "run.json").read_text()), console.getvalue()


def _row(summary: dict, stage: str) -> dict:
    return next(s for s in summary["stages"] if s["stage"] == stage)


def _assert_loaded_is_the_view(step_dir: Path, dumped: Path, *, masters: bool) -> int:
    """The one rank's state right after the load (weights, fp32 masters, AdamW's moments and step) is
    the checkpoint's layout-neutral view, whole (one rank holds every parameter whole), bitwise."""
    from support.engine import read_model_dir
    from tasks.core.models.convert.state_view import CheckpointState, Piece, local_piece

    (live,) = [torch.load(f, weights_only=True) for f in sorted(dumped.glob("rank-*.pt"))]
    view, weights = CheckpointState(step_dir), read_model_dir(step_dir / "model")
    assert set(live) == set(view.names()) and view.has_masters is masters
    step = _state(step_dir)["step"]
    for name, st in live.items():
        piece = Piece.of(st["piece"], 0)
        assert (piece.start, piece.length) == (0, piece.local_numel) and piece.local_shape == piece.shape, name
        whole = view.master(name)
        if masters:
            assert torch.equal(st["master"], local_piece(whole, piece)), name
            assert torch.equal(st["weight"], weights[name]), name  # bf16, as written
        else:  # fp32: the weight is its own master
            assert st["master"] is None and torch.equal(st["weight"].reshape(-1), whole.reshape(-1)), name
        adam = view.adam(name)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k].reshape(-1), adam[k].reshape(-1)), (name, k)
        assert float(st["step"]) == adam["step"] == float(step), name
    view.close()
    return len(live)


def _stage_tables(monkeypatch) -> list:
    """The Prefect stage table's rows as the flow makes them, kept (the artifact is made too)."""
    from tasks.flowkit import ui

    made: list = []
    real = ui.create_table_artifact

    def keep(rows, key, description):
        if key == ui.STAGES_KEY:
            made.append(rows)
        return real(rows, key=key, description=description)

    monkeypatch.setattr(ui, "create_table_artifact", keep)
    return made


def test_cpt_killed_under_tp2_on_2_ranks_continues_through_the_flow_under_ddp_on_1(demo_run_copy, monkeypatch):
    from tasks.engine.masters import DUMP_ENV

    copy = demo_run_copy
    cpt = copy.run_root / "cpt"
    ref = _state(cpt / "step-000008")
    shutil.rmtree(cpt / "step-000008")  # the stage as a run killed between its checkpoints at 4 and 8 left it
    table = _stage_tables(monkeypatch)

    # Under the layout that wrote it: killed after step 6 (rank 1 SIGKILLed), step 4 still the newest.
    monkeypatch.setenv("CPT_TO_SFT_FAULT", "kill@step=6@phase=cpt")
    rc, summary, _ = _run(copy.config, "train_cpt")
    assert rc == 1 and _row(summary, "train_cpt")["status"] == "failed", _row(summary, "train_cpt")
    assert sorted(p.name for p in cpt.glob("step-*")) == ["step-000000", "step-000004"]
    monkeypatch.delenv("CPT_TO_SFT_FAULT")

    # One rank, torch_ddp: the same global batch (4 x 1 x dp 1), so the same digests.
    raw = json.loads(json.dumps(copy.raw))
    raw["cpt"].update(plugin={"name": "torch_ddp", "precision": "fp32"}, launch={"nproc_per_node": 1})
    config = write_config(copy.config.parent / "ddp1.yaml", raw)
    assert CPT_LINE in _check(config)
    dumped = config.parent / "live-state"
    monkeypatch.setenv(DUMP_ENV, str(dumped))
    rc, summary, console = _run(config, "train_cpt")
    assert rc == 0, console[-4000:]
    statuses = {s["stage"]: s["status"] for s in summary["stages"]}
    assert statuses["boost_and_shard"] == "skipped" and statuses["train_cpt"] == "completed", statuses
    assert CPT_LINE in console, console[-4000:]  # the engine's line, on the console too

    assert _assert_loaded_is_the_view(cpt / "step-000004", dumped / "loaded-step-000004", masters=False) > 0
    got = _state(cpt / "step-000008")
    assert got["losses"][:4] == ref["losses"][:4] and got["tokens_seen"] == ref["tokens_seen"]
    assert got["sampler"] == ref["sampler"]
    drift = max(abs(a - b) / abs(b) for a, b in zip(got["losses"][4:], ref["losses"][4:]))
    assert 0 < drift < 1e-4, (ref["losses"], got["losses"])  # a reduction order of its own: not bitwise
    print(f"\ncpt tp=2 on 2 ranks -> ddp on 1 rank: losses of steps 5-8 within {drift:.2e} (relative) of the run's")

    segs = [(s["from_step"], s["plugin"], s["tp"], s["world_size"]) for s in got["segments"]]
    assert segs == [(0, "hybrid_parallel", 2, 2), (4, "torch_ddp", 1, 1)]
    assert _row(summary, "train_cpt")["detail"]["segments"] == got["segments"]
    (row,) = [r for r in table[-1] if r["stage"] == "train_cpt"]
    assert row["note"] == (
        "from step 0: hybrid_parallel tp=2 dp=1 on 2 ranks (4 x 1 a rank); "
        "from step 4: torch_ddp dp=1 on 1 rank (4 x 1 a rank)"
    ), row
    assert [r["note"] for r in table[-1] if r["stage"] == "boost_and_shard"] == [""]


def test_sft_under_low_level_zero_on_2_ranks_continues_through_the_flow_on_1(demo_run_copy, monkeypatch):
    from tasks.engine.masters import DUMP_ENV

    copy = demo_run_copy
    sft = copy.run_root / "sft"
    ref = _state(sft / "step-000008")
    shutil.rmtree(sft / "step-000008")
    raw = json.loads(json.dumps(copy.raw))
    raw["sft"].update(launch={"nproc_per_node": 1}, grad_accum_steps=2)  # 4 x 2 x dp 1 = 4 x 1 x dp 2
    config = write_config(copy.config.parent / "one-rank.yaml", raw)
    assert SFT_LINE in _check(config)
    dumped = config.parent / "live-state"
    monkeypatch.setenv(DUMP_ENV, str(dumped))
    table = _stage_tables(monkeypatch)
    rc, summary, console = _run(config, "train_sft")
    assert rc == 0, console[-4000:]
    statuses = {s["stage"]: s["status"] for s in summary["stages"]}
    assert {k for k, v in statuses.items() if v == "completed"} == {"train_sft"}, statuses
    assert SFT_LINE in console, console[-4000:]

    assert _assert_loaded_is_the_view(sft / "step-000004", dumped / "loaded-step-000004", masters=True) > 0
    got = _state(sft / "step-000008")
    assert got["losses"][:4] == ref["losses"][:4] and got["tokens_seen"] == ref["tokens_seen"]
    drift = max(abs(a - b) / abs(b) for a, b in zip(got["losses"][4:], ref["losses"][4:]))
    assert drift < 2e-2, (ref["losses"], got["losses"])  # bf16 working weights: bf16 reduction-order noise
    print(f"\nsft llz2 on 2 ranks -> 1 rank: losses of steps 5-8 within {drift:.2e} (relative) of the run's")
    assert [(s["from_step"], s["dp"], s["grad_accum_steps"]) for s in got["segments"]] == [(0, 2, 1), (4, 1, 2)]
    assert _row(summary, "train_sft")["detail"]["segments"] == got["segments"]
    (row,) = [r for r in table[-1] if r["stage"] == "train_sft"]
    assert row["note"].endswith("from step 4: low_level_zero zero=2 dp=1 on 1 rank (4 x 2 a rank)"), row


def test_cpt_preempted_by_sigterm_retries_by_itself_and_ends_bitwise_on_the_uninterrupted_run(
    demo_run_copy, monkeypatch
):
    """A notice (SIGTERM to rank 1 as step 6 begins, 20 s grace) to the 2-rank fp32 tp=2 CPT stage: the
    stage finishes step 6, commits it and ends preempted, the flow retries it by itself (no wait, no
    failure retry), the retry resumes from step 6, and step 8's weights are the uninterrupted run's, bitwise.
    run.json, the stage table, the end-of-run table and cpt/preemptions.json record the preemption."""
    from support.engine import read_model_dir

    copy = demo_run_copy
    cpt = copy.run_root / "cpt"
    ref_dir = copy.run_root.parent / "ref-step-000008"
    (cpt / "step-000008").rename(ref_dir)  # the uninterrupted run's step 8: the reference
    raw = json.loads(json.dumps(copy.raw))
    # Not in any digest: train_cpt resumes from step 4 as it would without a notice source.
    raw["cpt"]["elastic"] = {"notices": [{"source": "sigterm", "grace_s": 20}], "retry_wait_s": 0}
    config = write_config(copy.config.parent / "spot.yaml", raw)
    table = _stage_tables(monkeypatch)
    # and a second notice, to rank 0, in the middle of that step's checkpoint save: the save finishes whole
    monkeypatch.setenv("CPT_TO_SFT_FAULT", "term@step=5@phase=cpt@rank=1;term@save=6:optimizer@phase=cpt@rank=0")
    rc, summary, console = _run(config, "train_cpt")
    assert rc == 0, console[-4000:]
    assert _row(summary, "train_cpt")["status"] == "completed", _row(summary, "train_cpt")

    (rec,) = summary["preemptions"]
    assert (rec["stage"], rec["phase"], rec["source"], rec["noticed_step"], rec["checkpoint_step"]) == (
        "train_cpt",
        "cpt",
        "sigterm",
        6,
        6,
    ), rec
    assert rec["steps_lost"] == 0, (
        rec
    )  # the notice came as step 6 began (term@step=5): step 6 finished and was committed
    assert 0 <= rec["notice_to_commit_s"] < 20 and rec["restart_to_first_step_s"] > 0, rec
    assert rec["at"].endswith("Z") and _row(summary, "train_cpt")["detail"]["preemptions"] == [rec]
    assert json.loads((cpt / "preemptions.json").read_text()) == [rec]
    assert "retrying the run in 0 s" in console and "cpt preempted " in console, console[-4000:]
    fired = sorted(f.read_text().strip() for f in (cpt / ".faults").iterdir())  # each spec marks itself as it fires
    assert fired == ["term@save=6:optimizer@phase=cpt@rank=0", "term@step=5@phase=cpt@rank=1"], fired
    assert not [p.name for p in cpt.iterdir() if p.name.startswith(".step-")], "a torn checkpoint was left"
    (row,) = [r for r in table[-1] if r["stage"] == "train_cpt"]
    assert "preempted 1x, steps lost 0" in row["note"], row
    assert any(r["status"] == "preempted" for t in table[:-1] for r in t if r["stage"] == "train_cpt"), table

    got, want = read_model_dir(cpt / "step-000008" / "model"), read_model_dir(ref_dir / "model")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert _state(cpt / "step-000008")["losses"] == _state(ref_dir)["losses"]


def test_sft_cancelled_from_prefect_ends_cancelled_and_a_shutdown_keeps_the_step_in_flight(demo_run_copy, monkeypatch):
    """The 2-rank low_level_zero ZeRO-2 bf16 SFT stage from step 4, with no notice in the config
    (`sft.elastic.sigterm` is on by default), twice:

    1. a Prefect cancel: while the ranks hold after step 5, the flow run is set Cancelling through the
       API and this process (the flow's) gets the SIGTERM a runner sends. It reads Cancelling, so the
       SIGTERM is a cancel: the stage is torn down (the ranks end at once, no checkpoint is started)
       and the flow run ends Cancelled (exit 130);
    2. a machine's shutdown: SIGTERM to every process of the run at once (this one, torchrun and both
       ranks) as step 6 begins. The flow run reads Running, so it is a notice: step 6 is committed,
       the stage ends preempted, the flow retries it by itself, and step 8 is the uninterrupted run's,
       bitwise."""
    import contextvars
    import signal as sig
    import threading
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    from support.engine import read_model_dir
    from tasks.engine.faults import parse

    copy = demo_run_copy
    sft = copy.run_root / "sft"
    ref_dir = copy.run_root.parent / "ref-sft-step-000008"
    (sft / "step-000008").rename(ref_dir)  # the uninterrupted run's step 8: the reference
    raw = json.loads(json.dumps(copy.raw))
    assert "elastic" not in raw["sft"], raw["sft"]  # no notice configured
    raw["sft"]["elastic"] = {"retry_wait_s": 0}  # no digest holds it: train_sft resumes from step 4
    config = write_config(copy.config.parent / "shutdown.yaml", raw)

    # 1. the cancel, once every rank holds after step 5 (its mark is written as the hold begins)
    hold = "hold@step=5@phase=sft"
    (held,) = parse(hold)
    mark = sft / ".faults" / hashlib.sha256(held.spec.encode()).hexdigest()[:16]
    said: list = []
    ended = threading.Event()  # the run returned: nothing left to cancel, and no SIGTERM for pytest

    def operator() -> None:
        while not mark.exists():
            if ended.wait(0.1):
                return
        time.sleep(0.5)  # both ranks in the hold
        running = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])))
        with get_client(sync_client=True) as client:
            (run,) = client.read_flow_runs(flow_run_filter=running)
            client.set_flow_run_state(run.id, Cancelling(message="cancelled from the UI"), force=True)
        said.append(run.id)
        os.kill(os.getpid(), sig.SIGTERM)  # what Prefect's runner sends once the run is Cancelling

    monkeypatch.setenv("CPT_TO_SFT_FAULT", hold)
    t = threading.Thread(target=contextvars.copy_context().run, args=(operator,), daemon=True)
    t.start()
    try:
        rc, summary, console = _run(config, "train_sft")
    finally:
        ended.set()
        t.join(timeout=60)
    assert rc == 130 and said, console[-4000:]
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(said[0]).state.is_cancelled(), client.read_flow_run(said[0]).state
    assert "cancelled from Prefect (the flow run is Cancelling)" in console and "torn down the train stage" in console
    assert "preemptions" not in summary or not summary["preemptions"], summary.get("preemptions")
    assert sorted(p.name for p in sft.iterdir() if "step-" in p.name) == ["step-000000", "step-000004"]

    # 2. the shutdown, from step 4 again
    monkeypatch.setenv("CPT_TO_SFT_FAULT", "shutdown@step=5@phase=sft")
    rc, summary, console = _run(config, "train_sft")
    assert rc == 0, console[-4000:]
    assert _row(summary, "train_sft")["status"] == "completed", _row(summary, "train_sft")
    (rec,) = summary["preemptions"]
    got = (rec["stage"], rec["phase"], rec["source"], rec["noticed_step"], rec["checkpoint_step"], rec["steps_lost"])
    assert got == ("train_sft", "sft", "sigterm", 6, 6, 0), rec  # step 6, in flight when the SIGTERM came, was kept
    assert rec["grace_s"] == 30.0 and "retrying the run in 0 s" in console, console[-4000:]
    assert not [p.name for p in sft.iterdir() if p.name.startswith(".step-")], "a torn checkpoint was left"
    got, want = read_model_dir(sft / "step-000008" / "model"), read_model_dir(ref_dir / "model")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert _state(sft / "step-000008")["losses"] == _state(ref_dir)["losses"]


def test_cpt_preempted_on_2_ranks_is_retried_by_the_flow_on_1_at_the_kept_global_batch(demo_run_copy, monkeypatch):
    """`cpt.elastic.keep_global_batch` on (from the stage's first run: it is in the digest, so the demo's
    checkpoints are moved aside and CPT trains from step 0 under the demo's layout, tp=2 on 2 ranks, 4 x 1);
    SIGTERM to rank 1 as step 3 begins (20 s grace): step 3 is committed and the stage ends preempted. While
    the run waits, the config says what came back: one rank (torch_ddp, micro_batch_size 2). The flow's own
    retry reads it, pre-flight checks it, and the engine trains steps 4-8 on that rank at 2 x 2, the
    checkpoint's global batch of 4: the losses continue the uninterrupted run's within 1e-6, steps lost 0.
    Run as `cpt-to-sft run --set cpt.elastic.retry_wait_s=0` over a file that says 30: the retry reads the
    user's file (not a copy resolved at the start) with the --set applied again."""
    import tasks.flowkit.run as runner

    copy = demo_run_copy
    cpt = copy.run_root / "cpt"
    ref = _state(cpt / "step-000008")  # the uninterrupted run's, under the first attempt's layout
    raw = json.loads(json.dumps(copy.raw))
    raw["cpt"]["elastic"] = {
        "notices": [{"source": "sigterm", "grace_s": 20}],
        "keep_global_batch": True,
        "retry_wait_s": 30,  # the --set below makes it 0, on the first read and the retry's
    }
    config = write_config(copy.config.parent / "spot-kept.yaml", raw)
    one = json.loads(json.dumps(raw))
    one["cpt"].update(
        plugin={"name": "torch_ddp", "precision": "fp32"}, launch={"nproc_per_node": 1}, micro_batch_size=2
    )
    real, told = runner.preemption_policy, []

    def one_rank_comes_back(cfg, exc):
        write_config(config, one)  # what an operator (or a capacity script) writes while the run waits
        told.append(exc.record.get("checkpoint_step"))
        return real(cfg, exc)

    monkeypatch.setattr(runner, "preemption_policy", one_rank_comes_back)
    monkeypatch.setenv("CPT_TO_SFT_FAULT", "term@step=2@phase=cpt@rank=1")
    table = _stage_tables(monkeypatch)
    rc, summary, console = _run(config, "train_cpt", sets=("cpt.elastic.retry_wait_s=0",))
    assert rc == 0, console[-4000:]
    assert told == [3] and _row(summary, "train_cpt")["status"] == "completed", (told, _row(summary, "train_cpt"))
    (changed,) = [line for line in console.splitlines() if "the config changed while the run waited (" in line]
    assert "cpt.launch.nproc_per_node: 2 -> 1" in changed and "retry_wait_s" not in changed, changed
    kept = (
        "cpt.elastic.keep_global_batch: grad_accum_steps 1 -> 2 on 1 rank(s) (dp 1), the global batch of "
        "step-000003: 4 sequences"
    )
    assert kept in console, console[-4000:]

    (rec,) = summary["preemptions"]
    assert (rec["stage"], rec["phase"], rec["source"], rec["noticed_step"], rec["checkpoint_step"]) == (
        "train_cpt",
        "cpt",
        "sigterm",
        3,
        3,
    ), rec
    assert rec["steps_lost"] == 0, rec
    assert 0 <= rec["notice_to_commit_s"] < 20 and rec["restart_to_first_step_s"] > 0, rec
    assert json.loads((cpt / "preemptions.json").read_text()) == [rec]
    (row,) = [r for r in table[-1] if r["stage"] == "train_cpt"]
    assert "preempted 1x, steps lost 0" in row["note"] and "from step 3: torch_ddp dp=1 on 1 rank (2 x 2" in row["note"]

    got = _state(cpt / "step-000008")
    segs = [
        (s["from_step"], s["plugin"], s["world_size"], s["grad_accum_steps"], s["global_batch"])
        for s in got["segments"]
    ]
    assert segs == [(0, "hybrid_parallel", 2, 1, 4), (3, "torch_ddp", 1, 2, 4)], segs
    assert got["losses"][:3] == ref["losses"][:3]  # the first attempt: the demo's layout, bitwise
    assert got["lrs"] == ref["lrs"] and got["sampler"] == ref["sampler"] and got["tokens_seen"] == ref["tokens_seen"]
    # Another reduction order (one rank, two micro-batches): fp32 noise, measured 2.1e-7 relative (2 ulps of ~6)
    off = max(abs(a - b) / abs(b) for a, b in zip(got["losses"][3:], ref["losses"][3:], strict=True))
    assert off < 1e-6, (ref["losses"], got["losses"])
    print(
        f"\ncpt preempted at step 3 on 2 ranks, retried by the flow on 1 at 2 x 2: steps 4-8 within {off:.2e} (relative)"
    )


def test_a_notice_during_export_ends_it_preempted_and_the_retry_redoes_only_the_export(demo_run_copy, monkeypatch):
    """SIGTERM to the flow process while export builds (files written, manifest not yet), with
    `sft.elastic.notices: [{source: sigterm}]`: the export ends preempted at that point, its build
    directory removed (nothing torn); the flow retries by itself, every stage before the export
    skips both times (nothing finished redone) and the export is built whole."""
    import signal as sig

    import tasks.stages.export as export_mod
    from tasks.core.run.manifest import verify_artifact

    copy = demo_run_copy
    shutil.rmtree(copy.run_root / "export")
    raw = json.loads(json.dumps(copy.raw))
    raw["sft"]["elastic"] = {"notices": [{"source": "sigterm", "grace_s": 20}], "retry_wait_s": 0}
    config = write_config(copy.config.parent / "spot-export.yaml", raw)
    table = _stage_tables(monkeypatch)
    real, sent = export_mod.framework_versions, []

    def versions_then_notice():
        if not sent:
            # the stage listens in this process (else a SIGTERM would end pytest): the notice lands mid-build
            assert sig.getsignal(sig.SIGTERM) not in (sig.SIG_DFL, None), sig.getsignal(sig.SIGTERM)
            assert list(copy.run_root.glob("export.tmp-build/*"))
            sent.append(1)
            os.kill(os.getpid(), sig.SIGTERM)
        return real()

    monkeypatch.setattr(export_mod, "framework_versions", versions_then_notice)
    rc, summary, console = _run(config, "export")
    assert rc == 0 and sent, console[-4000:]
    (rec,) = summary["preemptions"]
    assert (rec["stage"], rec["source"], rec["steps_lost"]) == ("export", "sigterm", 0), rec
    assert _row(summary, "export")["status"] == "completed"
    before = [s["stage"] for s in summary["stages"]][: [s["stage"] for s in summary["stages"]].index("export")]
    assert all(_row(summary, s)["status"] == "skipped" for s in before), summary["stages"]
    preempted = next(t for t in table if any(r["stage"] == "export" and r["status"] == "preempted" for r in t))
    assert all(r["status"] == "skipped" for r in preempted if r["stage"] in before), preempted
    verify_artifact(copy.run_root / "export")
    assert not list(copy.run_root.glob("*.tmp-build")), "a build directory was left"


def test_a_notice_during_prepare_cpt_ends_it_preempted_and_the_retry_tokenizes_nothing_again(
    demo_run_copy, monkeypatch
):
    """SIGTERM to the flow process while prepare_cpt copies its first tokenized shard into data/cpt,
    with `cpt.elastic.notices: [{source: sigterm}]`: the stage ends preempted, its build directory
    removed (no data/cpt, nothing torn); the flow's retry builds data/cpt whole from the shards
    already in the cache, none tokenized again (their files untouched)."""
    import signal as sig

    import tasks.core.data.prepare as prep
    from tasks.core.run.manifest import verify_artifact
    from tasks.core.run.stages import DATA_CACHE

    copy = demo_run_copy
    shutil.rmtree(copy.run_root / "data" / "cpt")
    cache = copy.run_root / DATA_CACHE / "cpt" / "shards"
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    assert before, f"no tokenized shards in {cache}"
    raw = json.loads(json.dumps(copy.raw))
    raw["cpt"]["elastic"] = {"notices": [{"source": "sigterm", "grace_s": 20}], "retry_wait_s": 0}
    config = write_config(copy.config.parent / "spot-prepare.yaml", raw)
    real, sent = prep.copy_shard, []

    def copy_then_notice(src, dest):
        real(src, dest)
        if not sent:
            assert sig.getsignal(sig.SIGTERM) not in (sig.SIG_DFL, None), sig.getsignal(sig.SIGTERM)
            sent.append(1)
            os.kill(os.getpid(), sig.SIGTERM)

    monkeypatch.setattr(prep, "copy_shard", copy_then_notice)
    rc, summary, console = _run(config, "prepare_cpt")
    assert rc == 0 and sent, console[-4000:]
    (rec,) = summary["preemptions"]
    assert (rec["stage"], rec["source"], rec["steps_lost"]) == ("prepare_cpt", "sigterm", 0), rec
    assert _row(summary, "load_from_hf")["status"] == "skipped" and _row(summary, "prepare_cpt")["status"] == (
        "completed"
    )
    verify_artifact(copy.run_root / "data" / "cpt")
    assert not list(copy.run_root.rglob("*.tmp-build")), "a build directory was left"
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == before  # nothing tokenized again
