"""Unit tier: the per-rank memory estimate (tasks/core/preflight/memory.py) and pre-flight's use of it.

    .venv/bin/python -m pytest tests/test_memory_estimate.py -q

The figures are arithmetic on config.json and the plugin rows; the activation table of every family
is checked against what torch really keeps for one decoder layer's backward (saved-tensor hooks on
a tiny model), and benchmarks/scale.py checks the whole estimate against ranks' measured RSS.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from tasks.core.config import plugins
from tasks.core.config.schema import PhaseConfig
from tasks.core.errors import ConfigError
from tasks.core.models.families import FAMILIES, TP_SPLIT_DIMS, iter_tensors
from tasks.core.preflight.checks import Machine, load_for_check
from tasks.core.preflight.memory import (
    CUDA_RESERVE_BYTES,
    LLAMA3,
    RANK_BASELINE_BYTES,
    estimate,
    human,
    layer_activation_bytes,
    table,
)
from tasks.core.preflight.memory_check import flow_process, node_host_need
from tests._activations import kept_per_token
from tests.conftest import write_config
from tests.test_preflight import LLAMA3_8B, Case, _all, _llama3, _set

# hidden 64, 2 layers, 4 heads of 16 (q = 64), 2 KV heads (kv = 32), MLP 128, vocabulary 512
TINY = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def stage(plugin: dict, nproc: int = 1, nnodes: int = 1, **kw) -> PhaseConfig:
    return PhaseConfig.model_validate(
        {
            "data": {"uri": "x"},
            "plugin": plugin,
            "max_steps": 1,
            "lr": 1e-4,
            "launch": {"nproc_per_node": nproc, "nnodes": nnodes},
            "seq_len": 16,
            "micro_batch_size": 2,
            **kw,
        }
    )


def by_what(est) -> dict[str, int]:
    return {t.what: t.bytes for t in est.terms}


def test_torch_ddp_fp32_estimate_is_the_hand_computed_figure():
    # Parameters: embedding 512*64 = 32768, LM head 32768, final norm 64; per layer q 64*64 = 4096,
    # k and v 32*64 = 2048 each, o 4096, gate/up/down 3 * 128*64 = 24576, two norms 128: 36992.
    P = 32768 + 32768 + 64 + 2 * 36992
    assert P == 139584
    # torch_ddp fp32: fp32 weights, DDP's buckets and the Adam moments always (4 + 4 + 8 B),
    # gradients (4 B) from the backward through the step.
    always, grads = 16 * P, 4 * P
    # Activations per token: a layer keeps 2 fp32 hidden-wide (2*4*64 = 512), 4 hidden-wide
    # (4*4*64 = 1024), 5 q-wide (5*4*64 = 1280), the log-sum-exp of 4 heads (16) and 4 MLP-wide
    # (4*4*128 = 2048): 4880 B. Two layers plus the one in the backward: 3 * 4880 = 14640; the final
    # norm 4*64 + 2*4*64 = 768; the loss 12 B per logit: 12*512 = 6144. Tokens: 2 x 16 = 32.
    # (transformers >= 4.52 keeps 4 q-wide: 4880 - 256 = 4624 B a layer; family_spec.LLAMA_LAYER_ACTIVATIONS)
    layer = 4880 if transformers.__version__.startswith("4.51.") else 4624
    acts = (3 * layer + 768 + 6144) * 32
    assert acts == (689664 if layer == 4880 else 665088)
    est = estimate(TINY, stage({"name": "torch_ddp", "precision": "fp32"}), cuda=False)
    assert est.parameters == est.rank_parameters == P
    assert by_what(est) == {
        "fp32 weights": 4 * P,
        "gradients": 4 * P,
        "DDP gradient buckets": 4 * P,
        "Adam moments": 8 * P,
        "activations": acts,
    }
    assert est.device == always + max(acts, grads) == 2923008 - 689664 + acts
    # A CPU rank's RSS holds both phases (glibc keeps the freed activations), plus the baseline.
    assert est.host_steady == RANK_BASELINE_BYTES + always + acts + grads
    # On CUDA the same states must fit the GPU with the reserve; the host keeps the baseline.
    gpu = estimate(TINY, stage({"name": "torch_ddp", "precision": "fp32"}), cuda=True)
    assert gpu.device == est.device + CUDA_RESERVE_BYTES and gpu.host_steady == RANK_BASELINE_BYTES
    # today's engine builds the whole fp32 model on every rank for torch_ddp
    assert est.construction_host == RANK_BASELINE_BYTES + 4 * P


def test_zero_stages_shrink_the_rank_in_their_proportions():
    eight = dict(nproc=8, seq_len=4096, micro_batch_size=1)
    mc = LLAMA3["Llama-3-8B"]
    z1 = by_what(
        estimate(mc, stage({"name": "low_level_zero", "zero_stage": 1, "precision": "bf16"}, **eight), cuda=True)
    )
    z2 = by_what(
        estimate(mc, stage({"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}, **eight), cuda=True)
    )
    P = estimate(mc, stage({"name": "torch_ddp"}, **eight)).parameters
    # ZeRO-1 keeps every bf16 gradient; ZeRO-2 keeps this rank's 1/8: 8x less
    assert z1["gradients"] == 2 * P and z2["gradient shard"] == math.ceil(P / 8) * 2
    # both shard masters and moments over the 8 ranks and keep the whole bf16 model
    for z in (z1, z2):
        assert (z["working weights"], z["fp32 master weight shard"], z["Adam moment shard"]) == (
            2 * P,
            math.ceil(P / 8) * 4,
            math.ceil(P / 8) * 8,
        )
    # twice the ranks (2 nodes): the sharded states halve, the whole model does not
    z2x2 = by_what(
        estimate(
            mc, stage({"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}, nnodes=2, **eight), cuda=True
        )
    )
    assert z2x2["Adam moment shard"] == math.ceil(P / 16) * 8 and z2x2["working weights"] == z2["working weights"]
    # Gemini (ZeRO-3) shards the weights too
    g = by_what(estimate(mc, stage({"name": "gemini", "precision": "bf16"}, **eight), cuda=True))
    assert g["weight chunk shard"] == math.ceil(P / 8) * 2


def test_tensor_parallelism_splits_every_tp_tensor_and_replicates_the_norms():
    mc = LLAMA3["Llama-3-8B"]
    split = sum(math.prod(s) for _, rule, s, _ in iter_tensors(mc) if set(rule.shape) & TP_SPLIT_DIMS)
    replicated = sum(math.prod(s) for _, rule, s, _ in iter_tensors(mc) if not set(rule.shape) & TP_SPLIT_DIMS)
    assert replicated == 4096 * (2 * 32 + 1)  # the two norms of every layer and the final one
    for tp in (1, 2, 4, 8):
        est = estimate(mc, stage({"name": "hybrid_parallel", "tp_size": tp, "precision": "bf16"}, nproc=tp), cuda=True)
        assert est.rank_parameters == split // tp + replicated
        assert by_what(est)["Adam moments"] == 8 * (split // tp + replicated)
    # the activations of the q- and MLP-wide tensors split too, the hidden-wide ones do not
    per = {tp: layer_activation_bytes(mc, 2, tp) for tp in (1, 2)}
    hidden_wide = 2 * 4 * 4096 + 4 * 2 * 4096
    assert per[1] - hidden_wide == pytest.approx(2 * (per[2] - hidden_wide))


def test_activation_checkpointing_keeps_only_each_layers_input():
    plugin = {"name": "hybrid_parallel", "tp_size": 1, "precision": "bf16"}
    off = by_what(estimate(TINY, stage(plugin), cuda=True))["activations"]
    on = by_what(estimate(TINY, stage(plugin, activation_checkpointing=True), cuda=True))["activations"]
    layer, tokens = layer_activation_bytes(TINY, 2), 32
    # off: 2 layers + the one in the backward; on: 2 layer inputs (64 wide, bf16) + the layer being
    # recomputed + the one in the backward; the final norm and the loss are the same in both
    assert off - on == pytest.approx((3 * layer - (2 * 64 * 2 + 2 * layer)) * tokens, abs=2)
    assert on < off


def _saved_per_token(family: str, dtype: torch.dtype) -> float:
    """Bytes torch keeps for the backward of decoder layer 1 of a tiny model, per token."""
    spec = FAMILIES[family]
    dims = dict(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=344,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=3,
        head_dim=16,
    )
    cfg = getattr(transformers, spec.config_class)(**dims, **spec.demo_config)
    torch.manual_seed(0)
    return kept_per_token(getattr(transformers, spec.model_class)(cfg).to(dtype), "model.layers.1", masks=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_family_activation_table_is_what_torch_keeps(family, dtype):
    mc = {
        "model_type": family,
        "vocab_size": 300,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 3,
        "head_dim": 16,
    }
    table_bytes = layer_activation_bytes(mc, 4 if dtype == torch.float32 else 2)
    measured = _saved_per_token(family, dtype)
    # the table leaves out the 1-wide inverse RMS of each norm and RoPE's per-position cos/sin (and the attention
    # masks, built once per forward, which the measure leaves out too)
    assert table_bytes <= measured <= table_bytes * 1.02, (family, dtype, table_bytes, measured)


def test_a_registered_plugin_is_estimated_from_its_holds_row():
    spec = plugins.PluginSpec(
        name="dummy_sharded",
        summary="a test plugin",
        zero_stages=(3,),
        zero_hint="3",
        kernel_routes=("hf_model",),  # no fused-AdamW kernel row applies
        holds=(
            plugins.Held("weights", "weights", sharded=True),
            plugins.Held("grads", "weights", sharded=True, when="grads"),
            plugins.Held("moments", 8, sharded=True),
            plugins.Held("fp16-only buffer", 2, precisions=("fp16",)),
        ),
    )
    plugins.register(spec)
    try:
        phase_cfg = stage({"name": "dummy_sharded", "zero_stage": 3, "precision": "bf16"}, nproc=4)
        shard = math.ceil(139584 / 4)
        assert {k: v for k, v in by_what(estimate(TINY, phase_cfg)).items() if k != "activations"} == {
            "weights": 2 * shard,
            "grads": 2 * shard,
            "moments": 8 * shard,
        }
        # on CUDA an AdamW plugin without a fused-AdamW kernel row steps with torch's foreach temporaries
        assert by_what(estimate(TINY, phase_cfg, cuda=True))["AdamW foreach temporaries"] == 4 * shard
        plugins.register(plugins.PluginSpec(name="dummy_sharded", summary="no memory rows"))
        with pytest.raises(KeyError, match="no `holds` rows"):
            estimate(TINY, stage({"name": "dummy_sharded"}))
    finally:
        plugins.PLUGINS.pop("dummy_sharded", None)


def _fat_sft(c: Case) -> None:
    """Llama-3-8B under ZeRO-1 on 8 ranks: 16 GB bf16 weights + 16 GB gradients + shards."""
    _llama3(c)
    _set("cpt.plugin", {"name": "low_level_zero", "zero_stage": 1, "precision": "bf16"})(c)
    _set("cpt.launch", {"nproc_per_node": 8, "gpu_memory_gb": 40})(c)


def test_preflight_refuses_a_layout_over_the_declared_gpu_memory_naming_numbers_and_fixes(tmp_path):
    case = Case(tmp_path)
    _fat_sft(case)
    report = case.report()
    msgs = [m for f, m in report.problems if f == "cpt.launch.gpu_memory_gb"]
    assert msgs, report.text()
    mc = {"model_type": "llama", **LLAMA3_8B}
    phase_cfg = load_for_check(write_config(tmp_path / "c.yaml", case.raw)).cpt
    need = estimate(mc, phase_cfg, cuda=True).device
    assert f"cpt needs {need / 1e9:,.2f} GB of GPU memory per rank" in msgs[0]
    assert "more than the 40.00 GB of cpt.launch.gpu_memory_gb = 40" in msgs[0]
    fixed = estimate(
        mc, phase_cfg.model_copy(update={"plugin": phase_cfg.plugin.model_copy(update={"zero_stage": 2})}), cuda=True
    ).device
    assert fixed <= 40e9 < need
    assert f"it fits with cpt.plugin.zero_stage: 2 ({fixed / 1e9:,.2f} GB)" in msgs[0]
    # the same layout on 80 GB GPUs passes, and says so
    case.raw["cpt"]["launch"]["gpu_memory_gb"] = 80
    ok = case.report()
    assert not [p for p in ok.problems if "gpu_memory" in p[0]], ok.text()
    assert any(
        line.startswith("cpt memory per rank (estimate):") and "GPU of 80.00 GB" in line for line in ok.checked
    ), ok.text()


def test_a_visible_gpu_is_the_capacity_when_none_is_declared(tmp_path):
    case = Case(tmp_path)
    _fat_sft(case)
    del case.raw["cpt"]["launch"]["gpu_memory_gb"]
    case.machine = Machine(cuda_devices=8, cpu_count=16, free_bytes=10**13, gpu_memory_bytes=int(24e9))
    report = case.report()
    msgs = [m for f, m in report.problems if f == "cpt.plugin"]
    assert msgs and "more than the 24.00 GB of the visible GPU" in msgs[0], report.text()


def test_cpu_without_declared_gpu_memory_prints_the_host_estimate_and_refuses_nothing(tmp_path):
    case = Case(tmp_path)
    _all(
        _llama3,
        _set("cpt.plugin", {"name": "low_level_zero", "zero_stage": 1, "precision": "bf16"}),
        _set("cpt.launch", {"nproc_per_node": 2}),
    )(case)
    report = case.report()
    assert not [p for p in report.problems if p[0].startswith("cpt.launch") or p[0] == "cpt.plugin"], report.text()
    line = next(c for c in report.checked if c.startswith("cpt memory per rank"))
    assert "host RAM steady on this CPU rank" in line and "no GPU" in line


@pytest.mark.parametrize("value", [0, -8])
def test_gpu_memory_gb_must_be_positive(tmp_path, value):
    case = Case(tmp_path)
    _set("sft.launch", {"nproc_per_node": 2, "gpu_memory_gb": value})(case)
    with pytest.raises(ConfigError) as info:
        load_for_check(write_config(tmp_path / "c.yaml", case.raw))
    assert [f for f, _ in info.value.problems] == ["sft.launch.gpu_memory_gb"] and "greater than 0" in str(info.value)


def test_the_map_names_a_layout_that_fits_each_llama3_model():
    rows = [line.split(" | ") for line in table().splitlines() if line.startswith("| Llama")]
    for model in LLAMA3:
        assert any(r[0] == f"| {model}" and r[5] == "yes" for r in rows), model
        assert any(r[0] == f"| {model}" and r[5] == "no" for r in rows), model


def test_cpu_offload_moves_the_optimizer_state_and_step_to_the_host_on_cuda_only():
    on, off = (
        {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16", "cpu_offload": flag} for flag in (True, False)
    )
    shard = math.ceil(139584 / 2)
    unfused = {"kernels": {"fused_optimizer": False}}  # torch's foreach AdamW, whose temporaries follow the step
    gpu_on, gpu_off = (estimate(TINY, stage(p, nproc=2, **unfused), cuda=True) for p in (on, off))
    # the fp32 master shard (4 B) and the moments (8 B) always, the fp32 gradient shard (4 B) and
    # AdamW's foreach temporaries (4 B) at the step: in host memory, beside the baseline
    assert gpu_on.offloaded == 20 * shard and gpu_on.host_steady == RANK_BASELINE_BYTES + 20 * shard
    assert gpu_off.total("always") - gpu_on.total("always") == 12 * shard and gpu_off.offloaded == 0
    assert gpu_off.total("step") - gpu_on.total("step") == 8 * shard
    # on a CPU rank everything is host memory already: the same figure either way
    assert estimate(TINY, stage(on, nproc=2)).host_steady == estimate(TINY, stage(off, nproc=2)).host_steady


def test_gemini_offload_fractions_move_their_share():
    phase_cfg = stage({"name": "gemini", "precision": "bf16", "offload_optim_frac": 0.5}, nproc=2)
    shard = math.ceil(139584 / 2)
    est = estimate(TINY, phase_cfg, cuda=True)
    host = {t.what: t.bytes for t in est.terms if t.host}
    assert host == {"fp32 master shard": 2 * shard, "Adam moment shard": 4 * shard}  # half of 4 B and of 8 B


def test_the_refusal_offers_the_plugins_offload(tmp_path):
    case = Case(tmp_path)
    _fat_sft(case)
    msg = next(m for f, m in case.report().problems if f == "cpt.launch.gpu_memory_gb")
    phase_cfg = load_for_check(write_config(tmp_path / "c.yaml", case.raw)).cpt
    offloaded = phase_cfg.model_copy(update={"plugin": phase_cfg.plugin.model_copy(update={"cpu_offload": True})})
    need = estimate({"model_type": "llama", **LLAMA3_8B}, offloaded, cuda=True).device
    assert need <= 40e9 and f"cpt.plugin.cpu_offload: true ({need / 1e9:,.2f} GB)" in msg, msg


# -- the printed parts, ZeRO's buckets, the host's memory ---------------------------------------------


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
@pytest.mark.parametrize("name", sorted(n for n, s in plugins.PLUGINS.items() if s.holds))
def test_the_printed_parts_sum_to_each_figure_for_every_plugin(name, cuda):
    spec = plugins.PLUGINS[name]
    if spec.needs_cuda and not cuda:
        pytest.skip(f"{name} needs CUDA")
    zero = max(spec.zero_stages)
    fields = {"name": name, "precision": "bf16", "zero_stage": zero}
    for mc, st in (
        (TINY, stage(fields, nproc=2)),
        (LLAMA3["Llama-3-8B"], stage(fields, nproc=8, seq_len=4096, micro_batch_size=1)),
        (TINY, stage({**fields, "precision": "fp32" if not spec.zero_fp32_refused else "bf16"}, nproc=2)),
    ):
        est = estimate(mc, st, cuda=cuda)
        for figure, total in (
            ("device", est.device),
            ("host", est.host_steady),
            ("construction", est.construction_host),
            ("shard", est.shard_host),
        ):
            parts = est.parts(figure)
            assert sum(n for _, n in parts) == total, (name, figure, parts, total)
            assert all(n > 0 for _, n in parts)
            shown = est.breakdown(figure, limit=3)
            assert shown.endswith(f"= {human(total)}"), shown
            assert len(shown.split(" + ")) <= 4  # three parts and `other`


GEMMA3_270M = {  # google/gemma-3-270m's config.json, the fields the estimate reads
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "tie_word_embeddings": True,
}


def test_zero_keeps_a_flattened_bucket_and_zero2_the_whole_gradients_waiting_in_it():
    """ColossalAI 0.5.0's LowLevelZeroOptimizer flattens a bucket of gradients (12 Mi elements, or one tensor
    larger than that) to reduce it; under ZeRO-2 the gradients wait whole in the bucket beside the
    activations; the fp32 copy of the gradient shard at the step exists in bf16 only."""
    bucket = plugins.PLUGINS["low_level_zero"].grad_bucket_elements
    assert bucket == 12 * 1024 * 1024
    # the tiny model's 139584 parameters are one bucket
    z2 = estimate(TINY, stage({"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"}, nproc=2))
    terms = {(t.what, t.when): t.bytes for t in z2.terms}
    assert terms[("whole gradients awaiting their bucket", "forward")] == 4 * 139584
    assert terms[("flattened gradient bucket", "forward")] == 4 * 139584
    assert not any(t.what == "fp32 gradient shard" for t in z2.terms)  # in fp32 `.to(float32)` is the tensor
    z1 = estimate(TINY, stage({"name": "low_level_zero", "zero_stage": 1, "precision": "bf16"}, nproc=2))
    terms = {(t.what, t.when): t.bytes for t in z1.terms}
    assert terms[("flattened gradient bucket", "backward")] == 2 * 139584
    assert terms[("fp32 gradient shard", "step")] == 4 * math.ceil(139584 / 2)
    # Gemma 3 270M: its tied 262144 x 640 embedding (168M) is a bucket of its own, over 12 Mi elements
    g = estimate(GEMMA3_270M, stage({"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"}, nproc=2))
    assert by_what(g)["flattened gradient bucket"] == 4 * 262144 * 640


def test_the_shard_verb_holds_the_states_and_its_save_or_the_model_as_it_is_built():
    P, largest = 139584, 512 * 64
    ddp = estimate(TINY, stage({"name": "torch_ddp", "precision": "fp32"}, nproc=2))
    # fp32 weights, DDP buckets and Adam moments (16 B); torch DDP saves its whole local state as it is
    assert ddp.shard_host == RANK_BASELINE_BYTES + 16 * P and ddp.save_transient == 0
    assert ddp.shard_host > ddp.construction_host
    zero = estimate(TINY, stage({"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"}, nproc=2))
    # fp32 working weights, the master and moment shards (4 + 12 / 2 B), and one and a half gathered tensors'
    # Adam state (measured: benchmarks/scale.py, the 80M tied model)
    assert zero.save_transient == round(1.5 * 8 * largest)
    half = math.ceil(P / 2)
    assert zero.shard_host == RANK_BASELINE_BYTES + 4 * P + 12 * half + zero.save_transient


def _host_case(tmp_path, plugin: dict, nproc: int, host: int, available: int | None = None) -> Case:
    case = Case(tmp_path)
    _all(_llama3, _set("cpt.plugin", plugin), _set("cpt.launch", {"nproc_per_node": nproc}))(case)
    case.machine = Machine(
        cuda_devices=0, cpu_count=2, free_bytes=10**13, host_memory_bytes=host, host_available_bytes=available
    )
    return case


def test_cpu_ranks_over_this_machines_memory_are_refused_naming_the_levers(tmp_path):
    """4 torch_ddp ranks of Llama-3-8B in fp32 on this machine: no launch, refused before it."""
    from tasks.core.preflight.model_info import host_memory

    total, available = host_memory()
    assert total and total > 0 and available is not None
    assert Machine.detect().host_memory_bytes == total  # what `cpt-to-sft check` compares with
    case = _host_case(tmp_path, {"name": "torch_ddp", "precision": "fp32"}, 4, total, available)
    report = case.report()
    msgs = [m for f, m in report.problems if f == "cpt.launch.nproc_per_node"]
    assert msgs, report.text()
    phase_cfg = load_for_check(write_config(tmp_path / "c.yaml", case.raw)).cpt
    need = node_host_need({"model_type": "llama", **LLAMA3_8B}, phase_cfg, "cpt", False)
    assert need > total
    assert "4 rank(s) x " in msgs[0] and f"= {human(need)}" in msgs[0]
    assert f"more than this machine's {human(total)} of memory" in msgs[0]
    assert "zero_stage" in msgs[0] and "nproc_per_node" in msgs[0] and "micro_batch_size" in msgs[0]
    assert "Traceback" not in report.text()


def test_a_host_lever_that_fits_is_offered_with_its_figure(tmp_path):
    mc = {"model_type": "llama", **LLAMA3_8B}
    base = {"name": "low_level_zero", "zero_stage": 1, "precision": "bf16"}
    phase_cfg = load_for_check(write_config(tmp_path / "c.yaml", _host_case(tmp_path, base, 4, 1).raw)).cpt
    z2 = phase_cfg.model_copy(update={"plugin": phase_cfg.plugin.model_copy(update={"zero_stage": 2})})
    need, fixed = node_host_need(mc, phase_cfg, "cpt", False), node_host_need(mc, z2, "cpt", False)
    host = (need + fixed) // 2
    msg = next(m for f, m in _host_case(tmp_path, base, 4, host).report().problems if f == "cpt.launch.nproc_per_node")
    assert f"cpt.plugin.zero_stage: 2 ({human(fixed)})" in msg, msg
    three = phase_cfg.model_copy(update={"launch": phase_cfg.launch.model_copy(update={"nproc_per_node": 3})})
    assert f"cpt.launch.nproc_per_node: 3 ({human(node_host_need(mc, three, 'cpt', False))})" in msg, msg
    # with the memory it needs the same layout passes, and a warning says when others hold it now
    ok = _host_case(tmp_path, base, 4, need, available=need - 1).report()
    assert not [p for p in ok.problems if p[0] == "cpt.launch.nproc_per_node"], ok.text()
    assert any(line.startswith("cpt host memory on this node: 4 rank(s)") for line in ok.checked), ok.text()
    assert any("available now" in w for w in ok.warnings), ok.text()


def test_the_flow_process_is_estimated_and_checked_against_this_machine(tmp_path):
    case = _host_case(tmp_path, {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}, 2, int(1e15))
    report = case.report()
    lines = [c for c in report.checked if c.startswith("flow process, ")]
    assert any("logits checks" in c and "the largest unit, streamed" in c for c in lines), report.text()
    assert any(c.startswith("flow process, evaluate_cpt on CPU (fp32") for c in lines), report.text()
    mc = {"model_type": "llama", **LLAMA3_8B}
    cfg = load_for_check(write_config(tmp_path / "c.yaml", case.raw))
    figures = {what: sum(n for _, n in rows) for what, _, rows in flow_process(mc, cfg, cuda=False)}
    evaluation = next(n for what, n in figures.items() if what.startswith("evaluate_cpt"))
    assert evaluation > 4 * 8e9  # the fp32 model, whole
    # a machine that holds the ranks but not the fp32 evaluation: refused naming cpt.eval.dtype
    small = _host_case(tmp_path, {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}, 1, int(33e9))
    small.raw["cpt"]["launch"]["nproc_per_node"] = 1
    msgs = [m for f, m in small.report().problems if f == "cpt.eval.dtype"]
    assert msgs and "bf16" in msgs[0], small.report().text()
