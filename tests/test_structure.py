"""Unit tier: the rooms and the registries hold.

    pytest tests/test_structure.py

- `tasks/core` imports neither prefect, colossalai, torch.distributed nor any other room of the
  project; `tasks/engine` never imports prefect nor the Prefect task modules. Checked on the
  source of every module and, transitively, in a fresh interpreter.
- No module imports another module's private (`_name`) names.
- No module under `tasks/`, `flows/`, `benchmarks/` or `support/` is over 600 lines (ruff-formatted), nor
  any function there over 200.
- No import cycle among the modules of `tasks/` and `flows/`, read from the source (function-level
  and `if TYPE_CHECKING:` imports count: each is a dependency a reader has to follow; a module's
  `if __name__ == "__main__":` block does not, as it runs only when the module is the program).
- `tasks/core/` holds at most 12 entries, each a subpackage or a module, and every subpackage says
  in its `__init__` docstring what it holds.
- A fifth plugin is one registry row plus one builder; nothing else changes.
- No module branches on a phase name ("cpt", "sft") outside the phase registry, nor on a plugin name
  outside the plugin registry: it reads the row.
- The stages are peers: no module of `tasks/stages/` imports another (what two stages share lives in
  `tasks/flowkit/` or `tasks/core/`), so they stand on one level of the import graph; `tasks/flowkit/`
  never imports a stage module.
- A phase is a phase: no `Phase` or `PhaseConfig` is named `stage`/`st`, and the job file names its phase
  `phase` (a stage is a row of the stage table).
- The command line is one argument parser (flows/cli.py); `python -m flows.cpt_to_sft` is a command of it.
- The pipeline is the stage table: each row bound to a task, the runbook spelling no stage name.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_config_raw, write_config

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tasks"
# Counted in ruff-formatted lines of at most 120 characters.
MAX_LINES = 600


def _modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name of a (possibly relative) `from ... import`."""
    if not node.level:
        return node.module or ""
    base = _module_name(path).split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every import statement, function bodies included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((_resolve(path, node), [a.name for a in node.names]))
    return out


PREFECT_TASK_MODULES = {_module_name(p) for room in ("stages", "flowkit") for p in _modules(TASKS / room)}


def test_core_imports_no_other_room_and_no_framework():
    for path in _modules(TASKS / "core"):
        for mod, _ in _imports(path):
            top = mod.split(".")[0]
            assert top not in ("prefect", "colossalai") and not mod.startswith("torch.distributed"), (
                f"{path.relative_to(ROOT)} imports {mod}: tasks/core must stay free of prefect, colossalai and "
                "torch.distributed"
            )
            assert (
                not mod.startswith("tasks.engine") and mod not in PREFECT_TASK_MODULES and not mod.startswith("flows")
            ), f"{path.relative_to(ROOT)} imports {mod}: tasks/core is the pure room and imports only tasks.core"


def test_engine_never_imports_prefect_or_the_task_modules():
    for path in _modules(TASKS / "engine"):
        for mod, _ in _imports(path):
            assert mod.split(".")[0] != "prefect", (
                f"{path.relative_to(ROOT)} imports {mod}: the engine runs inside torchrun ranks and never imports "
                "prefect"
            )
            assert mod not in PREFECT_TASK_MODULES and not mod.startswith("flows"), (
                f"{path.relative_to(ROOT)} imports {mod}: the engine reaches only tasks.core and tasks.engine"
            )


def test_no_module_imports_another_modules_private_names():
    project = ("tasks", "flows", "tests", "benchmarks")
    bad = []
    for path in _modules(TASKS) + _modules(ROOT / "flows"):
        for mod, names in _imports(path):
            if mod.split(".")[0] in project and mod != _module_name(path):
                bad += [
                    f"{path.relative_to(ROOT)}: from {mod} import {n}"
                    for n in names
                    if n.startswith("_") and not n.startswith("__")
                ]
    assert not bad, "private names imported across modules (give them a public name):\n" + "\n".join(bad)


# The rules hold outside tasks/ too: the runbook, the benchmarks and what tests and benchmarks share.
RULED = ("tasks", "flows", "benchmarks", "support")
# A function longer than this is split into named steps (the longest in the project: tasks/core/hub/card.py's
# model_card, one template filled in order).
MAX_FUNCTION_LINES = 200


def test_no_module_is_over_600_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for folder in RULED
        for p in _modules(ROOT / folder)
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_function_is_over_200_lines():
    long = {
        f"{p.relative_to(ROOT)}:{node.lineno} {node.name}": n
        for folder in RULED
        for p in _modules(ROOT / folder)
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {long}"


# Eight or more parameters is a list to read at every call: the small dataclass it is in spirit
# (eval_time's Cpu and GenerationCheck, proof's _Folder, the evaluations' _Measured) reads better. The count only goes down;
# the list: python -c "from tests.test_structure import long_parameter_lists as f; print(*f(), sep='\n')"
MANY_PARAMETERS = 8
MAX_LONG_PARAMETER_LISTS = 17


def long_parameter_lists() -> list[str]:
    """`file:line name (n)` of each function of RULED with MANY_PARAMETERS or more (self and cls not counted)."""
    out = []
    for path in (p for folder in RULED for p in _modules(ROOT / folder)):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                n = len(names) - (names[:1] in (["self"], ["cls"]))
                if n >= MANY_PARAMETERS:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n})")
    return out


def test_long_parameter_lists_do_not_grow():
    long = long_parameter_lists()
    assert len(long) <= MAX_LONG_PARAMETER_LISTS, (
        f"{len(long)} functions take {MANY_PARAMETERS} or more parameters, over {MAX_LONG_PARAMETER_LISTS}: group "
        "the ones that travel together into a small dataclass (a new function), or lower one of these:\n"
        + "\n".join(long)
    )


PHASE_NAMES = {"cpt", "sft"}
PHASE_REGISTRY = ROOT / "tasks" / "core" / "config" / "phases.py"


