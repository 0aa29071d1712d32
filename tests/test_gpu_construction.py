"""GPU tier: sharded construction on CUDA keeps the model off the host.

    python -m pytest -m gpu tests/test_gpu_construction.py -v     # needs CUDA; skipped elsewhere

A random Llama of ~620M parameters (2.5 GB in fp32, weights in 256 MB files) goes through the
shard verb under hybrid_parallel on one GPU (tp=2 on two): the engine builds it under ColossalAI's
LazyInitContext with the GPU as its device, the plugin materializes each tensor there, and the
weights are read file by file into the device copy. Each rank logs the host memory that took
(`construction peak N bytes ... over the M at its start`, tasks/engine/loop.py), which must stay
under 1 GB (the CUDA context and the kernels' host side, as far as construction creates them) plus
the largest tensor (one file's tensor on its way to the GPU), a third of the model. The launch is
stopped at the step-000000 save (`fail@save=0:model`): the save is not what is measured, and
writing 7.5 GB of checkpoint would cost minutes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.engine import engine, phase_raw, write_job

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]

GB = 1e9
# 12 layers of 51M parameters; the largest tensor is an MLP projection, 5632 x 2048 (46 MB in fp32).
LARGE = dict(hidden_size=2048, num_layers=12, num_heads=16, num_kv_heads=16, intermediate_size=5632)
CONSTRUCTION = re.compile(r"^\[rank (\d+)(?:\|detail)?\] construction peak (\d+) bytes", re.MULTILINE)


@pytest.fixture(scope="module")
def large_model_dir(tmp_path_factory) -> Path:
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    out = tmp_path_factory.mktemp("gpu-construction") / "llama-620m"
    return build_tiny_model(out, build_tokenizer(DEFAULT_CORPUS, vocab_size=512), max_shard_size="256MB", **LARGE)


@pytest.mark.parametrize("tp", [1, 2])
def test_sharded_construction_on_cuda_keeps_host_memory_under_1gb_plus_the_largest_tensor(
    large_model_dir, tmp_path, tp
):
    import torch

    from tasks.core.models.families import count_parameters, largest_tensor

    if torch.cuda.device_count() < tp:
        pytest.skip(f"tp={tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
    config = json.loads((large_model_dir / "config.json").read_text())
    whole, largest = 4 * count_parameters(config), 4 * largest_tensor(config)
    assert whole > 2 * (GB + largest), "the model is too small for the bound to say anything"
    plugin = {"name": "hybrid_parallel", "tp_size": tp, "precision": "fp32"}
    section = phase_raw("cpt", plugin, launch={"nproc_per_node": tp}, kernels={"flash_attention": False})
    job = write_job(
        tmp_path / "shard.json",
        verb="shard",
        phase="cpt",
        phase_cfg=section,
        model_dir=large_model_dir,
        stage_dir=tmp_path / "cpt",
    )
    run = engine("shard", job, nproc=tp, env={"CPT_TO_SFT_FAULT": "fail@save=0:model"}, expect_ok=False, timeout=1200)
    peaks = {int(r): int(b) for r, b in CONSTRUCTION.findall(run.output)}
    assert sorted(peaks) == list(range(tp)), run.output[-4000:]
    for rank, added in peaks.items():
        assert added < GB + largest, (
            f"rank {rank}: construction took {added / GB:.2f} GB of host memory (model {whole / GB:.2f} GB, largest "
            f"tensor {largest / GB:.3f} GB)"
        )
    assert "injected failure" in run.output  # it stopped where the test stopped it, not earlier
