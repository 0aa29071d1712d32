"""Every model-folder shape a user brings from the Hub is run or refused before launch, naming the
file and the fix (tasks/core/models/shapes.py, tasks/core/preflight/model_shapes.py).

    .venv/bin/python -m pytest -q tests/test_model_shapes.py -m ""

Unit tier: pre-flight on tiny offline folders of each shape (a GGUF-only folder is a GGUF header
with no tensors: it is refused, never loaded; the multimodal ones are a tiny random LLaVA and Gemma 3 whose
fix, saving its `language_model`, is run and passes). Integration tier: the shapes that run
(sharded weights with their index, chat_template.jinja, several eos ids) go through
load_from_hf into base/ and through the export's build into export/, from a local folder and from
the test Hub server (where a GGUF-only repo is refused before anything is downloaded).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from tasks.core.models.demo import BOS, CHAT_TEMPLATE, EOS, IM_END, IM_START
from tasks.core.models.folder import SAFE_INDEX_NAME
from tasks.core.models.shapes import gguf_architecture, gguf_readable_architectures
from tasks.core.preflight.checks import load_for_check, preflight_report
from tests.conftest import tiny_config_raw, write_config
from tests.test_preflight import CPU2

pytest_plugins = ["tests.conftest_servers"]

# The template a chat_template.jinja carries: ChatML with a system line, so what rendered it shows.
JINJA = "{{- '<|im_start|>system\\nfrom chat_template.jinja<|im_end|>\\n' -}}" + CHAT_TEMPLATE


def _report(tmp: Path, model: Path):
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = load_for_check(write_config(tmp / "c.yaml", tiny_config_raw(model, tmp / "run")))
    return preflight_report(cfg, machine=CPU2, token_present=None)


def _problems(report) -> list[str]:
    return [msg for field, msg in report.problems if field == "base_model.uri"]


def _gguf(path: Path, arch: str) -> Path:
    """A GGUF v3 header with no tensors: a vocabulary array first (skipped by its lengths), then
    general.architecture. What a `*-GGUF` repo's file starts with."""

    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()

    vocab = b"".join(s(t) for t in ("<s>", "</s>", "hello"))
    kvs = s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + vocab
    kvs += s("general.architecture") + struct.pack("<I", 8) + s(arch)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + kvs + bytes(256))
    return path


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _edit_json(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data, indent=2))


# ---- GGUF-only: refused, naming the file and the offline conversion -------------------------


def test_the_gguf_header_is_read_for_its_architecture_and_a_malformed_one_is_none(tmp_path):
    assert gguf_architecture(_gguf(tmp_path / "a.gguf", "gemma3")) == "gemma3"
    (tmp_path / "b.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2**40) + struct.pack("<Q", 2**60))
    (tmp_path / "c.gguf").write_bytes(b"GGUF")
    assert gguf_architecture(tmp_path / "b.gguf") is None and gguf_architecture(tmp_path / "c.gguf") is None
    readable = gguf_readable_architectures()  # read from the installed transformers' source, not imported
    assert readable and "llama" in readable and "general" not in readable


def test_a_gguf_only_folder_is_refused_naming_the_file_and_the_conversion(tmp_path, tiny_model_dir):
    """The pip package's shape (a .gguf and nothing else) and a converted-halfway one (config and
    tokenizer, GGUF weights): both refused before launch, the second by the weight check."""
    bare = tmp_path / "gemma3-270m-gguf"
    bare.mkdir()
    _gguf(bare / "gemma-3-270m-it-Q4_K_M.gguf", "gemma3")
    problems = _problems(_report(tmp_path / "r1", bare))
    assert len(problems) == 1, problems
    (msg,) = problems
    assert f"{bare} holds GGUF weights only (gemma-3-270m-it-Q4_K_M.gguf)" in msg, msg
    assert "gguf_file='gemma-3-270m-it-Q4_K_M.gguf'" in msg and "then set base_model.uri to OUT" in msg
    if "gemma3" not in gguf_readable_architectures():  # the installed 4.51.3: its reader predates Gemma 3
        assert "'gemma3' (GGUF general.architecture), which the installed transformers" in msg, msg

    half = _copy(tiny_model_dir, tmp_path / "half")
    (half / "model.safetensors").unlink()
    _gguf(half / "model-q8_0.gguf", "llama")
    problems = _problems(_report(tmp_path / "r2", half))
    assert any(
        f"{half} holds GGUF weights only (model-q8_0.gguf)" in m
        and "Its architecture is 'llama' (GGUF general.architecture)." in m
        for m in problems
    ), problems


# ---- text_config: decided on the text model's family, refused with the way to save it alone ----


def _tiny_llava(tiny_model_dir: Path, out: Path) -> Path:
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    text = LlamaConfig.from_pretrained(tiny_model_dir)
    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=16
    )
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids(IM_START))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _save_text_model(m, out: Path) -> None:
    """The model lines of `save_text_model_recipe()`, as it says them for the installed transformers."""
    from transformers import AutoModelForCausalLM

    from tasks.core.models.shapes import save_text_model_recipe

    if "m.language_model.save_pretrained(OUT)" in save_text_model_recipe():
        m.language_model.save_pretrained(out)
        return
    lm = AutoModelForCausalLM.from_config(m.config.text_config, dtype=m.dtype)
    lm.model.load_state_dict(m.language_model.state_dict())
    lm.lm_head.load_state_dict(m.lm_head.state_dict())
    lm.save_pretrained(out)


