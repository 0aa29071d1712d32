"""The documentation cannot rot: the site builds strictly, the generated reference is in sync, every
YAML example passes pre-flight, every command shown parses, the diagrams and trees match the code.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/test_docs.py

Cheap on purpose: no torchrun launch, no flow run. A YAML example that needs hardware this machine
lacks says so in its first lines (`# needs: gpus`, `slurm`, `mlflow`), and the test fakes exactly that
at the seam pre-flight reads it through: the `Machine` facts, the Slurm backend's `preflight` row,
the MLflow probe.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.core.config import reference
from tasks.core.config.backends import BACKENDS
from tasks.core.config.layout import RULES
from tasks.core.launch.torchrun import PREFLIGHTS
from tasks.core.preflight import tracking as preflight_tracking
from tasks.core.preflight.checks import CHECKS, Machine, load_for_check, preflight_report
from tasks.core.run.stages import run_stages

STAGES = run_stages(("cpt", "sft"))  # the diagrams draw a run without the optional dpo phase (docs/dpo.md has its rows)

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
DEMO_MODEL = "build/demo-inputs/tiny-llama"
README_MAX_WORDS = 1200
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(page: Path, langs: tuple[str, ...]) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(page.read_text()) if m.group(1) in langs]


def rel(page: Path) -> str:
    return str(page.relative_to(REPO))


# ------------------------------------------------------------------------------------------------
# The site and the generated reference


def test_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link, a missing anchor or a page left out of the nav fails."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]


def test_config_reference_is_generated_from_the_schema():
    page = DOCS / "reference" / "config.md"
    assert page.read_text() == reference.render(), f"docs/reference/config.md is out of date: run `{reference.COMMAND}`"


def test_stage_reference_and_every_stage_list_are_generated_from_the_table():
    """docs/reference/stages.md is the table's page, and the numbered list on the pages a newcomer
    reads first (README.md, docs/index.md, docs/concepts.md) is the table's list, one line a row."""
    from tasks.core.run import reference as stages_ref
    from tasks.core.run.stages import STAGE_NAMES, STAGES

    bare = [s.name for s in STAGES if not s.summary]
    assert not bare, f"rows without a summary (what the stage leaves, in a line): {bare}; add summary= to each row"

    page = DOCS / "reference" / "stages.md"
    assert page.read_text() == stages_ref.render(), (
        f"docs/reference/stages.md is out of date: run `{stages_ref.COMMAND}`"
    )
    listed = stages_ref.stage_list()
    assert [line.split()[1] for line in listed.splitlines()] == list(STAGE_NAMES)
    for rel in stages_ref.LIST_PAGES:
        found = re.search(r"^ 1  .*?(?=^```)", (REPO / rel).read_text(), re.MULTILINE | re.DOTALL)
        assert found and found.group(0) == listed, (
            f"{rel}: its stage list is not the table's; paste the output of `{stages_ref.LIST_COMMAND}` over it"
        )


def test_family_table_is_generated_from_the_registries():
    from tasks.core.models import family_table
    from tasks.core.models.families import FAMILIES

    page = DOCS / "reference" / "families.md"
    text = family_table.render()
    assert page.read_text() == text, f"docs/reference/families.md is out of date: run `{family_table.COMMAND}`"
    assert all(f"| `{t}` |" in text for t in FAMILIES) and "| any other decoder |" in text


def test_config_reference_lists_every_field_and_registry_row():
    from tasks.core.config.batching import BATCHING
    from tasks.core.config.kernels import KERNELS
    from tasks.core.config.plugins import PLUGINS

    text = reference.render()
    for path, model in reference.sections():
        for name in model.model_fields:
            key = f"{path}.{name}" if path else name
            key = re.sub(r"^(cpt|sft)(?=\.|$)", "<phase>", key)
            # dpo's section lists its own fields; those of a phase section are <phase>'s
            stage_key = re.sub(r"^dpo(?=\.|$)", "<phase>", key)
            assert f"`{key}`" in text or f"`{stage_key}`" in text, key
    for rows in (PLUGINS, BATCHING, BACKENDS, {k.name: k for k in KERNELS}):
        for name in rows:
            assert f"| `{name}` |" in text, name


def test_readme_is_a_front_page():
    text = (REPO / "README.md").read_text()
    assert len(text.split()) <= README_MAX_WORDS
    for target in re.findall(r"\]\((?!https?://)([^)#]+)", text):
        assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"


# ------------------------------------------------------------------------------------------------
# Diagrams and trees against the code