def phase_branches(path: Path) -> list[str]:
    """`file:line` of each place that branches on a phase name: a "cpt"/"sft" literal compared (`==`, `!=`,
    `in`), in a conditional expression (`"cpt" if`, `else "sft"`), a `case`, or a tuple or list of phase
    names (a loop or a membership over both). Data is not a branch: a stage name ("train_cpt"), a config
    path ("cpt.seq_len"), a dict key or argument ("cpt": ..., TRAINING["cpt"]), text in a docstring."""
    return name_branches(path, PHASE_NAMES)


def name_branches(path: Path, names: set[str]) -> list[str]:
    """`file:line` of each place that branches on one of `names` (see `phase_branches`)."""
    import io
    import tokenize

    toks = [
        t
        for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    ]

    def phase(t) -> bool:
        if t.type != tokenize.STRING:
            return False
        try:
            return ast.literal_eval(t.string) in names
        except (ValueError, SyntaxError):
            return False

    hits = set()
    for i, t in enumerate(toks):
        if not phase(t):
            continue
        before = toks[i - 1].string if i else ""
        after = toks[i + 1].string if i + 1 < len(toks) else ""
        compared = before in ("==", "!=", "in", "else", "case") or after in ("==", "!=", "if", "in")
        # a tuple or list of phase names: ("cpt", "sft"), ["cpt", "sft"]
        listed = (before in ("(", "[", ",") and after == "," and i + 2 < len(toks) and phase(toks[i + 2])) or (
            before == "," and i >= 2 and phase(toks[i - 2])
        )
        if compared or listed:
            hits.add(f"{path.relative_to(ROOT)}:{t.start[0]}")
    return sorted(hits)


def test_no_branch_on_a_phase_name_outside_the_phase_registry():
    bad = [
        hit
        for folder in (TASKS, ROOT / "flows")
        for path in _modules(folder)
        if path != PHASE_REGISTRY
        for hit in phase_branches(path)
    ]
    assert not bad, (
        "branches on a phase name (read the row of tasks/core/config/phases.py PHASES instead, e.g. "
        "PHASES[phase].blocks, or iterate PHASES):\n" + "\n".join(bad)
    )


def test_the_phase_branch_finder_finds_branches_and_leaves_data_alone(tmp_path):
    probe = ROOT / "tasks" / "_phase_probe_for_test.py"
    src = (
        "def f(stage, kind, cfg):\n"
        '    """Docstring naming "cpt" == stage is text."""\n'
        '    if stage == "cpt":\n'  # 3
        "        pass\n"
        '    x = "text" if kind != \'sft\' else "messages"\n'  # 5
        '    for s in ("cpt", "sft"):\n'  # 6
        "        pass\n"
        '    y = "blocks" if kind in ["sft"] else "cpt"\n'  # 8
        '    return {"cpt": 1}, cfg["sft"], "train_cpt", f"cpt.seq_len", TRAINING["cpt"], g("cpt", 2)  # "cpt" ==\n'
    )
    probe.write_text(src)
    try:
        assert phase_branches(probe) == [f"tasks/_phase_probe_for_test.py:{n}" for n in (3, 5, 6, 8)]
    finally:
        probe.unlink()


STAGES = TASKS / "stages"


def stage_cross_imports(folder: Path, package: str = "tasks.stages") -> list[str]:
    """`path:line imports package.peer` for every import of one stage module by another: absolute, relative,
    `from package import peer`, inside a function, or by importlib with the name written out."""
    peers = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    where = package.replace(".", "/")
    bad = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                targets = [node.args[0].value]
            else:
                continue
            hits = {t[len(package) + 1 :].split(".")[0] for t in targets if t.startswith(package + ".")}
            bad += [
                f"{where}/{path.name}:{node.lineno} imports {package}.{o}" for o in sorted(hits & peers - {path.stem})
            ]
    return bad


def test_no_stage_module_imports_another_stage_module():
    bad = stage_cross_imports(STAGES)
    assert not bad, (
        "a stage module imports another (stages are peers: move what both need into tasks/flowkit/, e.g. "
        "tasks/flowkit/stage.py, or into tasks/core/):\n" + "\n".join(bad)
    )


def test_the_flowkit_never_imports_a_stage_module():
    bad = [
        f"{path.relative_to(ROOT)} imports {mod}"
        for path in _modules(TASKS / "flowkit")
        for mod, names in _imports(path)
        if mod.startswith("tasks.stages") and (mod != "tasks.stages" or names)
    ]
    assert not bad, "tasks/flowkit/ is what the stages are built with and never reaches up into them:\n" + "\n".join(
        bad
    )


def test_the_flowkit_imports_no_engine_module():
    """The Prefect side and the ranks are peers: what both use (the notice watch) lives in tasks/core below them."""
    bad = [
        f"{path.relative_to(ROOT)} imports {mod}"
        for path in _modules(TASKS / "flowkit")
        for mod, _names in _imports(path)
        if mod == "tasks.engine" or mod.startswith("tasks.engine.")
    ]
    assert not bad, "tasks/flowkit/ imports the ranks' engine; move what both need into tasks/core:\n" + "\n".join(bad)


_IMPORT_STRING = re.compile(r"^tasks(\.\w+)+:\w+$")
# The one registry whose rows still name code as "module:attr": a phase's encoder. The config leaf cannot
# import the data package (data imports config), so the data package resolves the string
# (tasks/core/data/shard.py `encoder_class`): its edge is the resolver's, checked below.
_STRING_REGISTRIES = {"tasks.core.config.phases": "tasks.core.data.shard"}