def test_a_multimodal_checkpoint_is_refused_naming_its_text_model_and_the_fix_runs(tmp_path, tiny_model_dir):
    llava = _tiny_llava(tiny_model_dir, tmp_path / "llava")
    report = _report(tmp_path / "r1", llava)
    msgs = [m for m in _problems(report) if "text_config" in m]
    assert len(msgs) == 1, report.text()
    assert (
        f"{llava}/config.json is a multimodal checkpoint (model_type 'llava', architectures "
        "LlavaForConditionalGeneration) whose text model is in text_config (model_type 'llama')" in msgs[0]
    )
    # The fix the message gives, run as written: the text model alone passes pre-flight.
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from tasks.core.models.shapes import save_text_model_recipe

    out = tmp_path / "llava-text"
    m = AutoModelForImageTextToText.from_pretrained(llava, dtype="auto")
    _save_text_model(m, out)
    AutoTokenizer.from_pretrained(llava).save_pretrained(out)
    assert save_text_model_recipe() in msgs[0]
    fixed = _report(tmp_path / "r2", out)
    assert not fixed.problems, fixed.text()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def test_gemma_3_multimodal_is_judged_on_gemma3_text_and_the_fix_saves_that_model(tmp_path):
    """Gemma 3 4B's shape (model_type gemma3, its text model gemma3_text in text_config), tiny and
    random: refused naming gemma3_text; the fix gives a folder whose config.json is gemma3_text,
    which plain transformers loads as a causal LM with the multimodal model's text weights."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    from support.tiny import tiny_tokenizer
    from tasks.core.models.shapes import save_text_model_recipe, text_config_refusal

    text = Gemma3TextConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=16,
    )
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=16
    )
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Gemma3ForConditionalGeneration(config).eval().save_pretrained(tmp_path / "gemma3")
    tiny_tokenizer().save_pretrained(tmp_path / "gemma3")
    raw = json.loads((tmp_path / "gemma3" / "config.json").read_text())
    msg = text_config_refusal(str(tmp_path / "gemma3"), raw)
    assert "(model_type 'gemma3', architectures Gemma3ForConditionalGeneration)" in msg
    assert "whose text model is in text_config (model_type 'gemma3_text')" in msg, msg
    assert msg in _problems(_report(tmp_path / "r1", tmp_path / "gemma3"))  # pre-flight refuses it so
    # the recipe the refusal gives (what it runs differs before and after transformers 4.52), step by step
    recipe = save_text_model_recipe()
    assert recipe in msg
    m = AutoModelForImageTextToText.from_pretrained(tmp_path / "gemma3", dtype="auto")
    _save_text_model(m, tmp_path / "out")
    AutoTokenizer.from_pretrained(tmp_path / "gemma3").save_pretrained(tmp_path / "out")
    fixed = _report(tmp_path / "r2", tmp_path / "out")  # the text model: its folder's shape and family pass
    assert not _problems(fixed) and any(c.startswith("model family gemma3_text") for c in fixed.checked), fixed.text()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "gemma3_text"
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(lm).__name__ == "Gemma3ForCausalLM"
    # transformers 4.51's language_model is a Gemma3ForCausalLM, later ones' its Gemma3TextModel
    text_model = getattr(m.language_model, "model", m.language_model)
    assert torch.equal(lm.model.embed_tokens.weight, text_model.embed_tokens.weight)
    assert torch.equal(lm.model.layers[1].mlp.down_proj.weight, text_model.layers[1].mlp.down_proj.weight)


# ---- broken shapes of the ones that run -----------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The tiny model in 40 KB shards with their index, its template in chat_template.jinja alone
    (tokenizer_config.json has none), several eos ids in config.json and generation_config.json."""
    from transformers import AutoTokenizer

    from support.tiny import tiny_model

    out = tiny_model(tmp_path_factory.mktemp("shapes") / "sharded", max_shard_size="40KB")
    tok = AutoTokenizer.from_pretrained(out)
    eos, im_start, im_end = (tok.convert_tokens_to_ids(t) for t in (EOS, IM_START, IM_END))
    config = json.loads((out / "tokenizer_config.json").read_text())
    # the template moves out of the config (transformers >= 4.52 saved it in chat_template.jinja already)
    assert (config.pop("chat_template", None) or (out / "chat_template.jinja").read_text()) == CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").write_text(JINJA)
    _edit_json(out / "config.json", eos_token_id=[eos, im_end])  # Llama 3.1's shape: several, in both files
    _edit_json(out / "generation_config.json", eos_token_id=[eos, im_start])
    return {"dir": out, "eos": [eos, im_start], "im_end": im_end, "bos": tok.convert_tokens_to_ids(BOS)}