TREE_ENTRY = re.compile(r"^[\w.*-]+(?:\.py|/)$")


def tree_paths(block: str) -> list[str]:
    """The paths of an indented tree (two spaces a level): a line starts with names ending in `.py`
    or `/`, one space apart, and two or more spaces set off its description."""
    stack: list[tuple[int, str]] = []
    out = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        names = re.split(r"\s{2,}", line.strip())[0].split(" ")
        if not all(TREE_ENTRY.match(n) for n in names):
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        prefix = "".join(name for _, name in stack)
        out += [prefix + n for n in names]
        if names[-1].endswith("/"):
            stack.append((indent, names[-1]))
    return out


def code_trees() -> list[str]:
    return [b for b in blocks(DOCS / "architecture.md", ("",)) if TREE_ENTRY.match((b.split() or [""])[0])]


def test_code_layout_matches_the_tree():
    trees = code_trees()
    assert len(trees) == 2, "docs/architecture.md: the short tree and the full tree"
    for tree in trees:
        for path in tree_paths(tree):
            assert list(REPO.glob(path.rstrip("/"))), f"docs/architecture.md lists {path}, which does not exist"
    subpackages = {p.parent.name for p in (REPO / "tasks" / "core").glob("*/__init__.py")}
    for tree in trees:
        listed = {p.split("/")[2] for p in tree_paths(tree) if p.startswith("tasks/core/") and p.count("/") >= 3}
        assert subpackages <= listed, f"docs/architecture.md does not list tasks/core/{sorted(subpackages - listed)}"


def test_troubleshooting_names_every_refusal():
    text = (DOCS / "troubleshooting.md").read_text()
    missing = [f.__name__ for f in CHECKS if f"`{f.__name__}`" not in text]
    missing += [f.__name__ for _, f in RULES if f"`{f.__name__}`" not in text]
    assert not missing, f"docs/troubleshooting.md: add the cause and fix of {missing}"


# ------------------------------------------------------------------------------------------------
# YAML examples pass pre-flight

GPU_NODE = Machine(cuda_devices=8, cpu_count=64, free_bytes=10**14, gpu_memory_bytes=80 * 10**9)
CPU_NODE = Machine(cuda_devices=0, cpu_count=2, free_bytes=10**13)


def yaml_examples() -> list[tuple[str, str]]:
    return [(f"{rel(p)}#{i}", b) for p in PAGES for i, b in enumerate(blocks(p, ("yaml", "yml")))]


def merge(base: dict, over: dict) -> dict:
    """`over` written onto `base`; a mixture (`data.sources`) replaces the base's `data.uri`, as it does in a config."""
    out = {k: v for k, v in base.items() if not (k == "uri" and "sources" in over)}
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def minimal_config() -> dict[str, Any]:
    """The README's smallest config: the base a fragment of another page is checked on."""
    return yaml.safe_load(blocks(REPO / "README.md", ("yaml",))[0])


def needs(block: str) -> set[str]:
    marked = re.findall(r"^# needs: ([\w, ]+)", block, re.MULTILINE)
    return {n.strip() for line in marked for n in line.split(",")}


def _cluster_answers(launch, where, tp_pp=1):
    return []


@pytest.mark.parametrize("where, block", yaml_examples(), ids=[w for w, _ in yaml_examples()])
def test_yaml_example_passes_preflight(where, block, tiny_model_dir, tmp_path, monkeypatch):
    raw = yaml.safe_load(block)
    want = needs(block)
    assert want <= {"gpus", "slurm", "mlflow"}, f"{where}: unknown needs {want}"
    if not {"name", "cpt", "sft"} <= set(raw):
        raw = merge(minimal_config(), raw)
    if raw["base_model"]["uri"] == DEMO_MODEL:
        raw["base_model"]["uri"] = str(tiny_model_dir)
    raw["run_root"] = str(tmp_path / "run")
    if "slurm" in want:
        monkeypatch.setitem(PREFLIGHTS, "slurm", _cluster_answers)
    if "mlflow" in want:
        monkeypatch.setattr(preflight_tracking, "check_uri", lambda uri: None)
    path = tmp_path / "example.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    report = preflight_report(
        load_for_check(path), machine=GPU_NODE if "gpus" in want else CPU_NODE, token_present=None
    )
    assert report.ok, f"{where}:\n{report.text()}"


# ------------------------------------------------------------------------------------------------
# Every command shown parses

