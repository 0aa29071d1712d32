"""The family registry against what transformers and ColossalAI really do: every row's shardformer
policy is ColossalAI 0.5.0's auto_policy entry for its class; a model_type with no row (OLMo 2,
Granite) gets its tensor table from the model transformers builds on the meta device, and that table
carries a tiny random OLMo 2 through convert, weight proof, logits fingerprint, export, LoRA target
resolution and the memory estimate; pre-flight names the derived class and refuses hybrid_parallel
for any family without a policy (qwen3 included) before anything launches.

    .venv/bin/python -m pytest -q tests/test_families.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from tasks.core.errors import ConfigError, ConversionError
from tasks.core.models.families import FAMILIES, expected_tensors, family_config, policy_problem, tied_keys
from tasks.core.run.manifest import PROVENANCE_DIR
from tests._activations import kept_per_token

DIMS = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# model types with no row in FAMILIES, one of them tied (its head is the embedding, saved once)
UNLISTED = {"olmo2": {}, "granite": {"tie_word_embeddings": True}}


def _unlisted_model(model_type: str, seed: int = 0) -> transformers.PreTrainedModel:
    config = CONFIG_MAPPING[model_type](**DIMS, **UNLISTED[model_type])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_every_rows_shardformer_policy_is_colossalais_auto_policy_entry_for_its_class():
    """The registry's claim cannot drift from ColossalAI's mapping (keyed by the class's dotted path)."""
    import importlib

    from colossalai.shardformer.policies.auto_policy import _POLICY_LIST

    from tasks.core.models.tp_plan import PLAN_POLICY, PLAN_ROWS
    from tasks.engine import hf_compat

    hf_compat.apply()  # as a rank does before any policy is imported
    for model_type, family in FAMILIES.items():
        cls = getattr(transformers, family.model_class)
        loc = _POLICY_LIST.get(f"{cls.__module__}.{cls.__qualname__}")
        want = f"colossalai.shardformer.policies.{loc.file_name}.{loc.class_name}" if loc else ""
        # ColossalAI has none for a plan row's family: the derived policy (tasks/core/models/tp_plan.py) shards it
        assert family.shardformer_policy == (PLAN_POLICY if model_type in PLAN_ROWS else want), model_type
        assert not (loc and model_type in PLAN_ROWS), model_type
        if family.shardformer_policy and family.shardformer_policy != PLAN_POLICY:
            module, _, name = family.shardformer_policy.rpartition(".")
            assert hasattr(importlib.import_module(module), name), family.shardformer_policy
    assert FAMILIES["qwen3"].shardformer_policy == PLAN_POLICY  # ColossalAI 0.5.0 has no Qwen3 policy


@pytest.mark.parametrize("model_type", sorted(UNLISTED))
def test_a_family_with_no_row_is_derived_from_the_model_transformers_builds(model_type):
    assert model_type not in FAMILIES
    model = _unlisted_model(model_type)
    mc = model.config.to_dict()
    family, _ = family_config(mc)
    assert family.derived and family.model_class == type(model).__name__
    assert family.shardformer_policy == "tasks.engine.plan_policy.PlanPolicy"  # a plan row over the derived table
    tied = UNLISTED[model_type].get("tie_word_embeddings", False)
    state = model.state_dict()
    saved = {k: tuple(v.shape) for k, v in state.items() if not (tied and k == "lm_head.weight")}
    assert expected_tensors(mc) == saved  # keys, shapes and save order
    assert tied_keys(mc) == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    assert family.vocab_dims == {"model.embed_tokens.weight": 0, "lm_head.weight": 0}
    from tasks.core.preflight.checks import estimate_parameters

    assert estimate_parameters(mc) == model.num_parameters()


def test_derivation_never_runs_model_folder_code_and_refuses_what_it_cannot_read():
    # auto_map names code in the model folder: dropped, the class is transformers' own
    family, _ = family_config({"model_type": "olmo2", **DIMS, "auto_map": {"AutoModelForCausalLM": "evil.Model"}})
    assert family.model_class == "Olmo2ForCausalLM"
    cases = {
        "not-a-family": "neither in the family registry nor a model type the installed transformers knows",
        "bert": "no decoder-only causal LM",  # an encoder with a causal head
        "gemma3": "cannot derive a tensor table",  # multimodal: its dims live in text_config
    }
    for model_type, words in cases.items():
        with pytest.raises(ConversionError, match=words):
            family_config({"model_type": model_type, **DIMS})


# -- the named rows of families ColossalAI has no policy for: the converter's bitwise tests -------

NAMED = {
    # Gemma 3 text: tied head, q/k norms, four norms a layer, sliding-window layers every other one
    "gemma3_text": {"head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2},
    # Phi-3: fused qkv_proj and gate_up_proj
    "phi3": {"pad_token_id": None},
}


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("model_type", sorted(NAMED))
def test_a_named_row_converts_bitwise_with_the_logits_of_the_model(tmp_path, model_type, pp):
    from tasks.core.models.convert import convert_checkpoint, load_state_dict_from_dir
    from tests.test_convert import pp2_stages, write_colossal_checkpoint

    spec = FAMILIES[model_type]
    config = getattr(transformers, spec.config_class)(**DIMS, **NAMED[model_type])
    torch.manual_seed(0)
    model = getattr(transformers, spec.model_class)(config).eval()
    mc = config.to_dict()
    state = {k: v.detach() for k, v in model.named_parameters()}  # a tied head once
    assert expected_tensors(mc) == {k: tuple(v.shape) for k, v in state.items()}
    tied = tied_keys(mc)
    if pp == 2 and tied:  # the last pipeline stage saves its copy of the tied head: dropped as equal
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    stages = pp2_stages(state, DIMS["num_hidden_layers"]) if pp == 2 else None
    src = write_colossal_checkpoint(state, tmp_path / "ckpt", stages=stages, config=config)
    report = convert_checkpoint(src, tmp_path / "hf", model_config=mc, fsync=False)
    assert report.dropped == (["lm_head.weight"] if pp == 2 and tied else [])
    got = load_state_dict_from_dir(tmp_path / "hf")
    assert sorted(got) == sorted(expected_tensors(mc)) and all(torch.equal(got[k], state[k]) for k in got)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, DIMS["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


# -- a tiny OLMo 2 through the converter, the proof, the fingerprint and the export ----------------


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory) -> Path:
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    out = tmp_path_factory.mktemp("olmo2") / "base"
    return build_tiny_model(out, build_tokenizer(DEFAULT_CORPUS, vocab_size=512), family="olmo2", num_layers=3)


@pytest.mark.parametrize("model_type", sorted(UNLISTED))
def test_a_derived_family_converts_a_pipeline_checkpoint_bitwise(model_type, tmp_path):
    from tasks.core.models.convert import convert_checkpoint, load_state_dict_from_dir
    from tests.test_convert import pp2_stages, write_colossal_checkpoint

    model = _unlisted_model(model_type)
    mc = model.config.to_dict()
    state = {k: v.detach() for k, v in model.named_parameters()}  # a tied head once
    tied = tied_keys(mc)
    if tied:  # the last pipeline stage saves its copy of the tied head: dropped as bitwise equal
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    src = write_colossal_checkpoint(state, tmp_path / "ckpt", stages=pp2_stages(state, DIMS["num_hidden_layers"]))
    converted = convert_checkpoint(src, tmp_path / "hf", model_config=mc, fsync=False)
    assert converted.keys == list(expected_tensors(mc)) and converted.dropped == list(tied)
    assert converted.num_params == model.num_parameters()
    got = load_state_dict_from_dir(tmp_path / "hf")
    assert sorted(got) == sorted(expected_tensors(mc)) and all(torch.equal(got[k], state[k]) for k in got)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, DIMS["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    # a key the model does not have is named, as for a registered family
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    bad = write_colossal_checkpoint(state, tmp_path / "bad", stages=[list(state)])
    with pytest.raises(ConversionError, match="unexpected key 'model.layers.0.self_attn.q_proj.bias'"):
        convert_checkpoint(bad, tmp_path / "hf-bad", model_config=mc, fsync=False)


def test_a_derived_family_exports_with_proof_and_fingerprint_and_loads_in_plain_transformers(olmo2, tmp_path):
    from tasks.core.models.fingerprint import compare_logits, hf_dir_logits
    from tests._consumer_rules import assert_consumer_rules
    from tests.test_export import _checkpoint, _export

    export = _export(tmp_path, olmo2, _checkpoint(tmp_path, olmo2), "export", "40KB")
    v = json.loads((export / PROVENANCE_DIR / "verification.json").read_text())
    assert (
        v["weights_bitwise"]["tensors"]
        == v["tensors"]
        == len(expected_tensors(json.loads((olmo2 / "config.json").read_text())))
    )
    assert v["fingerprint_match"] and v["top1_disagreements_beyond_tolerance"] == 0
    assert_consumer_rules(export)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert type(loaded).__name__ == "Olmo2ForCausalLM"
    cmp = compare_logits(hf_dir_logits(export, dtype="fp32"), hf_dir_logits(olmo2, dtype="fp32"), rtol=2e-2)
    assert cmp["top1_disagreements_beyond_tolerance"] == 0, cmp  # bf16 export of the fp32 base


@pytest.mark.parametrize("model_type", sorted(UNLISTED))
def test_a_derived_family_resolves_lora_targets_as_peft_does(model_type):
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    from tasks.core.models import lora_targets as lt

    mc = _unlisted_model(model_type).config.to_dict()
    modules = lt.model_modules(mc)
    for targets in (["q_proj", "down_proj"], "all-linear", r".*\.1\.mlp\.(up|gate)_proj", ["embed_tokens", "lm_head"]):
        peft_model = get_peft_model(
            _unlisted_model(model_type),
            LoraConfig(r=2, target_modules=list(targets) if isinstance(targets, list) else targets),
        )
        by_peft = [
            n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if isinstance(m, BaseTunerLayer)
        ]
        assert list(lt.resolve(targets, modules, lt.output_embedding(mc)).adapted) == by_peft, targets


def test_the_memory_estimate_counts_a_derived_familys_parameters_and_the_activations_its_layer_keeps():
    from tasks.core.preflight.memory import estimate, layer_activation_bytes
    from tests.test_memory_estimate import by_what, stage

    model = _unlisted_model("olmo2")
    mc = model.config.to_dict()
    for plugin in ({"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}, {"name": "torch_ddp"}):
        est = estimate(mc, stage(plugin, nproc=2), cuda=True)
        assert est.parameters == est.rank_parameters == model.num_parameters()
        assert by_what(est)["activations"] > 0
    # what torch keeps for the backward of one OLMo 2 layer, against the terms read off its tensor names:
    # Llama's plus its query/key norms (Llama's alone were 11 % under in fp32, 14 % in bf16)
    measured, table = kept_per_token(model, "model.layers.1", vocab=512, masks=False), layer_activation_bytes(mc, 4)
    print(f"olmo2 layer activations per token: measured {measured:.0f} B, the derived terms {table:.0f} B")
    # as for a named row: the table leaves out each norm's 1-wide inverse RMS and RoPE's cos/sin
    assert table <= measured <= table * 1.02, (measured, table)
    assert layer_activation_bytes({"model_type": "llama", **DIMS}, 4) < 0.9 * measured  # Llama's terms alone


# -- pre-flight: the derived line, and hybrid_parallel refused for a family without a policy -------


def _report(tmp_path: Path, model_type: str, cpt_plugin: dict | None = None):
    from tests.test_preflight import Case, fake_model

    case = Case(tmp_path)
    fake_model(case.model, model_type=model_type, architectures=None)
    if cpt_plugin:
        case.raw["cpt"]["plugin"] = cpt_plugin
    return case.report()


def test_hybrid_parallel_is_refused_before_launch_for_a_family_without_a_policy(tmp_path):
    # Gemma (1) ships a plan, but no row says the derived policy was measured on it
    report = _report(tmp_path, "gemma")  # tiny-cpu: CPT hybrid_parallel tp=2
    assert [f for f, _ in report.problems] == ["cpt.plugin.name"], report.text()
    msg = report.problems[0][1]
    assert "derived from GemmaForCausalLM" in msg
    assert msg.endswith("set cpt.plugin.name to one of the plugins that run it: low_level_zero, gemini, torch_ddp"), msg
    ok = _report(tmp_path / "lz", "gemma", {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"})
    assert ok.ok, ok.text()
    line = [c for c in ok.checked if c.startswith("model family gemma")]
    assert line and "derived from GemmaForCausalLM (GemmaConfig) built on the meta device" in line[0], ok.checked


@pytest.mark.parametrize("model_type", ["olmo2", "qwen3"])
def test_hybrid_parallel_at_tp_is_admitted_for_a_plan_family(tmp_path, model_type):
    report = _report(tmp_path, model_type)  # tiny-cpu: CPT hybrid_parallel tp=2
    assert report.ok, report.text()
    line = [c for c in report.checked if c.startswith(f"model family {model_type}")]
    assert line and any(
        w in line[0] for w in ("the derived tensor-parallel policy", "derived policy from its own plan")
    )
    pp_plugin = {"name": "hybrid_parallel", "pp_size": 2, "precision": "fp32", "num_microbatches": 2}
    pp = _report(tmp_path / "pp", model_type, pp_plugin)
    assert [f for f, _ in pp.problems] == ["cpt.plugin.pp_size"], pp.text()
    assert "pipeline and sequence parallelism are not proven" in pp.problems[0][1]


def test_the_engine_refuses_the_same_before_it_builds_a_plugin():
    from tasks.engine.builders import check_model
    from tests.test_memory_estimate import stage

    hp = stage({"name": "hybrid_parallel", "tp_size": 2}, nproc=2)
    with pytest.raises(ConfigError, match="plugins that run it: low_level_zero, gemini, torch_ddp"):
        check_model(hp, {"model_type": "gemma", **DIMS}, "cpt")
    with pytest.raises(ConfigError, match="num_key_value_heads=1 is not divisible by tp_size=2"):
        check_model(hp, {"model_type": "qwen3", **DIMS, "num_key_value_heads": 1}, "cpt")
    check_model(hp, {"model_type": "qwen3", **DIMS}, "cpt")
    check_model(hp, {"model_type": "llama", **DIMS}, "cpt")
    lz = stage({"name": "low_level_zero"}, nproc=2)
    assert policy_problem({"model_type": "olmo2", **DIMS}, lz, "cpt") is None


def test_a_dummy_row_shows_in_the_family_table_with_what_runs_it(monkeypatch):
    import dataclasses

    from tasks.core.models import family_table

    monkeypatch.setitem(FAMILIES, "tinyfam", dataclasses.replace(FAMILIES["llama"], shardformer_policy=""))
    rows = {line.split(" | ")[0]: line for line in family_table.render().splitlines() if line.startswith("| `")}
    assert "refused: ColossalAI 0.5.0 has no policy for LlamaForCausalLM" in rows["| `tinyfam`"]
    assert rows["| `tinyfam`"].endswith("| runs | runs | runs |")
    assert "runs (tp, pp; sequence parallelism: split_gather" in rows["| `llama`"]


# ColossalAI 0.5.0's decoder policies for layouts other than Llama's: a named row over the derived table
POLICY_TINY = {
    "gptj": ("GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, rotary_dim=8)),
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4)),
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),
    "mixtral": ("MixtralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "opt": ("OPTConfig", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=64, word_embed_proj_dim=64)),
    "cohere": ("CohereConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)),
}  # fmt: skip


def _policy_model(model_type: str):
    cls, fields = POLICY_TINY[model_type]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(vocab_size=512, **fields)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_every_policy_row_names_colossalais_policy_and_modules_it_really_splits():
    """Each row's policy is auto_policy's entry for its class, and each tp_column/tp_row suffix is one the
    policy's source replaces with a parallel linear (so the estimate's split cannot drift from the policy)."""
    import importlib
    import inspect

    from colossalai.shardformer.policies.auto_policy import _POLICY_LIST

    from tasks.core.models.policy_rows import POLICY_ROWS
    from tasks.engine import hf_compat

    hf_compat.apply()  # as a rank does before any policy is imported

    assert set(POLICY_ROWS) == set(POLICY_TINY) and not set(POLICY_ROWS) & set(FAMILIES)
    for model_type, row in POLICY_ROWS.items():
        cls = getattr(transformers, row.model_class)
        loc = _POLICY_LIST[f"{cls.__module__}.{cls.__qualname__}"]
        assert row.shardformer_policy == f"colossalai.shardformer.policies.{loc.file_name}.{loc.class_name}"
        module, _, name = row.shardformer_policy.rpartition(".")
        source = inspect.getsource(importlib.import_module(module))
        assert hasattr(importlib.import_module(module), name)
        for suffix in row.tp_column + row.tp_row:
            assert f'suffix="{suffix}"' in source, (model_type, suffix)
        assert not row.policy_refused and row.pp, (
            model_type
        )  # every row trains at tp=2 and pp=2 (the smoke re-measures)
        # what a row needs of the model and the plugin is something each takes
        if row.attn_implementation:
            assert row.attn_implementation in ("eager", *transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS)
        plugin_args = inspect.signature(importlib.import_module("colossalai.booster.plugin").HybridParallelPlugin)
        assert all(flag in plugin_args.parameters for flag, _ in row.shard_flags), model_type


@pytest.mark.parametrize("model_type", sorted(POLICY_TINY))
def test_a_policy_row_lays_its_policy_over_the_derived_table_and_the_estimate_splits_its_modules(model_type):
    from tasks.core.models.families import count_parameters, family_of
    from tasks.core.models.policy_rows import POLICY_ROWS
    from tasks.core.preflight.memory import estimate
    from tests.test_memory_estimate import stage

    model = _policy_model(model_type)
    mc = model.config.to_dict()
    family = family_of(mc)
    assert family.derived and family.shardformer_policy and family.model_class == type(model).__name__
    tied = model.config.tie_word_embeddings
    saved = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k in family.tied)}
    assert expected_tensors(mc) == saved  # keys, shapes, save order (GPT-2's Conv1D, OPT's decoder, experts)
    assert count_parameters(mc) == sum(p.numel() for p in model.parameters())
    split = [k for k in saved if family.tp_splits(k)]
    mc = {**mc, **{k: v for k, v, _ in POLICY_ROWS[model_type].tp_requires}}  # what tp needs (GPT-2: no dropout)
    assert policy_problem(mc, stage({"name": "hybrid_parallel", "tp_size": 2}, nproc=2), "cpt") is None
    assert policy_problem(mc, stage({"name": "hybrid_parallel", "pp_size": 2}, nproc=2), "cpt") is None
    # every split tensor is one a parallel linear or the vocabulary-parallel embedding holds
    assert split and all(k in family.vocab_dims or k.endswith((".weight", ".bias")) for k in split)
    one = estimate(mc, stage({"name": "hybrid_parallel", "tp_size": 1, "precision": "fp32"}, nproc=1))
    two = estimate(mc, stage({"name": "hybrid_parallel", "tp_size": 2, "precision": "fp32"}, nproc=2))
    n_split = sum(math.prod(saved[k]) for k in split)
    assert one.rank_parameters - two.rank_parameters == n_split - n_split // 2, (one, two)


def test_a_policy_row_that_fails_or_is_unmeasured_at_pp_is_refused_before_launch(monkeypatch):
    """A dummy row whose policy fails (`policy_refused`), and one not measured at pp (`pp=False`): hybrid_parallel
    refused naming the cause and the plugins that run it; pp=2 refused naming pp_size; tp runs."""
    import dataclasses

    from tasks.core.models.policy_rows import POLICY_ROWS
    from tasks.engine.builders import check_model
    from tests.test_memory_estimate import stage

    mc = _policy_model("opt").config.to_dict()
    refused = dataclasses.replace(POLICY_ROWS["opt"], policy_refused="KeyError 'sdpa' while sharding")
    monkeypatch.setitem(POLICY_ROWS, "opt", refused)
    with pytest.raises(ConfigError, match="does not run with transformers 4.51.3") as err:
        check_model(stage({"name": "hybrid_parallel", "tp_size": 2}, nproc=2), mc, "cpt")
    assert "KeyError 'sdpa'" in str(err.value) and "low_level_zero, gemini, torch_ddp" in str(err.value)
    assert policy_problem(mc, stage({"name": "low_level_zero"}, nproc=2), "cpt") is None
    monkeypatch.setitem(POLICY_ROWS, "opt", dataclasses.replace(POLICY_ROWS["opt"], policy_refused="", pp=False))
    assert policy_problem(mc, stage({"name": "hybrid_parallel", "tp_size": 2}, nproc=2), "cpt") is None
    pp2 = policy_problem(mc, stage({"name": "hybrid_parallel", "pp_size": 2}, nproc=2), "cpt")
    assert pp2 and pp2[0] == "cpt.plugin.pp_size" and "not measured" in pp2[1], pp2


def test_what_a_policy_assumes_at_tp_is_refused_otherwise_naming_tp_size():
    """OPT's policy makes lm_head the embedding's weight at tp without pp (tp_requires): a tied OPT (the
    config class's default, every published OPT) runs at tp; an untied one is refused at tp, runs at pp.
    GPT-2's draws a different dropout mask on each tp rank for replicated activations: its default residual and
    embedding dropout (0.1) is refused at tp, naming the fields; with them 0 it runs."""
    from tests.test_memory_estimate import stage

    cls, fields = POLICY_TINY["opt"]
    untied = getattr(transformers, cls)(vocab_size=512, tie_word_embeddings=False, **fields).to_dict()
    tied = _policy_model("opt").config.to_dict()
    hp2 = stage({"name": "hybrid_parallel", "tp_size": 2}, nproc=2)
    assert policy_problem(tied, hp2, "cpt") is None
    field, why = policy_problem(untied, hp2, "cpt")
    assert field == "cpt.plugin.tp_size" and "assumes tie_word_embeddings=True at tp_size > 1" in why, why
    assert "config.json has tie_word_embeddings=False" in why and "policies/opt.py:433" in why, why
    assert policy_problem(untied, stage({"name": "hybrid_parallel", "pp_size": 2}, nproc=2), "cpt") is None
    gpt2 = _policy_model("gpt2").config.to_dict()
    field, why = policy_problem(gpt2, hp2, "cpt")
    assert field == "cpt.plugin.tp_size" and "assumes embd_pdrop=0.0 at tp_size > 1" in why, why
    assert "DropoutForParallelInput" in why and "config.json has embd_pdrop=0.1" in why, why
    assert policy_problem({**gpt2, "embd_pdrop": 0.0, "resid_pdrop": 0.0}, hp2, "cpt") is None
    assert policy_problem(gpt2, stage({"name": "hybrid_parallel", "pp_size": 2}, nproc=2), "cpt") is None
    gptj = _policy_model("gptj").config.to_dict()  # GPT-J's policy the same, but its default dropout is 0
    assert policy_problem(gptj, hp2, "cpt") is None
    assert policy_problem({**gptj, "resid_pdrop": 0.1}, hp2, "cpt")[0] == "cpt.plugin.tp_size"


def test_the_engine_builds_a_policy_rows_family_with_what_its_policy_needs():
    """Under hybrid_parallel the plugin gets the row's shardformer flags whatever the kernels say (Cohere's and
    GPT-2's forwards need flash attention, which no kernel switches on without CUDA) and the model the row's
    attention implementation (OPT: eager); under a plugin without a policy, neither."""
    from tasks.core.config.kernels import Facts, resolve
    from tasks.core.config.layout import ParallelLayout
    from tasks.core.models.policy_rows import lazy_init_safe, needs_attention_mask, shard_settings
    from tasks.engine.builders import plugin_kwargs
    from tests.test_memory_estimate import stage

    def kwargs(plugin: dict, model_type: str) -> dict:
        phase_cfg = stage(plugin, nproc=2)
        layout = ParallelLayout.of(phase_cfg, "cpt", cuda=False, tiers=("static",))
        return plugin_kwargs(
            phase_cfg.plugin, phase_cfg, layout, False, resolve(phase_cfg, "cpt", Facts(cuda=False)), "cpt", model_type
        )

    hp = {"name": "hybrid_parallel", "tp_size": 2}
    for model_type in ("cohere", "gpt2"):
        assert kwargs(hp, model_type)["enable_flash_attention"] is True
        assert "enable_flash_attention" not in kwargs({"name": "low_level_zero", "zero_stage": 1}, model_type)
    assert "enable_flash_attention" not in kwargs(hp, "opt") and "enable_flash_attention" not in kwargs(hp, "llama")
    assert shard_settings("opt") == ({"attn_implementation": "eager"}, {})
    assert shard_settings("llama") == shard_settings(None) == ({}, {})
    # a CPT block gets an all-ones mask where the policy's forward reads one (GPT-2's; OPT's pipeline stages)
    assert {m for m in (*POLICY_TINY, "llama", None) if needs_attention_mask(m)} == {"gpt2", "opt"}
    # built whole on every rank, not lazily, where LazyInitContext would leave a plain tensor on meta (GPT-J)
    assert {m for m in (*POLICY_TINY, "llama", None) if not lazy_init_safe(m)} == {"gptj"}
    from tasks.core.preflight.memory import estimate  # whose host peak counts the whole model GPT-J is built as

    gptj = {**_policy_model("gptj").config.to_dict(), "model_type": "gptj"}
    est = estimate(gptj, stage({"name": "hybrid_parallel", "tp_size": 2, "precision": "fp32"}, nproc=2))
    assert est.construction == 4 * sum(p.numel() for p in _policy_model("gptj").parameters()), est


@pytest.mark.parametrize("model_type", sorted(POLICY_TINY))
def test_a_policy_rows_stated_activation_ratio_is_what_its_layer_keeps(model_type):
    """The families table says how far Llama's terms are from a non-Llama layout's layer: re-measured; a row
    with terms of its own (Mixtral's MoE) is estimated from them, and they are what its layer keeps."""
    from tasks.core.models.families import LLAMA_LAYER_ACTIVATIONS, family_of
    from tasks.core.models.policy_rows import POLICY_ROWS
    from tasks.core.preflight.memory import layer_activation_bytes

    cls, fields = POLICY_TINY[model_type]
    layers = "n_layer" if "n_layer" in fields else "num_hidden_layers"
    config = getattr(transformers, cls)(**{**fields, "vocab_size": 300, layers: 3})
    for name in ("dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):  # the measure runs in training mode
        if hasattr(config, name):
            setattr(config, name, 0.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    mc = model.config.to_dict()
    family, row = family_of(mc), POLICY_ROWS[model_type]
    assert family.layer_activations == (row.layer_activations or LLAMA_LAYER_ACTIVATIONS)
    later = not transformers.__version__.startswith("4.51.")
    stated_ratio = (later and row.llama_terms_ratio_4_57) or row.llama_terms_ratio
    for dtype, size, stated in zip((torch.float32, torch.bfloat16), (4, 2), stated_ratio):
        kept = kept_per_token(model.to(dtype), family.layer_prefix.format(i=1)[:-1])
        ratio = layer_activation_bytes(mc, size, terms=LLAMA_LAYER_ACTIVATIONS) / kept
        assert abs(ratio - stated) <= 0.03, (model_type, dtype, ratio, stated)
        if row.layer_activations:  # less only the 1-wide tensors (inverse RMS, the weights' sum) and RoPE's cos/sin
            own = layer_activation_bytes(mc, size)
            # the attention mask, built once per forward, is no layer's own (kept by every layer from 4.52 on)
            kept = kept_per_token(model.to(dtype), family.layer_prefix.format(i=1)[:-1], masks=False)
            print(f"{model_type} {dtype}: kept {kept:.0f} B/token, own terms {own / kept:.3f}, Llama's {ratio:.3f}")
            assert own <= kept <= own * 1.02, (model_type, dtype, own, kept)
    if model_type == "mixtral":  # tp=2 splits the attention's q-wide terms; every rank runs the experts whole
        split = layer_activation_bytes(mc, 4, terms=LLAMA_LAYER_ACTIVATIONS[2:4])
        assert layer_activation_bytes(mc, 4) - layer_activation_bytes(mc, 4, tp=2) == pytest.approx(split / 2)


@pytest.mark.parametrize("model_type", ["falcon", "opt"])
def test_preflight_names_a_policy_rows_policy(tmp_path, model_type):
    report = _report(tmp_path, model_type)  # tiny-cpu: CPT hybrid_parallel tp=2
    line = [c for c in report.checked if c.startswith(f"model family {model_type}")]
    assert report.ok, report.text()
    assert line and "its named row (tasks/core/models/policy_rows.py) gives hybrid_parallel" in line[0]
    assert {"falcon": "FalconForCausalLMPolicy", "opt": "OPTForCausalLMPolicy"}[model_type] in line[0], line
