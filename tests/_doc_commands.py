"""Parse every shell command the documentation shows, at `--help` level: nothing is run.

    echo '[["cpt-to-sft", "check", "--config", "FILE"]]' | python -m tests._doc_commands

Reads a JSON list of argv lists on stdin and prints one JSON list of problems (empty: all parse).
Run in a process of its own by tests/test_docs.py: modules are imported and their `main` run
in-process up to `ArgumentParser.parse_args`, which is made to stop right there, so an argument
the parser refuses (an unknown option, a missing required one, a stage name `--stop-after` does
not know) is a problem and a command that parses does no work. A module without argparse is only
checked to exist: running it would do its work.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import re
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class Parsed(Exception):
    """Raised by parse_args after it accepted the arguments."""


def _stop_after_parse() -> None:
    """The outermost parse_args / parse_known_args raises Parsed once it accepted its arguments
    (a sub-command's parser runs inside it, and parse_args refuses leftovers before returning)."""
    depth = [0]

    def wrap(original):
        def wrapper(self, args=None, namespace=None):
            depth[0] += 1
            try:
                result = original(self, args, namespace)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise Parsed
            return result

        return wrapper

    argparse.ArgumentParser.parse_args = wrap(argparse.ArgumentParser.parse_args)
    argparse.ArgumentParser.parse_known_args = wrap(argparse.ArgumentParser.parse_known_args)


def _parses(call, argv: list[str], what: str) -> str | None:
    """None when `call` reaches a parse_args that accepts `argv` (or prints its help), else why not."""
    err = io.StringIO()
    old = sys.argv
    sys.argv = [what, *argv]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            call()
    except Parsed:
        return None
    except SystemExit as exc:
        return (
            None
            if exc.code in (0, None)
            else f"{what} {' '.join(argv)}: {err.getvalue().strip().splitlines()[-1:] or exc.code}"
        )
    finally:
        sys.argv = old
    return f"{what} {' '.join(argv)}: finished without reaching an argument parser"


def _uses_argparse(path: Path) -> bool:
    """The module parses its arguments, itself or (`python -m flows.cpt_to_sft`) through flows/cli.py."""
    return path.is_file() and any(word in path.read_text() for word in ("argparse", "from flows.cli import"))


def _module_path(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None
    if spec.submodule_search_locations:  # a package: its __main__
        main = Path(spec.origin).parent / "__main__.py"
        return main if main.exists() else None
    return Path(spec.origin)


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))


def _prefect(argv: list[str]) -> str | None:
    """The command path exists (its `--help` prints, `--help` being eager after any argument) and
    every long option shown is in that help."""
    from prefect.cli import app

    words = [a for a in argv if not a.startswith("-")]
    options = [a.split("=")[0] for a in argv if a.startswith("--")]
    out, code, old = io.StringIO(), None, sys.argv
    sys.argv = ["prefect", *words, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            app()
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = old
    text = out.getvalue()
    if code not in (0, None):
        return f"prefect {' '.join(argv)}: {' '.join(text.split())[:300]}"
    missing = [o for o in options if o not in text]
    return f"prefect {' '.join(argv)}: options not in its help: {missing}" if missing else None


def check(argv: list[str]) -> str | None:
    prog, args = argv[0], argv[1:]
    if prog == "cpt-to-sft":
        from flows.cli import main

        return _parses(lambda: main(args), args, prog)
    if prog == "python" and args[:1] == ["-c"]:
        try:
            compile(args[1], "<doc>", "exec")
        except SyntaxError as exc:
            return f"python -c: {exc}"
        return None
    if prog == "python" and args[:1] == ["-m"]:
        name, rest = args[1], args[2:]
        path = _module_path(name)
        if path is None:
            return f"python -m {name}: no such module"
        if not _uses_argparse(path):
            return None
        return _parses(lambda: runpy.run_module(name, run_name="__main__", alter_sys=True), rest, name)
    if prog == "python":
        path = REPO / args[0]
        if not path.is_file():
            return f"python {args[0]}: no such file"
        if not _uses_argparse(path):
            return None
        sys.path.insert(0, str(REPO))
        return _parses(lambda: runpy.run_path(str(path), run_name="__main__"), args[1:], args[0])
    if prog == "bash":
        return None if (REPO / args[0]).is_file() else f"bash {args[0]}: no such file"
    if prog == "make":
        unknown = [t for t in args if not t.startswith("-") and "=" not in t and t not in _makefile_targets()]
        return f"make: no target {unknown} in the Makefile" if unknown else None
    if prog == "prefect":
        return _prefect(args)
    if prog == "mkdocs":
        return None if args and args[0] in ("build", "serve") else f"mkdocs {args}: not a documented use"
    return f"{prog}: a command the docs test does not know how to check; teach tests/test_docs.py"


def main() -> None:
    _stop_after_parse()
    commands = json.load(sys.stdin)
    problems = [p for argv in commands if (p := check(argv))]
    print(json.dumps(problems))


if __name__ == "__main__":
    main()
