"""The engine under `torchrun --nproc_per_node=2` on CPU (gloo), on the tiny random Llama.

    pytest -m distributed tests/test_engine_dist.py -s

Every launch costs ~8-13 s of imports on 2 cores, so launches are shared through module-scoped
fixtures (19 in all; the kill-in-every-save-phase test and the four re-layout tests launch their own),
and a stage's shard and its first training run share one launch (the verb shard-train, as the flow
runs them: `_shard_train`) wherever nothing has to happen between the two:

- hybrid_parallel tp=2 fp32, CPT on a 70/30 mixture of two sources (the blended stream of the 6
  steps): shard, train 6 steps uninterrupted, then the same 6 steps killed (SIGKILL of rank 1)
  after the checkpoint at step 3, mid-blend, resumed and preempted (SIGTERM to rank 1 after step 4,
  20 s grace: step-000005 committed, exit preempted), and resumed again -> per-step losses and final
  weights bitwise equal; checkpoint layout, manifests, retention, fingerprints. The preempted
  step-000005 continued on 1 rank with elastic.keep_global_batch (one launch of its own).
- the tp=2 stage under sequence parallelism from the same step-000000: split_gather (tp=2) and
  all_to_all (sp=2, tp=1) train the 6 steps -> losses and weights equal the tp=2 run's within fp32
  tolerance; the all_to_all stage then trains steps 4-6 again from its step-3 checkpoint -> bitwise.
- hybrid_parallel pp=2 fp32, CPT: shard; train killed in the middle of the save of step 6
  (before the optimizer files) -> the next attempt discards the torn save and resumes from step 3.
- low_level_zero stage 2 bf16, SFT (grad_accum 2): reboost from an HF dir made of the tp=2
  checkpoint's `model/` -> every tensor is the exact bf16 cast of its input; train.
- torch_ddp fp32, SFT (grad_accum 2), packed rows of a 60/40 mixture of two chat sources: reboost
  from the pp=2 checkpoint's `model/` -> every tensor bitwise equal; train; a flipped byte in the
  newest checkpoint is detected, named, skipped, and the retrained steps reproduce the same losses.
- low_level_zero fp32 with cpu_offload on a tied-embedding Qwen2: shard and train (the tied LM head is
  saved once, as HF does; the plugin takes its offload field and trains with it on CPU, where the
  fp32 master shard it moves is in host memory anyway).
- hybrid_parallel tp=2 fp32 on a wider random Llama (~100M parameters, 0.41 GB in fp32, one
  model.safetensors file, as HF saves any model under 5 GB): the shard verb only. Each rank's logged
  construction peak (model built lazily, sharded, weights read one tensor at a time) is what the
  memory estimate says (its share plus one tensor), well below the whole model. step-000000 is saved
  in several files (the save's blocks are sized by the largest tensor) and holds the HF tensors bitwise.
- hybrid_parallel tp=2 with ZeRO-1 bf16, CPT: shard, train, killed after step 4 and resumed (fp32 masters).
- Re-layouts, one launch each: the low_level_zero SFT checkpoint continued on 1 rank, the pp=2 CPT
  checkpoint continued under tp=2, the tp=2 ZeRO-1 bf16 one continued without ZeRO (bitwise).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from support.engine import engine, phase_raw, read_model_dir, shard_train, train_state, write_job
from tasks.core.models.fingerprint import FINGERPRINT_FILE, hf_dir_logits, load_fingerprint, max_abs_diff
from tasks.core.run.manifest import MANIFEST, verify_artifact

pytestmark = pytest.mark.distributed

TP2 = {"name": "hybrid_parallel", "tp_size": 2, "precision": "fp32"}
PP2 = {"name": "hybrid_parallel", "pp_size": 2, "precision": "fp32"}
LLZ2 = {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}
DDP = {"name": "torch_ddp", "precision": "fp32"}
LLZ2_OFFLOAD = {**LLZ2, "cpu_offload": True}

LAUNCHES: list[tuple[str, float]] = []
NOTICE = {"notices": [{"source": "sigterm", "grace_s": 20}]}


def _dump(work: Path, name: str) -> dict[str, str]:
    """The environment that makes every rank write the state it holds at each save (tasks/engine/masters.py)."""
    from tasks.engine.masters import DUMP_ENV

    return {DUMP_ENV: str(work / "live-state" / name)}


def _engine(label: str, verb: str, job: Path, **kw):
    run = engine(verb, job, **kw)
    LAUNCHES.append((label, run.seconds))
    return run


def _shard_train(label: str, shard_job: Path, train_job: Path, fault: str = "", **kw):
    """support.engine.shard_train: a stage's shard and train in one launch, as the flow shares them."""
    run = shard_train(shard_job, train_job, fault, **kw)
    LAUNCHES.append((label, run.seconds))
    return run


# Session-scoped: a module-scoped autouse fixture would put every test of this file in one
# pytest-xdist group (tests/conftest.py), the ten-kill test included.
@pytest.fixture(scope="session", autouse=True)
def _report_launches():
    t0 = time.monotonic()
    yield
    total = sum(s for _, s in LAUNCHES)
    lines = [f"  {label:<28} {s:6.1f}s" for label, s in LAUNCHES]
    print(f"\nengine launches ({len(LAUNCHES)}, {total:.1f}s of {time.monotonic() - t0:.1f}s):\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine")


def _jobs(
    work: Path,
    name: str,
    phase: str,
    plugin: dict,
    model_dir: Path,
    tokenizer_dir: Path,
    stage_dir: Path,
    verify_memory_gb: float | None = None,
    **phase_kw,
):
    section = phase_raw(phase, plugin, **phase_kw)
    common = dict(
        phase=phase,
        phase_cfg=section,
        model_dir=model_dir,
        tokenizer_dir=tokenizer_dir,
        stage_dir=stage_dir,
        verify_memory_gb=verify_memory_gb,
    )
    return (
        write_job(work / "jobs" / f"{name}-shard.json", verb="shard", **common),
        write_job(work / "jobs" / f"{name}-train.json", verb="train", **common),
    )


def _mixture(work: Path) -> dict:
    """CPT data of two weighted sources: the sample corpus (domain) and the sample chats' text (general)."""
    from support.engine import REPO

    chats = [
        json.loads(line) for line in (REPO / "data" / "sample" / "sft.jsonl").read_text().splitlines() if line.strip()
    ]
    general = work / "general.jsonl"
    general.write_text(
        "".join(json.dumps({"text": " ".join(m["content"] for m in c["messages"])}) + "\n" for c in chats)
    )
    return {
        "sources": [
            {"name": "domain", "uri": str(REPO / "data" / "sample" / "cpt.jsonl"), "weight": 0.7},
            {"name": "general", "uri": str(general), "weight": 0.3},
        ]
    }


