"""The derived tensor-parallel policy's plan reading and pre-flight refusals, on models built on the meta device.

    .venv/bin/python -m pytest -q tests/test_tp_plan.py

Each silent failure of a plan read naively has a case here that fails without its handling: a base-model
prefix that names no attribute (Gemma 3: nothing would be split), lm_head missing from the instance's plan
(4.51's and 4.57's post_init), a linear narrower than tp (ColossalAI returns it unsplit), a wrong plan
(StarCoder2's 4.51 c_proj), the q/k norms' gradient sum that 4.x plans do not state. The numbers (loss, every gradient,
the converted weights at tp=2 against the unsharded model, and the same with each handling dropped) are
measured in one launch by `benchmarks/shardformer_policies.py --smoke` (tests/test_benchmarks.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from tasks.core.models.families import FAMILIES, family_of, policy_problem
from tasks.core.models.tp_plan import (
    PLAN_POLICY,
    PLAN_ROWS,
    check_plan,
    merged_plan,
    plan_for,
    style_kind,
    too_old,
)

DENSE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip


def meta_model(config_class: str, **fields):
    config = getattr(transformers, config_class)(**{**DENSE, **fields})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _phase_cfg(plugin: dict):
    from tests.test_memory_estimate import stage

    return stage({"name": "hybrid_parallel", **plugin}, nproc=2)


def test_gemma3s_base_model_prefix_names_no_attribute_so_its_row_says_where_the_plan_applies():
    model = meta_model("Gemma3TextConfig", head_dim=16)
    assert not hasattr(model, model.base_model_prefix)  # 'language_model': a prefix match would split nothing
    row = PLAN_ROWS["gemma3_text"]
    matched, problems = check_plan(model, row, 2)
    assert not problems and "model.layers.1.self_attn.q_proj" in matched and "lm_head" in matched
    _, problems = check_plan(model, replace(row, base_prefix=""), 2)
    assert any("'language_model.layers.*.self_attn.q_proj' matches no module" in p for p in problems), problems


def test_the_head_is_read_from_the_class_plan_since_the_instances_loses_it():
    model = meta_model("Qwen3Config", head_dim=16)
    if transformers.__version__ in ("4.51.3", "4.57.6"):  # their post_init: the instance's plan without the head
        assert "lm_head" not in (model._tp_plan or {}) and type(model)._tp_plan == {"lm_head": "colwise_rep"}
    plan = plan_for(model, PLAN_ROWS["qwen3"])
    assert plan["lm_head"] in ("colwise_rep", "colwise_gather_output")
    assert plan["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"  # the row's fix (4.x: absent)


def test_a_linear_narrower_than_tp_is_refused_since_colossalai_would_leave_it_whole():
    model = meta_model("Qwen3Config", head_dim=16, intermediate_size=1)
    _, problems = check_plan(model, PLAN_ROWS["qwen3"], 2)
    assert any("model.layers.0.mlp.gate_proj" in p and "cannot be split 2 ways" in p for p in problems), problems
    # what ColossalAI would do with it: hand the module back unsplit (read in its source, not imported: ~10 CPU-s)
    import importlib.util
    from pathlib import Path

    linear = Path(importlib.util.find_spec("colossalai").origin).parent / "shardformer/layer/linear.py"
    assert "if out_features < tp_size:\n            return module" in linear.read_text()


def test_starcoder2s_wrong_plan_is_corrected_by_its_row():
    shipped = transformers.Starcoder2Config.base_model_tp_plan
    if transformers.__version__ == "4.51.3":
        assert shipped["layers.*.mlp.c_proj"] == "colwise"  # the plan as it ships (4.57 fixed it)
    merged = merged_plan(PLAN_ROWS["starcoder2"], shipped, {}, "model")
    assert merged["model.layers.*.mlp.c_proj"] == "rowwise"
    # 4.51.3's plan as it shipped, whatever transformers is installed: the row corrects it (4.57.6 ships it right,
    # so the lines above alone would pass without the row's fix there)
    wrong = {**shipped, "layers.*.mlp.c_proj": "colwise"}
    assert merged_plan(PLAN_ROWS["starcoder2"], wrong, {}, "model")["model.layers.*.mlp.c_proj"] == "rowwise"
    assert merged_plan(replace(PLAN_ROWS["starcoder2"], fixes=()), wrong, {}, "")["layers.*.mlp.c_proj"] == "colwise"


def test_both_plan_style_generations_map_and_the_others_are_refused_by_name():
    assert style_kind("colwise_rep") == style_kind("colwise_gather_output") == ("col_gather", "")
    assert style_kind("rowwise_rep") == style_kind("rowwise_split_input") == ("row_whole", "")
    assert style_kind("replicated_with_grad_allreduce") == ("grad_allreduce", "")
    for style, words in (
        ("local_colwise", "local"),
        ("moe_tp_experts", "MoE"),
        ("packed_colwise", "packed"),
        ("sequence_parallel", "sequence"),
        ("mla_kv_a_proj", "latent"),
        ("ep_router", "expert"),
    ):
        kind, why = style_kind(style)
        assert not kind and words in why, (style, why)  # fmt: skip
    model = meta_model("Qwen3Config", head_dim=16)
    row = replace(PLAN_ROWS["qwen3"], fixes=(("layers.*.mlp.gate_proj", "local_colwise", "a test"),))
    _, problems = check_plan(model, row, 2)
    assert len(problems) == 1 and "style 'local_colwise' is not one the derived policy maps (a local" in problems[0]


def test_the_registry_gives_the_plan_families_the_derived_policy_and_the_estimate_what_is_split():
    for model_type in ("qwen3", "gemma3_text", "phi3"):
        assert FAMILIES[model_type].shardformer_policy == PLAN_POLICY
    olmo2 = family_of({"model_type": "olmo2", **DENSE})
    assert olmo2.derived and olmo2.shardformer_policy == PLAN_POLICY
    assert olmo2.tp_splits("model.layers.0.self_attn.q_proj.weight")
    assert not olmo2.tp_splits("model.layers.0.self_attn.q_norm.weight")  # full-width, replicated
    # *_rep: OLMo 2's attention and Phi-3's attention and MLP are computed whole on every rank
    whole = {t.dim for t in olmo2.layer_activations if t.whole}
    assert whole == {"q", "kv", "heads"} and not any(t.whole for t in olmo2.layer_activations if t.dim == "inter")
    assert {t.dim for t in FAMILIES["phi3"].layer_activations if t.whole} == {"q", "heads", "inter", "inter2"}
    assert not any(t.whole for t in FAMILIES["qwen3"].layer_activations)


def test_the_memory_estimate_keeps_rep_activations_whole_at_tp():
    from tasks.core.preflight.memory import estimate

    phi3 = {"model_type": "phi3", **DENSE, "pad_token_id": None}
    qwen3 = {"model_type": "qwen3", **DENSE, "head_dim": 16}

    def ratio(mc):
        one = estimate(mc, _phase_cfg({"tp_size": 1, "precision": "fp32"})).total("activations")
        return estimate(mc, _phase_cfg({"tp_size": 2, "precision": "fp32"})).total("activations") / one

    assert ratio(phi3) > ratio(qwen3) + 0.2, (ratio(phi3), ratio(qwen3))


@pytest.mark.parametrize(
    ("mc", "plugin", "field", "words"),
    [
        ({"model_type": "qwen3", **DENSE, "head_dim": 16}, {"tp_size": 2}, None, ""),
        ({"model_type": "olmo2", **DENSE}, {"tp_size": 2}, None, ""),
        ({"model_type": "qwen3", **DENSE, "head_dim": 16, "num_key_value_heads": 1}, {"tp_size": 2},
         "cpt.plugin.tp_size", "num_key_value_heads=1 is not divisible by tp_size=2"),
        ({"model_type": "qwen3", **DENSE, "head_dim": 16}, {"pp_size": 2},
         "cpt.plugin.pp_size", "pipeline and sequence parallelism are not proven"),
        ({"model_type": "phi3", **DENSE}, {"tp_size": 2, "sequence_parallelism": {"mode": "split_gather"}},
         "cpt.plugin.sequence_parallelism", "set cpt.plugin.sequence_parallelism: null"),
    ],
)  # fmt: skip
def test_preflight_admits_what_the_derived_policy_maps_and_refuses_the_rest(mc, plugin, field, words):
    got = policy_problem(mc, _phase_cfg(plugin), "cpt")
    if field is None:
        assert got is None, got
    else:
        assert got is not None and got[0] == field and words in got[1], got
        assert "low_level_zero" in got[1] or "set cpt.plugin" in got[1]


def test_the_memory_estimate_counts_the_gathered_logits_whole_on_every_rank(monkeypatch):
    """The derived policy's head gathers the vocabulary (transformers' own loss runs on each rank), where
    ColossalAI's Llama policy keeps each rank's vocabulary shard: 12 fp32 bytes per logit, vocab/2 more at tp=2."""
    from tasks.core.preflight.memory import LOSS_BYTES_PER_LOGIT, estimate

    qwen3 = {"model_type": "qwen3", **DENSE, "head_dim": 16}
    phase_cfg = _phase_cfg({"tp_size": 2, "precision": "fp32"})
    derived = estimate(qwen3, phase_cfg).total("activations")
    monkeypatch.setitem(FAMILIES, "qwen3", replace(FAMILIES["qwen3"], shardformer_policy="vocab.parallel.Policy"))
    split = estimate(qwen3, phase_cfg).total("activations")
    tokens = phase_cfg.micro_batch_size * phase_cfg.seq_len
    assert derived - split == DENSE["vocab_size"] // 2 * LOSS_BYTES_PER_LOGIT * tokens


# -- families only later transformers build: SmolLM3 (4.53) and OLMo 3 (4.57) ---------------------------------------


def _built(model_type: str):
    return pytest.mark.skipif(bool(too_old(model_type)), reason=too_old(model_type) or "built")


@_built("smollm3")
def test_smollm3s_nope_layers_keep_llamas_modules_so_its_plan_splits_every_layer_alike():
    # layer 1 skips the rotary embedding (NoPE); SmolLM3Config's pad_token_id 128004 is beyond a tiny vocabulary
    model = meta_model("SmolLM3Config", no_rope_layers=[1, 0], pad_token_id=None)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [1, 0]
    matched, problems = check_plan(model, PLAN_ROWS["smollm3"], 2)
    assert not problems, problems
    for i in (0, 1):  # the NoPE layer is split as the rotary one: column q/k/v, gate, up; row o, down
        assert matched[f"model.layers.{i}.self_attn.q_proj"] == matched[f"model.layers.{i}.mlp.up_proj"] == "colwise"
        assert matched[f"model.layers.{i}.self_attn.o_proj"] == matched[f"model.layers.{i}.mlp.down_proj"] == "rowwise"
    assert "lm_head" in matched and not PLAN_ROWS["smollm3"].fixes
    family = family_of({"model_type": "smollm3", **DENSE, "no_rope_layers": [1, 0], "pad_token_id": None})
    assert family.derived and family.shardformer_policy == PLAN_POLICY
    assert family.tp_splits("model.layers.1.self_attn.k_proj.weight") and not any(
        t.whole for t in family.layer_activations
    )  # split heads: each rank computes its own


@_built("olmo3")
def test_olmo3s_full_width_qk_norms_make_its_attention_whole_on_every_rank_and_its_sliding_layers_change_nothing():
    fields = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    model = meta_model("Olmo3Config", **fields)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [8, None]
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (DENSE["hidden_size"],)  # q's whole width
    matched, problems = check_plan(model, PLAN_ROWS["olmo3"], 2)
    assert not problems, problems
    for i in (0, 1):  # colwise_rep: q/k/v split and gathered before the full-width norms; the MLP split as Llama's
        assert matched[f"model.layers.{i}.self_attn.k_proj"] in ("colwise_rep", "colwise_gather_output")
        assert matched[f"model.layers.{i}.mlp.gate_proj"] == "colwise"
        assert f"model.layers.{i}.self_attn.q_norm" not in matched  # it sees the whole q: no gradient sum
    family = family_of({"model_type": "olmo3", **DENSE, **fields})
    assert family.derived and family.shardformer_policy == PLAN_POLICY
    assert family.tp_splits("model.layers.0.self_attn.q_proj.weight")
    assert not family.tp_splits("model.layers.0.self_attn.q_norm.weight")  # full-width, replicated
    assert {t.dim for t in family.layer_activations if t.whole} == {"q", "kv", "heads"}


@pytest.mark.parametrize(("model_type", "release"), [("smollm3", "4.53.0"), ("olmo3", "4.57.0")])
def test_on_a_transformers_before_the_family_preflight_names_the_release_it_needs_and_the_installed_one(
    monkeypatch, tmp_path, model_type, release
):
    from tasks.core.errors import ConversionError
    from tasks.core.models import tp_plan
    from tests.test_families import _report

    monkeypatch.setattr(tp_plan, "installed_transformers", lambda: "4.51.3")  # the project's pin before 4.57
    report = _report(tmp_path, model_type)
    assert [f for f, _ in report.problems] == ["base_model.uri"], report.text()
    msg = report.problems[0][1]
    assert f"needs transformers >= {release}" in msg and "the installed transformers is 4.51.3" in msg, msg
    assert "neither in the family registry" not in msg  # not "unknown": a later release knows it
    with pytest.raises(ConversionError, match=f"needs transformers >= {release}"):
        family_of({"model_type": model_type, **DENSE})
    monkeypatch.setattr(tp_plan, "installed_transformers", lambda: release)
    assert not tp_plan.too_old(model_type)
