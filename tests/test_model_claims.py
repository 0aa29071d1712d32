"""A model folder whose config.json claims what its weight files cannot hold, or whose weights are not
a model's, is refused before anything is built from it, naming the field (or file and tensor) and the
fix (tasks/core/models/claims.py, tasks/core/preflight/model_files.py, tasks/core/models/shapes.py).

    .venv/bin/python -m pytest -q tests/test_model_claims.py -m ""

Unit tier. The weights are safetensors files written here from a header and zero bytes (a few KB):
the checks read headers only, so no tensor is ever built, and a config.json that claims 10^6 layers
or a 10^9-wide model is judged against them in seconds, registered and derived families alike.
"""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest

from tasks.core.models.claims import claim_problems, held_weights, size_problems, weight_dtype_problems
from tasks.core.models.folder import SAFETENSORS_DTYPE_BYTES
from tasks.core.models.shapes import folder_refusals
from tasks.core.preflight.checks import load_for_check, preflight_report
from tests.conftest import tiny_config_raw, write_config
from tests.test_preflight import CPU2

pytest_plugins = ["tests.conftest_servers"]

# A tiny Llama (and an OLMo 2, which has no row in FAMILIES: its family is derived) the headers describe
LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
OLMO2 = {**LLAMA, "model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"]}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> Path:
    """A well-formed safetensors file of zero bytes: {key: (dtype, shape)}."""
    header, at = {}, 0
    for key, (dtype, shape) in tensors.items():
        size = math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(at))
    return path


def llama_tensors(config: dict, dtype: str = "F32") -> dict[str, tuple[str, tuple[int, ...]]]:
    from tasks.core.models.families import expected_tensors

    return {k: (dtype, s) for k, s in expected_tensors(config).items()}


def model_folder(root: Path, config: dict, tensors: dict | None = None) -> Path:
    """config.json and model.safetensors (the llama tensors of LLAMA unless given) in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    write_safetensors(root / "model.safetensors", llama_tensors(LLAMA) if tensors is None else tensors)
    return root


def report_of(tmp: Path, model: Path, **base_model):
    tmp.mkdir(parents=True, exist_ok=True)
    raw = tiny_config_raw(model, tmp / "run")
    raw["base_model"].update(base_model)
    cfg = load_for_check(write_config(tmp / "c.yaml", raw))
    return preflight_report(cfg, machine=CPU2, token_present=None)


def model_problems(report) -> list[str]:
    return [msg for where, msg in report.problems if where == "base_model.uri"]


# ---- config.json's sizes against the files: refused in seconds, before any table or model ----------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layers", [10**5, 10**6])
@pytest.mark.parametrize("base", [LLAMA, OLMO2], ids=["registered", "derived"])
def test_more_layers_than_the_files_hold_are_refused_in_seconds_naming_the_field(tmp_path, base, layers):
    model = model_folder(tmp_path / "model", {**base, "num_hidden_layers": layers})
    started = time.monotonic()
    report = report_of(tmp_path, model)
    seconds = time.monotonic() - started
    want = (
        f"{model}/config.json num_hidden_layers={layers:,} claims more decoder layers than its weight files hold: "
        "2 layers (model.layers.0 to model.layers.1) in 21 tensors; set num_hidden_layers: 2 if these are the "
        "model's weights"
    )
    assert any(m.startswith(want) for m in model_problems(report)), report.problems
    # nothing built from the claim: no derived family, no table, no estimate (each would take minutes)
    assert not any("model family" in c or "memory" in c for c in report.checked), report.checked
    assert seconds < 15, seconds
    assert "Traceback" not in report.text()


@pytest.mark.parametrize(
    "field,value,said",
    [
        ("num_hidden_layers", 0, "is zero: a model has at least one"),
        ("hidden_size", -16, "is negative"),
        ("num_attention_heads", 2.5, "is not a whole number"),
        ("intermediate_size", 32.0, "is a float: write it as the integer 32"),
        ("vocab_size", "64", "is a str, not a number"),
    ],
)
def test_zero_negative_and_float_sizes_are_named_with_the_field_never_through_transformers(field, value, said):
    from tasks.core.errors import ConversionError
    from tasks.core.models.derive import derive_family
    from tasks.core.models.families import family_config

    for base in (LLAMA, OLMO2):
        config = {**base, field: value}
        ((where, msg),) = size_problems(config)
        assert where == field and msg.startswith(f"config.json {field}={value!r} {said}"), msg
        assert "a size is a whole number >= 1" in msg and "correct it in config.json" in msg
        assert claim_problems(config, held_weights(Path("/nonexistent"))) == [(where, msg)]
        # every reader of the sizes refuses them the same, registered or derived: no transformers exception
        with pytest.raises(ConversionError, match=f"config.json {field}="):
            family_config(config)
    with pytest.raises(ConversionError) as info:
        derive_family({**OLMO2, field: value})
    assert "transformers could not build" not in str(info.value) and field in str(info.value)


def test_a_derived_family_with_a_zero_size_is_refused_in_preflight_naming_the_field(tmp_path):
    model = model_folder(tmp_path / "model", {**OLMO2, "num_attention_heads": 0})
    problems = model_problems(report_of(tmp_path, model))
    assert any(m.startswith(f"{model}/config.json num_attention_heads=0 is zero") for m in problems), problems
    assert not any("transformers could not build" in m or "registered families" in m for m in problems), problems


def test_a_width_beyond_every_tensor_and_a_parameter_count_beyond_the_bytes_are_refused(tmp_path):
    """hidden_size=10^9 is wider than any tensor; a hidden_size within the widest tensor but 16x the real
    one makes the model 10x the files' parameters: each its own sentence, never 'an ungathered tp shard'."""
    model = model_folder(tmp_path / "model", {**LLAMA, "hidden_size": 10**9})
    held = held_weights(model)
    ((where, msg),) = claim_problems(json.loads((model / "config.json").read_text()), held)
    assert where == "hidden_size"
    assert msg.startswith(
        "config.json hidden_size=1,000,000,000 is wider than any tensor its weight files hold (the widest dimension "
        "is 64, of "
    ), msg
    # a claim each dimension of which the files could hold, but not all of them together
    big = {**LLAMA, "hidden_size": 64, "num_attention_heads": 2}
    ((where, msg),) = claim_problems(big, held)
    assert where == "config.json" and "describes a llama model of " in msg, msg
    assert f"its weight files hold {held.parameters:,} ({held.bytes:,} bytes)" in msg, msg
    # through pre-flight: refused in its own words, with no tensor-parallel diagnosis
    model2 = model_folder(tmp_path / "model2", big)
    problems = model_problems(report_of(tmp_path / "r2", model2))
    assert any("describes a llama model of" in m for m in problems), problems
    assert not any("ungathered" in m for m in problems), problems