@pytest.fixture(scope="module")
def tp2(work, tiny_model_dir):
    stage_dir = work / "tp2" / "cpt"
    mix = _mixture(work)
    shard_job, train_job = _jobs(
        work, "tp2", "cpt", TP2, tiny_model_dir, tiny_model_dir, stage_dir, keep_last=1, data=mix
    )
    # shard and the uninterrupted 6 steps in one launch; the killed twin's launches are its own
    shard = train = _shard_train("tp2 shard + train (6 steps)", shard_job, train_job, env=_dump(work, "tp2"))
    # The interrupted twin and the sequence-parallel runs start from copies of the same step-000000
    # (the stage keeps it whatever keep_last says).
    for twin in ("tp2-kill", "sp-split-gather", "sp-all-to-all"):
        (work / twin / "cpt").mkdir(parents=True)
        shutil.copytree(stage_dir / "step-000000", work / twin / "cpt" / "step-000000")
    kill_dir = work / "tp2-kill" / "cpt"
    # The twin listens for SIGTERM with a 20 s grace (the uninterrupted run above at the default 30 s:
    # the setting changes nothing trained).
    _, kill_job = _jobs(
        work, "tp2-kill", "cpt", TP2, tiny_model_dir, tiny_model_dir, kill_dir, keep_last=1, data=mix, elastic=NOTICE
    )
    faults = {"CPT_TO_SFT_FAULT": "kill@step=3;term@step=4@rank=1"}
    killed = _engine("tp2 train kill@step=3", "train", kill_job, env=faults, expect_ok=False)
    # Resumed from step 3; after step 4 rank 1 alone gets SIGTERM: both ranks stop after step 5.
    preempted = _engine("tp2 train term@step=4", "train", kill_job, env=faults, expect_ok=False)
    # keep_last=1: the resume drops step-000005; what it was is kept here, and a copy for the 1-rank test.
    preempted.step5 = (verify_artifact(kill_dir / "step-000005"), train_state(kill_dir / "step-000005"))
    shutil.copytree(kill_dir / "step-000005", work / "tp2-to-1" / "cpt" / "step-000005")
    resumed = _engine("tp2 train resume", "train", kill_job, env=faults)
    data_dir = Path(json.loads(train_job.read_text())["data_dir"])
    return dict(
        dir=stage_dir,
        kill_dir=kill_dir,
        shard=shard,
        train=train,
        killed=killed,
        preempted=preempted,
        resumed=resumed,
        data_dir=data_dir,
    )


# The tp=2 stage under sequence parallelism, from the same step-000000, on the same blended data (global
# batch 2, dp 1 in every layout): split_gather inside tp=2, all_to_all as a group of its own at tp=1 (the
# checkpoint re-sharded), the latter resumed from its step-3 checkpoint.
SG = {**TP2, "sequence_parallelism": {"mode": "split_gather"}}
A2A = {"name": "hybrid_parallel", "precision": "fp32", "sequence_parallelism": {"mode": "all_to_all", "size": 2}}


@pytest.fixture(scope="module")
def sp(work, tiny_model_dir, tp2):
    mix, out = _mixture(work), {}
    for name, plugin in (("sp-split-gather", SG), ("sp-all-to-all", A2A)):
        stage_dir = work / name / "cpt"
        _, train_job = _jobs(
            work, name, "cpt", plugin, tiny_model_dir, tiny_model_dir, stage_dir, keep_last=2, data=mix
        )
        out[name] = dict(dir=stage_dir, train=_engine(f"{name} train", "train", train_job), job=train_job)
    # Resume mid-stage: the uninterrupted step-000006 moved aside, the stage trains steps 4-6 again from step 3.
    a2a = out["sp-all-to-all"]
    shutil.move(a2a["dir"] / "step-000006", work / "sp-all-to-all-step-000006")
    a2a["resumed"] = _engine("sp-all-to-all resume", "train", a2a["job"])
    a2a["uninterrupted"] = work / "sp-all-to-all-step-000006"
    return out


@pytest.fixture(scope="module")
def pp2(work, tiny_model_dir):
    stage_dir = work / "pp2" / "cpt"
    # A weights budget below the tiny model's size: rank 0 streams the saved model/ a layer at a
    # time for each checkpoint's fingerprint, as it would for a model larger than verify_memory_gb.
    shard_job, train_job = _jobs(
        work,
        "pp2",
        "cpt",
        PP2,
        tiny_model_dir,
        tiny_model_dir,
        stage_dir,
        verify_memory_gb=1e-6,
        grad_accum_steps=2,
        keep_last=2,
    )
    shard = torn = _shard_train(
        "pp2 shard + train kill@save=6", shard_job, train_job, fault="kill@save=6:optimizer", expect_ok=False
    )
    leftovers = sorted(p.name for p in stage_dir.iterdir())
    resumed = _engine("pp2 train resume", "train", train_job, env=_dump(work, "pp2"))
    return dict(dir=stage_dir, shard=shard, torn=torn, leftovers=leftovers, resumed=resumed)


@pytest.fixture(scope="module")
def llz(work, tiny_model_dir, tp2):
    hf_in = tp2["dir"] / "step-000006" / "model"
    stage_dir = work / "llz" / "sft"
    shard_job, train_job = _jobs(work, "llz", "sft", LLZ2, hf_in, tiny_model_dir, stage_dir, grad_accum_steps=2)
    shard = train = _shard_train("llz2 reboost + train", shard_job, train_job, env=_dump(work, "llz"))
    kill_dir = work / "llz-kill" / "sft"  # the interrupted twin, from a copy of the same step-000000
    kill_dir.mkdir(parents=True)
    shutil.copytree(stage_dir / "step-000000", kill_dir / "step-000000")
    _, kill_job = _jobs(work, "llz-kill", "sft", LLZ2, hf_in, tiny_model_dir, kill_dir, grad_accum_steps=2)
    fault = {"CPT_TO_SFT_FAULT": "kill@step=4"}  # step 4 trained, not saved: the resume redoes it from step 3
    killed = _engine("llz2 train kill@step=4", "train", kill_job, env=fault, expect_ok=False)
    resumed = _engine("llz2 train resume", "train", kill_job, env=fault)
    return dict(dir=stage_dir, hf_in=hf_in, shard=shard, train=train, kill_dir=kill_dir, killed=killed, resumed=resumed)


