"""Streamed logits checks: a model over verify_memory_gb runs a layer at a time, bitwise the whole forward.

.venv/bin/python -m pytest -q tests/test_stream.py -p no:cacheprovider
"""

from __future__ import annotations

import pytest
import torch

from tasks.core.errors import ConversionError
from tasks.core.models.families import FAMILIES
from tasks.core.models.fingerprint import hf_dir_logits
from tasks.core.models.stream import meta_model, model_bytes, stream_units, streaming
from tasks.core.run import meter


@pytest.fixture(scope="module")
def tokenizer():
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tokenizer

    return build_tokenizer(DEFAULT_CORPUS, vocab_size=512)


def _shard(model_dir, max_shard_size="40KB"):
    """Re-save the folder in several shards with an index, as a large model is stored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    (model_dir / "model.safetensors").unlink()
    model.save_pretrained(model_dir, safe_serialization=True, max_shard_size=max_shard_size)
    return sorted(p.name for p in model_dir.glob("*.safetensors"))


# Every registered family, one of them tied (its head is the embedding, saved once), in shards
# and in one file; fp32 must be bitwise, and a bf16 load casts each tensor exactly as from_pretrained.
CASES = [
    ("llama", False, True),
    ("mistral", False, False),
    ("qwen2", True, True),
    ("qwen3", False, False),
    ("gemma3_text", True, False),
    ("phi3", False, True),
]
assert {family for family, _, _ in CASES} == set(FAMILIES), "a family added to FAMILIES needs a case here"


@pytest.mark.parametrize(
    ("family", "tied", "sharded"),
    CASES,
    ids=[f"{f}{'-tied' if t else ''}{'-sharded' if s else ''}" for f, t, s in CASES],
)
def test_streamed_logits_are_bitwise_the_whole_forward(tmp_path, tokenizer, family, tied, sharded):
    from tasks.core.models.demo import build_tiny_model

    d = build_tiny_model(tmp_path / family, tokenizer, family=family, tie_word_embeddings=tied, num_layers=3, seed=5)
    if sharded:
        assert len(_shard(d)) > 3 and (d / "model.safetensors.index.json").is_file()
    for dtype in ("fp32", "bf16"):
        whole = hf_dir_logits(d, dtype=dtype)
        streamed = hf_dir_logits(d, dtype=dtype, verify_memory_gb=0)  # any model is over a zero budget
        assert torch.equal(streamed, whole), (family, dtype, float((streamed - whole).abs().max()))
        assert torch.equal(hf_dir_logits(d, dtype=dtype, verify_memory_gb=1.0), whole)  # under the budget: loaded whole
    meta = meta_model(d, torch.float32)
    # the units: each decoder layer, then embedding, final norm and (untied) head; after the forward all is meta again
    names = {type(u).__name__ for u, _ in stream_units(meta)}
    assert sum(recurse for _, recurse in stream_units(meta)) == 3 and any(n.endswith("Embedding") for n in names)
    records: list[dict] = []
    with meter.reporting(records.append, interval_s=0), streaming(meta, d):  # a unit done: a line with an ETA
        meta(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    units = len(stream_units(meta))
    assert [r["done"] for r in records] == list(range(units)) + [units] and records[-1]["finished"]
    assert records[1]["eta_s"] is not None and records[0]["what"].startswith("logits check of")
    assert all(p.device.type == "meta" for p in meta.parameters())
    params = sum(p.numel() for p in meta.parameters())
    assert model_bytes(meta) == 4 * params


def test_a_missing_or_misshapen_tensor_is_named(tmp_path, tokenizer):
    from safetensors.torch import load_file, save_file

    from tasks.core.models.demo import build_tiny_model

    d = build_tiny_model(tmp_path / "m", tokenizer, num_layers=2)
    tensors = load_file(str(d / "model.safetensors"))
    key = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != key}, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=rf"no tensor {key} in its safetensors files"):
        hf_dir_logits(d, verify_memory_gb=0)
    save_file({**tensors, key: tensors[key][:-1]}, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=rf"{key} has shape \(127, 64\), its config.json wants \(128, 64\)"):
        hf_dir_logits(d, verify_memory_gb=0)
    (d / "model.safetensors").rename(d / "weights.safetensors")
    with pytest.raises(ConversionError, match="neither model.safetensors.index.json nor model.safetensors"):
        hf_dir_logits(d, verify_memory_gb=0)


def test_verify_memory_gb_defaults_and_must_be_positive(tmp_path, tiny_model_dir):
    """(That it re-runs nothing is tests/test_digests.py's NOTHING_RERUNS row.)"""
    from tasks.core.config.load import parse_config
    from tasks.core.errors import ConfigError
    from tests.conftest import tiny_config_raw

    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    assert (
        parse_config(raw).verify_memory_gb == 4.0
        and parse_config({**raw, "verify_memory_gb": 0.001}).verify_memory_gb == 0.001
    )
    with pytest.raises(ConfigError, match="verify_memory_gb"):
        parse_config({**raw, "verify_memory_gb": 0})
