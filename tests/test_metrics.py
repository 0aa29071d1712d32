"""Per-step metrics: the @@progress fields, the TensorBoard event files and their reader.

python -m pytest -q tests/test_metrics.py                 # unit tier
python -m pytest -q -m distributed tests/test_metrics.py  # + one 2-rank torch_ddp train launch
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.engine import phase_raw, shard_train, write_job
from tasks.core.errors import ManifestError
from tasks.core.models.flops import flops_per_token, mfu, peak_flops
from tasks.core.run.tbevents import read_scalars
from tasks.engine.metrics import TAGS, StepMetrics, grad_norm


class _Cfg:
    num_hidden_layers, hidden_size = 2, 64


def test_peak_table_matches_specific_names_first_and_knows_no_cpu():
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756.0e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert peak_flops(None, "bf16") is None
    assert mfu(1000.0, 6e9, None, 8) is None
    # 1e4 tokens/s of a 1B model (6e9 FLOPs/token) on one 312 TFLOP/s device: 19.2 %
    assert mfu(1e4, flops_per_token(10**9, 0, 0, 0), 312e12, 1) == pytest.approx(0.19230769)
    assert flops_per_token(100, 2, 8, 16) == 600 + 12 * 2 * 8 * 16


def test_step_metrics_write_one_point_per_step_and_read_back(tmp_path):
    m = StepMetrics(tmp_path, rank=0, world=1, n_params=1000, model_config=_Cfg, seq_len=32, precision="fp32")
    recs = []
    for step in range(1, 6):
        m.start()
        sum(i * i for i in range(20000))  # a measurable step
        recs.append(m.stop(step, loss=3.0 - step * 0.1, lr=1e-3 * step, tokens=64))
    m.close()
    for r in recs:
        assert set(r) == {
            "loss",
            "lr",
            "tokens_per_s",
            "seq_len",
            "step_s",
            "peak_mem_bytes",
            "peak_mem_rank",
        }  # no grad norm, no MFU on CPU
        assert r["seq_len"] == 32  # what tokens_per_s was measured at
        assert r["peak_mem_rank"] == 0  # no process group: this process is every rank
        assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(64 / r["step_s"], rel=1e-3)
        assert r["peak_mem_bytes"] > 10 * 2**20  # this process' RSS peak: torch alone is more
    scalars = read_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {TAGS[k] for k in recs[0]}
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in recs])


def test_a_resumed_launch_replaces_the_points_of_the_steps_it_trains_again(tmp_path):
    """Launch 1 logs steps 1..5 and dies after its checkpoint at step 3; launch 2 resumes at 4
    (purge_step=4): one point per step, steps 4 and 5 from launch 2."""
    first = StepMetrics(tmp_path, rank=0, world=1, n_params=10, model_config=_Cfg, seq_len=8, precision="fp32")
    for step in range(1, 6):
        first.write(step, {"loss": float(step)})
    first.close()
    second = StepMetrics(
        tmp_path, rank=0, world=1, n_params=10, model_config=_Cfg, seq_len=8, precision="fp32", purge_step=4
    )
    for step in (4, 5):
        second.write(step, {"loss": step + 0.5})
    second.close()
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert read_scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5), (5, 5.5)]


def test_non_writing_rank_leaves_no_files(tmp_path):
    m = StepMetrics(tmp_path, rank=1, world=2, n_params=10, model_config=_Cfg, seq_len=8, precision="bf16")
    m.start()
    m.stop(1, loss=1.0, lr=0.1, tokens=8)
    m.close()
    assert not (tmp_path / "tensorboard").exists()


def test_reader_names_the_file_of_a_flipped_byte(tmp_path):
    m = StepMetrics(tmp_path, rank=0, world=1, n_params=10, model_config=_Cfg, seq_len=8, precision="fp32")
    m.start()
    m.stop(1, loss=1.0, lr=0.1, tokens=8)
    m.close()
    (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    data = bytearray(path.read_bytes())
    data[-6] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=path.name):
        read_scalars(tmp_path / "tensorboard")


def test_grad_norm_from_colossalai_wrappers():
    import torch
    from colossalai.interface import OptimizerWrapper

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    wrapped = OptimizerWrapper(torch.optim.SGD([p], lr=0.1))
    norm = wrapped.clip_grad_by_norm(100.0)  # torch_ddp's path: the wrapper keeps no norm itself
    assert grad_norm(wrapped, norm) == pytest.approx(4.0)
    assert grad_norm(wrapped, None) is None


@pytest.mark.distributed
def test_ddp_train_emits_metrics_and_one_event_point_per_step(tmp_path, tiny_model_dir):
    plugin = {"name": "torch_ddp", "precision": "fp32"}
    section = phase_raw("cpt", plugin, max_steps=4, checkpoint_every=4)
    stage_dir = tmp_path / "cpt"
    common = dict(phase="cpt", phase_cfg=section, model_dir=tiny_model_dir, stage_dir=stage_dir)
    # shard and train in one launch, as the flow shares them
    out = shard_train(
        write_job(tmp_path / "shard.json", verb="shard", **common),
        write_job(tmp_path / "train.json", verb="train", **common),
    )
    progress = out.progress
    assert [p["step"] for p in progress] == [1, 2, 3, 4]
    for p in progress:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_s", "peak_mem_bytes", "peak_mem_rank", "eta_s"} <= set(
            p
        )
        assert p["grad_norm"] > 0 and "mfu" not in p and p["peak_mem_rank"] in (0, 1)
    scalars = read_scalars(stage_dir / "tensorboard")
    for tag in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_s", "perf/peak_mem_bytes"):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4], tag
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([p["loss"] for p in progress], rel=1e-6)
    (tmp_path / "progress.jsonl").write_text("".join(__import__("json").dumps(p) + "\n" for p in progress))


def test_gpu_check_mfu_is_the_engines(tiny_model_dir):
    """benchmarks/gpu_check.py computes MFU from the model's config.json (flops.config_flops_per_token);
    the engine from the built model (StepMetrics). Same model, tokens/s, device and world: one number."""
    import ast
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from tasks.core.models.flops import config_flops_per_token
    from tasks.engine.metrics import count_params

    mc = json.loads((tiny_model_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    eng = StepMetrics(
        tiny_model_dir,
        rank=1,
        world=2,
        n_params=count_params(model),
        model_config=AutoConfig.from_pretrained(tiny_model_dir),
        seq_len=256,
        precision="bf16",
        write=False,
    )
    peak = peak_flops("NVIDIA H200", "bf16")
    assert config_flops_per_token(mc, 256) == eng.per_token
    assert mfu(12345.0, config_flops_per_token(mc, 256), peak, 2) == mfu(12345.0, eng.per_token, peak, 2) > 0
    # gpu_check (its entry and its modules) takes its FLOP count and its peak from flops.py and keeps neither
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    srcs = [ast.parse(p.read_text()) for p in [bench / "gpu_check.py", *sorted((bench / "gpucheck").glob("*.py"))]]
    names = {n.name for src in srcs for n in ast.walk(src) if isinstance(n, ast.FunctionDef)}
    names |= {
        t.id
        for src in srcs
        for n in src.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert not {n for n in names if "flop" in n.lower() or "peak" in n.lower()}, names
    calls = {
        n.func.attr
        for src in srcs
        for n in ast.walk(src)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    assert {"config_flops_per_token", "peak_flops", "mfu"} <= calls