@pytest.fixture(scope="module")
def ddp(work, tiny_model_dir, pp2):
    hf_in = pp2["dir"] / "step-000006" / "model"
    stage_dir = work / "ddp" / "sft"
    # Packed SFT rows (several chats a row) of a blend of two chat sources: the retry after the
    # corruption below resumes them bitwise.
    from support.engine import REPO

    chats = (REPO / "data" / "sample" / "sft.jsonl").read_text().splitlines(keepends=True)
    (work / "chats-a.jsonl").write_text("".join(chats[:120]))
    (work / "chats-b.jsonl").write_text("".join(chats[120:]))
    mix = {
        "sources": [
            {"name": "a", "uri": str(work / "chats-a.jsonl"), "weight": 0.6},
            {"name": "b", "uri": str(work / "chats-b.jsonl"), "weight": 0.4},
        ]
    }
    shard_job, train_job = _jobs(
        work,
        "ddp",
        "sft",
        DDP,
        hf_in,
        tiny_model_dir,
        stage_dir,
        grad_accum_steps=2,
        batching="packed",
        seq_len=256,
        data=mix,
    )
    shard = train = _shard_train("ddp reboost + train", shard_job, train_job, env=_dump(work, "ddp"))
    first_losses = train_state(stage_dir / "step-000006")["losses"]
    # Flip one byte of the newest checkpoint's weights: the next attempt must refuse it.
    victim = min((stage_dir / "step-000006" / "model").glob("*.safetensors"))
    blob = bytearray(victim.read_bytes())
    blob[-7] ^= 0x01
    victim.write_bytes(bytes(blob))
    retrain = _engine("ddp train after corruption", "train", train_job)
    data_dir = Path(json.loads(train_job.read_text())["data_dir"])
    return dict(
        dir=stage_dir,
        hf_in=hf_in,
        shard=shard,
        train=train,
        first_losses=first_losses,
        victim=victim,
        retrain=retrain,
        data_dir=data_dir,
    )


@pytest.fixture(scope="module")
def tied(work):
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    model_dir = build_tiny_model(
        work / "qwen2-tied",
        build_tokenizer(DEFAULT_CORPUS, vocab_size=512),
        family="qwen2",
        tie_word_embeddings=True,
        vocab_size=515,
    )  # embedding rows past the tokenizer's 512: a padded vocabulary
    stage_dir = work / "tied" / "cpt"
    shard_job, train_job = _jobs(
        work, "tied", "cpt", LLZ2_OFFLOAD, model_dir, model_dir, stage_dir, max_steps=2, checkpoint_every=2
    )
    shard = train = _shard_train("tied llz2 shard + train", shard_job, train_job, env=_dump(work, "tied"))
    return dict(dir=stage_dir, model_dir=model_dir, shard=shard, train=train)


# A Llama wide enough that one rank's share under tp=2 is measurably less than the whole model over
# the ~0.45 GB a rank holds before it builds one, yet built, read and saved in seconds: 6 layers of
# 16.8M parameters, a 512-token vocabulary (the demo tokenizer's), largest tensor 16.8 MB in fp32,
# saved as one file (the case where ColossalAI's own loader reads the whole model on every rank).
WIDE = dict(hidden_size=1024, num_layers=6, num_heads=16, num_kv_heads=16, intermediate_size=4096)
CONSTRUCTION = re.compile(r"^\[rank (\d+)(?:\|detail)?\] construction peak (\d+) bytes", re.MULTILINE)


@pytest.fixture(scope="module")
def wide(work, tiny_model_dir):
    from transformers import AutoTokenizer

    from tasks.core.models.demo import build_tiny_model

    model_dir = build_tiny_model(
        work / "wide-llama", AutoTokenizer.from_pretrained(tiny_model_dir), max_shard_size="5GB", **WIDE
    )
    stage_dir = work / "wide" / "cpt"
    shard_job, _ = _jobs(work, "wide", "cpt", TP2, model_dir, tiny_model_dir, stage_dir)
    return dict(
        dir=stage_dir,
        model_dir=model_dir,
        shard=_engine("wide tp2 shard", "shard", shard_job),
        section=json.loads(shard_job.read_text())["phase_cfg"],
    )


# ------------------------------------------------------------------------------------------------


def _assert_trains(stage_dir: Path, run, phase: str, max_steps: int = 6):
    prog = run.progress
    assert [p["step"] for p in prog] == list(range(1, max_steps + 1)), run.output[-3000:]
    assert all(p["phase"] == phase and p["total"] == max_steps for p in prog)
    losses = [p["loss"] for p in prog]
    assert all(math.isfinite(x) for x in losses)
    tail = losses[-2:] if len(losses) > 2 else losses[-1:]
    assert sum(tail) / len(tail) < losses[0], f"loss did not go down: {losses}"
    assert prog[-1]["tokens"] > prog[0]["tokens"] > 0
    state = train_state(stage_dir / f"step-{max_steps:06d}")
    assert state["losses"] == losses and state["step"] == max_steps and state["phase"] == phase
    assert state["tokens_seen"] == prog[-1]["tokens"]
    return losses


def _assert_checkpoint(path: Path, phase: str, step: int, plugin: str, vocab: int = 512):
    m = verify_artifact(path)
    assert m["kind"] == "colossalai-checkpoint"
    meta = m["meta"]
    assert (meta["phase"], meta["step"], meta["plugin"]["name"], meta["world_size"]) == (phase, step, plugin, 2)
    assert m["parent"] == {"uri": m["parent"]["uri"], "digest": "parent-digest"} and m["config_digest"] == "0" * 64
    files = set(m["files"])
    for rel in (
        "model/model.safetensors.index.json",
        "model/config.json",
        "lr_scheduler.pt",
        "train_state.json",
        FINGERPRINT_FILE,
        "rng/rank-00000.json",
        "rng/rank-00000.safetensors",
        "rng/rank-00001.json",
        "rng/rank-00001.safetensors",
    ):
        assert rel in files, f"{rel} missing from {path}"
    assert any(f.startswith("optimizer/") for f in files)
    assert m["fingerprint"]["shape"] == [2, 16, vocab]
    return m


def test_tp2_fp32_shard_train_checkpoints(tp2):
    d = tp2["dir"]
    # one launch sharded (step 0) and trained (3, 6), as the flow's shared launch does
    assert tp2["shard"].checkpoints[0] == {"step": 0, "path": str(d / "step-000000")}
    losses = _assert_trains(d, tp2["train"], "cpt")
    assert [c["step"] for c in tp2["train"].checkpoints] == [0, 3, 6]
    # keep_last=1: step-000003 went once step-000006 committed; step-000000 (the shard artifact) stays.
    # (the stage directory also holds tensorboard/, the rank-0 event files)
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("step-")) == ["step-000000", "step-000006"]
    m = _assert_checkpoint(d / "step-000006", "cpt", 6, "hybrid_parallel")
    assert m["meta"]["final_loss"] == losses[-1] and m["meta"]["dp_size"] == 1
    # What ran, recorded: on CPU every kernel off with its reason, no activation checkpointing.
    assert m["meta"]["kernels"] == dict.fromkeys(
        ("flash_attention", "fused_normalization", "jit_fused", "fused_optimizer"), "off: no CUDA"
    )
    assert m["meta"]["activation_checkpointing"] is False
    assert "kernels: flash attention: off: no CUDA;" in tp2["train"].output
    rng = json.loads((d / "step-000006" / "rng" / "rank-00001.json").read_text())
    assert set(rng) == {"rank", "python", "numpy"} and rng["rank"] == 1
    # The fingerprint (live tp=2 model, vocab shards gathered) matches plain transformers on model/.
    assert (
        max_abs_diff(load_fingerprint(d / "step-000006"), hf_dir_logits(d / "step-000006" / "model", dtype="fp32"))
        < 1e-5
    )