PROGRAMS = ("cpt-to-sft", "python", "make", "prefect", "bash", "mkdocs")
EXTERNAL = ("pip", "tensorboard", "export", "source", "cd", "git", "hf", "sbatch", "curl")
INLINE = re.compile(r"`((?:\.venv/bin/)?(?:cpt-to-sft|python3? -m|python3? \S+\.py|make|bash|sudo bash) [^`]*)`")


def commands(line: str) -> list[list[str]]:
    """The argv lists of one shell line: comments, `sudo`/`time`, redirections and `.venv/bin/` dropped,
    `&&`, `|` and `;` split; an optional `[--flag VALUE]` is left out."""
    line = re.sub(r"\[(--[^\]]*)\]", "", line)
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError as exc:
        raise AssertionError(f"does not parse as a shell line: {line!r} ({exc})") from None
    out, cur, skip = [], [], False
    for tok in tokens + ["&&"]:
        if skip:
            skip = False
            continue
        if tok in ("&&", "|", ";", "||"):
            if cur:
                out.append(cur)
            cur = []
        elif tok in (">", ">>", "2>", "<"):
            skip = True
        elif not cur and (tok in ("sudo", "time", "/usr/bin/time") or re.match(r"^[A-Z_]+=", tok)):
            continue
        else:
            cur.append(tok)
    for argv in out:
        argv[0] = argv[0].removeprefix(".venv/bin/")
        if argv[0] == "python3":
            argv[0] = "python"
    return out


def shown_commands() -> tuple[list[list[str]], list[tuple[str, list[str]]]]:
    """(commands of the shell blocks, to parse; inline ones with where they are, to find)."""
    full, inline = [], []
    for page in PAGES:
        for block in blocks(page, ("", "bash", "sh", "shell", "console")):
            for line in block.splitlines():
                line = line.strip().removeprefix("$ ")
                word = line.split(" ")[0].removeprefix(".venv/bin/") if line else ""
                if word in PROGRAMS + ("python3", "sudo", "time") or re.match(r"^[A-Z_]+=\S+ ", line):
                    full += [c for c in commands(line) if c[0] not in EXTERNAL]
        if page == DOCS / "reference" / "config.md":  # generated; its defaults are not commands (`cpt-to-sft export`)
            continue
        for m in INLINE.finditer(page.read_text()):
            inline += [(rel(page), c) for c in commands(m.group(1)) if c[0] not in EXTERNAL]
    unique = list({json.dumps(c): c for c in full}.values())
    return unique, inline


def test_shell_commands_parse():
    """Each command of a shell block goes through its real argument parser (in a process of its
    own: tests/_doc_commands.py), which stops there."""
    full, inline = shown_commands()
    assert len(full) > 20
    # a subcommand quoted in prose exists: its --help parses
    full += list(
        {
            json.dumps(c): c
            for c in ([argv[0], argv[1], "--help"] for _, argv in inline if argv[0] == "cpt-to-sft" and len(argv) > 1)
        }.values()
    )
    unknown = [c for c in full if c[0] not in PROGRAMS]
    assert not unknown, f"commands the docs test cannot check: {unknown}"
    done = subprocess.run(
        [sys.executable, "-m", "tests._doc_commands"],
        input=json.dumps(full),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_inline_commands_name_what_exists():
    """A command quoted in prose names a module, file or Makefile target that exists (its
    `cpt-to-sft` subcommands are parsed by test_shell_commands_parse)."""
    import importlib.util

    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))

    def exists(argv: list[str]) -> bool:
        prog, args = argv[0], argv[1:]
        if prog == "python" and args[:1] == ["-m"]:
            return importlib.util.find_spec(args[1]) is not None
        if prog in ("python", "bash") and args:
            return (REPO / args[0]).exists()
        if prog == "make":
            return {a for a in args if not a.startswith("-")} <= targets
        return True

    _, inline = shown_commands()
    problems = [(where, argv) for where, argv in inline if not exists(argv)]
    assert not problems, problems


def test_commands_page_shows_every_subcommand():
    """docs/commands.md shows each subcommand `cpt-to-sft --help` lists, and `run --help` names the
    config file, the overrides form and --stop-after."""
    import argparse

    from flows.cli import FLOW_ALIAS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    shown = {c[1] for c in shown_commands()[0] if c[0] == "cpt-to-sft" and len(c) > 1}
    missing = sorted(set(sub.choices) - {FLOW_ALIAS} - shown)  # the alias is shown as `python -m flows.cpt_to_sft`
    assert not missing, f"docs/commands.md: show an example of cpt-to-sft {missing}"
    run_help = sub.choices["run"].format_help()
    for option in ("--config", "--set", "--stop-after"):
        assert option in run_help
