"""Advice that works: every layout refusal's suggested fixes, applied to the refused config, pass pre-flight.

    .venv/bin/python -m pytest -q tests/test_advice.py

One row per layout rule (tasks/core/config/layout.py RULES): a good tiny config broken one way.
Each fix the refusal offers (`Refusal.fixes`, dotted overrides) is applied to the YAML and the
whole pre-flight runs again: the refusal is gone and nothing is refused that was not before (a
problem of another rule that the case also broke may stay). A rule without a row fails the test.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import pytest

from tasks.core.config.fixes import Refusal, dotted
from tasks.core.config.layout import RULES, layout_problems
from tasks.core.preflight.checks import load_for_check
from tests.conftest import write_config
from tests.test_preflight import HP, Case, _all, _data, _set, fake_model, no_launch  # noqa: F401 - no_launch is autouse

HP2 = {**HP, "tp_size": 2}
A2A = {"mode": "all_to_all", "size": 2}


def _vocab(n: int) -> Callable[[Case], None]:
    return lambda c: fake_model(c.model, vocab_size=n)


def _dpo(**section) -> Callable[[Case], None]:
    """A dpo section: the sft one's settings on the shipped sample pairs, then `section`."""
    from support.engine import REPO

    def apply(c: Case) -> None:
        c.raw["dpo"] = {**copy.deepcopy(c.raw["sft"]), "data": {"uri": str(REPO / "data/sample/dpo.jsonl")}, **section}

    return apply