def test_tp2_resume_after_kill_is_bitwise(tp2):
    killed, resumed = tp2["killed"], tp2["resumed"]
    assert killed.rc != 0
    assert [p["step"] for p in killed.progress] == [1, 2, 3] and killed.checkpoints[-1]["step"] == 3
    assert "resuming cpt from step-000003" in tp2["preempted"].output
    assert [p["step"] for p in tp2["preempted"].progress] == [4, 5]  # then a notice: see the test below
    assert "resuming cpt from step-000005" in resumed.output
    assert [p["step"] for p in resumed.progress] == [6]
    ref = train_state(tp2["dir"] / "step-000006")
    got = train_state(tp2["kill_dir"] / "step-000006")
    assert got["losses"] == ref["losses"]  # python floats from JSON: bitwise
    assert got["lrs"] == ref["lrs"] and got["tokens_seen"] == ref["tokens_seen"] and got["sampler"] == ref["sampler"]
    a, b = (
        read_model_dir(tp2["dir"] / "step-000006" / "model"),
        read_model_dir(tp2["kill_dir"] / "step-000006" / "model"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Both runs walked the blend of the 6 planned steps of 2 blocks: its 12 positions, used up
    # exactly (a permutation of the corpus's blocks would stand at epoch 0, offset 12).
    index = json.loads((tp2["data_dir"] / "index.json").read_text())
    assert [(s["name"], s["samples"]) for s in index["sources"]] == [("domain", 8), ("general", 4)] and index["blend"][
        "positions"
    ] == 12
    assert ref["sampler"] == {"epoch": 1, "offset": 0, "seed": 1234} and ref["tokens_seen"] == 12 * 32


def test_tp2_sigterm_to_one_rank_commits_that_step_and_exits_preempted(tp2):
    """SIGTERM to rank 1 alone at the start of step 5 (grace 20 s): both ranks agree through the step's
    loss all-reduce, finish step 5, commit step-000005 (manifest last, as a periodic checkpoint) and
    exit PREEMPTED_EXIT; the launcher's Router reads the run as `Preempted`, steps lost 0. The resume
    from it ends bitwise on the uninterrupted run (test_tp2_resume_after_kill_is_bitwise)."""
    import logging

    from tasks.core.errors import PREEMPTED_EXIT, Preempted
    from tasks.core.launch.torchrun import Router

    run = tp2["preempted"]
    assert run.rc != 0
    assert re.search(rf"exitcode\s*:\s*{PREEMPTED_EXIT}", run.output), run.output[-3000:]
    assert "[rank 1] preemption notice (sigterm, grace 20s): SIGTERM received" in run.output
    assert [c["step"] for c in run.checkpoints] == [5]
    step5 = tp2["kill_dir"] / "step-000005"
    manifest, state = run.step5  # verified right after the preempted launch
    assert manifest["meta"]["step"] == 5 and state["step"] == 5 and len(state["losses"]) == 5
    router = Router(logging.getLogger("test-preempted"))
    for line in run.output.splitlines():
        router.line(line)
    exc = router.failure("train", run.rc)
    assert isinstance(exc, Preempted), exc
    rec = exc.record
    assert (rec["source"], rec["noticed_step"], rec["checkpoint_step"], rec["steps_lost"]) == ("sigterm", 5, 5, 0)
    assert rec["checkpoint"] == str(step5) and rec["grace_s"] == 20
    assert 0 < rec["notice_to_commit_s"] < 20 and rec["grace_left_s"] > 0, rec
    print(f"\nnotice -> committed step-000005: {rec['notice_to_commit_s']:.2f}s of a {rec['grace_s']:g}s grace")


def test_tp2_preempted_checkpoint_continues_on_1_rank_at_the_kept_global_batch(tp2, tiny_model_dir, work):
    """The preempted step-000005 (tp=2, dp 1, 2 x 1 a rank: global batch 2) continued on ONE rank
    under torch_ddp at micro_batch_size 1 with elastic.keep_global_batch: the engine sets
    grad_accum_steps 2, so the schedule and the data order continue: step 6's loss is the
    uninterrupted run's within 1e-6."""
    stage_dir = work / "tp2-to-1" / "cpt"
    _, job = _jobs(
        work,
        "tp2-to-1",
        "cpt",
        DDP,
        tiny_model_dir,
        tiny_model_dir,
        stage_dir,
        keep_last=1,
        data=_mixture(work),
        micro_batch_size=1,
        elastic={"keep_global_batch": True},
    )
    run = _engine("tp2 preempted -> 1 rank", "train", job, nproc=1)
    assert (
        "cpt.elastic.keep_global_batch: grad_accum_steps 1 -> 2 on 1 rank(s) (dp 1), the global batch of "
        "step-000005: 2 sequences"
    ) in run.output, run.output[-3000:]
    assert [p["step"] for p in run.progress] == [6]
    ref, got = train_state(tp2["dir"] / "step-000006"), train_state(stage_dir / "step-000006")
    assert got["losses"][:5] == ref["losses"][:5] and got["lrs"] == ref["lrs"]
    assert got["sampler"] == ref["sampler"] and got["tokens_seen"] == ref["tokens_seen"]
    assert abs(got["losses"][5] - ref["losses"][5]) < 1e-6, (got["losses"], ref["losses"])
    print(f"\n1 rank at the kept global batch: step 6 loss off by {abs(got['losses'][5] - ref['losses'][5]):.2e}")
    assert [(s["from_step"], s["world_size"], s["grad_accum_steps"], s["global_batch"]) for s in got["segments"]] == [
        (0, 2, 1, 2),
        (5, 1, 2, 2),
    ]


@pytest.mark.parametrize("name", ["sp-split-gather", "sp-all-to-all"])
def test_sequence_parallel_trains_as_tp2_without_it(sp, tp2, name):
    """Each CPU-capable mode equals the same stage without sequence parallelism: every step's loss and the
    weights after 6 steps (measured: split_gather bitwise; all_to_all, whose attention sees its heads in
    another order of sums, within 1e-6 of the losses and 1e-4 of the weights)."""
    run = sp[name]
    steps = [p["step"] for p in run["train"].progress]
    assert steps == [1, 2, 3, 4, 5, 6], run["train"].output[-3000:]
    ref, got = train_state(tp2["dir"] / "step-000006"), train_state(run["dir"] / "step-000006")
    assert got["tokens_seen"] == ref["tokens_seen"] and got["sampler"] == ref["sampler"]
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
    a, b = read_model_dir(tp2["dir"] / "step-000006" / "model"), read_model_dir(run["dir"] / "step-000006" / "model")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-3, worst
    m = json.loads((run["dir"] / "step-000006" / MANIFEST).read_text())
    assert m["meta"]["dp_size"] == 1  # every rank of the sequence group read the same rows


def test_sequence_parallel_resume_is_bitwise(sp):
    a2a = sp["sp-all-to-all"]
    assert "resuming cpt from step-000003" in a2a["resumed"].output
    assert [p["step"] for p in a2a["resumed"].progress] == [4, 5, 6]
    ref, got = train_state(a2a["uninterrupted"]), train_state(a2a["dir"] / "step-000006")
    assert got["losses"] == ref["losses"] and got["sampler"] == ref["sampler"]
    a, b = read_model_dir(a2a["uninterrupted"] / "model"), read_model_dir(a2a["dir"] / "step-000006" / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pp2_kill_during_save_resumes_from_last_complete(pp2):
    d = pp2["dir"]
    assert pp2["torn"].rc != 0
    assert ".step-000006.tmp" in pp2["leftovers"] and "step-000006" not in pp2["leftovers"]
    out = pp2["resumed"].output
    assert "removed unfinished saves: .step-000006.tmp" in out
    assert "resuming cpt from step-000003" in out
    assert [p["step"] for p in pp2["resumed"].progress] == [4, 5, 6]
    _assert_checkpoint(d / "step-000006", "cpt", 6, "hybrid_parallel")
    assert not any(p.name.endswith(".tmp") for p in d.iterdir())
    # pp=2 writes one file per stage; the fingerprint comes from those weights in plain transformers.
    names = {p.name for p in (d / "step-000006" / "model").glob("*.safetensors")}
    assert names == {"model-stage-00001-shard-00001.safetensors", "model-stage-00002-shard-00001.safetensors"}
    # Streamed on rank 0 (the job's budget is below the model): bitwise the whole-model forward.
    assert "/.step-000006.tmp/model: streamed a decoder layer at a time" in out, out[
        -3000:
    ]  # computed before the rename
    assert torch.equal(load_fingerprint(d / "step-000006"), hf_dir_logits(d / "step-000006" / "model", dtype="fp32"))


def test_tp2_and_pp2_checkpoints_hold_the_full_hf_state_dict(tp2, pp2, tiny_model_dir):
    ref = read_model_dir(tiny_model_dir)
    for d in (tp2["dir"], pp2["dir"]):
        got = read_model_dir(d / "step-000000" / "model")
        assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
        for k in ref:
            assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), f"{d}: {k} differs"


def test_llz2_reboost_from_tp2_hf_dir(llz):
    src = read_model_dir(llz["hf_in"])
    got = read_model_dir(llz["dir"] / "step-000000" / "model")
    assert got.keys() == src.keys()
    for k, v in src.items():
        # bf16 ZeRO stores bf16 working weights: exactly the cast of its fp32 input, nothing else.
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k
    _assert_checkpoint(llz["dir"] / "step-000000", "sft", 0, "low_level_zero")
    _assert_trains(llz["dir"], llz["train"], "sft")
    m = _assert_checkpoint(llz["dir"] / "step-000006", "sft", 6, "low_level_zero")
    assert m["meta"]["weights_dtype"] == "bf16" and m["meta"]["dp_size"] == 2


def test_ddp_reboost_from_pp2_hf_dir_is_bitwise(ddp):
    src = read_model_dir(ddp["hf_in"])
    got = read_model_dir(ddp["dir"] / "step-000000" / "model")
    assert got.keys() == src.keys()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], v) for k, v in src.items())
    _assert_trains(ddp["dir"], ddp["train"], "sft")
    # Packed: 8 rows a step (2 x 2 accumulation x 2 ranks) of seq_len 256, each holding more real
    # tokens than two of the sample's longest chats (106 tokens), little of it padding.
    state = train_state(ddp["dir"] / "step-000006")
    assert state["tokens_seen"] / (6 * 8) > 2 * 106 and max(state["step_metrics"]["padding_frac"]) < 0.15, state
    # The rows came from the blend, made just long enough for the 48 planned rows.
    index = json.loads((ddp["data_dir"] / "index.json").read_text())
    assert index["blend"]["plan"] == {"max_steps": 6, "global_batch": 8, "seed": 1234, "packed_seq_len": 256}
    assert state["sampler"] in ({"epoch": 0, "offset": 48, "seed": 1234}, {"epoch": 1, "offset": 0, "seed": 1234}), (
        state["sampler"]
    )
    assert [s["name"] for s in index["sources"]] == ["a", "b"] and abs(index["sources"][0]["sample_share"] - 0.6) < 0.01


