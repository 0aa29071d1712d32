"""LoRA SFT: the config, the plugin registry's capability row and the layout rules.

    .venv/bin/pytest -q tests/test_lora.py

The refusals themselves (Gemini, tp=2, QLoRA on CPU, LoRA on CPT) are rows of
tests/test_preflight.py's BAD table; here: the defaults a user gets from `sft.lora: {r: 16, alpha:
32}`, and that the rules read the registry row, not a plugin's name.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tasks.core.config import plugins
from tasks.core.config.layout import layout_problems
from tasks.core.config.load import parse_config
from tasks.core.config.lora import LORA_TARGETS, LoraConfig
from tests.conftest import tiny_config_raw


def test_a_user_writes_r_and_alpha_and_gets_every_projection():
    raw = tiny_config_raw(Path("/m"), Path("/r"))
    raw["sft"]["lora"] = {"r": 16, "alpha": 32}
    cfg = parse_config(raw)
    assert cfg.sft.lora == LoraConfig(r=16, alpha=32.0, target_modules=LORA_TARGETS)
    assert cfg.sft.lora.dropout == 0.0 and not cfg.sft.lora.quantize and cfg.sft.lora.modules_to_save == ()
    assert cfg.cpt.lora is None


@pytest.mark.parametrize("bad", [{"r": 0}, {"alpha": 0}, {"dropout": 1.0}, {"target_modules": []}, {"rank": 8}])
def test_a_bad_lora_field_is_refused(bad):
    raw = tiny_config_raw(Path("/m"), Path("/r"))
    raw["sft"]["lora"] = bad
    with pytest.raises(Exception, match="sft.lora"):
        parse_config(raw)


def test_the_rules_read_the_registry_row(monkeypatch):
    """A plugin whose row refuses LoRA is refused for that reason and left out of the plugins
    offered instead; one whose row needs tp_size 1 is refused only with tp > 1."""
    raw = tiny_config_raw(Path("/m"), Path("/r"))
    raw["sft"]["lora"] = {"r": 4}
    stage = parse_config(raw).sft
    base = plugins.PLUGINS["low_level_zero"]
    monkeypatch.setitem(
        plugins.PLUGINS, "low_level_zero", replace(base, lora=plugins.LoraSupport(refused="a dummy reason"))
    )
    [(field, msg)] = layout_problems(stage, "sft", tiers=("static",))
    assert field == "sft.lora" and "refused under plugin low_level_zero: a dummy reason" in msg
    assert (
        "set sft.plugin.name: hybrid_parallel" in msg
        and "set sft.plugin.name: torch_ddp" in msg
        and "set sft.lora: null" in msg
    )
    monkeypatch.setitem(
        plugins.PLUGINS,
        "low_level_zero",
        replace(base, supports_tp_pp=True, lora=plugins.LoraSupport(tp1_reason="a tp reason")),
    )
    assert layout_problems(stage, "sft", tiers=("static",)) == []
    tp2 = stage.model_copy(update={"plugin": stage.plugin.model_copy(update={"tp_size": 2})})
    [(field, msg)] = layout_problems(tp2, "sft", tiers=("static",))
    assert field == "sft.plugin.tp_size" and "needs tp_size 1 (a tp reason), got 2" in msg


def test_qlora_is_refused_where_the_config_is_read_until_the_export_merges_onto_the_4bit_base():
    raw = tiny_config_raw(Path("/m"), Path("/r"))
    raw["sft"]["lora"] = {"r": 4, "quantize": True}
    with pytest.raises(Exception, match=r"sft.lora.quantize[\s\S]*peft#2105"):
        parse_config(raw)


@pytest.mark.parametrize("train_head", [False, True])
def test_a_tied_model_merges_without_losing_its_trained_head(tmp_path, train_head):
    """qwen2-style tied embeddings: adapters on the projections leave the tie as it is; a head
    trained in full (modules_to_save) is exported untied, so no loader re-ties it onto the embedding."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from tasks.core.config.outputs import ExportConfig
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer
    from tasks.core.models.fingerprint import compare_logits, hf_dir_logits, model_logits
    from tasks.core.models.merge import build_merged_dir

    base_dir = build_tiny_model(
        tmp_path / "qwen", build_tokenizer(DEFAULT_CORPUS, vocab_size=512), family="qwen2", tie_word_embeddings=True
    )
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
        PeftLoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "o_proj"],
            modules_to_save=["lm_head"] if train_head else None,
            init_lora_weights=False,
        ),
    )
    if train_head:
        with torch.no_grad():
            model.base_model.model.lm_head.modules_to_save["default"].weight.add_(
                0.05 * torch.randn_like(model.base_model.model.lm_head.weight)
            )
    model.save_pretrained(tmp_path / "ckpt" / "adapter", safe_serialization=True)
    reference = model_logits(model.eval(), 512)
    built = build_merged_dir(tmp_path / "ckpt", tmp_path / "export", base_dir, ExportConfig(dtype="fp32"))
    assert built["verification"]["lora"]["untied_head"] is train_head
    assert compare_logits(hf_dir_logits(tmp_path / "export"), reference, 1e-5)["fingerprint_match"]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert merged.config.tie_word_embeddings is not train_head
    assert torch.equal(merged.lm_head.weight, merged.model.embed_tokens.weight) is not train_head


def test_the_card_says_lora_r_alpha_targets_and_the_trainable_share(tmp_path):
    import json

    from tasks.core.hub.card import model_card, train_facts
    from tasks.core.run.manifest import MANIFEST

    raw = tiny_config_raw(tmp_path / "m", tmp_path)
    raw["sft"]["lora"] = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}
    cfg = parse_config(raw)
    for phase in ("cpt", "sft"):
        step = tmp_path / phase / f"step-{cfg.phase(phase).max_steps:06d}"
        (step / MANIFEST).parent.mkdir(parents=True)
        (step / "train_state.json").write_text(json.dumps({"losses": [2.0]}))
        meta = (
            {"lora": {"trainable_params": 133, "total_params": 1000, "trainable_pct": 13.3}} if phase == "sft" else {}
        )
        (step / MANIFEST).write_text(json.dumps({"meta": meta}))
    card = model_card(cfg, {"meta": {}}, train_facts(cfg, {}, lambda rel: (tmp_path / rel).read_text()))
    assert "| fine-tuning | full | LoRA r=16, alpha=32 on q_proj, v_proj; 13.3 % of parameters trained |" in card


def test_the_adapter_push_is_refused_where_the_config_is_read_without_an_adapter_or_beside_the_merged_weights():
    from tasks.core.errors import ConfigError

    raw = tiny_config_raw(Path("/m"), Path("/r"))
    raw["hub"] = {"repo_id": "org/m", "push_adapter": True}
    with pytest.raises(ConfigError, match=r"hub.push_adapter: there is no adapter to push"):
        parse_config(raw)
    raw["sft"]["lora"] = {"r": 4}
    assert parse_config(raw).hub.push_adapter  # the subfolder adapter/ of org/m
    raw["hub"]["adapter_repo_id"] = "org/m"
    with pytest.raises(
        ConfigError,
        match=r"hub.adapter_repo_id: is hub.repo_id \(org/m\): the adapter would sit beside the merged weights",
    ):
        parse_config(raw)
