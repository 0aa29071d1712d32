"""The engine's weight reader (tasks/engine/weights.py) on plain HF models in this process: every
tensor read one at a time into a freshly built model gives the model from_pretrained gives, from a
single file or an indexed folder, a tied head from the tensor it is tied to; a tensor the model
holds that no file has, or one of another shape, is refused naming the folder.

    .venv/bin/python -m pytest -q tests/test_weights.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tasks.core.errors import ManifestError
from tasks.engine.weights import read_into, weight_map


def _fresh(model_dir: Path) -> torch.nn.Module:
    torch.manual_seed(123)  # other weights than the saved ones
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("max_shard_size", ["5GB", "100KB"])
def test_every_tensor_read_alone_gives_the_saved_model(tiny_model_dir, tmp_path, max_shard_size):
    src = tmp_path / "m"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(src, max_shard_size=max_shard_size)
    files = set(weight_map(src).values())
    assert (len(files) == 1) == (max_shard_size == "5GB")
    model = _fresh(src)
    got = read_into(model, src, json.loads((src / "config.json").read_text()))
    assert got.files == len(files) and got.tensors == len(dict(model.named_parameters()))
    _same(model, AutoModelForCausalLM.from_pretrained(src))


def test_a_tied_head_is_read_from_its_embedding(tmp_path):
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    src = build_tiny_model(
        tmp_path / "tied", build_tokenizer(DEFAULT_CORPUS, vocab_size=512), family="qwen2", tie_word_embeddings=True
    )
    assert "lm_head.weight" not in weight_map(src)
    model = _fresh(src)
    read_into(model, src, json.loads((src / "config.json").read_text()))
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    _same(model, AutoModelForCausalLM.from_pretrained(src))


def test_a_missing_or_misshapen_tensor_is_refused_naming_the_folder(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "m"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if k != "model.norm.weight"},
        str(src / "model.safetensors"),
        metadata={"format": "pt"},
    )
    with pytest.raises(
        ManifestError,
        match=r"weights do not match the model's config: 1 tensor\(s\) the model holds are in no file, e.g. "
        r"\['model.norm.weight'\]",
    ) as e:
        read_into(_fresh(src), src, config)
    assert str(src) in str(e.value)
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ManifestError, match="size mismatch for model.norm.weight"):
        read_into(_fresh(src), src, config)
    (src / "model.safetensors").unlink()
    with pytest.raises(ManifestError, match="neither model.safetensors.index.json nor model.safetensors"):
        read_into(_fresh(src), src, config)