def test_corrupt_newest_checkpoint_is_named_and_skipped(ddp):
    out = ddp["retrain"].output
    assert (
        f"not resuming from step-000006: {ddp['dir'] / 'step-000006'}: file model/{ddp['victim'].name} fails its "
        "sha256 check" in out
    )
    assert "resuming sft from step-000003" in out
    assert [p["step"] for p in ddp["retrain"].progress] == [4, 5, 6]
    verify_artifact(ddp["dir"] / "step-000006")
    assert train_state(ddp["dir"] / "step-000006")["losses"] == ddp["first_losses"]


def test_tied_embeddings_under_low_level_zero(tied):
    src = read_model_dir(tied["model_dir"])
    assert "lm_head.weight" not in src  # HF saves a tied head once
    for step in (0, 2):
        got = read_model_dir(tied["dir"] / f"step-{step:06d}" / "model")
        assert got.keys() == src.keys()
    got = read_model_dir(tied["dir"] / "step-000000" / "model")
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in src.items())
    _assert_trains(tied["dir"], tied["train"], "cpt", max_steps=2)
    # the offload field reached the plugin (builders.offload_kwargs) and is recorded with the checkpoint
    assert "'cpu_offload': True" in tied["shard"].output
    assert (
        _assert_checkpoint(tied["dir"] / "step-000002", "cpt", 2, "low_level_zero", vocab=515)["meta"]["plugin"][
            "cpu_offload"
        ]
        is True
    )


# ---- conversion of real ColossalAI checkpoints ------------------------------------------------

ZERO1 = {"name": "hybrid_parallel", "tp_size": 2, "zero_stage": 1, "precision": "bf16"}


