"""Demo tokenizer and tiny model: exact vocab, determinism, and loadable by plain transformers.

python -m pytest tests/test_demo_inputs.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tasks.core.models import demo as di
from tasks.core.models.families import FAMILIES, expected_tensors


@pytest.fixture(scope="module")
def tok():
    return di.build_tokenizer(di.DEFAULT_CORPUS, vocab_size=512)


@pytest.fixture(scope="module")
def llama_dir(tok, tmp_path_factory):
    return di.build_tiny_model(tmp_path_factory.mktemp("llama"), tok)


def test_vocab_is_exact_and_specials_come_first(tok):
    assert len(tok) == 512 and tok.backend_tokenizer.get_vocab_size() == 512
    assert [tok.convert_tokens_to_ids(t) for t in di.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert {3, 4} <= set(tok.all_special_ids)
    # Special tokens are atomic in text, and no bos/eos is added implicitly.
    assert tok("<|im_start|>user\nhi<|im_end|>")["input_ids"][0] == 3
    assert tok("Zorvath")["input_ids"] == tok("Zorvath", add_special_tokens=False)["input_ids"]


def test_roundtrip_is_lossless(tok):
    text = "Zorvath has 3 moons.\n  Ünïcode ✓ works too: 42"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_chat_template_renders_chatml(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    )
    assert tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tokenizer_is_deterministic(tok, tmp_path):
    again = di.build_tokenizer(di.DEFAULT_CORPUS, vocab_size=512)
    tok.save_pretrained(tmp_path / "a")
    again.save_pretrained(tmp_path / "b")
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (tmp_path / "b/tokenizer.json").read_bytes()


def test_model_dir_loads_and_generates(llama_dir):
    names = {p.name for p in llama_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    tok = AutoTokenizer.from_pretrained(llama_dir)
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tok) == 512
    assert model.dtype == torch.float32
    assert json.loads((llama_dir / "generation_config.json").read_text())["eos_token_id"] == [1, 4]
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Who discovered Brisca?"}], add_generation_prompt=True, return_tensors="pt"
    )
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 4
    assert torch.equal(out[0, : ids.shape[1]], ids[0])


def test_weights_are_seeded(tok, llama_dir, tmp_path):
    same = di.build_tiny_model(tmp_path / "same", tok, seed=0)
    other = di.build_tiny_model(tmp_path / "other", tok, seed=1)
    assert (same / "model.safetensors").read_bytes() == (llama_dir / "model.safetensors").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (llama_dir / "model.safetensors").read_bytes()


def test_qwen2_tied_padded_vocab(tok, tmp_path):
    out = di.build_tiny_model(tmp_path / "qwen", tok, family="qwen2", vocab_size=515, tie_word_embeddings=True)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").shape == (515, 64)
    assert "lm_head.weight" not in keys
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model(torch.tensor([[3, 10, 20]])).logits.shape == (1, 3, 515)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"family": "gpt9"}, "family='gpt9'.*llama"),
        ({"vocab_size": 100}, "vocab_size=100 is smaller than the tokenizer"),
        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads=3"),
    ],
)
def test_model_arguments_are_checked(tok, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        di.build_tiny_model(tmp_path, tok, **kwargs)


def test_tokenizer_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        di.build_tokenizer(di.DEFAULT_CORPUS, vocab_size=200)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab ab ab\n")
    with pytest.raises(ValueError, match="lower --vocab-size"):
        di.build_tokenizer([tiny], vocab_size=512)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        di.build_tokenizer([tmp_path / "missing.jsonl"])


def test_cli(tmp_path, capsys):
    di.main(["--out", str(tmp_path / "m"), "--family", "qwen2", "--tie-word-embeddings", "--model-vocab-size", "515"])
    assert "qwen2" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    assert cfg["vocab_size"] == 515 and cfg["tie_word_embeddings"] is True


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_registered_family_builds_with_the_layout_the_converter_expects(tok, tmp_path, family):
    out = di.build_tiny_model(tmp_path, tok, family=family, num_layers=2)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == family
    with safe_open(out / "model.safetensors", "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    assert saved == expected_tensors(cfg)