# rule: (stage, mutation)
CASES: dict[str, tuple[str, Callable[[Case], None]]] = {
    "_tp_pp_need_support": ("sft", _all(_set("sft.plugin", {"name": "torch_ddp", "tp_size": 2, "precision": "fp32"}))),
    "_zero_stage_allowed": ("cpt", _set("cpt.plugin", {**HP2, "zero_stage": 2, "precision": "bf16"})),
    "_precision_allowed": ("sft", _set("sft.plugin", {"name": "gemini", "precision": "fp32"})),
    "_zero_fp32_where_refused": ("cpt", _set("cpt.plugin", {**HP2, "zero_stage": 1})),
    "_world_divisible": ("cpt", _set("cpt.launch", {"nproc_per_node": 3})),
    "_pipeline_microbatches": ("cpt", _set("cpt.plugin", {**HP, "pp_size": 2})),
    "_packing_keeps_conversations_apart": ("sft", _all(_set("sft.plugin", HP2), _set("sft.batching", "packed"))),
    "_lora_in_sft_only": ("cpt", _set("cpt.lora", {"r": 8})),
    "_pairs_whole_in_one_forward": ("dpo", _dpo(plugin={**HP, "pp_size": 2}, grad_accum_steps=2)),
    "_lora_supported_by_plugin": ("sft", _all(_set("sft.plugin", HP2), _set("sft.lora", {"r": 8}))),
    "_qlora_export_not_built": ("sft", _set("sft.lora", {"r": 8, "quantize": True})),
    # the known wrong advice: "set zero_stage: 1", which fp32 then refused
    "_offload_where_the_plugin_has_it": ("cpt", _set("cpt.plugin", {**HP2, "cpu_offload": True})),
    "_rows_divide_microbatches": (
        "cpt",
        _all(
            _set("cpt.plugin", {**HP, "pp_size": 2, "num_microbatches": 4}),
            _set("cpt.micro_batch_size", 3),
            _set("cpt.grad_accum_steps", 2),
        ),
    ),
    "_tp_divides_heads": (
        "cpt",
        _all(_set("cpt.plugin", {**HP, "tp_size": 4}), _set("cpt.launch", {"nproc_per_node": 4})),
    ),
    "_tp_divides_vocab": ("cpt", _vocab(515)),
    "_pp_within_layers": (
        "cpt",
        _all(
            _set("cpt.plugin", {**HP, "pp_size": 8}),
            _set("cpt.launch", {"nproc_per_node": 8}),
            _set("cpt.grad_accum_steps", 8),
        ),
    ),
    "_cuda_only_plugin": ("sft", _set("sft.plugin", {"name": "gemini", "precision": "bf16"})),
    "_cuda_only_precision": (
        "sft",
        _set("sft.plugin", {"name": "low_level_zero", "zero_stage": 2, "precision": "fp16"}),
    ),
    "_qlora_needs_cuda_and_bitsandbytes": ("sft", _set("sft.lora", {"r": 8, "quantize": True})),
    "_sp_needs_plugin": (
        "cpt",
        _set("cpt.plugin", {"name": "torch_ddp", "precision": "fp32", "sequence_parallelism": A2A}),
    ),
    "_sp_mode_refused": ("cpt", _set("cpt.plugin", {**HP2, "sequence_parallelism": {"mode": "ring"}})),
    "_sp_on_blocks_only": ("sft", _set("sft.plugin", {**HP2, "sequence_parallelism": {"mode": "split_gather"}})),
    "_sp_inside_tp": ("cpt", _set("cpt.plugin", {**HP, "sequence_parallelism": {"mode": "split_gather"}})),
    "_sp_own_group_size": ("cpt", _set("cpt.plugin", {**HP2, "sequence_parallelism": A2A})),
    "_sp_divides_seq_len": (
        "cpt",
        _all(_set("cpt.plugin", {**HP, "sequence_parallelism": A2A}), _set("cpt.seq_len", 63)),
    ),
    "_sp_divides_heads": (  # the tiny model's 2 KV heads
        "cpt",
        _all(
            _set("cpt.plugin", {**HP, "sequence_parallelism": {"mode": "all_to_all", "size": 4}}),
            _set("cpt.launch", {"nproc_per_node": 4}),
        ),
    ),
    "_sp_mode_needs_cuda": (
        "cpt",
        _set("cpt.plugin", {**HP, "sequence_parallelism": {"mode": "ring_attn", "size": 2}}),
    ),
    "_context_in_cpt_only": ("sft", _set("sft.context", {"rope_theta": 20000.0})),
    "_document_attention_isolates": ("cpt", _set("cpt.attention", "document")),
}
# Rules whose fix is not a config value (a host:port, another section): said in words.
IN_WORDS = {
    "_rendezvous_by_backend": "a rendezvous endpoint only the operator knows",
    "_backend_settings": "a settings section to move or remove",
    # no registered plugin builds fp16 without dynamic loss scaling
    "_fp16_needs_dynamic_loss_scale": "unreachable with the registered plugins",
    # the scaling meant: the message names the rope types, the keys and the values they take
    "_rope_scaling_valid": "a RoPE scaling only the user knows",
}


def test_every_layout_rule_has_a_case():
    assert {rule.__name__ for _, rule in RULES} == set(CASES) | set(IN_WORDS)


def _refusals(case: Case, phase: str, rule: str) -> list[Refusal]:
    cfg = load_for_check(write_config(case.tmp / "config.yaml", case.raw))
    model = json.loads((case.model / "config.json").read_text())
    return [p for p in layout_problems(cfg.phase(phase), phase, model_config=model, cuda=False) if p.rule == rule]


@pytest.mark.parametrize("rule", list(CASES))
def test_each_offered_fix_passes_preflight(tmp_path, rule):
    stage, mutate = CASES[rule]
    case = Case(tmp_path)
    mutate(case)
    before = case.report()
    refused = _refusals(case, stage, rule)
    assert refused and not before.ok, (rule, before.text())
    for r in refused:
        assert r.fixes, (rule, r[1])  # a fix is offered, in the config's own words
        for fix in r.fixes:
            overrides = dotted(stage, fix)
            for key in overrides:
                assert f"{key}: " in r[1], (key, r[1])  # the message says every field the fix changes
            fixed = Case(tmp_path / f"fix-{abs(hash(json.dumps(overrides, default=str)))}")
            fixed.raw = copy.deepcopy(case.raw)
            fixed.raw["run_root"] = str(fixed.run_root)
            fixed.model, fixed.raw["base_model"]["uri"] = case.model, str(case.model)
            for key, value in overrides.items():
                _set(key, value)(fixed)
            after = fixed.report()
            assert r.why not in after.text(), (rule, overrides, after.text())
            assert {f for f, _ in after.problems} <= {f for f, _ in before.problems}, (rule, overrides, after.text())


