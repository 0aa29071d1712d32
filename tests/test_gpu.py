"""GPU tier: Gemini (bf16, HybridAdam) checkpoints, the CUDA RNG state on resume, Gemini -> export.

    python -m pytest -m gpu tests/test_gpu.py -v     # needs CUDA; skipped elsewhere (and deselected by `pytest`)

`benchmarks/gpu_check.sh` runs this on the GPU machine after the flow check (which has JIT-built
ColossalAI's Adam kernels by then; run alone, the first launch builds them). Every launch is
torchrun with one process. The model is the tiny random Llama with attention dropout 0.1, so
training draws from the CUDA generator: a resume that did not restore it would train on other
dropout masks and give other losses. For bitwise comparisons the launches get a `sitecustomize`
that makes CUDA deterministic (math SDPA, no TF32, `torch.use_deterministic_algorithms`,
CUBLAS_WORKSPACE_CONFIG); the engine itself runs unchanged.

- run A: the shard verb (as reboost does) boosts the model under Gemini -> sft/step-000000; the train
  verb trains 6 steps, checkpoints at 3 and 6.
- run B: from a copy of A's step-000000, SIGKILLed after step 4, retried: resumes from step 3.
  Step 3's checkpoint is bitwise A's (both written before any resume), and so is the loss of step
  4, the first one after the resume: it needs the same bf16 weights, data position and dropout
  masks, i.e. the CUDA generator restored. Steps 5-6 agree to 1e-2, not bitwise: a bf16 Gemini
  checkpoint holds the bf16 cast of the fp32 master weights (Gemini saves `get_temp_total_chunk_on_cuda`
  in the mixed precision; the optimizer files hold only Adam's moments), so a resumed run's masters
  are the bf16 weights upcast (ARCHITECTURE.md section 4; the same test on CPU with low_level_zero
  bf16 gave step 4 bitwise equal, step 5 off by 1.5e-4, and without the RNG restored step 4 off by 2e-3).
  Each checkpoint holds the CUDA generator state, equal in A and B at step 3 and moved on from step 0's.
- round trip (this file run as a torchrun worker): boost under Gemini, train 2 steps, Engine.save;
  a fresh model + HybridAdam under a new GeminiPlugin, Engine.load, Engine.save again -> model,
  optimizer, scheduler and fingerprint bitwise equal.
- RNG unit: capture_rng / write_rng / restore_rng reproduce CUDA random draws bitwise.
- export: A's final Gemini checkpoint through `build_hf_dir` (the export stage's code): fingerprint
  match, tensors bitwise the checkpoint's cast to bf16, logits of plain transformers on the GPU within 1e-2 of
  the fingerprint the engine took under Gemini.
- kernels: a CPT stage under hybrid_parallel bf16 with the registry's kernels on (its default on CUDA)
  and activation checkpointing: shard, then 4 steps resumed from step 0 (the fused AdamW state the
  shard verb materialized loads back); every checkpoint manifest records what ran: shardformer flash
  attention and the fused AdamW on, the others off with their reasons.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from support.engine import engine, phase_raw, prepared_data, read_model_dir, train_state, write_job

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(3600)]  # the first launch may JIT-build kernels

GEMINI = {"name": "gemini", "precision": "bf16", "placement_policy": "static"}
# The bitwise comparisons keep flash_attention_2 off where flash_attn is installed (its backward
# accumulates with atomics); the kernels test below runs with the registry's defaults.
ONE_RANK = {"launch": {"nproc_per_node": 1}, "keep_last": 3, "kernels": {"flash_attention": False}}
DETERMINISTIC = """\
# Written by tests/test_gpu.py: deterministic CUDA for the bitwise resume comparisons.
import torch