def test_a_smaller_size_than_the_files_is_one_tp_shard_only_for_a_tp_group_s_factor():
    from tasks.core.models.families import FAMILIES, shape_cause

    llama = FAMILIES["llama"]
    assert "ungathered tensor-parallel shard: holds 1/2" in shape_cause("model.norm.weight", (8,), (16,), llama)
    lying = shape_cause("model.norm.weight", (16,), (16 * 19531250,), llama)
    assert "ungathered" not in lying and "config.json claims 312,500,000 where the weights hold 16" in lying, lying


@pytest.mark.timeout(120)
def test_a_hub_models_sizes_are_judged_by_its_headers_before_anything_reads_them(tmp_path, hub_env, monkeypatch):
    """A Hub model: pre-flight reads each shard's header with a ranged GET from the test Hub server and
    refuses 10^6 layers in seconds, a zero size from config.json alone; load_from_hf (folder_refusals)
    judges the files it downloaded the same."""
    from huggingface_hub import CommitOperationAdd, HfApi

    from tasks.core.preflight.model_info import read_model_info

    monkeypatch.setenv("HF_TOKEN", hub_env.token)
    api = HfApi(token=hub_env.token)
    for repo, field, value in (("org/layers", "num_hidden_layers", 10**6), ("org/zero", "hidden_size", 0)):
        folder = model_folder(tmp_path / repo, {**OLMO2, field: value})
        api.create_repo(repo, private=True, exist_ok=True)
        ops = [CommitOperationAdd(p.name, str(p)) for p in sorted(folder.iterdir())]
        api.create_commit(repo, ops, commit_message="upload")
        raw = tiny_config_raw(folder, tmp_path / "run")
        raw["base_model"]["uri"] = repo
        cfg = load_for_check(write_config(tmp_path / "c.yaml", raw))
        started = time.monotonic()
        report = preflight_report(cfg, machine=CPU2, token_present=True, model=read_model_info(repo))
        assert time.monotonic() - started < 15
        assert any(m.startswith(f"{repo}@main/config.json {field}={value:,}") for m in model_problems(report)), (
            report.problems
        )
        assert "Traceback" not in report.text()
        # load_from_hf, on the files the download put in base/: the same sentence, before any table
        refusals = folder_refusals(folder, json.loads((folder / "config.json").read_text()))
        assert any(f"config.json {field}={value:,}" in m for m in refusals), refusals