@pytest.fixture(scope="module")
def zero1(work, tiny_model_dir):
    stage_dir = work / "zero1" / "cpt"
    shard_job, train_job = _jobs(work, "zero1", "cpt", ZERO1, tiny_model_dir, tiny_model_dir, stage_dir)
    shard = train = _shard_train("tp2 zero1 bf16 shard + train", shard_job, train_job, env=_dump(work, "zero1"))
    kill_dir = work / "zero1-kill" / "cpt"
    kill_dir.mkdir(parents=True)
    shutil.copytree(stage_dir / "step-000000", kill_dir / "step-000000")
    _, kill_job = _jobs(work, "zero1-kill", "cpt", ZERO1, tiny_model_dir, tiny_model_dir, kill_dir)
    fault = {"CPT_TO_SFT_FAULT": "kill@step=4"}
    killed = _engine("tp2 zero1 bf16 kill@step=4", "train", kill_job, env=fault, expect_ok=False)
    resumed = _engine("tp2 zero1 bf16 resume", "train", kill_job, env=fault)
    return dict(dir=stage_dir, shard=shard, train=train, kill_dir=kill_dir, killed=killed, resumed=resumed)


def test_streaming_converter_on_real_checkpoints_is_bitwise(tp2, pp2, zero1, llz, tiny_model_dir, tmp_path):
    """tp=2, pp=2, tp=2+zero1 and LowLevelZero saves, converted to HF shards, are exactly the
    model's full state dict at save time (the HF input, cast to the plugin's dtype)."""
    from tasks.core.models.convert import convert_checkpoint, load_state_dict_from_dir

    ref = read_model_dir(tiny_model_dir)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    cases = {
        "tp2": (tp2["dir"], torch.float32, ref),
        "pp2": (pp2["dir"], torch.float32, ref),
        "tp2-zero1-bf16": (zero1["dir"], torch.bfloat16, ref),
        "llz2-bf16": (llz["dir"], torch.bfloat16, read_model_dir(llz["hf_in"])),
    }
    for name, (stage_dir, dtype, expected) in cases.items():
        out = tmp_path / name
        report = convert_checkpoint(
            stage_dir / "step-000000" / "model", out, model_config=config, max_shard_size="100KB"
        )
        got = load_state_dict_from_dir(out)
        assert got.keys() == expected.keys(), (name, sorted(set(got) ^ set(expected)))
        for k, v in expected.items():
            assert got[k].dtype == dtype and torch.equal(got[k], v.to(dtype)), f"{name}: {k}"
        assert report.num_tensors == len(expected) and len([f for f in report.files if f.endswith(".safetensors")]) > 1


# ---- kill during save, many times ---------------------------------------------------------------


def test_a_kill_in_every_save_phase_never_loads_a_torn_checkpoint(tmp_path, tiny_model_dir):
    """One trial per save phase, in a seeded random order: each launch resumes, then a rank dies
    inside the next checkpoint save in that phase. Every resume must start from the newest COMPLETE
    checkpoint (one interval back), never a partial one; the last launch completes and every step's
    loss is finite. (Every phase once, where ten random draws from the eight could miss some.)"""
    import random

    from tasks.engine.faults import SAVE_PARTS

    seed = 20261129
    phases = list(SAVE_PARTS)
    random.Random(seed).shuffle(phases)
    last = len(phases) + 1
    # Its own tmp_path, no module fixture: pytest-xdist may run it on another worker than the
    # fixtures above (tests/conftest.py groups a file's tests only where they share one).
    stage_dir = tmp_path / "kills" / "sft"
    shard_job, train_job = _jobs(
        tmp_path,
        "kills",
        "sft",
        DDP,
        tiny_model_dir,
        tiny_model_dir,
        stage_dir,
        max_steps=last,
        checkpoint_every=1,
        keep_last=2,
    )
    for killed_step, phase in enumerate(phases, start=1):
        spec = f"kill@save={killed_step}:{phase}"
        if killed_step == 1:  # the shard and the first trial in one launch, as the flow shares it
            run = _shard_train(f"kills shard + {spec}", shard_job, train_job, fault=spec, expect_ok=False)
        else:
            run = _engine(f"kills {spec}", "train", train_job, env={"CPT_TO_SFT_FAULT": spec}, expect_ok=False)
        assert run.rc != 0, f"seed {seed}: {spec} did not kill the run"
        assert (
            not (stage_dir / f"step-{killed_step:06d}").exists()
            or not (stage_dir / f"step-{killed_step:06d}" / MANIFEST).exists()
        )
        # This launch started after the previous one died saving step killed_step-1: it resumed
        # from the newest complete checkpoint, killed_step-2, redoing exactly one interval.
        resumed_from = max(killed_step - 2, 0)
        begins = "starting" if resumed_from == 0 else "resuming"  # step 0 is the sharded base: a fresh start
        assert f"{begins} sft from step-{resumed_from:06d}" in run.output, (seed, spec, run.output[-2000:])
        assert [p["step"] for p in run.progress] == list(range(resumed_from + 1, killed_step + 1)), (seed, spec)
    final = _engine("kills final resume", "train", train_job)
    assert f"resuming sft from step-{last - 2:06d}" in final.output
    assert [p["step"] for p in final.progress] == [last - 1, last]
    state = train_state(stage_dir / f"step-{last:06d}")
    assert len(state["losses"]) == last and all(math.isfinite(x) for x in state["losses"])
    verify_artifact(stage_dir / f"step-{last:06d}")
    assert not any(p.name.endswith(".tmp") for p in stage_dir.iterdir())


def test_tp2_construction_peak_is_the_rank_share_not_the_whole_model(wide):
    """A rank's host peak while it builds the model lazily, lets the plugin shard it and reads the
    weights one tensor at a time from the base's single file is what the estimate predicts (its fp32
    share plus one whole tensor), below the whole fp32 model by the margin the estimate predicts."""
    from tasks.core.config.schema import PhaseConfig
    from tasks.core.preflight.memory import estimate

    assert [p.name for p in wide["model_dir"].glob("*.safetensors")] == ["model.safetensors"]
    assert "read 57 tensors of" in wide["shard"].output and "(1 file(s), the largest 16.0 MiB)" in wide["shard"].output
    config = json.loads((wide["model_dir"] / "config.json").read_text())
    est = estimate(config, PhaseConfig.model_validate(wide["section"]), phase="cpt")
    whole = est.parameters * 4
    assert est.construction < 0.6 * whole, "the model is too narrow for the estimate to predict a margin"
    peaks = {int(r): int(b) for r, b in CONSTRUCTION.findall(wide["shard"].output)}
    assert sorted(peaks) == [0, 1], wide["shard"].output[-3000:]
    for rank, added in peaks.items():
        assert added <= 1.25 * est.construction < whole, (
            f"rank {rank}: {added:,} bytes over its start; estimate {est.construction:,}, whole model {whole:,}"
        )


def test_a_save_larger_than_its_block_size_holds_the_hf_tensors_bitwise(wide):
    step0 = wide["dir"] / "step-000000"
    _assert_checkpoint(step0, "cpt", 0, "hybrid_parallel")
    assert (
        len(list((step0 / "model").glob("*.safetensors"))) > 1
        and len(list((step0 / "optimizer").glob("pytorch_optim-*.bin"))) > 1
    )
    want, got = read_model_dir(wide["model_dir"]), read_model_dir(step0 / "model")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


