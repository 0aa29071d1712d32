"""Streaming checkpoint conversion against the reference: tiny random transformers models, saved in
ColossalAI 0.5.0's sharded layout (single stage and pp=2), converted, then compared bitwise and
by logits with the original model.

    .venv/bin/python -m pytest tests/test_convert.py -q
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tasks.core.errors import ConversionError
from tasks.core.models.convert import (
    SAFE_INDEX_NAME,
    convert_checkpoint,
    expected_tensors,
    load_state_dict_from_dir,
    parse_size,
    plan_shards,
)
from tasks.core.run import meter

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


# ---------------------------------------------------------------------------------------------
# ColossalAI 0.5.0's save layout, reproduced line for line from colossalai/checkpoint_io/utils.py
# (StateDictSharder, save_state_dict_shards, get_shard_filename) and
# hybrid_parallel_checkpoint_io.py (per-stage names, merged index); checked against the real
# functions in test_layout_matches_real_colossalai.
# ---------------------------------------------------------------------------------------------


def _mb(t: torch.Tensor) -> float:
    return t.numel() * t.element_size() / 1024 / 1024  # calculate_tensor_size: MiB, as a float


def _shard_blocks(state: dict[str, torch.Tensor], size_per_shard_mb: float):
    block, block_size = OrderedDict(), 0.0
    for key, t in state.items():
        size = _mb(t)
        if block_size + size > size_per_shard_mb and block_size > 0:
            yield block, block_size
            block, block_size = OrderedDict(), 0.0
        block[key] = t
        block_size += size
    yield block, block_size


def _save_stage(state, ckpt: Path, base: str, size_per_shard_mb: float, weight_map: dict) -> float:
    total = 0.0
    for idx, (block, size) in enumerate(_shard_blocks(state, size_per_shard_mb)):
        name = base.replace(".safetensors", f"-{idx + 1:05d}.safetensors")
        total += size
        for key in block:
            weight_map[key] = name
        save_file({k: v.data.cpu() for k, v in block.items()}, str(ckpt / name), metadata={"format": "pt"})
    return total


def write_colossal_checkpoint(
    state: dict[str, torch.Tensor],
    ckpt: Path,
    *,
    size_per_shard_mb: float = 0.05,
    stages: list[list[str]] | None = None,
    config=None,
) -> Path:
    """`booster.save_model(model, ckpt, shard=True, use_safetensors=True)` as ColossalAI writes it.

    `stages` (lists of keys, one per pipeline stage) selects the pp > 1 layout.
    """
    ckpt.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    if stages is None:
        total = _save_stage(state, ckpt, "model.safetensors", size_per_shard_mb, weight_map)
    else:
        total = 0.0
        for s, keys in enumerate(stages):
            stage_state = OrderedDict((k, state[k]) for k in keys)
            total += _save_stage(
                stage_state, ckpt, f"model-stage-{s + 1:05d}-shard.safetensors", size_per_shard_mb, weight_map
            )
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (ckpt / SAFE_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    if config is not None:
        config.save_pretrained(ckpt)
    return ckpt


def pp2_stages(state: dict[str, torch.Tensor], n_layers: int) -> list[list[str]]:
    """What a 2-stage pipeline holds: embeddings + first half, then second half + norm + lm_head."""
    half = n_layers // 2
    first = [
        k
        for k in state
        if k.startswith("model.embed_tokens") or any(k.startswith(f"model.layers.{i}.") for i in range(half))
    ]
    return [first, [k for k in state if k not in first]]


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------


def _model(cls, cfg_cls, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = cls(cfg_cls(**{**TINY, "vocab_size": 128, **overrides})).eval()
    return model


def _params(model) -> OrderedDict[str, torch.Tensor]:
    """What HybridParallel saves: named_parameters(), so a tied weight appears once."""
    return OrderedDict((k, v.detach()) for k, v in model.named_parameters())


@pytest.fixture(scope="module")
def llama():
    return _model(LlamaForCausalLM, LlamaConfig, vocab_size=101)  # odd vocab: not divisible by any tp


@pytest.fixture(scope="module")
def qwen_tied():
    model = _model(Qwen2ForCausalLM, Qwen2Config, seed=1, vocab_size=99, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


IDS = torch.randint(0, 99, (2, 12), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _logits(model):
    return model(input_ids=IDS, use_cache=False).logits


def _assert_same_state(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype, k
        assert torch.equal(got[k], w), k


def _cfg(model) -> dict:
    return model.config.to_dict()


# ---------------------------------------------------------------------------------------------
# registry and helpers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls,cfg_cls,overrides",
    [
        (LlamaForCausalLM, LlamaConfig, {}),
        (
            LlamaForCausalLM,
            LlamaConfig,
            {"attention_bias": True, "mlp_bias": True, "head_dim": 8, "num_key_value_heads": 1},
        ),
        (MistralForCausalLM, MistralConfig, {"head_dim": 32}),
        (Qwen2ForCausalLM, Qwen2Config, {"tie_word_embeddings": True}),
        (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 16}),
        (Gemma3ForCausalLM, Gemma3TextConfig, {"head_dim": 16}),  # tied by default
        (Gemma3ForCausalLM, Gemma3TextConfig, {"tie_word_embeddings": False}),
        (Phi3ForCausalLM, Phi3Config, {"pad_token_id": None}),
    ],
    ids=[
        "llama-gqa",
        "llama-bias-headdim-mqa",
        "mistral",
        "qwen2-tied",
        "qwen3",
        "gemma3-tied",
        "gemma3-untied",
        "phi3",
    ],
)
def test_expected_tensors_match_transformers(cls, cfg_cls, overrides):
    model = _model(cls, cfg_cls, **overrides)
    saved = _params(model)  # module order, tied weight once
    got = expected_tensors(_cfg(model))
    assert list(got) == list(saved)
    assert got == {k: tuple(v.shape) for k, v in saved.items()}


def test_unknown_model_type_lists_supported():
    with pytest.raises(ConversionError, match=r"tinyfam.*llama.*mistral.*qwen2"):
        expected_tensors({"model_type": "tinyfam", **TINY, "vocab_size": 10})


def test_parse_size_and_plan():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1GiB") == 2**30
    assert parse_size(1234) == 1234
    with pytest.raises(ConversionError, match="max_shard_size"):
        parse_size("5 parsecs")
    assert plan_shards([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]


def test_layout_matches_real_colossalai(tmp_path, llama):
    """Our fixture writer and ColossalAI's own save functions produce identical directories."""
    pytest.importorskip("colossalai")
    from colossalai.checkpoint_io.index_file import CheckpointIndexFile
    from colossalai.checkpoint_io.utils import get_model_base_filenames, save_state_dict_shards, shard_model_checkpoint

    state = _params(llama)
    for stages in (None, pp2_stages(state, 4)):
        ours = write_colossal_checkpoint(state, tmp_path / f"ours{bool(stages)}", stages=stages)
        real = tmp_path / f"real{bool(stages)}"
        real.mkdir()
        weights_name, index_name = get_model_base_filenames(None, use_safetensors=True)
        if stages is None:
            index = CheckpointIndexFile(str(real))
            total = save_state_dict_shards(
                shard_model_checkpoint(state, 0.05), str(real), index, weights_name, True, True
            )
            index.append_meta_data("total_size", total)
            index.write_index_file(index_name)
        else:  # HybridParallelCheckpointIO.save_sharded_model, pp branch, one stage at a time
            merged = CheckpointIndexFile(str(real))
            merged.append_meta_data("total_size", 0)
            for s, keys in enumerate(stages):
                base = weights_name.replace(".safetensors", f"-stage-{s + 1:05d}-shard.safetensors")
                stage_index = CheckpointIndexFile(str(real))
                sub = OrderedDict((k, state[k]) for k in keys)
                total = save_state_dict_shards(
                    shard_model_checkpoint(sub, 0.05), str(real), stage_index, base, True, True, use_pp_format=True
                )
                merged.metadata["total_size"] += total
                for k, f in stage_index.weight_map.items():
                    merged.append_weight_map(k, f)
            merged.write_index_file(index_name)
        assert sorted(os.listdir(ours)) == sorted(os.listdir(real))
        for name in os.listdir(real):
            assert (ours / name).read_bytes() == (real / name).read_bytes(), name
    assert "model-stage-00002-shard-00001.safetensors" in os.listdir(real)