def test_import_strings_are_registry_rows_that_resolve_within_the_layering():
    """A "tasks.x:Name" string is an import the graph cannot see: each must be a row of a known registry,
    resolve to its attribute, and be one its resolver may import (the same core subpackage, or one below)."""
    import importlib

    graph = import_graph(_modules(TASKS / "core"))
    found = []
    for room in (TASKS, ROOT / "flows"):
        for path in _modules(room):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and _IMPORT_STRING.match(node.value):
                    found.append((_module_name(path), node.value))
    assert found, "the finder found no import string: the encoder rows of tasks/core/config/phases.py name two"
    stray = [f"{holder}: {text!r}" for holder, text in found if holder not in _STRING_REGISTRIES]
    assert not stray, (
        "import strings outside a registry the layering test reads; import the callable where the row is defined "
        f"(in a package allowed to), or add the registry here: {stray}"
    )
    for holder, text in found:
        module, _, attr = text.partition(":")
        assert hasattr(importlib.import_module(module), attr), f"{holder}: {text!r} does not resolve"
        resolver = _STRING_REGISTRIES[holder]
        below = {m.split(".")[2] for m in graph.get(resolver, set()) if m.startswith("tasks.core.")}
        concern = module.split(".")[2]
        assert concern == resolver.split(".")[2] or concern in below, (
            f"{holder}: {text!r} is resolved by {resolver}, which may not import {module} under the layering"
        )


def test_each_launch_backend_with_a_cluster_check_has_one_in_the_launch_package():
    from tasks.core.config.backends import BACKENDS
    from tasks.core.launch.torchrun import PREFLIGHTS

    assert set(PREFLIGHTS) == {n for n, b in BACKENDS.items() if b.cluster_check}, (
        "a BACKENDS row's cluster_check says what tasks.core.launch.torchrun.PREFLIGHTS runs for it: keep the keys equal"
    )


def test_the_stage_import_finder_finds_every_form_and_leaves_the_rest_alone(tmp_path):
    folder = tmp_path / "stages"
    folder.mkdir()
    (folder / "__init__.py").write_text('"""The stages."""\n')
    (folder / "b.py").write_text("X = 1\n")
    (folder / "c.py").write_text("Y = 2\n")
    (folder / "a.py").write_text(
        "import tasks.stages.b\n"  # 1
        "from tasks.stages.c import Y\n"  # 2
        "from tasks.stages import b, c\n"  # 3
        "from . import b as bee\n"  # 4
        "from .c import Y as why\n"  # 5
        "from tasks.flowkit.stage import Stage\n"
        "from tasks.core.data.stage_data import prepared_dir\n"
        "import tasks.stages.a\n"
        "from tasks.stagesque import z\n"
        "import importlib\n"
        "def f():\n"
        "    from tasks.stages.b import X\n"  # 12
        '    return importlib.import_module("tasks.stages.c"), "tasks.stages.b"\n'  # 13
    )
    found = stage_cross_imports(folder)
    assert found == [
        "tasks/stages/a.py:1 imports tasks.stages.b",
        "tasks/stages/a.py:2 imports tasks.stages.c",
        "tasks/stages/a.py:3 imports tasks.stages.b",
        "tasks/stages/a.py:3 imports tasks.stages.c",
        "tasks/stages/a.py:4 imports tasks.stages.b",
        "tasks/stages/a.py:5 imports tasks.stages.c",
        "tasks/stages/a.py:12 imports tasks.stages.b",
        "tasks/stages/a.py:13 imports tasks.stages.c",
    ], found
    assert stage_cross_imports(folder, package="elsewhere.stages") == [
        f"elsewhere/stages/a.py:{n} imports elsewhere.stages.{m}" for n, m in ((4, "b"), (5, "c"))
    ]


PLUGIN_REGISTRY = ROOT / "tasks" / "core" / "config" / "plugins.py"


def plugin_branches(path: Path) -> list[str]:
    """`file:line` of each place that branches on a registered plugin's name, as `phase_branches` finds
    phase names: `p.name != "gemini"`, `plugin in ("low_level_zero", "torch_ddp")`. A config's
    `{"name": "gemini"}` or the engine's builder table keyed by name is data."""
    from tasks.core.config.plugins import PLUGINS

    return name_branches(path, set(PLUGINS))


def test_no_branch_on_a_plugin_name_outside_the_plugin_registry():
    bad = [
        hit
        for folder in (TASKS, ROOT / "flows")
        for path in _modules(folder)
        if path != PLUGIN_REGISTRY
        for hit in plugin_branches(path)
    ]
    assert not bad, (
        "branches on a plugin name (give the plugin's row in tasks/core/config/plugins.py a field and read it, "
        "e.g. PLUGINS[name].kernel_routes or .lever):\n" + "\n".join(bad)
    )


def test_the_plugin_branch_finder_finds_branches_and_leaves_data_alone():
    probe = ROOT / "tasks" / "_plugin_probe_for_test.py"
    src = (
        "def f(p, st):\n"
        '    """Docstring naming p.name != "gemini" is text."""\n'
        '    if p.name != "gemini":\n'  # 3
        "        pass\n"
        '    x = 4 if p.name in ("low_level_zero", "torch_ddp") else 2\n'  # 5
        '    y = "shard" if "hybrid_parallel" == p.name else "own"\n'  # 6
        '    return {"name": "gemini", "zero_stage": 0}, BUILDERS["torch_ddp"], g("low_level_zero")  # == "gemini"\n'
    )
    probe.write_text(src)
    try:
        assert plugin_branches(probe) == [f"tasks/_plugin_probe_for_test.py:{n}" for n in (3, 5, 6)]
    finally:
        probe.unlink()


