"""GPU tier: the CUDA-only sequence-parallel mode, ring_attn, trains as the same stage without it.

    python -m pytest -m gpu tests/test_gpu_sequence.py -v     # needs 2 GPUs and flash_attn; skipped elsewhere

On CPU pre-flight refuses ring_attn naming why (tasks/core/config/sequence.py: flash attention kernels and
CUDA streams); here the tiny Llama's CPT stage is sharded at tp=2 in bf16, trained 4 steps at tp=2, and
trained again from a copy of the same step-000000 under ring_attn (sp=2, tp=1: the checkpoint re-sharded),
both with a global batch of 2 sequences. The losses agree to bf16 tolerance (ring attention sums the
softmax blocks in another order, and flash attention runs where sdpa ran), and every manifest records the
mode the stage ran under.
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from support.engine import engine, phase_raw, train_state, write_job

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]

TP2 = {"name": "hybrid_parallel", "tp_size": 2, "precision": "bf16"}
RING = {"name": "hybrid_parallel", "precision": "bf16", "sequence_parallelism": {"mode": "ring_attn", "size": 2}}


def test_ring_attn_trains_as_tp2_without_it(tiny_model_dir, tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"ring_attn at sp=2 needs 2 GPUs, {torch.cuda.device_count()} visible")
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("ring_attn runs flash_attn's kernels, which are not installed")
    runs = {}
    for name, plugin in (("tp2", TP2), ("ring", RING)):
        section = phase_raw("cpt", plugin, max_steps=4, checkpoint_every=4, seq_len=64)
        common = dict(phase="cpt", phase_cfg=section, model_dir=tiny_model_dir, stage_dir=tmp_path / name / "cpt")
        runs[name] = (
            write_job(tmp_path / f"{name}-shard.json", verb="shard", **common),
            write_job(tmp_path / f"{name}-train.json", verb="train", **common),
        )
    engine("shard", runs["tp2"][0])
    (tmp_path / "ring" / "cpt").mkdir(parents=True)
    shutil.copytree(tmp_path / "tp2" / "cpt" / "step-000000", tmp_path / "ring" / "cpt" / "step-000000")
    engine("train", runs["tp2"][1])
    ring = engine("train", runs["ring"][1])
    assert [p["step"] for p in ring.progress] == [1, 2, 3, 4], ring.output[-4000:]
    ref = train_state(tmp_path / "tp2" / "cpt" / "step-000004")["losses"]
    got = train_state(tmp_path / "ring" / "cpt" / "step-000004")["losses"]
    assert got == pytest.approx(ref, rel=2e-2), (ref, got)