def test_fp32_refusals_offer_every_plugin_that_trains_in_fp32(tmp_path):
    """A plugin that cannot take fp32 with ZeRO offers the layouts that run in fp32 before bf16."""
    case = Case(tmp_path)
    _set("cpt.plugin", {**HP2, "zero_stage": 1})(case)
    (r,) = _refusals(case, "cpt", "_zero_fp32_where_refused")
    assert "HybridParallelPlugin.configure asserts precision != 'fp32'" in r[1]
    said = r[1].split("; set ", 1)[1]
    for layout in (
        "cpt.plugin.zero_stage: 0",
        "cpt.plugin.name: low_level_zero",
        "cpt.plugin.name: torch_ddp",
        "cpt.plugin.precision: bf16",
    ):
        assert layout in said, r[1]
    assert said.index("torch_ddp") < said.index("precision: bf16")


def test_a_number_where_text_should_be_is_the_records_fault(tmp_path):
    lines = [{"text": f"document {i}"} for i in range(8)]
    lines[4] = {"text": 5}
    case = Case(tmp_path)
    _data("cpt", lines)(case)
    report = case.report()
    (msg,) = [m for _, m in report.problems]
    assert ":5: field 'text' holds a int (5), not text" in msg and "text_field" not in msg, msg
    assert "set data.on_bad_record: skip" in msg
    _set("cpt.data.on_bad_record", "skip")(case)  # the advice, applied
    report = case.report()
    assert report.ok and any(":5: field 'text' holds a int (5), not text: skipped" in w for w in report.warnings), (
        report.text()
    )


def test_sequence_parallel_size_3_on_4_heads_is_one_refusal_whose_fixes_all_pass(tmp_path):
    """Size 3 on a 4-head model with seq_len 64: the seq_len rule once offered `seq_len: 66` (a
    multiple of 3), which the heads rule then refused in a second round. Every fix offered now
    passes pre-flight whole, and the seq_len refusal offers what settles both."""
    case = Case(tmp_path)
    fake_model(case.model, num_attention_heads=4, num_key_value_heads=4)
    _all(
        _set("cpt.plugin", {**HP, "sequence_parallelism": {"mode": "all_to_all", "size": 3}}),
        _set("cpt.launch", {"nproc_per_node": 3}),
        _set("cpt.seq_len", 64),
    )(case)
    before = case.report()
    said = dict(before.problems)
    assert "seq_len=64 must be a multiple of the sequence-parallel size 3" in said["cpt.seq_len"], before.text()
    assert "must divide num_attention_heads=4" in said["cpt.plugin.sequence_parallelism.size"]
    assert "cpt.seq_len: 66" not in before.text() and "cpt.seq_len: 63" not in before.text()
    assert "set cpt.plugin.sequence_parallelism.size: 2 and cpt.launch.nproc_per_node: 2" in said["cpt.seq_len"]
    for r in _refusals(case, "cpt", "_sp_divides_seq_len") + _refusals(case, "cpt", "_sp_divides_heads"):
        assert r.fixes, r[1]
        for fix in r.fixes:
            fixed = Case(tmp_path / f"fix-{abs(hash(json.dumps(fix, default=str)))}")
            fixed.raw = copy.deepcopy(case.raw)
            fixed.raw["run_root"] = str(fixed.run_root)
            fixed.model, fixed.raw["base_model"]["uri"] = case.model, str(case.model)
            for key, value in dotted("cpt", fix).items():
                _set(key, value)(fixed)
            after = fixed.report()
            assert after.ok, (fix, after.text())