@pytest.mark.parametrize("base", [LLAMA, OLMO2], ids=["registered", "derived"])
def test_pickle_weights_bound_the_claims_by_their_bytes_never_unpickled(tmp_path, base):
    """Pickle weights list no shapes without unpickling: their bytes bound the claim (a registered
    family's exact count, layers x hidden for any family), so 10^6 layers over 4 KB are refused."""
    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({**base, "num_hidden_layers": 10**6}))
    (root / "pytorch_model.bin").write_bytes(b"never unpickled" + bytes(4096))
    started = time.monotonic()
    problems = model_problems(report_of(tmp_path, root, allow_pickle=True))
    assert time.monotonic() - started < 15
    want = (
        "describes a llama model of 2,592,002,064 parameters, more than its weight files' 4,111 bytes"
        if base is LLAMA
        else "num_hidden_layers=1,000,000 x hidden size 16 is more values than its weight files' 4,111 bytes"
    )
    assert any(m.startswith(f"{root}/config.json ") and want in m for m in problems), problems
    assert any(want in m for m in folder_refusals(root, {**base, "num_hidden_layers": 10**6}))  # load_from_hf's


def test_an_fsspec_folders_sizes_are_judged_by_its_headers(tmp_path):
    """An fsspec base model (memory:// here, s3:// in use): its headers are read through the filesystem's
    ranged reads, and 10^5 layers over 2 are refused in seconds."""
    import fsspec

    from tasks.core.preflight.model_info import read_model_info

    folder = model_folder(tmp_path / "model", {**LLAMA, "num_hidden_layers": 10**5})
    fs = fsspec.filesystem("memory")
    for p in folder.iterdir():
        fs.pipe(f"/claims-model/{p.name}", p.read_bytes())
    raw = tiny_config_raw(folder, tmp_path / "run")
    raw["base_model"]["uri"] = "memory://claims-model"
    cfg = load_for_check(write_config(tmp_path / "c.yaml", raw))
    info = read_model_info("memory://claims-model")
    assert info.source == "fsspec"
    started = time.monotonic()
    report = preflight_report(cfg, machine=CPU2, token_present=None, model=info)
    assert time.monotonic() - started < 15
    problems = model_problems(report)
    assert any(
        "config.json num_hidden_layers=100,000 claims more decoder layers than its weight files hold: 2 layers" in m
        for m in problems
    ), problems
    fs.rm("/claims-model", recursive=True)


# ---- what the weights are: floats of the model config.json describes -----------------------------


@pytest.mark.parametrize("dtype", ["I64", "F8_E4M3"])
def test_weights_that_are_not_trainable_floats_are_refused_naming_file_tensor_and_dtype(tmp_path, dtype):
    tensors = llama_tensors(LLAMA, dtype)
    tensors["model.position_ids"] = ("I64", (64,))  # a buffer some savers keep: not a weight
    model = model_folder(tmp_path / "model", LLAMA, tensors)
    problems = model_problems(report_of(tmp_path, model))
    want = f"{model}/model.safetensors holds weights in {dtype}: model.embed_tokens.weight ({dtype}), "
    found = [m for m in problems if m.startswith(want)]
    assert len(found) == 1, problems
    assert "and 18 more; the run trains from F32, BF16, F16, F64 weights" in found[0], found[0]
    assert ("quantized checkpoint" if dtype.startswith("F8") else "not floats") in found[0]
    assert "position_ids" not in found[0]
    assert found[0] in folder_refusals(model, LLAMA)  # load_from_hf's refusal of a Hub model's files


def test_float_weights_and_integer_buffers_pass():
    from tasks.core.models.claims import HeldWeights

    held = HeldWeights(
        {
            "model.embed_tokens.weight": ("BF16", (64, 16), "a.safetensors"),
            "model.norm.weight": ("F64", (16,), "a.safetensors"),
            "model.layers.0.self_attn.rotary_emb.inv_freq": ("F32", (4,), "a.safetensors"),
            "h.0.attn.bias": ("BOOL", (1, 1, 8, 8), "a.safetensors"),
        }
    )
    assert weight_dtype_problems(held, "/m") == []