def _module_of(name: str, known: set[str]) -> str | None:
    """The project module an import names: the longest known prefix (a package is its __init__)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def import_graph(paths: list[Path]) -> dict[str, dict[str, set[str]]]:
    """module -> {imported project module -> names taken from it}, every import of the source counted."""
    known = {_module_name(p) for p in paths}
    graph: dict[str, dict[str, set[str]]] = {m: {} for m in known}
    for path in paths:
        me = _module_name(path)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [(a.name, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(path, node)
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
                targets = [(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, a.name) for a in node.names]
            else:
                continue
            for target, name in targets:
                mod = _module_of(target, known)
                if mod is not None and mod != me:
                    graph[me].setdefault(mod, set()).add(name)
    return graph


def strongly_connected(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_the_project_modules():
    graph = import_graph(_modules(TASKS) + _modules(ROOT / "flows"))
    cycles = strongly_connected(graph)
    report = []
    for comp in cycles:
        report.append("cycle: " + ", ".join(comp))
        report += [
            f"  {a} imports {b}: {', '.join(sorted(graph[a][b]))}" for a in comp for b in sorted(graph[a]) if b in comp
        ]
    assert not cycles, (
        "modules that import each other (directly or around a loop); move what both need into a module of its own:\n"
        + "\n".join(report)
    )


def test_core_subpackages_import_one_way():
    """Not only modules: the concerns of tasks/core form layers, so a subpackage reads knowing only those below it."""
    graph = import_graph(_modules(TASKS / "core"))

    def top(mod: str) -> str:  # tasks.core.<concern>[.module...] -> <concern>
        return mod.split(".")[2] if mod.count(".") >= 2 else mod

    packages: dict[str, dict[str, set[str]]] = {top(m): {} for m in graph}
    for a, targets in graph.items():
        for b in targets:
            if top(a) != top(b):
                packages[top(a)].setdefault(top(b), set()).add(f"{a} -> {b}")
    cycles = strongly_connected(packages)
    report = [
        f"{', '.join(c)}: " + "; ".join(sorted(e for a in c for b in c if b in packages[a] for e in packages[a][b]))
        for c in cycles
    ]
    assert not cycles, (
        "tasks/core subpackages that import each other; move the shared piece into the lower one:\n" + "\n".join(report)
    )


def test_core_top_level_is_subpackages_and_modules_each_package_documented():
    core = TASKS / "core"
    entries = sorted(p for p in core.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 12, (
        f"tasks/core/ has {len(entries)} entries ({', '.join(p.name for p in entries)}); at most 12: group them into "
        "a subpackage"
    )
    stray = [
        p.name
        for p in entries
        if not ((p.is_dir() and (p / "__init__.py").is_file()) or (p.is_file() and p.suffix == ".py"))
    ]
    assert not stray, (
        f"tasks/core/ holds {stray}: only subpackages (a folder with __init__.py) and modules belong at its top level"
    )
    undocumented = [
        str(p.relative_to(ROOT))
        for p in sorted(core.rglob("__init__.py"))
        if "__pycache__" not in p.parts and not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not undocumented, f"packages without a docstring saying what they hold: {undocumented}"


# A package docstring lists what it holds as lines "- name.py  what it is" (or "- name/" for a subpackage).
_LISTED = re.compile(r"^\s*- (\S+?\.py|\S+?/):?(?:\s|$)", re.MULTILINE)


def _listed_modules(doc: str) -> set[str]:
    return set(_LISTED.findall(doc))


def _package_entries(pkg: Path) -> set[str]:
    """What a reader looks for in a package: its modules (not __init__/__main__) and its subpackages."""
    out = set()
    for p in pkg.iterdir():
        if p.is_dir() and (p / "__init__.py").is_file():
            out.add(p.name + "/")
        elif p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"):
            out.add(p.name)
    return out


@pytest.mark.parametrize(
    "pkg",
    sorted(
        str(p.parent.relative_to(ROOT))
        for room in (TASKS, ROOT / "flows")
        for p in [room / "__init__.py", *room.rglob("*/__init__.py")]
        if "__pycache__" not in p.parts
    ),
)
def test_each_package_docstring_lists_exactly_the_modules_it_holds(pkg):
    folder = ROOT / pkg
    present = _package_entries(folder)
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    listed = _listed_modules(doc)
    missing, gone = sorted(present - listed), sorted(listed - present)
    assert not missing and not gone, (
        f"{pkg}/__init__.py's docstring is not the package's list of modules: "
        f"not listed {missing}, listed but not there {gone}; fix: one line '- name.py  what it holds' per module "
        "(and '- name/' per subpackage) in the docstring"
    )


def test_the_module_list_reader_finds_list_lines_only():
    doc = "Intro naming tasks/flowkit/stage.py in prose.\n\n- a.py  one\n- sub/  two\n  - b.py: three\n"
    assert _listed_modules(doc) == {"a.py", "sub/", "b.py"}


_PROBE = """
import importlib, json, pkgutil, sys
import tasks  # installs what keeps transformers from importing scikit-learn (tasks/core/models/hf_imports.py)
import torch  # what torch itself loads is the baseline, not something the project pulled in
baseline = set(sys.modules)
import transformers.generation.candidate_generator  # what loading any tokenizer or model imports
hf = set(sys.modules) - baseline
import tasks.{room} as room
for m in pkgutil.walk_packages(room.__path__, "tasks.{room}."):
    if not m.name.endswith("__main__"):
        importlib.import_module(m.name)
print(json.dumps(dict(all=sorted(set(sys.modules) - baseline), hf=sorted(hf))))
"""


# scikit-learn and scipy: transformers would import them (with pandas) for nothing (tasks/core/models/hf_imports.py).
# torch.distributed: transformers >= 4.52 loads torch.distributed.tensor itself (its tensor-parallel helpers), so
# what importing transformers alone loads is not the room's doing; the room must add none of it.
@pytest.mark.parametrize(
    "room, forbidden, beyond_transformers",
    [
        ("core", ("prefect", "colossalai", "sklearn", "scipy"), ("torch.distributed",)),
        ("engine", ("prefect", "sklearn", "scipy"), ()),
    ],
)
def test_transitive_imports_in_a_fresh_interpreter(room, forbidden, beyond_transformers):
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(room=room)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    bad = [m for m in loaded["all"] if any(m == f or m.startswith(f + ".") for f in forbidden)]
    bad += [
        m
        for m in set(loaded["all"]) - set(loaded["hf"])
        if any(m == f or m.startswith(f + ".") for f in beyond_transformers)
    ]
    assert not bad, f"importing every tasks.{room} module loads {sorted(bad)[:10]}"


# A rank's whole import path, as `python -m tasks.engine shard|train` runs it before the verb's work
# (tasks/engine/__main__.py): the job's modules, ColossalAI's booster under deferred torch.compile
# (`import_colossalai()`), the hf_compat and cpu_compat patches, the verb's module, every plugin class the
# BUILDERS rows name with the patches they apply, and the model family's transformers module. The two verbs
# share it up to the verb (`loop` holds both): one probe covers both. A forked rank (tasks/engine/agent.py)
# holds the agent's imports too: its `preload` comes first, watched for what a fork must not inherit (a read
# of a rank's environment, a thread, CUDA), then torchrun's own modules.
_RANK_PROBE = """
import importlib, json, os, sys, threading
read = set()
getitem = os._Environ.__getitem__
def watch(self, key):
    read.add(key)
    return getitem(self, key)