# ---------------------------------------------------------------------------------------------
# conversions that must succeed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [1, 2])
def test_convert_bitwise_and_logits(tmp_path, llama, pp):
    state = _params(llama)
    stages = pp2_stages(state, 4) if pp == 2 else None
    src = write_colossal_checkpoint(state, tmp_path / "ckpt", stages=stages, config=llama.config)
    report = convert_checkpoint(src, tmp_path / "hf", model_config=_cfg(llama), fsync=False)

    assert report.source_layout == ("colossalai-pipeline" if pp == 2 else "colossalai-sharded")
    assert report.num_tensors == len(state) and report.dropped == []
    assert report.keys == list(state)  # model order, whatever the input sharding
    _assert_same_state(load_state_dict_from_dir(tmp_path / "hf"), dict(state))
    assert set(report.files) == {"model.safetensors", "config.json"}  # 5GB budget: one shard, no index
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(_logits(loaded), _logits(llama))


def test_multi_shard_index_and_hashes(tmp_path, llama):
    src = write_colossal_checkpoint(_params(llama), tmp_path / "ckpt")
    dst = tmp_path / "hf"
    report = convert_checkpoint(src, dst, model_config=_cfg(llama), max_shard_size="100KB", fsync=False)

    shards = sorted(f for f in report.files if f.endswith(".safetensors"))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((dst / SAFE_INDEX_NAME).read_text())
    state = load_state_dict_from_dir(dst)
    assert (
        index["metadata"]["total_size"]
        == report.total_bytes
        == sum(t.numel() * t.element_size() for t in state.values())
    )
    assert list(index["weight_map"]) == sorted(index["weight_map"]) and set(index["weight_map"].values()) == set(shards)
    assert sorted(os.listdir(dst)) == sorted(report.files)
    for rel, entry in report.files.items():
        blob = (dst / rel).read_bytes()
        assert entry == {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}, rel
    for name in shards:  # every shard within budget unless a single tensor is larger
        keys = [k for k, f in index["weight_map"].items() if f == name]
        assert sum(state[k].numel() * 4 for k in keys) <= 100_000 or len(keys) == 1
    loaded = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert torch.equal(_logits(loaded), _logits(llama))

    # converting again into the same directory with one shard leaves no stale shards or index
    report = convert_checkpoint(src, dst, model_config=_cfg(llama), fsync=False)
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors"]