def test_the_shapes_that_run_pass_preflight_and_it_says_so(tmp_path, sharded):
    model = sharded["dir"]
    assert len(json.loads((model / SAFE_INDEX_NAME).read_text())["weight_map"]) > 1
    report = _report(tmp_path, model)
    assert not report.problems, report.text()
    (line,) = [c for c in report.checked if c.startswith("base model folder:")]
    for words in (
        "weights sharded as model.safetensors.index.json names them, every shard present",
        "several eos ids in config.json and generation_config.json, kept by the export",
        "chat template: chat_template.jinja (the tokenizer reads it over tokenizer_config.json's",
    ):
        assert words in line, line
    from transformers import AutoTokenizer  # the installed transformers reads the file, as pre-flight says

    assert AutoTokenizer.from_pretrained(model).chat_template == JINJA


def test_an_index_naming_a_missing_shard_and_an_eos_outside_the_vocabulary_are_refused(tmp_path, sharded):
    model = _copy(sharded["dir"], tmp_path / "model")
    shard = max(model.glob("model-*.safetensors"))
    shard.unlink()
    _edit_json(model / "generation_config.json", eos_token_id=[sharded["eos"][0], 70000])
    problems = _problems(_report(tmp_path, model))
    assert any(
        f"{model / SAFE_INDEX_NAME} names shard(s) the folder lacks: {shard.name}; download the missing shard(s)" in m
        for m in problems
    ), problems
    assert any(
        f"{model}/generation_config.json eos_token_id [{sharded['eos'][0]}, 70000]: 70000 is no token id of the "
        "vocabulary" in m
        for m in problems
    ), problems


