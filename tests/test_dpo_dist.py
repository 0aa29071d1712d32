"""DPO's train verb under `torchrun --nproc_per_node=2` on CPU (gloo), on the tiny random Llama.

    pytest -m distributed tests/test_dpo_dist.py -s

The tiny pair set is the shipped sample's first 8 records (every layout the reader takes), prepared by
the real PairEncoder path; its reference is the real `write_reference` on the starting model (the tiny
model stands for sft/hf). Two plugins, each with one uninterrupted run that is the reference of the
checks below (launches shared through module fixtures, 7 in all):

- hybrid_parallel tp=2 fp32 (vocab-split LM head: the log-probabilities computed vocab-parallel): shard
  and train 6 steps in one launch (shard-train, as the flow shares reboost_dpo's ranks with train_dpo);
  its twin from a copy of the same step-000000 killed (SIGKILL of rank 1) after step 4
  (step 3 committed, step 4 lost), resumed and given a notice (SIGTERM to rank 1 after step 4, 20 s
  grace: step-000005 committed, not a periodic step, exit preempted), resumed again to step 6.
- low_level_zero ZeRO-2 fp32 on 2 data-parallel ranks, from the tp=2 run's step-000000 re-sharded (no
  shard launch of its own): train 6 steps; its twin noticed after step 1 (step-000002 committed, exit
  preempted) and resumed to step 6.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from support.engine import REPO, engine, phase_raw, read_model_dir, reference_for, shard_train, train_state, write_job

pytestmark = pytest.mark.distributed

TP2 = {"name": "hybrid_parallel", "tp_size": 2, "precision": "fp32"}
LLZ2 = {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"}
NOTICE = {"notices": [{"source": "sigterm", "grace_s": 20}]}
STEPS = 6


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dpo")


def _jobs(work: Path, name: str, plugin: dict, model: Path, stage_dir: Path, **kw) -> tuple[Path, Path]:
    src = work / "pairs.jsonl"
    if not src.is_file():
        src.write_text("".join((REPO / "data" / "sample" / "dpo.jsonl").read_text().splitlines(keepends=True)[:8]))
    # 8 pairs, 2 a step (tp=2: 2 on its one replica; ZeRO-2: 1 on each of 2): every pair seen at steps 1-4
    section = phase_raw(
        "dpo", plugin, data={"uri": str(src)}, seq_len=96, lr=1e-2, beta=0.5, checkpoint_every=3, keep_last=3, **kw
    )
    section["micro_batch_size"] = 2 if plugin["name"] == "hybrid_parallel" else 1
    common = dict(phase="dpo", phase_cfg=section, model_dir=model, stage_dir=stage_dir)
    shard = write_job(work / "jobs" / f"{name}-shard.json", verb="shard", **common)
    ref = reference_for(shard, work / "reference")
    return shard, write_job(work / "jobs" / f"{name}-train.json", verb="train", reference_dir=ref, **common)


def _fresh(src: Path, *dirs: Path) -> None:
    for d in dirs:
        d.mkdir(parents=True)
        shutil.copytree(src, d / src.name)


@pytest.fixture(scope="module")
def tp2(work, tiny_model_dir):
    d, twin = work / "tp2" / "dpo", work / "tp2-kill" / "dpo"
    shard_job, train_job = _jobs(work, "tp2", TP2, tiny_model_dir, d)
    # shard and the uninterrupted run in one launch, as the flow shares them; step-000000 stays for the copies
    shard = train = shard_train(shard_job, train_job)
    _fresh(d / "step-000000", twin, work / "llz" / "dpo", work / "llz-notice" / "dpo")
    _, twin_job = _jobs(work, "tp2-kill", TP2, tiny_model_dir, twin, elastic=NOTICE)
    killed = engine("train", twin_job, env={"CPT_TO_SFT_FAULT": "kill@step=4"}, expect_ok=False)
    preempted = engine("train", twin_job, env={"CPT_TO_SFT_FAULT": "term@step=4@rank=1"}, expect_ok=False)
    resumed = engine("train", twin_job)
    return dict(dir=d, twin=twin, shard=shard, train=train, killed=killed, preempted=preempted, resumed=resumed)


@pytest.fixture(scope="module")
def llz(work, tiny_model_dir, tp2):
    d, twin = work / "llz" / "dpo", work / "llz-notice" / "dpo"  # both hold a copy of tp2's step-000000
    _, train_job = _jobs(work, "llz", LLZ2, tiny_model_dir, d)
    train = engine("train", train_job)
    _, twin_job = _jobs(work, "llz-notice", LLZ2, tiny_model_dir, twin, elastic=NOTICE)
    preempted = engine("train", twin_job, env={"CPT_TO_SFT_FAULT": "term@step=1@rank=1"}, expect_ok=False)
    resumed = engine("train", twin_job)
    return dict(dir=d, twin=twin, train=train, preempted=preempted, resumed=resumed)


def _trained(run, stage_dir: Path) -> list[float]:
    prog = run.progress
    assert [p["step"] for p in prog] == list(range(1, STEPS + 1)), run.output[-3000:]
    losses = [p["loss"] for p in prog]
    state = train_state(stage_dir / f"step-{STEPS:06d}")
    assert state["losses"] == losses and state["phase"] == "dpo"
    # the per-step preference figures beside the losses, as the progress records carried them
    assert {k: [p[k] for p in prog] for k in ("accuracy", "margin", "chosen_logp")} == state["preference"]
    return losses


@pytest.mark.parametrize("name", ["tp2", "llz"])
def test_dpo_lowers_the_loss_from_the_reference_model(name, tp2, llz):
    run = {"tp2": tp2, "llz": llz}[name]
    losses = _trained(run["train"], run["dir"])
    state = train_state(run["dir"] / f"step-{STEPS:06d}")
    # Step 1 scores the pairs with the model the reference was computed from: the margin is 0 and the loss
    # log 2, so the ranks' log-probabilities (vocab-parallel under tp=2) are plain transformers' own.
    assert abs(losses[0] - math.log(2)) < 1e-6 and abs(state["preference"]["margin"][0]) < 1e-6
    assert max(losses[-2:]) < losses[0] - 0.05, losses
    assert state["preference"]["accuracy"][-1] == 1.0 and state["preference"]["margin"][-1] > 0
    print(f"\n{name} dpo losses: {[round(x, 4) for x in losses]}")


def test_tp2_and_zero2_train_the_same_pairs_alike(tp2, llz):
    """The same global batches from the same weights: the vocab-parallel pair loss under tp=2 trains as the
    whole-logits one under ZeRO-2 does (fp32 reduction order apart)."""
    a, b = (train_state(r["dir"] / f"step-{STEPS:06d}")["losses"] for r in (tp2, llz))
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)


def _same_end(ref_dir: Path, got_dir: Path) -> None:
    ref, got = (train_state(d / f"step-{STEPS:06d}") for d in (ref_dir, got_dir))
    for key in ("losses", "lrs", "tokens_seen", "sampler", "preference"):
        assert got[key] == ref[key], key  # python floats from JSON: bitwise
    a, b = (read_model_dir(d / f"step-{STEPS:06d}" / "model") for d in (ref_dir, got_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tp2_resume_after_a_kill_is_bitwise(tp2):
    killed = tp2["killed"]
    assert killed.rc != 0 and [p["step"] for p in killed.progress] == [1, 2, 3, 4]
    assert [c["step"] for c in killed.checkpoints] == [3]  # step 4 trained, lost with the kill
    assert "resuming dpo from step-000003" in tp2["preempted"].output
    assert "resuming dpo from step-000005" in tp2["resumed"].output
    assert [p["step"] for p in tp2["resumed"].progress] == [6]
    _same_end(tp2["dir"], tp2["twin"])


def _preempted(run, step: int) -> dict:
    import logging

    from tasks.core.errors import PREEMPTED_EXIT, Preempted
    from tasks.core.launch.torchrun import Router

    assert run.rc != 0 and re.search(rf"exitcode\s*:\s*{PREEMPTED_EXIT}", run.output), run.output[-3000:]
    assert [c["step"] for c in run.checkpoints] == [step]
    router = Router(logging.getLogger("test-dpo-preempted"))
    for line in run.output.splitlines():
        router.line(line)
    exc = router.failure("train", run.rc)
    assert isinstance(exc, Preempted), exc
    return exc.record


@pytest.mark.parametrize("name, step", [("tp2", 5), ("llz", 2)])
def test_a_notice_commits_the_step_in_flight_and_the_resume_is_bitwise(name, step, tp2, llz):
    """SIGTERM to rank 1 alone at the start of a step that is no periodic checkpoint's: both ranks finish
    it, commit it and exit preempted, losing no step; the resume from it ends on the uninterrupted run."""
    run = {"tp2": tp2, "llz": llz}[name]
    rec = _preempted(run["preempted"], step)
    assert (rec["phase"], rec["noticed_step"], rec["checkpoint_step"], rec["steps_lost"]) == ("dpo", step, step, 0)
    assert f"resuming dpo from step-{step:06d}" in run["resumed"].output
    _same_end(run["dir"], run["twin"])