def test_parallel_shard_writers_are_byte_identical_and_fail_cleanly(tmp_path, llama, monkeypatch):
    from tasks.core.models.convert import write
    from tasks.core.models.convert.source import Reader

    src = write_colossal_checkpoint(_params(llama), tmp_path / "ckpt")
    serial = convert_checkpoint(
        src, tmp_path / "w1", model_config=_cfg(llama), max_shard_size="100KB", fsync=False, workers=1
    )
    # fsync on, with the writeback step shrunk so sync_file_range runs on these small files too
    monkeypatch.setattr(write, "_WRITEBACK_STEP", 4096)
    records: list[dict] = []
    with meter.reporting(records.append, interval_s=0):  # three threads report each shard written to one meter
        parallel = convert_checkpoint(
            src, tmp_path / "w3", model_config=_cfg(llama), max_shard_size="100KB", fsync=True, workers=3
        )
    shards = sum(f.endswith(".safetensors") for f in parallel.files)
    assert records[0]["done"] == 0 and records[-1] == {**records[-1], "done": shards, "total": shards, "finished": True}
    assert any(0 < r["done"] < shards and r["eta_s"] is not None for r in records)
    assert len(serial.files) > 4 and parallel.files == serial.files
    for rel in serial.files:
        assert (tmp_path / "w1" / rel).read_bytes() == (tmp_path / "w3" / rel).read_bytes(), rel

    # one writer failing stops the others: its error is raised and no partial (.tmp) file is left
    victim = serial.keys[len(serial.keys) // 2]
    real = Reader.readinto

    def failing(self, entry, pos, out):
        if entry.key == victim:
            raise OSError(5, f"injected read error in {entry.key}")
        return real(self, entry, pos, out)

    monkeypatch.setattr(Reader, "readinto", failing)
    with pytest.raises(OSError, match="injected read error"):
        convert_checkpoint(
            src, tmp_path / "broken", model_config=_cfg(llama), max_shard_size="100KB", fsync=False, workers=3
        )
    assert not [p.name for p in (tmp_path / "broken").iterdir() if p.name.endswith(".tmp")]
    assert not (tmp_path / "broken" / SAFE_INDEX_NAME).exists()
    with pytest.raises(ConversionError, match="workers=0"):
        convert_checkpoint(src, tmp_path / "w0", model_config=_cfg(llama), workers=0)


def test_bf16_cast(tmp_path, llama):
    src = write_colossal_checkpoint(_params(llama), tmp_path / "ckpt", stages=pp2_stages(_params(llama), 4))
    report = convert_checkpoint(
        src, tmp_path / "hf", model_config=_cfg(llama), dtype="bf16", max_shard_size="200KB", fsync=False
    )
    assert report.dtype == "bf16"
    got = load_state_dict_from_dir(tmp_path / "hf")
    _assert_same_state(got, {k: v.to(torch.bfloat16) for k, v in _params(llama).items()})
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["dtype"] == written["torch_dtype"] == "bfloat16"  # 4.56+ reads `dtype` first, older `torch_dtype`
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert loaded.dtype == torch.bfloat16


def test_tied_embeddings_qwen2(tmp_path, qwen_tied):
    params = _params(qwen_tied)
    assert "lm_head.weight" not in params  # HybridParallel with pp == 1 saves the tied weight once
    src = write_colossal_checkpoint(params, tmp_path / "ckpt", config=qwen_tied.config)
    report = convert_checkpoint(src, tmp_path / "hf", model_config=_cfg(qwen_tied), fsync=False)
    out = load_state_dict_from_dir(tmp_path / "hf")
    assert "lm_head.weight" not in out and report.dropped == []
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(_logits(loaded), _logits(qwen_tied))


def test_tied_duplicate_dropped_only_if_equal(tmp_path, qwen_tied):
    # pp > 1 saves the first stage's embeddings and the last stage's lm_head: two equal copies
    params = _params(qwen_tied)
    params["lm_head.weight"] = params["model.embed_tokens.weight"].clone()
    src = write_colossal_checkpoint(params, tmp_path / "ckpt", stages=pp2_stages(params, 4))
    report = convert_checkpoint(src, tmp_path / "hf", model_config=_cfg(qwen_tied), fsync=False)
    assert report.dropped == ["lm_head.weight"]
    assert "lm_head.weight" not in load_state_dict_from_dir(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(_logits(loaded), _logits(qwen_tied))

    params["lm_head.weight"][3, 5] += 1.0
    src = write_colossal_checkpoint(params, tmp_path / "ckpt2", stages=pp2_stages(params, 4))
    with pytest.raises(ConversionError, match=r"'lm_head.weight' in model-stage-00002-shard-\d+\.safetensors differs"):
        convert_checkpoint(src, tmp_path / "hf2", model_config=_cfg(qwen_tied), fsync=False)


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_tiny_io_chunks(tmp_path, qwen_tied, monkeypatch, dtype):
    """Chunk size far below the tensor sizes: exercises multi-chunk copies and casts, reuse of the
    write ring while the hasher thread is behind, and chunked tied-weight comparison."""
    from tasks.core.models.convert import dtypes

    monkeypatch.setattr(dtypes, "CHUNK", 4100)
    params = _params(qwen_tied)
    params["lm_head.weight"] = params["model.embed_tokens.weight"].clone()
    src = write_colossal_checkpoint(params, tmp_path / "ckpt", stages=pp2_stages(params, 4))
    report = convert_checkpoint(
        src, tmp_path / "hf", model_config=_cfg(qwen_tied), dtype=dtype, max_shard_size="50KB", fsync=False
    )
    assert report.dropped == ["lm_head.weight"]
    want = {k: v.to(torch.bfloat16) if dtype else v for k, v in _params(qwen_tied).items()}
    _assert_same_state(load_state_dict_from_dir(tmp_path / "hf"), want)
    for rel, entry in report.files.items():
        assert entry["sha256"] == hashlib.sha256((tmp_path / "hf" / rel).read_bytes()).hexdigest(), rel


def test_cli(tmp_path, llama, capsys):
    from tasks.core.models.convert.__main__ import main as _main

    src = write_colossal_checkpoint(_params(llama), tmp_path / "ckpt", config=llama.config)
    assert _main([str(src), str(tmp_path / "hf"), "--dtype", "bf16", "--max-shard-size", "100KB", "--no-fsync"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bf16"
    assert _main([str(src), str(src)]) == 1  # refuses to write into its source


def test_hf_directory_input_reshards(tmp_path, llama):
    llama.save_pretrained(tmp_path / "single", safe_serialization=True)
    llama.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="150KB")
    assert (tmp_path / "sharded" / SAFE_INDEX_NAME).exists()
    for name, layout in (("single", "hf-single"), ("sharded", "hf-sharded")):
        report = convert_checkpoint(
            tmp_path / name, tmp_path / f"{name}-out", model_config=_cfg(llama), max_shard_size="300KB", fsync=False
        )
        assert report.source_layout == layout
        _assert_same_state(load_state_dict_from_dir(tmp_path / f"{name}-out"), dict(_params(llama)))


def test_pickle_refused_unless_allowed(tmp_path, llama):
    src = tmp_path / "bin"
    src.mkdir()
    torch.save(dict(_params(llama)), src / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=r"pytorch_model\.bin: refusing a pickled checkpoint"):
        convert_checkpoint(src, tmp_path / "hf", model_config=_cfg(llama))
    report = convert_checkpoint(
        src, tmp_path / "hf", model_config=_cfg(llama), allow_pickle=True, dtype="fp16", fsync=False
    )
    assert report.source_layout == "pickle"
    _assert_same_state(load_state_dict_from_dir(tmp_path / "hf"), {k: v.half() for k, v in _params(llama).items()})


# ---------------------------------------------------------------------------------------------
# conversions that must fail, naming the file or key
# ---------------------------------------------------------------------------------------------


def _convert_fails(src: Path, model, match: str, tmp_path: Path):
    with pytest.raises(ConversionError, match=match) as info:
        convert_checkpoint(src, tmp_path / "out", model_config=_cfg(model), fsync=False)
    assert not any((tmp_path / "out").glob("*.safetensors")) if (tmp_path / "out").exists() else True
    return str(info.value)


def _shards(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("model-*.safetensors"))


def test_corrupted_header_names_file(tmp_path, llama):
    src = write_colossal_checkpoint(_params(llama), tmp_path / "ckpt")
    victim = _shards(src)[1]
    blob = bytearray(victim.read_bytes())
    blob[8] ^= 0xFF  # the header's opening brace
    victim.write_bytes(bytes(blob))
    _convert_fails(src, llama, rf"{victim.name}: safetensors header is not valid JSON", tmp_path)

    blob[8] ^= 0xFF
    blob[4] ^= 0x01  # the header length field, now 4 GiB longer than the file
    victim.write_bytes(bytes(blob))
    _convert_fails(src, llama, rf"{victim.name}: header length field says", tmp_path)


def test_truncated_shard_names_file(tmp_path, llama):
    src = write_colossal_checkpoint(_params(llama), tmp_path / "ckpt")
    victim = _shards(src)[-1]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 100)
    _convert_fails(
        src, llama, rf"{victim.name}: header describes \d+ data bytes but the file holds \d+ \(truncated\)", tmp_path
    )


def test_index_naming_missing_file(tmp_path, llama):
    src = write_colossal_checkpoint(_params(llama), tmp_path / "ckpt", stages=pp2_stages(_params(llama), 4))
    victim = _shards(src)[-1]
    victim.unlink()
    _convert_fails(src, llama, rf"{SAFE_INDEX_NAME} names {victim.name} .* but the file is missing", tmp_path)


def test_duplicated_key_names_both_files(tmp_path, llama):
    src = write_colossal_checkpoint(_params(llama), tmp_path / "ckpt")
    first, second = _shards(src)[:2]
    key = json.loads((src / SAFE_INDEX_NAME).read_text())["weight_map"]
    dup = next(k for k, f in key.items() if f == first.name)
    extra = load_state_dict_from_dir(src)
    part = {k: extra[k] for k, f in key.items() if f == second.name}
    part[dup] = extra[dup]
    save_file(part, str(second), metadata={"format": "pt"})
    _convert_fails(src, llama, rf"duplicated key '{dup}' in {first.name} and {second.name}", tmp_path)


def test_missing_and_extra_keys(tmp_path, llama):
    params = _params(llama)
    del params["model.layers.2.mlp.up_proj.weight"]
    params["model.layers.1.self_attn.rotary.weight"] = torch.zeros(3)
    src = write_colossal_checkpoint(params, tmp_path / "ckpt")
    msg = _convert_fails(src, llama, "2 problems", tmp_path)
    assert "missing key 'model.layers.2.mlp.up_proj.weight'" in msg
    assert re.search(r"unexpected key 'model.layers.1.self_attn.rotary.weight' in model-\d{5}\.safetensors", msg)


def test_padded_vocab_and_ungathered_shard(tmp_path, llama):
    params = _params(llama)
    params["model.embed_tokens.weight"] = torch.cat(
        [params["model.embed_tokens.weight"], torch.zeros(27, 64)]
    )  # to 128
    params["model.layers.0.self_attn.q_proj.weight"] = params["model.layers.0.self_attn.q_proj.weight"][
        :32
    ]  # tp=2 rank 0
    src = write_colossal_checkpoint(params, tmp_path / "ckpt")
    msg = _convert_fails(src, llama, "2 problems", tmp_path)
    assert (
        "'model.embed_tokens.weight' in model-00001.safetensors has shape [128, 64], config.json implies [101, 64]: "
        "padded vocabulary rows: 27 rows" in msg
    )
    assert (
        "'model.layers.0.self_attn.q_proj.weight'" in msg
        and "ungathered tensor-parallel shard: holds 1/2 of dim 0" in msg
    )


def test_untied_config_with_missing_lm_head(tmp_path, llama):
    params = _params(llama)
    del params["lm_head.weight"]
    src = write_colossal_checkpoint(params, tmp_path / "ckpt")
    _convert_fails(src, llama, r"missing key 'lm_head.weight'.*tie_word_embeddings=false", tmp_path)


def test_incomplete_saves(tmp_path, llama):
    src = write_colossal_checkpoint(_params(llama), tmp_path / "ckpt")
    (src / SAFE_INDEX_NAME).unlink()
    _convert_fails(src, llama, r"no model\.safetensors\.index\.json .*incomplete", tmp_path)
    (src / "model.safetensors").write_bytes(b"")
    (src / SAFE_INDEX_NAME).write_text("{}")
    _convert_fails(src, llama, r"both model\.safetensors and model\.safetensors\.index\.json", tmp_path)
    (src / "model.safetensors").unlink()
    (src / SAFE_INDEX_NAME).unlink()
    (src / "tmp_index_files").mkdir()
    _convert_fails(src, llama, r"tmp_index_files/ folder: a pipeline-parallel save stopped", tmp_path)


def test_header_parser_rejects_overlapping_offsets(tmp_path):
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()  # fmt: skip
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with pytest.raises(ConversionError, match=r"model\.safetensors: tensor 'b' does not start where"):
        load_state_dict_from_dir(tmp_path)