def test_a_weight_whose_shape_disagrees_with_config_json_is_refused_naming_file_tensor_shapes_and_fix(
    tmp_path, tiny_model_dir
):
    """A norm one value too wide and an embedding with padded vocabulary rows: every safetensors header and
    extent is sound, so only the shapes against config.json's tensor table show it, before launch; load_from_hf
    refuses the same (a Hub model's weights are first read there) with a ConfigError, which is not retried."""
    import torch
    from safetensors.torch import load_file, save_file

    from tasks.core.errors import ConfigError
    from tasks.core.models.shapes import folder_refusals
    from tasks.flowkit.retry import cannot_heal

    model = _copy(tiny_model_dir, tmp_path / "model")
    weights = model / "model.safetensors"
    state = load_file(weights)
    norm, embed = state["model.norm.weight"], state["model.embed_tokens.weight"]
    state["model.norm.weight"] = torch.ones(norm.shape[0] + 1)
    state["model.embed_tokens.weight"] = torch.zeros(embed.shape[0] + 64, embed.shape[1])
    save_file(state, weights, metadata={"format": "pt"})
    problems = [m for m in _problems(_report(tmp_path, model)) if str(weights) in m]
    assert len(problems) == 1, problems  # one sentence for the file, naming both tensors
    (msg,) = problems
    assert f"model.norm.weight is [{norm.shape[0] + 1}] where config.json makes it [{norm.shape[0]}]" in msg, msg
    assert f"model.embed_tokens.weight is [{embed.shape[0] + 64}, {embed.shape[1]}] where config.json makes it " in msg
    assert "padded vocabulary rows: 64 rows beyond vocab_size" in msg, msg
    assert msg.endswith("or point base_model.uri at the folder whose config.json (llama) these weights were saved with")
    config = json.loads((model / "config.json").read_text())
    assert msg in folder_refusals(model, config)  # load_from_hf's refusal: a ConfigError, never retried
    assert cannot_heal(ConfigError([("base_model.uri", msg)]))
    assert not [m for m in _problems(_report(tmp_path / "ok", tiny_model_dir)) if "tensor" in m]


def test_a_processors_chat_template_json_is_named_since_no_tokenizer_reads_it(tmp_path, sharded):
    from transformers import AutoTokenizer

    model = _copy(sharded["dir"], tmp_path / "model")
    (model / "chat_template.jinja").rename(tmp_path / "kept.jinja")
    (model / "chat_template.json").write_text(json.dumps({"chat_template": JINJA}))
    assert AutoTokenizer.from_pretrained(model).chat_template is None  # the installed transformers ignores it
    report = _report(tmp_path, model)
    assert any(
        "chat_template.json is a processor's file the tokenizer never reads (SFT finds no chat template)" in w
        and 'write its "chat_template" string to chat_template.jinja' in w
        for w in report.warnings
    ), report.warnings
    assert any("has no chat_template" in m for m in _problems(report)), report.text()

    # Both a chat_template.jinja and a different template in tokenizer_config.json: the file wins, said.
    (tmp_path / "kept.jinja").rename(model / "chat_template.jinja")
    (model / "chat_template.json").unlink()
    _edit_json(model / "tokenizer_config.json", chat_template=CHAT_TEMPLATE)
    report = _report(tmp_path / "both", model)
    assert not _problems(report), report.text()
    assert any(
        "chat_template.jinja and tokenizer_config.json's chat_template differ; the tokenizer uses chat_template.jinja"
        in w
        for w in report.warnings
    ), report.warnings
    assert AutoTokenizer.from_pretrained(model).chat_template == JINJA


# ---- the shapes that run, through load_from_hf and the export ------------------------------


@pytest.mark.integration
def test_sharded_weights_a_jinja_template_and_several_eos_ids_run_through_load_and_export(
    prefect_harness, tmp_path, sharded
):
    """base/ keeps the index, every shard and chat_template.jinja (the manifest lists them, the
    logits fingerprint was taken through the index); the export built from it keeps the jinja
    template and both base eos ids, adding the template's end of turn."""
    from transformers import AutoTokenizer

    from tasks.core.config.load import load_config
    from tasks.core.run.manifest import verify_artifact
    from tasks.stages.load import load_from_hf
    from tests.test_export import _checkpoint, _export

    model = sharded["dir"]
    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config_raw(model, tmp_path / "run")))
    state = load_from_hf(cfg, return_state=True)
    assert state.is_completed(), state.message
    base = tmp_path / "run" / "base"
    manifest = verify_artifact(base)
    shards = sorted(p.name for p in model.glob("model-*.safetensors"))
    assert manifest["meta"]["weights"] == shards and len(shards) > 1
    for name in (SAFE_INDEX_NAME, "chat_template.jinja", *shards):
        assert name in manifest["files"], name
    assert "left_out" not in manifest["meta"]
    assert AutoTokenizer.from_pretrained(base).chat_template == JINJA

    export = _export(tmp_path, base, _checkpoint(tmp_path, base), "export", "40KB")
    assert (export / SAFE_INDEX_NAME).is_file() and (export / "chat_template.jinja").read_text() == JINJA
    tok = AutoTokenizer.from_pretrained(export)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nfrom chat_template.jinja<|im_end|>\n"), rendered
    stop = json.loads((export / ".cpt-to-sft" / "verification.json").read_text())["stop_tokens"]
    assert stop["base_eos_token_id"] == sharded["eos"], stop
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == [
        *sharded["eos"],
        sharded["im_end"],
    ]


