"""Where evaluation puts a model (tasks/core/evaluation/placement.py): the pure plan, its figures,
and, on a GPU machine, evaluation spread over the visible GPUs.

    .venv/bin/python -m pytest tests/test_eval_placement.py -q                 # unit tier (CPU)
    .venv/bin/python -m pytest -m gpu tests/test_eval_placement.py -v          # GPU tier; skipped without CUDA

The unit tier checks the decision (model bytes, GPUs and their memory -> CPU, one GPU, spread, or
refused with the numbers) and that accelerate, given the plan's max_memory, really spreads a model
over the GPUs it names and nowhere else (its device map is computed on the meta device, no GPU
needed). The GPU tier loads the tiny model spread over every visible GPU (the plan run with each
GPU's free memory shrunk so the model cannot fit one) and compares its held-out loss and greedy
generations with the same model on one GPU.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tasks.core.config.schema import EvalConfig
from tasks.core.evaluation import heldout as ev
from tasks.core.evaluation import placement as where
from tasks.core.evaluation.generation import generation_check
from tasks.core.evaluation.placement import CUDA_RESERVE_BYTES, Placement, forward_bytes, logits_chunk_tokens, plan

GB = 10**9
# Llama-3-8B: 8.03e9 parameters, 16.06 GB in bf16
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256}


def test_no_gpu_is_the_cpu_exactly_as_before():
    assert plan(16 * GB, [], forward=GB) == Placement("cpu", 16 * GB)
    assert where.eval_dtype(None, "bf16", cuda=False) == "fp32"  # CPU evaluation keeps fp32
    assert ev.resolved(EvalConfig()).dtype == "fp32" and ev.resolved(EvalConfig(dtype="bf16")).dtype == "bf16"


def test_the_default_dtype_follows_the_export_on_a_gpu():
    assert where.eval_dtype(None, "bf16", cuda=True) == "bf16"
    assert where.eval_dtype(None, "fp16", cuda=True) == "fp16"
    assert where.eval_dtype("fp32", "bf16", cuda=True) == "fp32"  # as set, wherever


def test_a_model_that_fits_the_first_gpu_goes_there_whole():
    fwd = forward_bytes(LLAMA3_8B, "bf16", 8 * 2048)
    p = plan(16 * GB, [80 * GB] * 8, forward=fwd)
    assert (p.kind, p.device_map, p.gpus, p.describe()) == ("gpu", {"": 0}, 1, "cuda:0")


def test_a_model_larger_than_one_gpu_is_spread_over_the_visible_gpus_with_room_for_the_forward():
    # Llama-3-70B in bf16 (141 GB) on 4 x 80 GB: each GPU gives accelerate its free memory less the
    # CUDA reserve and one batch's forward
    fwd = forward_bytes({"hidden_size": 8192, "intermediate_size": 28672, "vocab_size": 128256}, "bf16", 4 * 4096)
    p = plan(141 * GB, [80 * GB, 79 * GB, 80 * GB, 80 * GB], forward=fwd)
    assert p.kind == "spread" and p.device_map == "auto" and p.gpus == 4
    assert p.max_memory == {
        0: 80 * GB - CUDA_RESERVE_BYTES - fwd,
        1: 79 * GB - CUDA_RESERVE_BYTES - fwd,
        2: 80 * GB - CUDA_RESERVE_BYTES - fwd,
        3: 80 * GB - CUDA_RESERVE_BYTES - fwd,
    }
    assert sum(p.max_memory.values()) >= 141 * GB and p.describe().startswith("cuda:0-3 (device_map auto")
    # accelerate keeps the largest block (a decoder layer: 1.7 GB) free on each GPU as it fills it
    assert plan(141 * GB, [80 * GB, 79 * GB, 80 * GB, 80 * GB], forward=fwd, largest=int(1.7 * GB)).kind == "spread"
    free = [38 * GB + fwd] * 4  # 36 GB of room each: 144 GB in all, 137.2 GB with a block spare on each
    assert plan(141 * GB, free, forward=fwd).kind == "spread"
    tight = plan(141 * GB, free, forward=fwd, largest=int(1.7 * GB))
    assert tight.kind == "refused" and "1.70 GB of each, the largest block, stays free" in tight.problem


def test_a_model_that_fits_nowhere_is_refused_with_the_numbers():
    p = plan(280 * GB, [80 * GB] * 2, forward=GB)
    assert p.kind == "refused" and p.device_map is None
    assert (
        "needs 280.00 GB" in p.problem
        and "2 visible GPU(s) leave 154.00 GB" in p.problem
        and "80.00, 80.00 GB free" in p.problem
    )
    with pytest.raises(ValueError, match=r"cannot be evaluated on this node's GPUs: .*set eval\.dtype: bf16"):
        ev.load_model("/nowhere", "fp32", torch.device("cpu"), placement=p)
    # one GPU smaller than the model is refused too: there is nothing to spread over
    assert plan(20 * GB, [16 * GB], forward=GB).kind == "refused"


def test_forward_bytes_is_one_layers_working_tensors_and_a_chunk_of_logits():
    # per token: (7 * 64 + 3 * 128) * 2 B in bf16 = 1664 (a layer's working tensors, the final hidden states);
    # logits 512 * (2 + 8) = 5120 per position, for 10 positions: under one chunk (32768 positions of 512)
    assert forward_bytes({"hidden_size": 64, "intermediate_size": 128, "vocab_size": 512}, "bf16", 10) == 10 * (
        1664 + 5120
    )
    # a 262k vocabulary: 64 positions of logits at a time, however many tokens the batch holds
    big = {"hidden_size": 640, "intermediate_size": 2048, "vocab_size": 262144}
    assert logits_chunk_tokens(262144) == 64
    assert forward_bytes(big, "fp32", 4096) == 4096 * (7 * 640 + 3 * 2048) * 4 + 64 * 262144 * 12


def test_model_bytes_come_from_the_safetensors_headers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # HF saves a tied head once; the demo model is untied, so every parameter is a stored tensor
    assert where.safetensors_numel(tiny_model_dir) == sum(p.numel() for p in model.parameters())
    assert where.largest_block_numel(tiny_model_dir) == sum(
        p.numel() for p in model.model.layers[0].parameters()
    )  # > the embedding
    assert where.place(tiny_model_dir, "bf16", 512, gpu_bytes=[]) == Placement("cpu")
    one = where.place(tiny_model_dir, "bf16", 512, gpu_bytes=[80 * GB])
    assert one.kind == "gpu" and one.model_bytes == 2 * where.safetensors_numel(tiny_model_dir)


def test_accelerate_spreads_the_model_over_exactly_the_gpus_of_the_plan(tiny_model_dir):
    """What from_pretrained(device_map="auto", max_memory=...) does with the plan, on the meta device."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from accelerate.utils import get_balanced_memory
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    size, largest = 2 * where.safetensors_numel(tiny_model_dir), 2 * where.largest_block_numel(tiny_model_dir)
    fwd = forward_bytes(json.loads((tiny_model_dir / "config.json").read_text()), "bf16", 64)
    free = [CUDA_RESERVE_BYTES + fwd + math.ceil(size / 2) + largest] * 2  # the least room the plan spreads over
    p = plan(size, free, fwd, largest=largest)
    assert p.kind == "spread" and plan(size, [f - 2 for f in free], fwd, largest=largest).kind == "refused"
    no_split = model._no_split_modules
    balanced = get_balanced_memory(
        model, max_memory=p.max_memory, no_split_module_classes=no_split, dtype=torch.bfloat16
    )
    device_map = infer_auto_device_map(
        model, max_memory=balanced, no_split_module_classes=no_split, dtype=torch.bfloat16
    )
    assert set(device_map.values()) == {0, 1}, device_map  # both GPUs, never the CPU or the disk


