"""The tokenizer's special tokens agree with the model before anything is trained (pre-flight), and the
prepared data records the ones it used.

    python -m pytest -q tests/test_special_tokens.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import tiny_config_raw, write_config


def _model(
    tiny_model_dir: Path,
    out: Path,
    tokenizer: dict | None = None,
    config: dict | None = None,
    generation: dict | None = None,
) -> Path:
    shutil.copytree(tiny_model_dir, out)
    template = (tokenizer or {}).get("chat_template")
    if template is not None and (out / "chat_template.jinja").is_file():
        # transformers >= 4.52 saves the template beside tokenizer_config.json, and the tokenizer reads it there first
        (out / "chat_template.jinja").write_text(template)
        tokenizer = {k: v for k, v in tokenizer.items() if k != "chat_template"}
    for name, change in (
        ("tokenizer_config.json", tokenizer),
        ("config.json", config),
        ("generation_config.json", generation),
    ):
        if change:
            (out / name).write_text(json.dumps({**json.loads((out / name).read_text()), **change}))
    return out


def _check(tmp_path: Path, model: Path, capsys) -> tuple[int, str]:
    from tasks.flowkit.preflight import run_check_cli

    code = run_check_cli(str(write_config(tmp_path / "c.yaml", tiny_config_raw(model, tmp_path / "run"))))
    return code, capsys.readouterr().out


def test_a_tokenizer_eos_the_model_does_not_end_documents_with_is_refused(tiny_model_dir, tmp_path, capsys):
    """Case 11: a converted tokenizer whose eos is <|im_start|> while config.json and
    generation_config.json say <|im_end|>: CPT would end every document with <|im_start|>."""
    from transformers import AutoTokenizer

    model = _model(
        tiny_model_dir,
        tmp_path / "converted",
        tokenizer={"eos_token": "<|im_start|>"},
        config={"eos_token_id": 4, "pad_token_id": 4},
        generation={"eos_token_id": 4, "pad_token_id": 4},
    )
    assert AutoTokenizer.from_pretrained(model).eos_token_id == 3  # what prepare_cpt would separate documents with
    code, out = _check(tmp_path, model, capsys)
    assert code == 1 and "nothing was launched" in out
    line = next(x for x in out.splitlines() if "the tokenizer's eos is" in x)
    for words in (
        "base_model.uri",
        "'<|im_start|>' (id 3)",
        f"{model}/tokenizer_config.json",
        "config.json eos_token_id 4 ('<|im_end|>')",
        "generation_config.json eos_token_id 4 ('<|im_end|>')",
        "set \"eos_token\": '<|im_end|>' in tokenizer_config.json",
    ):
        assert words in line, (words, line)


def test_a_template_that_ends_a_reply_with_no_special_token_is_refused(tiny_model_dir, tmp_path, capsys):
    template = (
        "{%- for message in messages -%}{{- message['role'] + ':\\n' + message['content'] + '\\n\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'assistant:\\n' -}}{%- endif -%}"
    )
    code, out = _check(
        tmp_path, _model(tiny_model_dir, tmp_path / "plain", tokenizer={"chat_template": template}), capsys
    )
    assert code == 1 and "closes an assistant turn with no special token" in out and "SFT" in out


def test_agreeing_tokens_are_shown_in_the_report_and_recorded_in_the_index(tiny_model_dir, tmp_path, capsys):
    from tasks.core.data.prepare import prepare

    code, out = _check(tmp_path, tiny_model_dir, capsys)
    assert code == 0, out
    assert (
        "special tokens: CPT document separator eos '<|end_of_text|>' (id 1) = config.json 1, generation_config.json "
        "[1, 4]; "
        "pad '<|pad|>' (id 2); bos '<|begin_of_text|>' (id 0); SFT end of turn '<|im_end|>' (id 4)"
    ) in out
    r = prepare(
        str(Path(__file__).parent.parent / "data/sample/sft.jsonl"),
        tiny_model_dir,
        tmp_path / "sft",
        kind="sft",
        field="messages",
        seq_len=128,
    )
    assert r.index["special_tokens"] == {
        "eos": {"id": 1, "token": "<|end_of_text|>"},
        "bos": {"id": 0, "token": "<|begin_of_text|>"},
        "pad": {"id": 2, "token": "<|pad|>"},
        "pad_is": "pad_token",
        "end_of_turn": [{"id": 4, "token": "<|im_end|>"}],
    }