os._Environ.__getitem__ = watch
os.environ["OMP_NUM_THREADS"] = "1"  # as the agent sets it when unset (above 1 it starts no fork: OpenMP's pool)
from tasks.engine import agent
agent.preload()
os._Environ.__getitem__ = getitem
import torch
rank_env = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "CPT_TO_SFT_FAULT", "CPT_TO_SFT_STAGE_TOKEN"}
assert not read & rank_env, f"the agent's preload read a rank's environment: {sorted(read & rank_env)}"
assert threading.active_count() == 1, f"the agent's preload started threads: {threading.enumerate()}"
assert len(os.listdir("/proc/self/task")) == 1, "the agent's preload started a native thread"
assert not torch.cuda.is_initialized()
import torch.distributed.run, torch.distributed.launcher.api
import tasks.engine.__main__
from tasks.core.errors import PREEMPTED_EXIT
from tasks.core.launch.proctree import die_with_parent
from tasks.core.run.events import DETAIL
from tasks.engine import faults, preconditions, rankio
from tasks.engine.builders import BUILDERS, check_supported
from tasks.engine.lazy_compile import import_colossalai
import_colossalai()
from tasks.engine import cpu_compat, hf_compat
hf_compat.apply()
cpu_compat.apply()
import colossalai
from colossalai.logging import get_dist_logger
from tasks.engine import loop
for row in BUILDERS.values():
    module, _, name = row.factory.partition(":")
    assert getattr(importlib.import_module(module), name)
    if row.patch is not None:
        row.patch()