# ---- GPU tier: evaluation across the visible GPUs ----------------------------------------------


@pytest.fixture(scope="module")
def cpt_records():
    from tasks.core.data.records import read_records
    from tests.conftest import REPO

    return read_records(str(REPO / "data" / "sample" / "cpt.jsonl"))


@pytest.fixture(scope="module")
def sft_records():
    from tasks.core.data.records import read_records
    from tests.conftest import REPO

    return read_records(str(REPO / "data" / "sample" / "sft.jsonl"))


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs to spread over")


def _squeezed(model_dir, dtype: str) -> list[int]:
    """Each visible GPU's memory as the plan sees it (with the forward counted as nothing), cut so
    that the model cannot fit one of them but fits all of them."""
    size, n = where.safetensors_numel(model_dir) * where.DTYPE_BYTES[dtype], torch.cuda.device_count()
    share = math.ceil(size / n) + where.largest_block_numel(model_dir) * where.DTYPE_BYTES[dtype] + 1024
    assert share < size  # so the plan spreads
    return [CUDA_RESERVE_BYTES + share] * n


@pytest.mark.gpu
@cuda_only
def test_gpu_evaluation_defaults_to_the_export_dtype_on_the_first_gpu(tiny_model_dir, cpt_records):
    from tasks.core.data.split import split_by_fraction

    held = split_by_fraction(cpt_records, 0.05).heldout
    m = ev.evaluate_cpt(tiny_model_dir, tiny_model_dir, held, "text", 64, EvalConfig(batch_size=8))
    assert m["dtype"] == "bf16" and m["device"] == "cuda:0" and m["base"] == m["cpt"]