def _push(api, repo: str, folder: Path) -> None:
    from huggingface_hub import CommitOperationAdd

    api.create_repo(repo, private=True, exist_ok=True)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    ops = [CommitOperationAdd(p.relative_to(folder).as_posix(), str(p)) for p in files]
    api.create_commit(repo, ops, commit_message="upload")


@pytest.mark.integration
def test_hub_repos_of_each_shape_are_run_or_refused_before_launch(
    hub_env, prefect_harness, tmp_path, sharded, monkeypatch
):
    """From the Hub: a GGUF-only repo (no config.json) is refused when pre-flight reads it, naming
    the file and the conversion; a multimodal one on its text model; the sharded repo with its
    jinja template and several eos ids downloads whole (index, every shard, the template) into base/;
    the same repo with its second shard gone is refused by load_from_hf, naming the index."""
    from huggingface_hub import CommitOperationDelete, HfApi

    from tasks.core.config.load import load_config
    from tasks.core.errors import ConfigError
    from tasks.core.preflight.model_info import read_model_info
    from tasks.stages.load import load_from_hf

    monkeypatch.setenv("HF_TOKEN", hub_env.token)
    api = HfApi(token=hub_env.token)
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    _gguf(gguf / "gemma-3-270m-it-Q4_K_M.gguf", "gemma3")
    (gguf / "README.md").write_text("a GGUF export\n")
    _push(api, "org/gemma-3-270m-gguf", gguf)
    with pytest.raises(ConfigError) as info:
        read_model_info("org/gemma-3-270m-gguf")
    assert "org/gemma-3-270m-gguf@main holds GGUF weights only (gemma-3-270m-it-Q4_K_M.gguf)" in str(
        info.value
    ) and "gguf_file='gemma-3-270m-it-Q4_K_M.gguf'" in str(info.value), info.value

    mm = tmp_path / "mm"
    mm.mkdir()
    (mm / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gemma3",
                "architectures": ["Gemma3ForConditionalGeneration"],
                "text_config": {"model_type": "gemma3_text"},
            }
        )
    )
    _push(api, "org/gemma-3-4b-it", mm)
    info = read_model_info("org/gemma-3-4b-it")
    raw = tiny_config_raw(sharded["dir"], tmp_path / "r")
    raw["base_model"]["uri"] = "org/gemma-3-4b-it"
    cfg = load_for_check(write_config(tmp_path / "mm.yaml", raw))
    problems = _problems(preflight_report(cfg, machine=CPU2, token_present=True, model=info))
    assert any("whose text model is in text_config (model_type 'gemma3_text')" in m for m in problems), problems

    _push(api, "org/sharded", sharded["dir"])
    raw = tiny_config_raw(sharded["dir"], tmp_path / "run")
    raw["base_model"]["uri"] = "org/sharded"
    state = load_from_hf(load_config(write_config(tmp_path / "c.yaml", raw)), return_state=True)
    assert state.is_completed(), state.message
    base = tmp_path / "run" / "base"
    for p in sharded["dir"].iterdir():
        assert (base / p.name).read_bytes() == p.read_bytes(), p.name  # the index, every shard, chat_template.jinja
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(base).chat_template == JINJA

    shards = sorted(p.name for p in sharded["dir"].glob("model-*.safetensors"))
    api.create_commit("org/sharded", [CommitOperationDelete(shards[-1])], commit_message="lose a shard")
    raw["run_root"] = str(tmp_path / "run2")
    state = load_from_hf(load_config(write_config(tmp_path / "c2.yaml", raw)), return_state=True)
    assert state.is_failed() and state.name == "Failed", state.name  # refused, not retried
    assert f"names shard(s) the folder lacks: {shards[-1]}" in state.message, state.message
