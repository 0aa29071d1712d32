"""Pre-flight's evaluation-cost warning (tasks/core/preflight/eval_time.py): pure, no launch.

PYTHONPATH=$PWD python -m pytest -q tests/test_preflight_eval_time.py
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tasks.core.config.schema import RunConfig
from tasks.core.models.families import count_parameters
from tasks.core.preflight.checks import CHECKS
from tasks.core.preflight.eval_time import FLOOR, SHARE, Cpu, GenerationCheck, check_eval_time, estimate, threads
from tasks.core.preflight.model_info import Machine, ModelInfo
from tasks.core.preflight.report import CheckContext, PreflightReport
from tests.conftest import REPO

TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}
# ~135M parameters: a small model that still takes minutes a stage on a CPU
SMALL = {
    **TINY,
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
}


def _raw() -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())


def _issue_case(max_batches: int | None = 50) -> dict[str, Any]:
    """The issue's shape: a short CPT stage and evaluation at the default 50 batches."""
    raw = _raw()
    raw["cpt"].update(max_steps=50, seq_len=512, micro_batch_size=4)
    raw["cpt"]["eval"] = {"max_batches": max_batches}
    return raw


@pytest.fixture(autouse=True)
def _default_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def _report(raw: dict[str, Any], model_config: dict[str, Any], cuda: int = 0, cpus: int = 2) -> PreflightReport:
    cfg = RunConfig.model_validate(raw)
    report = PreflightReport()
    model = ModelInfo(source="local", where="model", config=model_config, files=["config.json"])
    check_eval_time(CheckContext(cfg, Machine(cuda_devices=cuda, cpu_count=cpus), None, model, report))
    return report


def _cost_warnings(report: PreflightReport, phase: str) -> list[str]:
    return [w for w in report.warnings if w.startswith(f"evaluate_{phase}:")]


def test_registered_as_a_check():
    assert check_eval_time in CHECKS


def test_issue_case_warns_with_the_max_batches_fix_and_the_fix_passes():
    report = _report(_issue_case(), SMALL)
    (msg,) = _cost_warnings(report, "cpt")
    fix = int(re.search(r"lower cpt\.eval\.max_batches from 50 to (\d+)", msg).group(1))
    assert 1 <= fix < 50
    assert "of cpt training" in msg and "2N FLOPs per evaluated token" in msg and "6N per trained token" in msg
    ratio = int(re.search(r"(\d+)% of cpt training", msg).group(1))
    assert ratio > SHARE * 100

    fixed = _report(_issue_case(fix), SMALL)
    assert not _cost_warnings(fixed, "cpt"), fixed.warnings
    assert any(c.startswith("evaluate_cpt:") for c in fixed.checked)
    # the fix is the largest that passes: one batch more warns again
    assert _cost_warnings(_report(_issue_case(fix + 1), SMALL), "cpt")


def test_estimate_scales_with_batches_and_models():
    st = RunConfig.model_validate(_issue_case()).cpt
    a = estimate(SMALL, st, "cpt", cuda=False, max_batches=10)
    b = estimate(SMALL, st, "cpt", cuda=False, max_batches=20)
    assert b.eval_flops == pytest.approx(2 * a.eval_flops)
    # training: 6N per token over max_steps x micro_batch x dp sequences; CPU ranks share one node's cores
    n = a.train_flops / (50 * 4 * 1 * 512)  # tp=2 of 2 ranks: dp 1
    assert 6 * count_parameters(SMALL) < n < 6.5 * count_parameters(SMALL)  # + the attention term
    # evaluation: 2 models x 2N per token, about 2/3 of training's cost per token
    per_token = a.per_batch_flops / (8 * 512)
    assert per_token / n == pytest.approx(4 / 6, rel=0.05)
    # on GPUs training spreads over the stage's 2 ranks, evaluation still runs on one device
    assert estimate(SMALL, st, "cpt", cuda=True).train_flops == pytest.approx(a.train_flops / 2)
    # on CPU: 2 ranks of 1 thread against evaluation's 8 threads: training takes 4x longer per FLOP
    assert estimate(SMALL, st, "cpt", cuda=False, cpu=Cpu(8, 1, 8)).train_flops == pytest.approx(a.train_flops * 4)


def test_threads_follow_omp_num_threads():
    assert threads(16, {}) == (16, 1)  # torch in the worker uses every core; torchrun gives each rank 1
    assert threads(16, {"OMP_NUM_THREADS": "4"}) == (4, 4)
    assert threads(2, {"OMP_NUM_THREADS": "8"}) == (2, 8)


def test_more_evaluation_threads_than_training_threads_lower_the_share():
    """16 cores: evaluation gets 16 threads, the 2 training ranks 1 each, so the same config passes."""
    assert _cost_warnings(_report(_issue_case(), SMALL, cpus=2), "cpt")
    assert not _cost_warnings(_report(_issue_case(), SMALL, cpus=16), "cpt")


def test_sft_counts_the_generation_check_and_lora():
    raw = _raw()
    cfg = RunConfig.model_validate(raw)
    plain = estimate(SMALL, cfg.sft, "sft", cuda=False, generation=GenerationCheck(4, 64))
    assert plain.fixed_flops > 0 and plain.eval_flops > plain.per_batch_flops * cfg.sft.eval.max_batches
    raw["sft"]["lora"] = {"r": 8}
    lora = estimate(SMALL, RunConfig.model_validate(raw).sft, "sft", cuda=False, generation=GenerationCheck(4, 64))
    assert lora.train_flops < plain.train_flops and lora.ratio > plain.ratio


def test_default_demo_config_does_not_warn():
    """tiny-cpu.yaml's upper bound is over the share, but a few seconds of evaluation (under FLOOR) are not worth a word."""
    report = _report(_raw(), TINY)
    assert not [w for w in report.warnings if w.startswith("evaluate_")], report.warnings
    assert estimate(TINY, RunConfig.model_validate(_raw()).cpt, "cpt", cuda=False).eval_flops < FLOOR
    assert len([c for c in report.checked if c.startswith("evaluate_")]) == 2


def test_demo_config_with_a_real_model_warns_only_where_evaluation_dominates():
    """The demo's shape with a 135M model: 30 steps of 4 x 64 tokens against 50 batches of 8 does warn."""
    report = _report(_raw(), SMALL)
    assert _cost_warnings(report, "cpt") and _cost_warnings(report, "sft")
    raw = _raw()
    for st in ("cpt", "sft"):
        raw[st]["max_steps"] = 2000
    assert not _cost_warnings(_report(raw, SMALL), "cpt")
