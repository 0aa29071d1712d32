"""Untrusted input is parsed and rendered under bounds: YAML aliases, chat templates, safetensors
headers, and a model folder's `auto_map`. Each input here would take hours, or
run code, without its bound; the tests' timeouts are seconds.

    .venv/bin/python -m pytest -q tests/test_untrusted_bounds.py
"""

from __future__ import annotations

import time

import pytest

from tasks.core.config.bounded_yaml import load_bounded
from tasks.core.config.load import read_raw_config
from tasks.core.errors import ConfigError


def alias_bomb(levels: int, fanout: int = 10) -> str:
    """~60 bytes a level; `levels` nested aliases expand to fanout**levels values."""
    lines = ["a0: &a0 [" + ", ".join(["x"] * fanout) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fanout) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def merge_bomb(levels: int, fanout: int = 10) -> str:
    """The same through merge keys, which PyYAML's constructor flattens into copies."""
    text = "m0: &m0 {x: 1, y: 2}\n"
    for i in range(1, levels + 1):
        text += f"m{i}: &m{i}\n  <<: [" + ", ".join([f"*m{i - 1}"] * fanout) + "]\n"
    return text


@pytest.mark.timeout(30)
def test_nested_yaml_aliases_are_refused_before_they_expand(tmp_path, capsys):
    from tasks.flowkit.preflight import run_check_cli

    path = tmp_path / "bomb.yaml"
    path.write_text("name: x\n" + alias_bomb(9))  # 1e9 values: hours for the old duplicate-key scan
    assert path.stat().st_size < 1024
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        read_raw_config(path)
    assert time.monotonic() - start < 5
    assert str(path) in str(info.value) and "more than 100,000 values once its aliases are expanded" in str(info.value)
    assert run_check_cli(str(path)) == 1  # --check: the refusal, no hang, no traceback
    out = capsys.readouterr()
    assert str(path) in out.out and "once its aliases are expanded" in out.out and "Traceback" not in out.out + out.err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "text, why",
    [
        (merge_bomb(9), "values once its aliases are expanded"),
        ("a: &a [1, *a]\n", "refers to a node that contains it"),
        ("a: " + "[" * 1000 + "]" * 1000 + "\n", "nested too deeply"),
        ("a: " + "[" * 70 + "]" * 70 + "\n", "nested more than 64 levels"),
        ("a: '" + "x" * (1 << 20) + "'\n", "over the 1,048,576 a YAML file here may hold"),
    ],
    ids=["merge-keys", "recursive-alias", "deep-nesting", "nesting-over-the-bound", "size"],
)
def test_yaml_bounds_name_the_file(text, why):
    with pytest.raises(ConfigError) as info:
        load_bounded(text, "/cfg/run.yaml")
    assert "/cfg/run.yaml" in str(info.value) and why in str(info.value)


def test_set_values_are_bounded_too():
    from flows.cli import parse_sets

    with pytest.raises(ConfigError) as info:
        parse_sets(["cpt.data.uri=" + "{" + alias_bomb(9).replace("\n", ", ").rstrip(", ") + "}"])
    assert "--set cpt.data.uri" in str(info.value) and "once its aliases are expanded" in str(info.value)


def test_aliases_within_the_bound_load_as_before():
    assert load_bounded(alias_bomb(3), "ok.yaml")["a3"][0][0][0][0] == "x"  # 1,111 values: fine
    assert load_bounded("b: &b {x: 1}\no:\n  <<: *b\n  y: 2\n", "ok.yaml") == {"b": {"x": 1}, "o": {"x": 1, "y": 2}}


# -- chat templates ------------------------------------------------------------------------------

NESTED_LOOPS = (  # 1e10 iterations: hours for an unmetered sandbox (it caps one range, not their product)
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)


def _globals_template(marker) -> str:
    return (
        "{{ lipsum.__globals__['os'].popen('touch " + str(marker) + "').read() }}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )


def _model_with_template(tiny_model_dir, out, template: str, jinja_file: bool = False):
    import json
    import shutil

    shutil.copytree(tiny_model_dir, out)
    if jinja_file:
        (out / "chat_template.jinja").write_text(template)
    else:  # the layout transformers < 4.52 saves: no chat_template.jinja (which the tokenizer would read first)
        (out / "chat_template.jinja").unlink(missing_ok=True)
        path = out / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template}))
    return out