def test_a_llama_config_over_another_familys_tensors_is_refused_naming_missing_and_extra_keys(tmp_path):
    from tasks.core.models.families import expected_tensors

    phi3 = {**LLAMA, "model_type": "phi3"}
    model = model_folder(tmp_path / "model", LLAMA, {k: ("F32", s) for k, s in expected_tensors(phi3).items()})
    report = report_of(tmp_path, model)
    (msg,) = [m for m in model_problems(report) if "the weight files" in m]
    assert msg.startswith(
        f"{model}: the weight files lack 10 of the 21 tensors config.json (llama) gives the model "
        "(model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.k_proj.weight, "
        "model.layers.0.self_attn.v_proj.weight and 7 more) and hold 4 tensors a llama model has no place for "
        "(model.layers.0.mlp.gate_up_proj.weight, model.layers.0.self_attn.qkv_proj.weight, "
        "model.layers.1.mlp.gate_up_proj.weight and 1 more); their decoder layers are those of a phi3 model "
        "(model_type 'phi3')"
    ), msg
    assert not any("every weight's shape is the one config.json gives it" in c for c in report.checked)


def test_extra_tensors_alone_and_a_missing_untied_head_are_refused_each_with_its_fix(tmp_path):
    extra = {**llama_tensors(LLAMA), "model.layers.0.mlp.extra.weight": ("F32", (16, 16))}
    (msg,) = [m for m in folder_refusals(model_folder(tmp_path / "a", LLAMA, extra), LLAMA) if "weight files" in m]
    assert "hold 1 tensors a llama model has no place for (model.layers.0.mlp.extra.weight)" in msg, msg
    assert "lack" not in msg and "drop the others unread" in msg
    headless = {k: v for k, v in llama_tensors(LLAMA).items() if k != "lm_head.weight"}
    (msg,) = [m for m in folder_refusals(model_folder(tmp_path / "b", LLAMA, headless), LLAMA) if "weight" in m]
    assert "lack 1 of the 21 tensors config.json (llama) gives the model (lm_head.weight)" in msg, msg
    assert msg.endswith(
        "set tie_word_embeddings: true in config.json if the model shares its input embedding with the output"
    )
    # the model whose tensors are config.json's passes; saved from the bare model (no 'model.' prefix) too
    ok = model_folder(tmp_path / "c", LLAMA)
    assert folder_refusals(ok, LLAMA) == []
    bare = {k.removeprefix("model."): v for k, v in llama_tensors(LLAMA).items()}
    assert folder_refusals(model_folder(tmp_path / "d", LLAMA, bare), LLAMA) == []


# ---- load_from_hf: what fails the same on every try is not retried ---------------------------------


def test_a_deterministic_load_error_fails_at_once_and_a_network_error_is_retried(tmp_path):
    """An I64 model past the header checks (as a folder refused nothing for): transformers fails to make a
    parameter of it; load_from_hf says so as a ConfigError naming the folder, which the retry condition
    declines. A dropped connection is retried."""
    import requests
    from prefect.states import Failed

    from tasks.core.config.load import load_config
    from tasks.core.errors import ConfigError
    from tasks.flowkit.retry import cannot_heal, transient
    from tasks.stages.load import _verified_logits

    model = model_folder(tmp_path / "model", LLAMA, llama_tensors(LLAMA, "I64"))
    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config_raw(model, tmp_path / "run")))
    with pytest.raises(ConfigError) as info:
        _verified_logits(cfg, model)
    msg = str(info.value)
    assert f"transformers cannot load the model from {model}" in msg and "not retried" in msg, msg
    assert "Only Tensors of floating point and complex dtype can require gradients" in msg, msg
    assert cannot_heal(info.value)  # the retry condition declines it
    assert transient(None, None, Failed(data=requests.ConnectionError("connection reset"))) is True
    assert transient(None, None, Failed(data=TimeoutError("read timed out"))) is True


# ---- trust_remote_code on a model_type transformers does not know: one consistent answer ---------


def test_trust_remote_code_on_an_unknown_model_type_says_one_thing(tmp_path):
    config = {**LLAMA, "model_type": "mystery_lm", "auto_map": {"AutoModelForCausalLM": "modeling_mystery.Mystery"}}
    model = model_folder(tmp_path / "model", config)
    (model / "modeling_mystery.py").write_text("raise SystemExit('never run')\n")
    report = report_of(tmp_path, model, trust_remote_code=True)
    (msg,) = [m for m in model_problems(report) if "mystery_lm" in m]
    assert "base_model.trust_remote_code: true does not change that" in msg and "is never run" in msg, msg
    assert not any("loads as transformers' own" in w for w in report.warnings), report.warnings