import transformers.models.llama.modeling_llama
print(json.dumps(sorted(sys.modules)))
"""

# What only another verb needs, each named by the verb: none of it may load in a training rank.
OTHER_VERBS = {
    "prefect": "the flow process",
    "tasks.flowkit": "the flow process",
    "tasks.stages": "the flow process",
    "tasks.core.preflight": "pre-flight (the flow process, before any launch)",
    "tasks.core.launch.torchrun": "the launcher",
    "tasks.core.launch.slurm": "the launcher",
    "tasks.core.launch.slurm_batch": "the launcher",
    "tasks.core.data.prepare": "prepare_data",
    "tasks.core.data.encoders": "prepare_data",
    "tasks.core.models.convert.proof": "unshard/export (the converter's proof)",
    "tasks.core.models.hf_artifact": "unshard/export",
    "tasks.core.models.merge": "a LoRA run's merge",
    "tasks.core.evaluation": "evaluate and benchmark",
    "lm_eval": "benchmark",
    "tasks.core.hub": "push",
    "mlflow": "tracking (the flow process)",
    "tensorboardX": "rank 0's metrics writer, imported at its first write (tasks/engine/metrics.py)",
}

# What no rank needs at start, whatever its verb and plugin, and what keeps it out. Not listed, because a
# rank needs them where they are imported (docs/spot.md, "What a restart's launch costs"): peft
# (`colossalai.interface` imports it), bitsandbytes (ColossalAI's GaLore optimizers, imported by the hybrid
# and ZeRO plugins, subclass its optimizer), torch._dynamo and with it the `torch._inductor` package's
# `__init__` (`colossalai.launch` sets its config; transformers' modeling_utils imports it), sympy
# (`torch.distributed.tensor`, which transformers' modeling_utils imports).
NO_RANK = {
    "torch._inductor.compile_fx": "torch's compiler: torch.compile deferred to first use (tasks/engine/lazy_compile.py)",
    "torch._inductor.codecache": "torch's compiler: torch.compile deferred to first use (tasks/engine/lazy_compile.py)",
    "sklearn": "transformers' scikit-learn flag off (tasks/core/models/hf_imports.py)",
    "scipy": "transformers' scipy flag off (tasks/core/models/hf_imports.py)",
    "transformers.models.gpt2": "another family's modeling: AutoModelForCausalLM imports the model's own at build",
    "transformers.models.qwen2": "another family's modeling: AutoModelForCausalLM imports the model's own at build",
    "transformers.models.mistral": "another family's modeling: AutoModelForCausalLM imports the model's own at build",
}


def test_a_training_rank_imports_nothing_only_another_verb_needs():
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _RANK_PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    # the probe imported the path it checks: the verbs' module, the booster, every plugin, the model's family
    assert {"tasks.engine.loop", "colossalai.booster.plugin.hybrid_parallel_plugin"} <= set(loaded)
    assert {"colossalai.booster.plugin.gemini_plugin", "transformers.models.llama.modeling_llama"} <= set(loaded)
    rules = {**OTHER_VERBS, **NO_RANK}
    bad = {m: why for m in loaded for f, why in rules.items() if m == f or m.startswith(f + ".")}
    assert not bad, f"a rank's import path loads what it does not need: {bad}"


# hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 512: 139,584 parameters
MODEL = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_a_fifth_plugin_is_one_registry_row_plus_one_builder():
    from tasks.core.config import plugins
    from tasks.core.config.kernels import Facts, report, resolve
    from tasks.core.config.layout import ParallelLayout, layout_problems
    from tasks.core.config.load import parse_config
    from tasks.core.config.schema import PluginConfig, RunConfig
    from tasks.core.errors import ConfigError
    from tasks.core.preflight.memory import estimate
    from tasks.core.preflight.memory_check import fits_with
    from tasks.engine import builders as engine_plugins
    from tests.conftest import tiny_config_raw

    built = []
    spec = plugins.PluginSpec(
        name="dummy_zero",
        summary="a test plugin",
        zero_stages=(1,),
        zero_hint="dummy_zero needs zero_stage 1",
        no_sync_zero_stages=(),
        casts_model=False,
        strict_load=False,
        dedupes_tied_weights=False,
        holds=(plugins.Held("weights", 4), plugins.Held("Adam moment shard", 8, sharded=True)),
        lever=plugins.Lever((("zero_stage", 1),)),
    )
    plugins.register(spec)
    engine_plugins.BUILDERS["dummy_zero"] = engine_plugins.Builder(
        factory=lambda **kw: built.append(kw) or "plugin-object",
        kwargs=lambda p, st, layout, cuda: {"stage": p.zero_stage, "dp": layout.dp},
    )
    try:
        raw = tiny_config_raw(Path("/m"), Path("/r"))
        raw["sft"]["plugin"] = {"name": "dummy_zero", "zero_stage": 1, "precision": "bf16"}
        cfg = parse_config(raw)
        assert "dummy_zero" in RunConfig.model_json_schema()["$defs"]["PluginConfig"]["properties"]["name"]["enum"]
        layout = ParallelLayout.of(cfg.sft, "sft")
        assert (layout.plugin, layout.dp, layout.zero_stage) == ("dummy_zero", 2, 1)
        # the registry's capabilities drive every rule and engine decision
        assert not engine_plugins.can_no_sync(cfg.sft.plugin)
        assert engine_plugins.uses_autocast(cfg.sft.plugin) is not None  # does not cast the model: bf16 under autocast
        assert (
            layout_problems(
                cfg.sft.model_copy(update={"plugin": PluginConfig(name="dummy_zero", zero_stage=2)}), "sft"
            )[0][0]
            == "sft.plugin.zero_stage"
        )
        with pytest.raises(ConfigError, match="tensor parallelism needs plugin hybrid_parallel"):
            raw["sft"]["plugin"] = {"name": "dummy_zero", "zero_stage": 1, "precision": "bf16", "tp_size": 2}
            parse_config(raw)
        assert engine_plugins.make_plugin(cfg.sft.plugin, cfg.sft, phase="sft", cuda=False) == "plugin-object"
        assert built == [{"stage": 1, "dp": 2}]  # no kernel is a plugin argument under it: only its own ones
        # its row's kernel routes give it the model's own attention kernel and torch's fused AdamW
        facts = Facts(cuda=True, packages=frozenset({"flash_attn"}))
        assert report(resolve(cfg.sft, "sft", facts)) == (
            "flash attention: on (transformers flash_attention_2); fused optimizer: on (torch AdamW fused)"
        )
        # its `holds` give it an estimate, and its `lever` offers it to a layout that does not fit
        shard = estimate(MODEL, cfg.sft, phase="sft").terms
        assert [(t.what, t.bytes) for t in shard[:2]] == [("weights", 4 * 139584), ("Adam moment shard", 8 * 69792)]
        ddp = cfg.sft.model_copy(update={"plugin": PluginConfig(name="torch_ddp", precision="bf16")})
        offered = fits_with(MODEL, ddp, "sft", capacity=10**12, cuda=False)
        assert "sft.plugin.name: dummy_zero, zero_stage: 1" in [label for label, _ in offered]
    finally:
        plugins.PLUGINS.pop("dummy_zero", None)
        engine_plugins.BUILDERS.pop("dummy_zero", None)
    with pytest.raises(ConfigError, match="unknown plugin 'dummy_zero'"):
        parse_config(raw)


def test_every_registered_plugin_has_an_engine_builder():
    from tasks.core.config.plugins import PLUGINS
    from tasks.engine.builders import BUILDERS

    assert set(PLUGINS) == set(BUILDERS)


def test_the_pipeline_is_the_stage_table_each_row_bound_to_a_task_and_the_runbook_names_no_stage():
    """A stage's name is written once, in its row of tasks/core/run/stages.py: the runbook
    (flows/cpt_to_sft/) and the pipeline's binding spell none, the runner reads the table. Every row
    has a task whose parameters take exactly the stages it reads (tasks/flowkit/pipeline.py
    `arguments`), each read and `held_by` is a row before it, each phase a PHASES row."""
    import flows.cpt_to_sft  # noqa: F401 - binds every stage module's task
    from tasks.core.config.phases import PHASES
    from tasks.core.run.stages import STAGE_NAMES, STAGES
    from tasks.flowkit import pipeline

    assert set(pipeline.TASKS) == set(STAGE_NAMES), "a row without a task, or a task bound to no row"
    for i, spec in enumerate(STAGES):
        earlier = set(STAGE_NAMES[:i])
        assert set(spec.reads) <= earlier and set(spec.parents) <= earlier, f"{spec.name} reads a later stage"
        assert spec.held_by is None or spec.held_by in earlier, spec.name
        assert spec.phase is None or spec.phase in PHASES, f"{spec.name}: phase {spec.phase!r} is no PHASES row"
        results = {name: f"<{name}>" for name in STAGE_NAMES}
        args = pipeline.arguments(spec, pipeline.TASKS[spec.name], "cfg", results)
        assert [results[r] for r in spec.reads] == [a for a in args if isinstance(a, str) and a in results.values()]
    # The runner names only the stages whose outcome run.json carries as a field of its own (and the card's export).
    own = {TASKS / "flowkit" / "run.py": {"export", "gate", "push_to_hub"}}
    spelled = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
        for path in [*_modules(ROOT / "flows" / "cpt_to_sft"), TASKS / "flowkit" / "pipeline.py", *own]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in set(STAGE_NAMES) - own.get(path, set())
    ]
    assert not spelled, "the runbook spells a stage's name; read it from the table's row:\n" + "\n".join(spelled)


# Where a string names a stage: the first argument of these calls or their `name=`/`stages=`, and
# a key of a `results` mapping (run.json's rows by stage).
_NAMING_CALLS = {"Stage", "StageResult", "WorkProgress", "task", "stage_task", "bind", "stage_event", "log_evaluation"}


def _docstrings(tree: ast.AST) -> set[int]:
    bodies = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, bodies)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }


def _stage_naming_strings(tree: ast.AST) -> set[int]:
    """The string constants of `tree` in a position that names a stage (_NAMING_CALLS, `results` keys)."""
    out: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if called in _NAMING_CALLS:
                out |= {id(a) for a in n.args[:1]}
                out |= {id(c) for k in n.keywords if k.arg in ("name", "stages") for c in ast.walk(k.value)}
            if called in ("get", "pop") and isinstance(f, ast.Attribute) and "results" in ast.unparse(f.value):
                out |= {id(a) for a in n.args[:1]}
        elif isinstance(n, ast.Subscript) and "results" in ast.unparse(n.value):
            out.add(id(n.slice))
    return out


def test_a_stage_name_is_a_string_in_the_table_only():
    """A stage's name is written once, in its row (tasks/core/run/stages.py); code names a stage by
    its row, `ROWS.<name>` (a task by `stage_task(ROWS.<name>)`), so a renamed row breaks every
    use, and each `ROWS.<name>` in the code is a row. A name that is also a config section
    (`export`, `benchmark`, `gate`), or the word an evaluation's record names its baseline by
    (`reference`), is a word of its own elsewhere (the benchmark's "export" model, run.json's "gate" field): those are held where a string names a stage (_NAMING_CALLS, a
    `results` key)."""
    from tasks.core.config.schema import RunConfig
    from tasks.core.run.stages import STAGE_NAMES

    # words a stage's name shares: the config sections, and "reference", which an evaluation's record
    # also names its baseline model by (the `reference` stage's log-probabilities are DPO's baseline)
    sections = set(RunConfig.model_fields) | {"reference"}
    table = TASKS / "core" / "run" / "stages.py"
    files = [p for d in ("tasks", "flows", "support", "benchmarks", "scripts") for p in _modules(ROOT / d)]
    spelled, unknown = [], []
    for path in files:
        if path == table:
            continue
        tree = ast.parse(path.read_text())
        skip, naming = _docstrings(tree), _stage_naming_strings(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and n.value in STAGE_NAMES and id(n) not in skip:
                if n.value not in sections or id(n) in naming:
                    spelled.append(f"{path.relative_to(ROOT)}:{n.lineno}: {n.value!r}")
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "ROWS":
                unknown += [f"{path.relative_to(ROOT)}:{n.lineno}: ROWS.{n.attr}"] if n.attr not in STAGE_NAMES else []
    assert not spelled, (
        "a stage's name spelled outside its row; name it by the row, ROWS.<name>.name "
        "(tasks/core/run/stages.py), and a task by @stage_task(ROWS.<name>):\n" + "\n".join(spelled)
    )
    assert not unknown, "ROWS.<name> of no row of tasks/core/run/stages.py STAGES:\n" + "\n".join(unknown)


def test_the_stage_name_check_sees_a_literal_a_naming_position_and_a_row_that_is_not():
    src = 'Stage("unshard", cfg)\nStageResult("export", s)\nresults.get("gate")\nx = {"export": 1}\n'
    tree = ast.parse(src)
    naming = _stage_naming_strings(tree)
    named = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) in naming]
    assert named == ["unshard", "export", "gate"]  # the dict key is run.json's field, not a stage
    from tasks.core.run.stages import ROWS

    assert ROWS.unshard.name == "unshard"
    with pytest.raises(AttributeError, match="no stage row named 'unshrd'"):
        ROWS.unshrd  # noqa: B018 - the lookup is what is tested


# A phase (cpt, sft, dpo: a `Phase` name, a `PhaseConfig` section) is never called a stage, the name of a
# row of the stage table: no parameter, annotated local or field holding one is named `stage` or `st`.
_PHASE_TYPES = re.compile(r"^(PhaseConfig|DpoConfig|Phase)( \| None)?$")


def phase_called_stage(path: Path) -> list[str]:
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = n.args
            named = [(x.arg, x.annotation, x.lineno) for x in a.posonlyargs + a.args + a.kwonlyargs]
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            named = [(n.target.id, n.annotation, n.lineno)]
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Attribute):
            named = [(n.target.attr, n.annotation, n.lineno)]
        else:
            continue
        for name, ann, line in named:
            if name in ("stage", "st") and ann is not None and _PHASE_TYPES.match(ast.unparse(ann).strip("'\"")):
                out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line} {name}")
    return out


def test_a_phase_is_called_a_phase_never_a_stage():
    from dataclasses import fields

    from tasks.core.run.job import Job
    from tasks.engine.faults import Fault

    found = [
        hit for room in (*RULED, "tests") for p in sorted((ROOT / room).rglob("*.py")) for hit in phase_called_stage(p)
    ]
    assert not found, "a Phase or PhaseConfig named stage/st (call it phase, phase_cfg):\n" + "\n".join(found)
    assert "phase" in Job.model_fields and "stage" not in Job.model_fields, "the job file names its phase `phase`"
    assert {"phase", "part"} <= {f.name for f in fields(Fault)} and "stage" not in {f.name for f in fields(Fault)}


def test_the_phase_name_check_sees_a_parameter_a_local_and_a_field(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "def f(stage: Phase, st: 'PhaseConfig', phase_cfg: PhaseConfig, spec: Stage):\n"
        "    st: PhaseConfig | None = None\n"
        "class C:\n    stage: DpoConfig\n    st: str\n    stage_dir: PhaseConfig\n"
    )
    assert [h.split(":")[1] for h in phase_called_stage(src)] == ["1 stage", "1 st", "2 st", "4 stage"]


def test_every_launch_backend_has_a_runner_and_a_new_one_is_a_row_plus_a_runner(tiny_model_dir, tmp_path):
    """BACKENDS (tasks/core/config/backends.py) and RUNNERS (tasks/core/launch/torchrun.py) have the same keys; a
    registered backend is accepted by the config, its rendezvous rule comes from its row, and
    run_engine dispatches to its runner without any other change."""
    import logging

    import tasks.core.launch.torchrun as launch_mod
    from tasks.core.config.backends import BACKENDS, BackendSpec, register
    from tasks.core.config.load import parse_config
    from tasks.core.errors import ConfigError
    from tasks.core.run.job import Job, Parent

    assert set(BACKENDS) == set(launch_mod.RUNNERS)
    ran = []
    register(BackendSpec(name="dummy_sched", summary="test", rendezvous="scheduler"))
    launch_mod.RUNNERS["dummy_sched"] = lambda verb, job, path, launch, rdzv, router, env: (
        ran.append((verb, launch.nnodes)) or router.line('[rank 0] @@progress {"step": 1}')
    )
    try:
        raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
        raw["cpt"]["launch"] = {"backend": "dummy_sched", "nnodes": 2, "nproc_per_node": 1}
        cfg = parse_config(raw)  # no rdzv_endpoint needed: the scheduler places it
        raw["cpt"]["launch"]["rdzv_endpoint"] = "h:1"
        with pytest.raises(ConfigError, match="dummy_sched backend places the rendezvous"):
            parse_config(raw)
        job = Job(
            verb="train",
            phase="cpt",
            phase_cfg=cfg.cpt,
            trust_remote_code=False,
            model_dir=tiny_model_dir,
            tokenizer_dir=tiny_model_dir,
            data_dir=tmp_path / "data",
            stage_dir=tmp_path / "run" / "cpt",
            parent=Parent(uri=None, digest=None),
            config_digest=None,
        )
        progress = launch_mod.run_engine(
            "train", job, tmp_path / "job.json", cfg.cpt.launch, "r", logging.getLogger("t")
        )
        assert ran == [("train", 2)] and progress == [{"step": 1}]
    finally:
        BACKENDS.pop("dummy_sched", None)
        launch_mod.RUNNERS.pop("dummy_sched", None)
    raw["cpt"]["launch"] = {"backend": "dummy_sched"}
    with pytest.raises(ConfigError, match="unknown launch backend 'dummy_sched'"):
        parse_config(raw)


def test_the_flow_process_starts_and_checks_without_torch_on_a_machine_without_gpus(tmp_path, tiny_model_dir):
    """No GPU device node here: the flow module, the whole pre-flight report and the kernel facts
    run without importing torch or transformers (a re-run that skips every stage pays neither);
    where a node exists, `cuda_available` asks torch."""
    import glob

    from tasks.core.config.kernels import GPU_DEVICE_NODES

    if not sys.platform.startswith("linux") or any(glob.glob(p) for p in GPU_DEVICE_NODES):
        pytest.skip("this machine has a GPU device node: torch is asked, as it should be")
    cfg = write_config(tmp_path / "run.yaml", tiny_config_raw(tiny_model_dir, tmp_path / "run"))
    probe = (
        "import sys, flows.cpt_to_sft\n"
        "from tasks.core.preflight.checks import load_for_check, preflight_report\n"
        "from tasks.core.config.kernels import Facts, cuda_available\n"
        f"report = preflight_report(load_for_check({str(cfg)!r}))\n"
        "assert not report.problems, report.problems\n"
        "assert cuda_available() is False and Facts.detect().cuda is False\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_tests_and_benchmarks_share_code_only_through_support():
    """benchmarks/ never imports tests/ nor tests/ benchmarks/ (by package or by a script's file name):
    what both use lives in support/, which imports neither. A test runs a benchmark as a subprocess."""
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    rules = {
        "benchmarks": {"tests"},
        "tests": {"benchmarks", *scripts},
        "support": {"tests", "benchmarks", *scripts},
    }
    bad = [
        f"{path.relative_to(ROOT)} imports {mod}"
        for folder, forbidden in rules.items()
        for path in _modules(ROOT / folder)
        for mod, _ in _imports(path)
        if mod.split(".")[0] in forbidden
    ]
    assert not bad, "tests/ and benchmarks/ share code through support/ only:\n" + "\n".join(bad)
    # a benchmark finds the checkout in one place, benchmarks/_checkout.py, its first import
    bootstrap = ROOT / "benchmarks" / "_checkout.py"
    inserts = [
        str(path.relative_to(ROOT))
        for folder in ("benchmarks", "support")
        for path in _modules(ROOT / folder)
        if "sys.path.insert(" in path.read_text() and path != bootstrap
    ]
    assert not inserts, f"sys.path changed outside benchmarks/_checkout.py: {inserts}"
    unbooted = [
        p.name
        for p in (ROOT / "benchmarks").glob("*.py")
        if p != bootstrap and "\nimport _checkout  # noqa: F401" not in p.read_text()
    ]
    assert not unbooted, f"benchmarks that do not import _checkout first: {unbooted}"


def test_support_is_read_from_the_checkout_never_installed():
    """support/ is not among the installed packages; pytest and the processes a test starts find it in the
    checkout."""
    import os
    import tomllib

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert not [p for p in find["include"] if p.startswith("support")], find
    assert str(ROOT) in os.environ["PYTHONPATH"].split(os.pathsep)  # tests/conftest.py, for child processes


def test_the_command_line_is_one_argument_parser():
    """flows/ builds one argument parser, in flows/cli.py: `python -m flows.cpt_to_sft` parses its argv as
    a command of it. A delegated subcommand (a whole CLI of its own, `cli.DELEGATED`) keeps its parser."""
    from flows.cli import DELEGATED

    delegated = {ROOT / "flows" / f"{fn.__name__.lstrip('_')}.py" for fn, _ in DELEGATED.values()}
    built = [
        str(path.relative_to(ROOT))
        for path in _modules(ROOT / "flows")
        if path not in delegated
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "ArgumentParser"
    ]
    assert built == ["flows/cli.py"], built