@pytest.mark.gpu
@two_gpus
def test_gpu_evaluation_spread_over_the_visible_gpus_gives_the_one_gpu_numbers(
    tiny_model_dir, cpt_records, sft_records, monkeypatch
):
    from tasks.core.data.split import split_by_fraction

    held = split_by_fraction(cpt_records, 0.05).heldout
    cfg = EvalConfig(batch_size=8, dtype="fp32")
    one = ev.evaluate_cpt(tiny_model_dir, tiny_model_dir, held, "text", 64, cfg)
    chats = split_by_fraction(sft_records, 0.1).heldout
    gen_one, rows_one = generation_check(
        tiny_model_dir, chats, "messages", max_new_tokens=8, num_prompts=3, dtype="fp32"
    )
    squeezed = _squeezed(tiny_model_dir, "fp32")
    # GPUs as small as the tiny model needs to be spread (its forward, MBs, would not fit what is left)
    monkeypatch.setattr(where, "visible_gpu_bytes", lambda: squeezed)
    monkeypatch.setattr(where, "forward_bytes", lambda config, dtype, tokens: 0)
    spread = ev.evaluate_cpt(tiny_model_dir, tiny_model_dir, held, "text", 64, cfg)
    n = torch.cuda.device_count()
    assert one["device"] == "cuda:0" and spread["device"].startswith(f"cuda:0-{n - 1} (device_map auto")
    assert spread["base"]["loss"] == pytest.approx(one["base"]["loss"], rel=1e-6) and spread["tokens"] == one["tokens"]
    # the generation check takes the same path
    gen, rows = generation_check(tiny_model_dir, chats, "messages", max_new_tokens=8, num_prompts=3, dtype="fp32")
    assert gen["device"].startswith(f"cuda:0-{n - 1}") and gen_one["device"] == "cuda:0"
    assert [r["completion"] for r in rows] == [r["completion"] for r in rows_one]
    # what accelerate placed: layers on more than one GPU
    placed = where.place(tiny_model_dir, "fp32", 8 * 64)
    assert placed.kind == "spread"
    model = ev.load_model(tiny_model_dir, "fp32", torch.device("cuda:0"), placement=placed)
    try:
        assert len({str(p.device) for p in model.parameters()}) > 1, model.hf_device_map
    finally:
        del model
        torch.cuda.empty_cache()


# ---- pre-flight: the same plan from config.json, before anything trains -------------------------


def _report_on(tmp_path, gpus: int, gpu_gb: float, **cpt_eval):
    from tasks.core.preflight.checks import Machine
    from tests.test_preflight import Case, _llama3

    case = Case(tmp_path)
    _llama3(case)  # Llama-3-8B: 8.03e9 parameters
    case.raw["cpt"]["eval"] = {**case.raw["cpt"].get("eval", {}), **cpt_eval}
    case.machine = Machine(cuda_devices=gpus, cpu_count=16, free_bytes=10**13, gpu_memory_bytes=int(gpu_gb * GB))
    report = case.report()
    return [p for p in report.problems if ".eval." in p[0]], [
        line for line in report.checked if line.startswith("evaluate_")
    ]


def test_preflight_refuses_an_evaluation_that_fits_no_gpu_naming_the_dtype(tmp_path):
    problems, checked = _report_on(tmp_path, gpus=1, gpu_gb=24, dtype="fp32")
    assert [f for f, _ in problems] == ["cpt.eval.dtype"], problems
    assert "needs 32.12 GB" in problems[0][1] and "set cpt.eval.dtype: bf16 (half of fp32)" in problems[0][1]
    # sft.eval.dtype unset: the export's bf16 on a GPU, 16.06 GB, fits the one GPU
    assert checked == ["evaluate_sft: 16.06 GB model in bf16 on cuda:0 of 1 visible GPU(s)"]


def test_preflight_spreads_an_evaluation_over_the_visible_gpus(tmp_path):
    problems, checked = _report_on(tmp_path, gpus=2, gpu_gb=24, dtype="fp32")
    assert not problems and checked[0].startswith(
        "evaluate_cpt: 32.12 GB model in fp32 on cuda:0-1 (device_map auto"
    ), checked


def test_preflight_checks_no_evaluation_memory_without_a_gpu(tmp_path):
    from tasks.core.preflight.checks import Machine
    from tests.test_preflight import Case

    case = Case(tmp_path)
    case.machine = Machine(cuda_devices=0, cpu_count=2, free_bytes=10**13)
    # check_eval_time's lines (FLOPs against training) are not memory lines
    assert not [line for line in case.report().checked if line.startswith("evaluate_") and "FLOPs" not in line]