# ---- fp32 master weights and the layout-neutral view ----------------------------------------------


def test_bf16_resume_after_kill_is_bitwise(llz, zero1):
    """A bf16 stage killed after step 4 (its last checkpoint at step 3) and resumed reproduces the
    uninterrupted run's losses and final weights bitwise, under low_level_zero ZeRO-2 on 2 ranks and
    hybrid_parallel tp=2 with ZeRO-1: the checkpoint holds the fp32 masters and the resume restores
    them (before, they were rebuilt from the bf16 weights and the run drifted from step 5 on)."""
    for name, f in (("low_level_zero zero 2", llz), ("hybrid_parallel tp2 zero 1", zero1)):
        assert f["killed"].rc != 0 and [p["step"] for p in f["killed"].progress] == [1, 2, 3, 4], name
        out = f["resumed"].output
        assert (
            "resuming" in out and "from step-000003" in out and [p["step"] for p in f["resumed"].progress] == [4, 5, 6]
        ), name
        assert "restored the fp32 master weights of step-000003 (39 as written)" in out, (name, out[-3000:])
        ref, got = train_state(f["dir"] / "step-000006"), train_state(f["kill_dir"] / "step-000006")
        assert got["losses"] == ref["losses"], (name, ref["losses"], got["losses"])
        a, b = (
            read_model_dir(f["dir"] / "step-000006" / "model"),
            read_model_dir(f["kill_dir"] / "step-000006" / "model"),
        )
        assert a.keys() == b.keys() and all(a[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a), name
        meta = verify_artifact(f["kill_dir"] / "step-000006")["meta"]
        n = sum(v.numel() for v in a.values())
        assert meta["masters"]["fp32"] is True and n * 4 <= meta["masters"]["bytes"] < n * 4 + 4 * 64, (
            name,
            meta["masters"],
            n,
        )


def _assert_view_is_live_state(step_dir: Path, dumped: Path, *, masters: bool) -> int:
    """Every rank's live state at the save (its fp32 master pieces, its AdamW state, its weights where
    they are the masters) equals the layout-neutral view cut back to that rank's piece, bitwise."""
    from dataclasses import replace

    from tasks.core.models.convert.state_view import CheckpointState, Piece, local_piece

    view = CheckpointState(step_dir)
    ranks = [torch.load(f, weights_only=True) for f in sorted(dumped.glob("rank-*.pt"))]
    assert len(ranks) == 2, dumped
    assert set(view.names()) == {n for r in ranks for n in r}
    assert view.has_masters is masters, step_dir
    checked = 0
    for live in ranks:
        for name, st in live.items():
            piece = Piece.of(st["piece"], 0)
            whole = view.master(name)
            assert whole.dtype == torch.float32 and tuple(whole.shape) == piece.shape
            if st["master"] is not None:
                assert torch.equal(local_piece(whole, piece), st["master"].reshape(-1)), (step_dir, name)
                state_piece = piece
            else:  # the weight is the master: fp32, this rank's tensor-parallel slice
                state_piece = replace(piece, start=0, length=piece.local_numel)
                assert torch.equal(local_piece(whole, state_piece), st["weight"].reshape(-1)), (step_dir, name)
            adam = view.adam(name)
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(local_piece(adam[k], state_piece), st[k].reshape(-1)), (step_dir, name, k)
            assert adam["step"] == float(st["step"]) > 0
            checked += 1
    view.close()
    return checked


def test_layout_neutral_view_equals_the_state_it_came_from(tp2, pp2, llz, ddp, tied, zero1, work):
    """The view of checkpoints written under tp=2, pp=2, ZeRO-2 on 2 ranks (a Llama, and a tied-embedding
    Qwen2 whose vocabulary is padded past its tokenizer's), tp=2 + ZeRO-1 and DDP, per parameter, bitwise."""
    live = work / "live-state"
    cases = {
        "tp2 fp32": (tp2["dir"] / "step-000006", live / "tp2" / "step-000006", False),
        "pp2 fp32": (pp2["dir"] / "step-000006", live / "pp2" / "step-000006", False),
        "llz2 bf16": (llz["dir"] / "step-000006", live / "llz" / "step-000006", True),
        "ddp fp32": (ddp["dir"] / "step-000003", live / "ddp" / "step-000003", False),
        "tied qwen2 llz2 bf16": (tied["dir"] / "step-000002", live / "tied" / "step-000002", True),
        "tp2 zero1 bf16": (zero1["dir"] / "step-000006", live / "zero1" / "step-000006", True),
    }
    for name, (step_dir, dumped, masters) in cases.items():
        assert _assert_view_is_live_state(step_dir, dumped, masters=masters) > 0, name
    config = json.loads((tied["model_dir"] / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["vocab_size"] > len(
        json.loads((tied["model_dir"] / "tokenizer.json").read_text())["model"]["vocab"]
    )


def test_sft_low_level_zero_on_2_ranks_resumes_on_1_from_the_resharded_state(llz, tiny_model_dir, work):
    """The SFT stage's step-000003 (low_level_zero ZeRO-2 bf16, 2 ranks, 2 x 2 a rank) continued on one
    rank at 2 x 4 (the same global batch of 8): the state it resumes from is the checkpoint's, cut for
    one rank, bitwise (fp32 masters, AdamW moments and step, bf16 weights); steps 4-6 continue the
    uninterrupted run's losses within bf16 reduction-order noise, and train_state records both segments."""
    from tasks.core.models.convert.state_view import CheckpointState, Piece, local_piece

    stage_dir = work / "llz-to-1" / "sft"
    stage_dir.mkdir(parents=True)
    src = llz["dir"] / "step-000003"
    shutil.copytree(src, stage_dir / "step-000003")
    _, job = _jobs(work, "llz-to-1", "sft", LLZ2, llz["hf_in"], tiny_model_dir, stage_dir, grad_accum_steps=4)
    run = _engine("llz2 2 ranks -> 1", "train", job, nproc=1, env=_dump(work, "llz-to-1"))
    out = run.output
    assert (
        "sft: resuming step-000003, written under low_level_zero zero=2 dp=2 on 2 ranks (2 x 2 a rank), under "
        "low_level_zero zero=2 dp=1 on 1 rank (2 x 4 a rank): model and optimizer re-sharded"
    ) in out, out[-3000:]
    assert "restored the fp32 master weights of step-000003 (39 cut from the whole tensors for this layout)" in out
    assert "read this rank's AdamW state of step-000003 as its pieces: 78 tensors" in out  # not ColossalAI's loader
    view, weights = CheckpointState(src), read_model_dir(src / "model")
    (live,) = [
        torch.load(f, weights_only=True)
        for f in sorted((work / "live-state" / "llz-to-1" / "loaded-step-000003").glob("rank-*.pt"))
    ]
    assert set(live) == set(view.names())
    for name, st in live.items():
        piece = Piece.of(st["piece"], 0)
        assert (piece.start, piece.length) == (0, piece.local_numel)  # one rank: the whole parameter
        assert torch.equal(st["master"], local_piece(view.master(name), piece)), name
        assert torch.equal(st["weight"], weights[name]), name
        adam = view.adam(name)
        assert torch.equal(st["exp_avg"].reshape(-1), adam["exp_avg"].reshape(-1)) and torch.equal(
            st["exp_avg_sq"].reshape(-1), adam["exp_avg_sq"].reshape(-1)
        )
        assert float(st["step"]) == adam["step"] == 3.0
    view.close()
    assert [p["step"] for p in run.progress] == [4, 5, 6]
    ref, got = train_state(llz["dir"] / "step-000006"), train_state(stage_dir / "step-000006")
    assert (
        got["losses"][:3] == ref["losses"][:3]
        and got["tokens_seen"] == ref["tokens_seen"]
        and got["sampler"] == ref["sampler"]
    )
    assert all(abs(a - b) < 2e-2 * abs(b) for a, b in zip(got["losses"][3:], ref["losses"][3:])), (
        ref["losses"],
        got["losses"],
    )
    assert [(s["from_step"], s["plugin"], s["dp"], s["grad_accum_steps"]) for s in got["segments"]] == [
        (0, "low_level_zero", 2, 2),
        (3, "low_level_zero", 1, 4),
    ]
    assert verify_artifact(stage_dir / "step-000006")["meta"]["layout"]["world_size"] == 1


def test_cpt_under_pp2_resumes_under_tp2_from_the_resharded_state(pp2, tiny_model_dir, work):
    """The CPT stage's step-000003 (hybrid_parallel pp=2 fp32, 2 ranks, 2 x 2 a rank) continued under
    tp=2 on 2 ranks at the same split: each rank's state after the load (its tp slices of the weights,
    AdamW's moments and step) is the checkpoint's, cut for that rank, bitwise; steps 4-6 continue the
    pipeline's losses within fp32 reduction-order noise, and train_state records both segments."""
    stage_dir = work / "pp2-to-tp2" / "cpt"
    stage_dir.mkdir(parents=True)
    src = pp2["dir"] / "step-000003"
    shutil.copytree(src, stage_dir / "step-000003")
    _, job = _jobs(
        work, "pp2-to-tp2", "cpt", TP2, tiny_model_dir, tiny_model_dir, stage_dir, grad_accum_steps=2, keep_last=2
    )
    run = _engine("pp2 -> tp2", "train", job, env=_dump(work, "pp2-to-tp2"))
    assert (
        "cpt: resuming step-000003, written under hybrid_parallel pp=2 dp=1 on 2 ranks (2 x 2 a rank), under "
        "hybrid_parallel tp=2 dp=1 on 2 ranks (2 x 2 a rank): model and optimizer re-sharded"
    ) in run.output, run.output[-3000:]
    assert "read this rank's AdamW state of step-000003 as its pieces" in run.output  # its tp slices, by offset
    loaded = work / "live-state" / "pp2-to-tp2" / "loaded-step-000003"
    assert _assert_view_is_live_state(src, loaded, masters=False) > 0
    ranks = [torch.load(f, weights_only=True) for f in sorted(loaded.glob("rank-*.pt"))]
    assert any(st["piece"]["tp_size"] == 2 for st in ranks[0].values())  # tp slices, not whole tensors
    assert [p["step"] for p in run.progress] == [4, 5, 6]
    ref, got = train_state(pp2["dir"] / "step-000006"), train_state(stage_dir / "step-000006")
    assert got["losses"][:3] == ref["losses"][:3] and got["sampler"] == ref["sampler"]
    assert got["tokens_seen"] == ref["tokens_seen"]
    drift = max(abs(a - b) / abs(b) for a, b in zip(got["losses"][3:], ref["losses"][3:]))
    assert drift < 1e-4, (ref["losses"], got["losses"])
    print(f"\npp=2 -> tp=2: losses of steps 4-6 within {drift:.2e} (relative) of the pipeline's")
    assert [(s["from_step"], s["tp"], s["pp"]) for s in got["segments"]] == [(0, 1, 2), (3, 2, 1)]


def test_hybrid_parallel_bf16_without_zero_resumes_from_the_fp32_masters(zero1, tiny_model_dir, work):
    """hybrid_parallel bf16 without ZeRO (its mixed-precision optimizer keeps whole fp32 masters per tp
    slice) continuing the tp=2 ZeRO-1 bf16 stage's step-000003 on the same 2 ranks (dp=1: ZeRO-1 shards
    nothing): each rank's fp32 masters after the load are the checkpoint's, not rebuilt from the bf16
    weights, bitwise; steps 4-6 reproduce the uninterrupted ZeRO-1 run's losses and final weights bitwise."""
    stage_dir = work / "zero1-to-zero0" / "cpt"
    stage_dir.mkdir(parents=True)
    src = zero1["dir"] / "step-000003"
    shutil.copytree(src, stage_dir / "step-000003")
    plugin = {**ZERO1, "zero_stage": 0}
    _, job = _jobs(work, "zero1-to-zero0", "cpt", plugin, tiny_model_dir, tiny_model_dir, stage_dir)
    run = _engine("tp2 zero1 -> zero0 bf16", "train", job, env=_dump(work, "zero1-to-zero0"))
    out = run.output
    assert (
        "cpt: resuming step-000003, written under hybrid_parallel tp=2 zero=1 dp=1 on 2 ranks (2 x 1 a rank), under "
        "hybrid_parallel tp=2 dp=1 on 2 ranks (2 x 1 a rank): model and optimizer re-sharded"
    ) in out, out[-3000:]
    assert "restored the fp32 master weights of step-000003 (39 as written)" in out, out[-3000:]
    loaded = work / "live-state" / "zero1-to-zero0" / "loaded-step-000003"
    assert _assert_view_is_live_state(src, loaded, masters=True) > 0
    ranks = [torch.load(f, weights_only=True) for f in sorted(loaded.glob("rank-*.pt"))]
    assert all(st["master"].dtype == torch.float32 and st["weight"].dtype == torch.bfloat16 for st in ranks[0].values())
    # the masters hold what bf16 cannot: rebuilt from the weights, they would equal the weights' cast
    assert any(not torch.equal(st["master"], st["weight"].float()) for st in ranks[0].values())
    ref, got = train_state(zero1["dir"] / "step-000006"), train_state(stage_dir / "step-000006")
    assert [p["step"] for p in run.progress] == [4, 5, 6]
    assert got["losses"] == ref["losses"], (ref["losses"], got["losses"])
    a, b = read_model_dir(zero1["dir"] / "step-000006" / "model"), read_model_dir(stage_dir / "step-000006" / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
