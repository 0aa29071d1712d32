"""Sequence parallelism as data: the SP_MODES rows, their layout rules, the family rows, the plugin's arguments,
the data-parallel size, the memory estimate and the CPU attention, without a launch.

    /work/main/.venv/bin/python -m pytest -q tests/test_sequence_parallel.py

The launches (each CPU mode trains as the same stage without it; resume under it is bitwise) are in
tests/test_engine_dist.py, ring_attn on GPUs in tests/test_gpu_sequence.py; every rule's offered fixes
pass pre-flight in tests/test_advice.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tasks.core.config import sequence
from tasks.core.config.layout import ParallelLayout, global_batch, layout_problems
from tasks.core.config.schema import PhaseConfig, PluginConfig, RunConfig
from tasks.core.config.sequence import SP_MODES, SpModeSpec
from tasks.core.models.families import sp_family_problem

LLAMA = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
HP = {"name": "hybrid_parallel", "precision": "fp32"}


def phase_cfg_for(plugin: dict[str, Any], nproc: int = 2, seq_len: int = 64, **kw: Any) -> PhaseConfig:
    return PhaseConfig.model_validate(
        {
            "data": {"uri": "x"},
            "plugin": plugin,
            "max_steps": 1,
            "seq_len": seq_len,
            "lr": 1e-3,
            "micro_batch_size": 2,
            "launch": {"nproc_per_node": nproc},
            **kw,
        }
    )


def refusals(phase_cfg: PhaseConfig, where: str = "cpt", cuda: bool | None = False) -> dict[str, str]:
    return dict(layout_problems(phase_cfg, where, model_config=LLAMA, cuda=cuda))


# -- the registry ------------------------------------------------------------------------------------


def test_every_colossalai_mode_is_a_row_and_says_what_it_needs():
    assert list(SP_MODES) == ["split_gather", "ring", "all_to_all", "ring_attn"]
    assert [m for m, s in SP_MODES.items() if s.shares_tp] == ["split_gather", "ring"]
    assert SP_MODES["all_to_all"].divides_heads and SP_MODES["ring_attn"].causal_only
    assert SP_MODES["ring_attn"].cuda_reason and not SP_MODES["all_to_all"].cuda_reason
    assert SP_MODES["ring"].refused and not SP_MODES["split_gather"].refused


def test_a_registered_dummy_mode_is_accepted_everywhere():
    from tasks.engine.builders import sequence_kwargs

    sequence.register(SpModeSpec("dummy_sp", "a test row: its own group", shares_tp=False))
    try:
        cfg = PluginConfig.model_validate({**HP, "sequence_parallelism": {"mode": "dummy_sp", "size": 2}})
        schema = RunConfig.model_json_schema()["$defs"]["SequenceParallelConfig"]["properties"]["mode"]
        assert "dummy_sp" in schema["enum"] and "a test row" in schema["description"]
        phase_cfg = phase_cfg_for(cfg.model_dump(), nproc=4)
        assert not refusals(phase_cfg)
        layout = ParallelLayout.of(phase_cfg, "cpt", model_config=LLAMA, cuda=False)
        assert (layout.dp, layout.sp, layout.sp_mode) == (2, 2, "dummy_sp")
        assert sequence_kwargs(cfg) == {
            "enable_sequence_parallelism": True,
            "sequence_parallelism_mode": "dummy_sp",
            "sp_size": 2,
            "enable_flash_attention": True,
        }
    finally:
        del SP_MODES["dummy_sp"]
    with pytest.raises(ValueError, match="unknown sequence-parallel mode 'dummy_sp'; registered modes: split_gather"):
        PluginConfig.model_validate({**HP, "sequence_parallelism": {"mode": "dummy_sp"}})


# -- how the world size factors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("plugin", "nproc", "dp", "sp"),
    [
        ({**HP, "tp_size": 2, "sequence_parallelism": {"mode": "split_gather"}}, 4, 2, 2),  # inside tp: dp x tp
        ({**HP, "sequence_parallelism": {"mode": "all_to_all", "size": 2}}, 4, 2, 2),  # its own group: dp x sp
        ({**HP, "tp_size": 2}, 4, 2, 1),
    ],
    ids=["split_gather", "all_to_all", "none"],
)
def test_data_parallel_size_and_global_batch(plugin, nproc, dp, sp):
    phase_cfg = phase_cfg_for(plugin, nproc=nproc)
    layout = ParallelLayout.of(phase_cfg, "cpt", model_config=LLAMA, cuda=False)
    assert (layout.dp, layout.sp) == (dp, sp)
    assert global_batch(phase_cfg) == 2 * dp  # micro_batch_size x grad_accum_steps x dp


def test_plugin_arguments_as_colossalai_expects():
    from tasks.core.config.kernels import Facts, resolve
    from tasks.engine.builders import plugin_kwargs, plugin_meta

    phase_cfg = phase_cfg_for({**HP, "tp_size": 2, "sequence_parallelism": {"mode": "split_gather"}})
    layout = ParallelLayout.of(phase_cfg, "cpt", cuda=False)
    kw = plugin_kwargs(phase_cfg.plugin, phase_cfg, layout, False, resolve(phase_cfg, "cpt", Facts(cuda=False)))
    # sp_size 1: the plugin takes tp_size for a mode inside tp (and warns when given another)
    assert (kw["enable_sequence_parallelism"], kw["sequence_parallelism_mode"], kw["sp_size"]) == (
        True,
        "split_gather",
        1,
    )
    assert kw["enable_flash_attention"] is True  # the causal ColoAttention path, not the maskless eager one
    assert plugin_meta(phase_cfg.plugin, phase_cfg)["sp"] == {"mode": "split_gather", "size": 2}
    plain = phase_cfg_for({**HP, "tp_size": 2})
    assert "enable_sequence_parallelism" not in plugin_kwargs(
        plain.plugin, plain, ParallelLayout.of(plain, "cpt", cuda=False), False, {}
    )


# -- refusals -----------------------------------------------------------------------------------------


def test_refusals_name_the_requirement_and_the_modes_that_would_run():
    ring_attn = refusals(phase_cfg_for({**HP, "sequence_parallelism": {"mode": "ring_attn", "size": 2}}))
    msg = ring_attn["cpt.plugin.sequence_parallelism.mode"]
    assert "ring_attn needs CUDA" in msg and "flash attention" in msg
    assert "set cpt.plugin.sequence_parallelism.mode: all_to_all" in msg
    assert not refusals(phase_cfg_for({**HP, "sequence_parallelism": {"mode": "ring_attn", "size": 2}}), cuda=True)

    ring = refusals(phase_cfg_for({**HP, "tp_size": 2, "sequence_parallelism": {"mode": "ring"}}), cuda=True)
    assert "_ring_as_gather" in ring["cpt.plugin.sequence_parallelism.mode"]

    no_tp = refusals(phase_cfg_for({**HP, "sequence_parallelism": {"mode": "split_gather"}}))
    assert "runs inside tensor parallelism" in no_tp["cpt.plugin.sequence_parallelism.mode"]
    assert "set cpt.plugin.tp_size: 2" in no_tp["cpt.plugin.sequence_parallelism.mode"]

    size = refusals(phase_cfg_for({**HP, "tp_size": 2, "sequence_parallelism": {"mode": "split_gather", "size": 4}}))
    assert "size must equal tp_size=2 or be unset" in size["cpt.plugin.sequence_parallelism.size"]

    heads = refusals(phase_cfg_for({**HP, "sequence_parallelism": {"mode": "all_to_all", "size": 4}}, nproc=4))
    assert "num_key_value_heads=2" in heads["cpt.plugin.sequence_parallelism.size"]
    assert "set cpt.plugin.sequence_parallelism.size: 2" in heads["cpt.plugin.sequence_parallelism.size"]

    seq = refusals(phase_cfg_for({**HP, "sequence_parallelism": {"mode": "all_to_all", "size": 2}}, seq_len=63))
    assert "seq_len=63 must be a multiple" in seq["cpt.seq_len"]

    ddp = refusals(
        phase_cfg_for({"name": "torch_ddp", "precision": "fp32", "sequence_parallelism": {"mode": "all_to_all"}})
    )
    assert "needs plugin hybrid_parallel" in ddp["cpt.plugin.sequence_parallelism"]

    sft = refusals(phase_cfg_for({**HP, "tp_size": 2, "sequence_parallelism": {"mode": "split_gather"}}), where="sft")
    assert "in SFT a record is a row" in sft["sft.plugin.sequence_parallelism"]


@pytest.mark.parametrize(
    ("model_type", "mode", "words"),
    [
        ("mistral", "all_to_all", "Mistral policy switches sequence parallelism off with a warning"),
        ("qwen3", "split_gather", "pipeline and sequence parallelism are not proven with it"),
        ("qwen2", "ring_attn", "modes split_gather, all_to_all run"),
    ],
)
def test_families_refuse_what_their_policy_does_not_run(model_type, mode, words):
    phase_cfg = phase_cfg_for(
        {**HP, "tp_size": 2, "sequence_parallelism": {"mode": mode, **({"size": 2} if mode != "split_gather" else {})}},
        nproc=4,
    )
    field, msg = sp_family_problem({**LLAMA, "model_type": model_type}, phase_cfg, "cpt")
    assert field == "cpt.plugin.sequence_parallelism.mode" and words in msg, msg
    assert sp_family_problem(LLAMA, phase_cfg, "cpt") is None  # llama's policy runs every mode


def test_preflight_refuses_sequence_parallelism_on_mistral(tmp_path):
    from tests.test_preflight import Case, _set, fake_model

    case = Case(tmp_path)
    fake_model(case.model, model_type="mistral", architectures=["MistralForCausalLM"])
    _set("cpt.plugin", {**HP, "sequence_parallelism": {"mode": "all_to_all", "size": 2}})(case)
    report = case.report()
    assert not report.ok
    assert any(f == "cpt.plugin.sequence_parallelism.mode" and "Mistral policy" in m for f, m in report.problems), (
        report.text()
    )


# -- the estimate ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt", [False, True])
def test_estimate_divides_activations_by_the_sequence_group(ckpt):
    from tasks.core.preflight.memory import LLAMA3, estimate

    model = LLAMA3["Llama-3-8B"]

    def acts(plugin: dict[str, Any], seq_len: int = 32768) -> int:
        phase_cfg = phase_cfg_for(
            {**plugin, "precision": "bf16"}, nproc=8, seq_len=seq_len, activation_checkpointing=ckpt
        )
        return next(t.bytes for t in estimate(model, phase_cfg, cuda=True).terms if t.what == "activations")

    hp = {"name": "hybrid_parallel"}
    whole = acts(hp)
    # all_to_all: every per-token tensor over the group, the logits and the loss included
    assert acts({**hp, "sequence_parallelism": {"mode": "all_to_all", "size": 8}}) == pytest.approx(whole / 8, rel=1e-6)
    assert acts({**hp, "sequence_parallelism": {"mode": "all_to_all", "size": 8}}, 8 * 32768) == pytest.approx(
        whole, rel=1e-6
    )
    # split_gather: the hidden-wide tensors tp leaves whole are split too, the rest (and the logits) already are;
    # its q, k, v, gate and up projections each keep their gathered input (bf16, hidden 4096, 32k tokens) in
    # every layer held for the backward (32 + the one in the backward; with checkpointing the recomputed one, twice)
    tp8 = acts({**hp, "tp_size": 8})
    sg = acts({**hp, "tp_size": 8, "sequence_parallelism": {"mode": "split_gather"}})
    held = 2 if ckpt else 33
    assert sg == pytest.approx(whole / 8 + held * 5 * 4096 * 2 * 2 * 32768, rel=1e-6) and sg < tp8  # 2 rows


def test_long_context_table_prints_every_layout_and_length(capsys):
    from tasks.core.preflight import long_context

    assert long_context.main([]) == 0
    out = capsys.readouterr().out
    assert "| model | layout | act. ckpt | 8k | 32k | 128k |" in out
    assert out.count("| Llama-3-8B |") == 10 and out.count("| Llama-3-70B |") == 6
    assert "sp=split_gather" in out and "sp=all_to_all/8" in out and "sp=ring_attn/8" in out


# -- CPU attention --------------------------------------------------------------------------------------


def test_cpu_coloattention_is_sdpa_causal_without_a_mask_tensor():
    import torch

    from tasks.engine import cpu_compat

    cpu_compat.apply()
    from colossalai.shardformer.layer.attn import AttnMaskType, ColoAttention

    kw = ColoAttention.prepare_attn_kwargs((2, 1, 16, 16), torch.float32, "cpu", is_causal=True)
    assert kw["attention_mask_type"] == AttnMaskType.CAUSAL and kw["attention_mask"].numel() == 0
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(ColoAttention.attention(q, k, v, **kw), ref)
    assert "ColoAttention._dispatch_kernel" not in cpu_compat.apply()  # idempotent


def test_preflight_says_the_layout_with_its_sequence_group(tmp_path):
    from tests.test_preflight import Case, _set

    case = Case(tmp_path)
    _set("cpt.plugin", {**HP, "tp_size": 1, "sequence_parallelism": {"mode": "all_to_all", "size": 2}})(case)
    report = case.report()
    assert report.ok, report.text()
    assert any("cpt layout: hybrid_parallel tp=1 · pp=1 · sp=all_to_all x 2 · dp=1 = " in c for c in report.checked)
