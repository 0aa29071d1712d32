"""What particular pages promise: the data-formats page's records are read by the real reader and
pass pre-flight, the extending page names tests that exist, the examples page lists every example,
the site is in its four sections, and every page's paragraphs fit a screen.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/test_docs_pages.py

Cheap: no launch; the headless-browser look at the built site is tests/test_docs_screen.py.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import yaml

from tasks.core.data.pairs import read_pair
from tasks.core.data.records import read_records, text_problem
from tasks.core.data.samples import validate_messages
from tasks.core.preflight.checks import load_for_check, preflight_report
from tests.test_docs import CPU_NODE, DOCS, REPO, blocks, minimal_config


def test_data_formats_records_are_read_by_the_reader_and_pass_preflight(tiny_model_dir, tmp_path):
    page = DOCS / "data-formats.md"
    jsonl, txt = blocks(page, ("jsonl",)), blocks(page, ("txt",))
    assert len(jsonl) == 3 and len(txt) == 1, "data-formats.md: a text block, a chat block, a pair block and a .txt"
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text(jsonl.pop())
    pairs = [read_pair(r) for r in read_records(str(pairs_file))]  # every layout, read to one pair
    assert len(pairs) == 4 and all(p.chosen != p.rejected and p.prompt[-1]["role"] == "user" for p in pairs)
    files = {"text": tmp_path / "text.jsonl", "chat": tmp_path / "chat.jsonl", "txt": tmp_path / "plain.txt"}
    for path, block in zip(files.values(), [*jsonl, *txt], strict=True):
        path.write_text(block)
    text, chat, plain = (read_records(str(p)) for p in files.values())
    assert text == [json.loads(line) for line in jsonl[0].splitlines()]
    assert all(text_problem(r, "text") is None for r in text)
    assert all("messages" not in r for r in text) and all(set(r) == {"messages"} for r in chat)
    for rec in chat:
        validate_messages(rec["messages"])
    assert [json.loads(b) for b in blocks(page, ("json",))] == chat[:1], "the indented record is the file's first"
    assert plain == [{"text": line} for line in txt[0].splitlines()]
    # The stage's own rules on those files: pre-flight's data checks read them as a run would.
    raw = minimal_config()
    raw["base_model"]["uri"] = str(tiny_model_dir)
    raw["run_root"] = str(tmp_path / "run")
    raw["cpt"]["data"] = {"uri": [str(files["text"]), str(files["txt"])]}
    raw["sft"]["data"] = {"uri": str(files["chat"])}
    raw["sft"]["eval"] = {"heldout_fraction": 0.0}  # two chats: none to spare for a held-out set
    raw["cpt"]["eval"] = {"heldout_fraction": 0.0}
    raw["gate"] = {"enabled": False}
    raw["dpo"] = {**raw["sft"], "data": {"uri": str(pairs_file)}}
    config = tmp_path / "formats.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    report = preflight_report(load_for_check(config), machine=CPU_NODE, token_present=None)
    assert not report.problems, report.text()
    checked = "\n".join(report.checked)
    assert "'messages' have valid roles and an assistant turn" in checked, checked
    assert f"dpo data {pairs_file}: first 4 record(s) parse, each is a preference pair" in checked, checked


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_extending_page_names_a_test_that_exists_for_each_recipe():
    text = (DOCS / "extending.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    assert [s.splitlines()[0] for s in sections] == [
        "A model family",
        "A plugin",
        "A stage",
        "A phase",
        "A kernel",
        "A notice source",
        "A launch backend",
    ]
    for section in sections:
        named = re.findall(r"`(tests/\w+\.py)::(\w+)`", section)
        assert named, f"extending.md, {section.splitlines()[0]}: name the test that proves the recipe"
        for file, name in named:
            assert name in _test_functions(REPO / file), f"extending.md names {file}::{name}, which does not exist"


def test_examples_are_listed_where_a_newcomer_looks():
    names = sorted(p.name for p in (REPO / "examples").glob("*.yaml"))
    for page in (DOCS / "examples.md", REPO / "examples" / "README.md"):
        listed = re.findall(r"^\| `([\w.-]+\.yaml)` \|", page.read_text(), re.MULTILINE)
        assert sorted(listed) == names, f"{page.relative_to(REPO)} lists {listed}, examples/ holds {names}"


def test_the_site_is_in_four_sections():
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    assert [next(iter(section)) for section in nav] == ["Get started", "How-to", "Reference", "Explanation"]
    pages = [next(iter(item.values())) for section in nav for item in next(iter(section.values()))]
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk, "mkdocs.yml's nav and docs/ hold different pages"


# A paragraph a reader takes in on one screen, on every page of the site and the README (the longest
# ran to 1,024 words); a list item counts on its own, and a generated page is held through its generator.
PARAGRAPH_MAX_WORDS = 180
_NOT_PROSE = re.compile(r"^(#|\||\s*([-*]|\d+\.)\s)")


def _paragraphs(text: str) -> list[tuple[int, int]]:
    """(first line, words) of each paragraph or list item of a Markdown page, code blocks left out."""
    out: list[tuple[int, int]] = []
    start, words, fenced = 0, 0, False

    def close() -> None:
        nonlocal words
        if words:
            out.append((start, words))
        words = 0

    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            close()
            fenced = not fenced
        elif fenced:
            continue
        elif not line.strip() or _NOT_PROSE.match(line):
            close()
            if line.strip() and not line.startswith(("#", "|")):  # a list item opens a paragraph of its own
                start, words = number, len(line.split()) - 1  # the words after its marker
        else:
            start = start if words else number
            words += len(line.split())
    close()
    return out


def test_the_paragraph_reader_counts_prose_and_list_items_apart_and_skips_code():
    page = "# Title\n\none two\nthree\n\n- four five\n  six\n- seven\n\n```\nnot prose at all\n```\n| a | b |\n"
    assert _paragraphs(page) == [(3, 3), (6, 3), (8, 1)]


def test_no_page_has_a_paragraph_longer_than_a_screen():
    pages = [*sorted(DOCS.rglob("*.md")), REPO / "README.md"]
    long = [
        f"{page.relative_to(REPO)}:{line} ({words} words)"
        for page in pages
        for line, words in _paragraphs(page.read_text())
        if words > PARAGRAPH_MAX_WORDS
    ]
    assert not long, (
        f"paragraphs over {PARAGRAPH_MAX_WORDS} words: {long}; split each where its subject turns (a new "
        "paragraph, or its items as a list; a page of docs/reference/ in the module that writes it)"
    )


def test_the_maps_stage_list_is_the_tables_rows_in_order_each_at_its_tasks_module():
    """docs/architecture.md's run, as data, lists every row of the stage table in order, each beside
    the module that binds its task (the list itself, with what each row leaves, is generated:
    tests/test_docs.py::test_stage_reference_and_every_stage_list_are_generated_from_the_table)."""
    import flows.cpt_to_sft  # noqa: F401 - binds every stage module's task
    from tasks.core.run.stages import STAGE_NAMES
    from tasks.flowkit.pipeline import TASKS

    text = (DOCS / "architecture.md").read_text()
    block = re.search(r"^```\n(.*?)^```", text[text.index("## 1. One run, as data") :], re.MULTILINE | re.DOTALL)
    rows = re.findall(r"^  (\w+)\s+(tasks/stages/\w+\.py)", block.group(1) if block else "", re.MULTILINE)
    assert [name for name, _ in rows] == list(STAGE_NAMES), "architecture.md section 1 lists other stages than STAGES"
    for name, module in rows:
        bound = getattr(TASKS[name], "fn", TASKS[name]).__module__
        assert module == bound.replace(".", "/") + ".py", f"architecture.md: {name} is bound in {bound}, not {module}"