torch.use_deterministic_algorithms(True, warn_only=True)
# Deterministic mode also fills torch.empty() with NaN; ColossalAI allocates chunk shards that way
# before copying into them, and a padding NaN would be a false alarm here, not what is tested.
torch.utils.deterministic.fill_uninitialized_memory = False
torch.backends.cuda.enable_flash_sdp(False)
torch.backends.cuda.enable_mem_efficient_sdp(False)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
"""
FIRST_LAUNCH_TIMEOUT = 900  # may JIT-build ColossalAI's CPU-Adam and fused-Adam kernels


def _det_env(work: Path) -> dict[str, str]:
    d = work / "deterministic"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(DETERMINISTIC)
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(d), str(REPO), os.environ.get("PYTHONPATH")) if p),
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _load_any(path: Path):
    import torch

    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if path.suffix == ".npy":  # the fingerprint
        import numpy as np

        return {"logits": torch.from_numpy(np.load(path, allow_pickle=False))}
    return torch.load(str(path), map_location="cpu", weights_only=True)


def _rng(step_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(step_dir / "rng" / "rank-00000.safetensors"))


# ------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu")


@pytest.fixture(scope="module")
def dropout_model_dir(work) -> Path:
    """The tiny demo Llama with attention dropout 0.1 (training consumes the CUDA generator)."""
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    out = build_tiny_model(work / "tiny-dropout", build_tokenizer(DEFAULT_CORPUS, vocab_size=512))
    cfg = json.loads((out / "config.json").read_text())
    cfg["attention_dropout"] = 0.1
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out


@pytest.fixture(scope="module")
def gemini_runs(work, dropout_model_dir):
    """A: shard + 6 steps; B: the same from a copy of step 0, killed after step 4 and resumed."""
    env = _det_env(work)
    section = phase_raw("sft", GEMINI, **ONE_RANK)
    common = dict(phase="sft", phase_cfg=section, model_dir=dropout_model_dir)
    a_dir, b_dir = work / "a" / "sft", work / "b" / "sft"
    shard_a = write_job(work / "jobs" / "a-shard.json", verb="shard", stage_dir=a_dir, **common)
    train_a = write_job(work / "jobs" / "a-train.json", verb="train", stage_dir=a_dir, **common)
    train_b = write_job(work / "jobs" / "b-train.json", verb="train", stage_dir=b_dir, **common)

    shard = engine("shard", shard_a, nproc=1, env=env, timeout=FIRST_LAUNCH_TIMEOUT)
    shutil.copytree(a_dir / "step-000000", b_dir / "step-000000")
    a = engine("train", train_a, nproc=1, env=env)
    killed = engine(
        "train", train_b, nproc=1, env={**env, "CPT_TO_SFT_FAULT": "kill@step=4@phase=sft"}, expect_ok=False
    )
    resumed = engine("train", train_b, nproc=1, env=env)
    return {"a": a_dir, "b": b_dir, "shard": shard, "train_a": a, "killed": killed, "resumed": resumed}


# ------------------------------------------------------------------------------------------------
# Gemini through the engine


def test_gemini_checkpoints_are_complete_and_say_so(gemini_runs):
    from tasks.engine.checkpoint import check_checkpoint

    for step in (0, 3, 6):
        m = check_checkpoint(gemini_runs["a"] / f"step-{step:06d}", step, "sft", "0" * 64)
        meta = m["meta"]
        assert meta["plugin"]["name"] == "gemini" and meta["plugin"]["placement_policy"] == "static"
        assert meta["optimizer"] == "HybridAdam", meta["optimizer"]
        assert meta["weights_dtype"] == "bf16"
    assert "engine shard sft: world size 1, CUDA" in gemini_runs["shard"].output


def test_gemini_kill_and_resume_continues_exactly(gemini_runs):
    killed, resumed = gemini_runs["killed"], gemini_runs["resumed"]
    assert killed.rc != 0 and "SIGKILLs itself after step 4" in killed.output
    assert "resuming sft from step-000003" in resumed.output
    assert [p["step"] for p in resumed.progress] == [4, 5, 6]
    nondet = sorted(
        {
            ln.strip()[:200]
            for ln in (killed.output + resumed.output).splitlines()
            if "does not have a deterministic implementation" in ln
        }
    )
    # Before any resume, A and B are the same computation: step 3's checkpoints are bitwise equal.
    wa = read_model_dir(gemini_runs["a"] / "step-000003" / "model")
    wb = read_model_dir(gemini_runs["b"] / "step-000003" / "model")
    assert wa.keys() == wb.keys()
    assert [k for k in wa if not _same(wa[k], wb[k])] == [], (
        f"runs differ before the kill; non-deterministic ops: {nondet}"
    )
    la = train_state(gemini_runs["a"] / "step-000006")["losses"]
    lb = train_state(gemini_runs["b"] / "step-000006")["losses"]
    assert la[:3] == lb[:3]
    # The first step after the resume: same weights, batch and dropout masks -> the same loss.
    assert la[3] == lb[3], (
        f"step 4 after resume: {lb[3]!r} vs uninterrupted {la[3]!r} (CUDA RNG not restored?); non-deterministic ops: "
        f"{nondet}"
    )
    # Later steps: the resumed fp32 masters are the bf16 weights upcast (see the module docstring).
    assert max(abs(a - b) for a, b in zip(la[4:], lb[4:])) <= 1e-2, (la, lb)


def test_cuda_rng_state_is_checkpointed_and_restored(gemini_runs):
    import torch

    a0, a3 = _rng(gemini_runs["a"] / "step-000000"), _rng(gemini_runs["a"] / "step-000003")
    b3 = _rng(gemini_runs["b"] / "step-000003")
    assert "cuda" in a3 and a3["cuda"].dtype == torch.uint8
    assert torch.equal(a3["cuda"], b3["cuda"]) and torch.equal(a3["torch_cpu"], b3["torch_cpu"])
    # Attention dropout drew from the CUDA generator during steps 1-3, so the state moved on;
    # were it not restored on resume, step 4 of run B would draw step 0's masks again.
    assert not torch.equal(a0["cuda"], a3["cuda"])
    assert "has no RNG state" not in gemini_runs["resumed"].output


def test_cuda_rng_capture_restore_reproduces_draws(tmp_path):
    import torch

    from tasks.engine.checkpoint import capture_rng, restore_rng, write_rng

    torch.manual_seed(7)
    torch.cuda.manual_seed(7)
    torch.rand(100, device="cuda")  # move the generator off its seed
    write_rng(tmp_path, 0, capture_rng())
    want_cuda, want_cpu = torch.rand(1000, device="cuda"), torch.rand(10)
    torch.cuda.manual_seed(12345)
    torch.manual_seed(12345)
    assert restore_rng(tmp_path, 0)
    assert torch.equal(torch.rand(1000, device="cuda"), want_cuda)
    assert torch.equal(torch.rand(10), want_cpu)


def test_gemini_save_load_round_trip_is_bitwise(work, dropout_model_dir):
    out = work / "roundtrip"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        str(Path(__file__).resolve()),
        "--worker",
        "roundtrip",
        "--model",
        str(dropout_model_dir),
        "--work",
        str(out),
    ]
    env = dict(os.environ)
    env.update(_det_env(work))
    env.update({"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
    env.pop("CPT_TO_SFT_FAULT", None)
    proc = subprocess.run(
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=FIRST_LAUNCH_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    first, second = out / "first" / "sft" / "step-000002", out / "second" / "sft" / "step-000002"
    from tasks.core.models.fingerprint import FINGERPRINT_FILE
    from tasks.core.run.manifest import MANIFEST
    from tasks.engine.checkpoint import check_checkpoint

    for d in (first, second):
        check_checkpoint(d, 2, "sft", "0" * 64)
    names = sorted(
        str(p.relative_to(first))
        for p in first.rglob("*")
        if p.is_file() and p.relative_to(first).as_posix() != MANIFEST
    )
    assert names == sorted(
        str(p.relative_to(second))
        for p in second.rglob("*")
        if p.is_file() and p.relative_to(second).as_posix() != MANIFEST
    )
    assert any(n.startswith("optimizer/") and n.endswith(".bin") for n in names), names
    # Tensors and their indexes. model/generation_config.json legitimately differs (the first model
    # came from from_pretrained, the second from from_config, as in the engine's train verb), and so
    # does rng/ (the generators moved on between the two saves).
    tensors = [
        n
        for n in names
        if n.endswith((".safetensors", ".bin", ".pt", ".npy", ".index.json")) and not n.startswith("rng/")
    ]
    assert any(n.startswith("model/") for n in tensors) and FINGERPRINT_FILE in tensors, tensors
    differ = [n for n in tensors if not _same(_load_any(first / n), _load_any(second / n))]
    assert differ == [], f"not bitwise equal after save -> load -> save under Gemini: {differ}"


# ------------------------------------------------------------------------------------------------
# the fast kernels, on by default on CUDA


def test_a_stage_runs_with_the_kernels_on_and_its_manifests_record_them(work, dropout_model_dir):
    from tasks.core.config.kernels import Facts, resolve_for
    from tasks.engine.checkpoint import check_checkpoint

    section = phase_raw(
        "cpt",
        {"name": "hybrid_parallel", "precision": "bf16"},
        launch={"nproc_per_node": 1},
        max_steps=4,
        checkpoint_every=2,
        activation_checkpointing=True,
    )
    d = work / "kernels" / "cpt"
    common = dict(phase="cpt", phase_cfg=section, model_dir=dropout_model_dir, stage_dir=d)
    shard = engine(
        "shard",
        write_job(work / "jobs" / "kernels-shard.json", verb="shard", **common),
        nproc=1,
        timeout=FIRST_LAUNCH_TIMEOUT,
    )
    train = engine("train", write_job(work / "jobs" / "kernels-train.json", verb="train", **common), nproc=1)
    want = resolve_for("hybrid_parallel", "bf16", Facts.detect(cuda=True, model_type="llama"))
    assert (
        want["flash_attention"].reason == "on (shardformer)"
        and want["fused_optimizer"].reason == "on (torch AdamW fused)"
    )
    for step in (0, 2, 4):
        meta = check_checkpoint(d / f"step-{step:06d}", step, "cpt", "0" * 64)["meta"]
        # what ran is what the registry decides here: a kernel that failed to load would say so instead
        assert meta["kernels"] == {n: s.reason for n, s in want.items()}, meta["kernels"]
        assert meta["activation_checkpointing"] is True
    assert meta["kernels"]["jit_fused"] == "off: ColossalAI 0.5.0's llama policy has no shardformer JIT fused ops"
    for run in (shard, train):
        assert (
            "kernels: flash attention: on (shardformer);" in run.output and "activation checkpointing: on" in run.output
        )
        assert "failed to load" not in run.output, run.output[-3000:]
    losses = train_state(d / "step-000004")["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) and x < 20 for x in losses), losses


# ------------------------------------------------------------------------------------------------
# Gemini -> export


def test_gemini_checkpoint_exports_with_matching_fingerprint(gemini_runs, dropout_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.core.config.outputs import ExportConfig
    from tasks.core.models.fingerprint import load_fingerprint, max_abs_diff, model_logits
    from tasks.core.models.hf_artifact import build_hf_dir

    ckpt = gemini_runs["a"] / "step-000006"
    dst = tmp_path / "export"
    dst.mkdir()
    built = build_hf_dir(ckpt, dst, dropout_model_dir, ExportConfig(dtype="bf16"), weights_dtype="bf16")
    v = built["verification"]
    assert v["fingerprint_match"], v
    from safetensors.torch import load_file

    exported = {k: v for f in sorted(dst.glob("model*.safetensors")) for k, v in load_file(str(f)).items()}
    trained = read_model_dir(ckpt / "model")
    assert exported.keys() == trained.keys()
    # The export is the checkpoint's tensors cast to the export dtype (what build_hf_dir's proof
    # checks). Not the checkpoint's dtype: on one GPU Gemini's chunks stay gathered, and colossalai
    # 0.5.0's get_temp_total_chunk_on_cuda then returns the fp32 chunk uncast, so model/ holds the
    # fp32 masters.
    assert [k for k in trained if not _same(exported[k], trained[k].to(exported[k].dtype))] == []
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16, use_safetensors=True).cuda()
    diff = max_abs_diff(model_logits(model, model.config.vocab_size), load_fingerprint(ckpt))
    assert diff <= 1e-2, f"export logits on the GPU differ from the Gemini fingerprint by {diff}"


# ------------------------------------------------------------------------------------------------
# torchrun worker (not a test): python -m torch.distributed.run ... tests/test_gpu.py --worker roundtrip


def _roundtrip_worker(model_dir: Path, out: Path, plugin: dict | None = None) -> None:
    import colossalai
    import torch
    import torch.distributed as dist

    from tasks.engine import hf_compat
    from tasks.engine.boosted import Engine
    from tasks.engine.faults import Injector
    from tasks.engine.loop import StageData
    from tasks.engine.preconditions import parse_job

    hf_compat.apply()  # ColossalAI's forwards on the installed transformers
    if not torch.cuda.is_available():  # only for checking this worker's logic on CPU with a CPU plugin
        from tasks.engine import cpu_compat

        cpu_compat.apply()
    colossalai.launch_from_torch(seed=1234, verbose=False)
    section = phase_raw("sft", plugin or GEMINI, **ONE_RANK)
    data_dir = prepared_data(section, "sft", model_dir, out / "data-sft")  # StageData reads prepared token shards

    def job(name: str):
        return parse_job(
            {
                "verb": "shard",
                "phase": "sft",
                "phase_cfg": section,
                "trust_remote_code": False,
                "model_dir": str(model_dir),
                "tokenizer_dir": str(model_dir),
                "data_dir": str(data_dir),
                "stage_dir": str(out / name / "sft"),
                "parent": None,
                "config_digest": "0" * 64,
            }
        )

    first = job("first")
    a = Engine(first, Injector("sft", first.stage_dir, 0, 1, value=""))
    a.boost(a.load_pretrained())
    a.materialize_optimizer_state()
    data = StageData(first, 0, 1)
    losses = [a.train_step(data.next_batch()[0]) for _ in range(2)]
    sampler = data.sampler.state_dict()
    state = {
        "phase": "sft",
        "step": 2,
        "max_steps": section["max_steps"],
        "tokens_seen": 0,
        "sampler": sampler,
        "epoch": sampler["epoch"],
        "losses": losses,
        "lrs": [],
        "lr": float(a.scheduler.get_last_lr()[0]),
    }
    saved = a.save(2, state)

    second = job("second")
    b = Engine(second, Injector("sft", second.stage_dir, 0, 1, value=""))
    b.boost(b.from_config())
    b.load(saved)
    b.save(2, state)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["roundtrip"], required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument(
        "--plugin",
        type=json.loads,
        default=None,
        help="plugin section as JSON (default Gemini; a CPU plugin to check this worker without CUDA)",
    )
    a = ap.parse_args()
    _roundtrip_worker(a.model, a.work, a.plugin)
