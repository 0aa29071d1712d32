"""The export's model folder, without torchrun: a second model family (qwen2) exported single- and
multi-shard through the real `build_hf_dir`, checked with the consumers' rules; the exact weight
proof failing on a swapped pair of layers and on one flipped mantissa bit; stop-token alignment.

    .venv/bin/python -m pytest -q tests/test_export.py      # ~1 min on 2 cores

The "checkpoint" here is what the engine's save leaves (`model/` HF safetensors + fingerprint),
made from the tiny qwen2 base directly: the conversion, the proof, the stop tokens and the
logits check are the code the export stage runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tasks.core.config.outputs import ExportConfig
from tasks.core.errors import ConversionError
from tasks.core.models.convert.proof import prove_weights
from tasks.core.run import meter
from tasks.core.run.manifest import MANIFEST, PROVENANCE_DIR
from tests._consumer_rules import assert_consumer_rules, served_files

MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",  # transformers >= 4.52 saves the tokenizer's template here
}


def _base(root: Path, tie: bool) -> Path:
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    out = root / f"qwen2-{'tied' if tie else 'untied'}"
    build_tiny_model(out, build_tokenizer(DEFAULT_CORPUS, vocab_size=512), family="qwen2", tie_word_embeddings=tie)
    # A base whose eos is the document end only (like a pre-trained base with </s>): the
    # template's <|im_end|> must be added at export.
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = 1
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def _checkpoint(root: Path, base: Path) -> Path:
    """What the engine leaves: model/ (HF names, fp32) and the fingerprint of those weights."""
    from tasks.core.models.fingerprint import hf_dir_logits, save_fingerprint

    ckpt = root / f"ckpt-{base.name}"
    (ckpt / "model").mkdir(parents=True)
    for p in base.glob("*.safetensors*"):
        shutil.copy2(p, ckpt / "model" / p.name)
    shutil.copy2(base / "config.json", ckpt / "model" / "config.json")
    save_fingerprint(hf_dir_logits(base, dtype="fp32"), ckpt, "fp32")
    return ckpt


def _export(root: Path, base: Path, ckpt: Path, name: str, max_shard_size: str, align: bool = True) -> Path:
    from tasks.core.models.hf_artifact import VERIFICATION, build_hf_dir
    from tasks.core.run.manifest import write_manifest

    dst = root / name
    dst.mkdir()
    export = ExportConfig(dtype="bf16", max_shard_size=max_shard_size, align_stop_tokens=align)
    built = build_hf_dir(ckpt, dst, base, export, weights_dtype="fp32")
    (dst / VERIFICATION).write_text(json.dumps(built["verification"]))
    write_manifest(
        dst,
        kind="hf-export",
        meta={"verification": built["verification"]},
        fingerprint=built["fingerprint"],
        known_hashes=built["known_hashes"],
    )
    return dst


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    single_base, multi_base = _base(root, tie=False), _base(root, tie=True)
    single_ckpt, multi_ckpt = _checkpoint(root, single_base), _checkpoint(root, multi_base)
    return {
        "root": root,
        "single": (_export(root, single_base, single_ckpt, "single", "5GB"), single_ckpt),
        "multi": (_export(root, multi_base, multi_ckpt, "multi", "40KB"), multi_ckpt),
        "base": single_base,
    }


@pytest.mark.parametrize("kind", ["single", "multi"])
def test_second_family_export_passes_the_consumer_rules(qwen2, kind):
    export, _ = qwen2[kind]
    out = assert_consumer_rules(export)
    assert (len(out["files"]) == 1) == (kind == "single"), out
    assert (export / "model.safetensors.index.json").is_file() == (kind == "multi")
    top = {p.name for p in export.iterdir()}
    assert (
        top - {"model.safetensors", "model.safetensors.index.json", PROVENANCE_DIR} - set(served_files(export))
        <= MODEL_FILES
    ), top
    assert {p.name for p in (export / PROVENANCE_DIR).iterdir()} == {
        "manifest.json",
        "verification.json",
        "fingerprint.npy",
    }
    assert MANIFEST.startswith(PROVENANCE_DIR + "/")
    v = json.loads((export / PROVENANCE_DIR / "verification.json").read_text())
    assert (
        v["weights_bitwise"]["tensors"] == v["tensors"]
        and v["fingerprint_match"]
        and v["top1_disagreements_beyond_tolerance"] == 0
    )


def test_stop_tokens_are_the_base_eos_plus_the_templates_end_of_turn(qwen2):
    export, _ = qwen2["single"]
    gen = json.loads((export / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 4] and gen["pad_token_id"] == 2  # <|end_of_text|>, <|im_end|>; <|pad|>
    stop = json.loads((export / PROVENANCE_DIR / "verification.json").read_text())["stop_tokens"]
    assert stop["base_eos_token_id"] == [1] and [a["token"] for a in stop["added"]] == ["<|im_end|>"]
    assert "chat template closes an assistant turn" in stop["added"][0]["why"]
    # Switched off: the base's generation config is kept, and the record says what was not added.
    off = _export(qwen2["root"], qwen2["base"], qwen2["single"][1], "single-unaligned", "5GB", align=False)
    assert json.loads((off / "generation_config.json").read_text())["eos_token_id"] == 1
    rec = json.loads((off / PROVENANCE_DIR / "verification.json").read_text())["stop_tokens"]
    assert rec["aligned"] is False and [a["id"] for a in rec["would_add"]] == [4]


def test_end_of_turn_comes_from_rendering_the_template_not_from_names(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tasks.core.models.stop_tokens import end_of_turn_tokens

    # A template with made-up markers no table of names could know: the reply ends with [[/A]].
    specials = ["[[BOS]]", "[[EOS]]", "[[A]]", "[[/A]]", "[[U]]", "[[/U]]"]
    vocab = {t: i for i, t in enumerate(specials + list("abcdefghijklmnopqrstuvwxyz !?"))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[[BOS]]",
        eos_token="[[EOS]]",
        unk_token="?",
        additional_special_tokens=specials[2:],
    )
    fast.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}[[U]]{{ m['content'] }}[[/U]]{% else %}[[A]]{{ "
        "m['content'] }}[[/A]]{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}[[A]]{% endif %}"
    )
    assert end_of_turn_tokens(fast) == [vocab["[[/A]]"]]


def _rewrite(path: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_a_swapped_pair_of_layers_fails_the_proof_naming_both(qwen2, tmp_path):
    export, ckpt = qwen2["single"]
    bad = tmp_path / "swapped"
    shutil.copytree(export, bad)
    a, b = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"

    def swap(t):
        t[a], t[b] = t[b], t[a]

    _rewrite(bad / "model.safetensors", swap)
    with pytest.raises(ConversionError) as info:
        prove_weights(ckpt / "model", bad, "bf16")
    msg = str(info.value)
    assert f"'{a}' holds the checkpoint's '{b}'" in msg and f"'{b}' holds the checkpoint's '{a}'" in msg, msg
    assert "2 problems" in msg


def test_one_flipped_mantissa_bit_fails_the_export_naming_the_tensor(qwen2, tmp_path, monkeypatch):
    """A converter that writes one wrong bit: the export stage's build fails, naming the tensor."""
    import tasks.core.models.hf_artifact as hf
    from tasks.core.models.convert import convert_checkpoint

    export, ckpt = qwen2["multi"]
    key = "model.layers.2.self_attn.q_proj.weight"

    def flipping(src, dst, **kw):
        report = convert_checkpoint(src, dst, **kw)
        shard = json.loads((Path(dst) / "model.safetensors.index.json").read_text())["weight_map"][key]

        def flip(t):
            t[key].view(torch.int16)[3, 5] ^= 1  # the lowest mantissa bit of one bf16 element

        _rewrite(Path(dst) / shard, flip)
        return report

    monkeypatch.setattr(hf, "convert_checkpoint", flipping)
    dst = tmp_path / "flipped"
    dst.mkdir()
    with pytest.raises(ConversionError) as info:
        hf.build_hf_dir(
            ckpt,
            dst,
            qwen2["root"] / "qwen2-tied",
            ExportConfig(dtype="bf16", max_shard_size="40KB", align_stop_tokens=True),
            weights_dtype="fp32",
        )
    msg = str(info.value)
    assert f"'{key}': 1 of {64 * 64} elements differ" in msg and f"flat index {3 * 64 + 5}" in msg, msg
    assert "1 problem)" in msg and "do not publish" in msg
    # The same folder without the flip proves clean: the proof is exact, not tolerant.
    records: list[dict] = []
    with meter.reporting(records.append, interval_s=0):  # each tensor read is progress, with an ETA
        tensors = prove_weights(ckpt / "model", export, "bf16")["tensors"]
    assert tensors == json.loads((export / PROVENANCE_DIR / "verification.json").read_text())["tensors"]
    assert records[-1]["finished"] and records[-1]["done"] == records[-1]["total"] == 2 * tensors, records[-1]
    assert any(0 < r["done"] < r["total"] and r["eta_s"] is not None for r in records)