def _check(tmp_path, model, capsys) -> tuple[int, str]:
    from tasks.flowkit.preflight import run_check_cli
    from tests.conftest import tiny_config_raw, write_config

    code = run_check_cli(str(write_config(tmp_path / "c.yaml", tiny_config_raw(model, tmp_path / "run"))))
    return code, capsys.readouterr().out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("jinja_file", [False, True], ids=["tokenizer_config.json", "chat_template.jinja"])
def test_a_template_with_nested_loops_is_refused_by_preflight_naming_its_file(
    tiny_model_dir, tmp_path, capsys, jinja_file
):
    model = _model_with_template(tiny_model_dir, tmp_path / "m", NESTED_LOOPS, jinja_file)
    start = time.monotonic()
    code, out = _check(tmp_path, model, capsys)
    assert time.monotonic() - start < 60
    name = "chat_template.jinja" if jinja_file else "tokenizer_config.json"
    line = next(x for x in out.splitlines() if "the chat template cannot be rendered" in x)
    assert code == 1 and f"{model}/{name}" in line and "steps (loop items and calls)" in line, out


@pytest.mark.timeout(120)
def test_a_template_reaching_for_globals_is_refused_by_preflight_and_runs_nothing(tiny_model_dir, tmp_path, capsys):
    marker = tmp_path / "marker"
    model = _model_with_template(tiny_model_dir, tmp_path / "m", _globals_template(marker))
    code, out = _check(tmp_path, model, capsys)
    line = next(x for x in out.splitlines() if "the chat template cannot be rendered" in x)
    assert code == 1 and f"{model}/tokenizer_config.json" in line and "__globals__" in line, out
    assert not marker.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["loops", "globals"])
def test_preparation_renders_under_the_same_bounds_and_names_the_file(tiny_model_dir, tmp_path, kind):
    """prepare_sft's path (the ChatEncoder's encode_chat): the template's error, naming the file,
    fails the stage (never a rejected record), in seconds, and nothing it asked for runs."""
    from tasks.core.data.chat_template import ChatTemplateError
    from tasks.core.data.prepare import prepare

    marker = tmp_path / "marker"
    template = NESTED_LOOPS if kind == "loops" else _globals_template(marker)
    model = _model_with_template(tiny_model_dir, tmp_path / "m", template)
    with pytest.raises(ChatTemplateError) as info:
        prepare(
            str(__import__("pathlib").Path(__file__).parent.parent / "data/sample/sft.jsonl"),
            model,
            tmp_path / "sft",
            kind="sft",
            field="messages",
            seq_len=128,
        )
    assert str(model / "tokenizer_config.json") in str(info.value)
    assert ("steps" if kind == "loops" else "__globals__") in str(info.value)
    assert not marker.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "template, why",
    [
        ("{{ 'x' * 1000000000 }}", "a repetition of 1,000,000,000 characters"),
        ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "~"),
        ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}", "steps"),
        ("{% for a in range(100000) recursive %}{{ loop(range(100000)) if loop.depth < 3 }}{% endfor %}", "steps"),
        ("{% macro f() %}{% for i in range(99999) %}{{ 'y' * 99 }}AAAA{% endfor %}{% endmacro %}{{ f() }}", "wrote"),
        ("{{ 'x'|center(10000000000) }}", "center() to a width"),
        ("{{ ('x' * 100000).replace('x', 'x' * 100000) }}", "replace() making"),
        ("{{ '{:>999999999999}'.format(1) }}", "a format width"),
        ("{{ '%0999999999999d' % 1 }}", "a format width"),
        (
            "{% set a = ['x' * 500] * 1000 %}{% set b = [a] * 1000 %}{{ b|tojson|length }}",
            "a repetition of 501,001,000",
        ),
        ("{{ ('\t' * 1000).expandtabs(100000) }}", "expandtabs() to a width"),
    ],
    ids=[
        "repeat",
        "concat-doubling",
        "macro-recursion",
        "recursive-loop",
        "output",
        "pad",
        "replace",
        "format",
        "%",
        "nested-repeat",
        "tabs",
    ],
)
def test_template_budgets_stop_each_way_of_multiplying_work(template, why):
    from tasks.core.data.chat_template import ChatTemplateError, render

    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        render(template, {"messages": [{"role": "user", "content": "hi"}]}, "/m/tokenizer_config.json")
    assert time.monotonic() - start < 20
    assert info.value.kind == "budget" and why in info.value.reason and "/m/tokenizer_config.json" in str(info.value)


def test_the_metered_renderer_writes_what_transformers_writes(tiny_model_dir):
    """Same text as apply_chat_template for the demo template, with and without the generation
    prompt, and for the `{% generation %}` tag transformers adds."""
    from transformers import AutoTokenizer

    from tasks.core.data.chat_template import render_with_tokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ping"},
        {"role": "assistant", "content": "pong"},
    ]
    for gen in (False, True):
        assert render_with_tokenizer(tok, msgs, gen) == tok.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen
        )
    tok.chat_template = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert (
        render_with_tokenizer(tok, msgs, False) == tok.apply_chat_template(msgs, tokenize=False) == "be briefpingpong"
    )


# -- safetensors headers -------------------------------------------------------------------------


def _header(tensors: dict, data: bytes = b"", length: int | None = None) -> bytes:
    import json

    blob = json.dumps(tensors).encode()
    return (len(blob) if length is None else length).to_bytes(8, "little") + blob + data


@pytest.mark.parametrize(
    "blob, why",
    [
        (_header({}, length=1 << 40), "claims a 1,099,511,627,776-byte header (header too large"),
        (_header({}, length=4096), "claims a 4,096-byte header but holds"),
        (b"\x01\x00", "too short for a safetensors file"),
        (b"\x04" + b"\x00" * 7 + b"{{{{", "header that is not JSON"),
        (_header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\x00" * 8), "at bytes 0-16"),
        (_header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\x00" * 8), "need 16"),
        (_header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\x00" * 8), "4 bytes after"),
        (_header({"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\x00"), "without a known dtype"),
        (
            _header(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                },
                b"\x00" * 12,
            ),
            "overlapping",
        ),
    ],
    ids=["2^40", "past-the-end", "short", "not-json", "range-out", "dtype-shape", "tail", "dtype", "overlap"],
)
def test_a_safetensors_header_is_bounded_and_checked_against_the_file(tmp_path, blob, why):
    from tasks.core.models.folder import safetensors_problem

    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    assert why in (safetensors_problem(path) or ""), safetensors_problem(path)


def test_real_safetensors_files_pass(tiny_model_dir):
    from tasks.core.models.folder import safetensors_problems

    assert safetensors_problems(tiny_model_dir) == {}


@pytest.mark.timeout(120)
def test_preflight_refuses_a_safetensors_header_claiming_2_40_bytes_naming_the_file(tiny_model_dir, tmp_path, capsys):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes(_header({}, length=1 << 40))
    code, out = _check(tmp_path, model, capsys)
    line = next(x for x in out.splitlines() if "header too large" in x)
    assert code == 1 and f"{model}/model.safetensors claims a 1,099,511,627,776-byte header" in line, out


# -- a model folder's code: auto_map and .py files -------------------------------------------------


def _model_with_code(tiny_model_dir, out, marker, nested: bool = True):
    """The tiny model naming its own code: a tokenizer auto_map with the .py beside it (which would
    write `marker` when imported), and an auto_map nested in config.json's text_config or at its top."""
    import json
    import shutil

    shutil.copytree(tiny_model_dir, out)
    (out / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    c = json.loads((out / "config.json").read_text())
    where = c.setdefault("text_config", {}) if nested else c
    where["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (out / "config.json").write_text(json.dumps(c))
    return out


@pytest.mark.timeout(120)
def test_preflight_refuses_an_auto_map_anywhere_in_the_configs_naming_each(tiny_model_dir, tmp_path, capsys):
    marker = tmp_path / "marker"
    model = _model_with_code(tiny_model_dir, tmp_path / "m", marker)
    code, out = _check(tmp_path, model, capsys)
    line = next(x for x in out.splitlines() if "names its own Python code" in x)
    assert code == 1 and "base_model.trust_remote_code" in line, out
    for words in ("config.json text_config.auto_map", "tokenizer_config.json auto_map", "tokenization_evil.py"):
        assert words in line, (words, line)
    assert not marker.exists()


def test_a_folders_code_is_never_copied_and_its_auto_map_is_removed(tiny_model_dir, tmp_path):
    """load_from_hf's copy of a local model and its clean-up (`_copy_path`, `strip_auto_map`), then
    the tokenizer copy every later folder (cpt/hf/, export/) is made with."""
    import json

    from transformers import AutoTokenizer

    from tasks.core.config.load import load_config
    from tasks.core.models.folder import auto_map_entries, folder_problems, strip_auto_map
    from tasks.core.models.hf_artifact import copy_tokenizer
    from tasks.stages.load import _copy_path
    from tests.conftest import tiny_config_raw, write_config

    marker = tmp_path / "marker"
    model = _model_with_code(tiny_model_dir, tmp_path / "m", marker)
    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config_raw(model, tmp_path / "run")))
    base = tmp_path / "base"
    base.mkdir()
    meta = _copy_path(cfg, base)
    assert not list(base.rglob("*.py")) and "tokenization_evil.py" in meta["left_out"]
    assert strip_auto_map(base) == ["config.json text_config.auto_map", "tokenizer_config.json auto_map"]
    assert auto_map_entries(base) == [] and json.loads((base / "config.json").read_text())["text_config"] == {}
    AutoTokenizer.from_pretrained(base, trust_remote_code=True)  # loads as its own class: nothing to import
    # The model-folder rule (export before its manifest, the push, verify) refuses code that slipped in.
    assert any("tokenizer_config.json auto_map" in p for p in folder_problems(model))
    assert any("tokenization_evil.py: Python code" in p for p in folder_problems(model))
    # The tokenizer copy into cpt/hf/ and export/ never takes a .py, even one named like a tokenizer file.
    (model / "tokenizer_evil.py").write_text("raise SystemExit\n")
    out = tmp_path / "export"
    out.mkdir()
    assert not [n for n in copy_tokenizer(model, out) if n.endswith(".py")] and not list(out.glob("*.py"))
    assert not marker.exists()


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_load_from_hf_carries_no_code_into_base(prefect_harness, tiny_model_dir, tmp_path):
    """With trust_remote_code (the model accepted as its native class): the real load stage leaves
    the .py out of base/ and removes every auto_map with a line in its manifest; nothing runs."""
    import json

    from tasks.core.config.load import load_config
    from tasks.stages.load import load_from_hf
    from tests.conftest import tiny_config_raw, write_config

    marker = tmp_path / "marker"
    model = _model_with_code(tiny_model_dir, tmp_path / "m", marker, nested=False)
    raw = tiny_config_raw(model, tmp_path / "run")
    raw["base_model"]["trust_remote_code"] = True
    cfg = load_config(write_config(tmp_path / "c.yaml", raw))
    result = load_from_hf(cfg)
    base = tmp_path / "run" / "base"
    manifest = json.loads((base / ".cpt-to-sft" / "manifest.json").read_text())
    assert not list(base.rglob("*.py")) and "tokenization_evil.py" in manifest["meta"]["left_out"], result
    assert manifest["meta"]["removed_auto_map"] == ["config.json auto_map", "tokenizer_config.json auto_map"]
    assert "auto_map" not in (base / "config.json").read_text() + (base / "tokenizer_config.json").read_text()
    assert not marker.exists()


def test_a_config_transformers_trips_on_is_not_retried():
    """A text_config section Llama has no sub-config for (the AttributeError of GenerationConfig's
    `to_dict` on a dict) is the same on every try: load_from_hf does not retry it."""
    from tasks.flowkit.retry import cannot_heal

    assert cannot_heal(AttributeError("'dict' object has no attribute 'to_dict'"))
    assert cannot_heal(TypeError("unsupported operand"))
    assert not cannot_heal(ConnectionError("reset by peer"))


@pytest.mark.timeout(300)
def test_an_export_from_a_base_that_still_names_code_carries_none(tiny_model_dir, tmp_path):
    """A base/ made before load_from_hf removed auto_map (or any source folder): build_hf_dir, which
    makes cpt/hf/ and export/, copies no .py and removes every auto_map, saying so in its record."""
    import json
    import shutil

    from tasks.core.config.outputs import ExportConfig
    from tasks.core.models.fingerprint import hf_dir_logits, save_fingerprint
    from tasks.core.models.folder import auto_map_entries, folder_problems
    from tasks.core.models.hf_artifact import build_hf_dir

    marker = tmp_path / "marker"
    base = _model_with_code(tiny_model_dir, tmp_path / "base", marker, nested=False)
    (base / "tokenizer_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    ckpt = tmp_path / "ckpt"
    (ckpt / "model").mkdir(parents=True)
    shutil.copy2(base / "model.safetensors", ckpt / "model" / "model.safetensors")
    shutil.copy2(tiny_model_dir / "config.json", ckpt / "model" / "config.json")
    save_fingerprint(hf_dir_logits(tiny_model_dir, dtype="fp32"), ckpt, "fp32")
    dst = tmp_path / "export"
    dst.mkdir()
    built = build_hf_dir(ckpt, dst, base, ExportConfig(dtype="fp32"), weights_dtype="fp32")
    assert built["verification"]["removed_auto_map"] == ["config.json auto_map", "tokenizer_config.json auto_map"]
    assert auto_map_entries(dst) == [] and not list(dst.glob("*.py")) and folder_problems(dst) == []
    assert "auto_map" not in json.dumps(built["verification"]["tokenizer_files"])
    assert not marker.exists()
