"""Where relative paths in configs (run_root, data and model URIs) point: the project root.

    python -m tasks.core.config.paths        # prints the project root in effect

`run_root` may start with `~` and name environment variables (`$RUNS/x`, `${RUNS}/x`), expanded as a
shell would (`expand_user_path`) before it is judged relative or absolute; an unset variable is
refused, and so is one whose name says it holds a secret (its value would be written into run.json
and every log line that names the run root).

A path that does not exist is named with its look-alike when one is there (`missing_hint`): a name
stored NFD on disk while the config says it NFC (macOS, archives), or in another case.

1. `$CPT_TO_SFT_HOME` when set (a deployment's worker sets it to its checkout);
2. the checkout the package is imported from, when it has a pyproject.toml (editable install or
   `python -m` from a clone): relative paths resolve the same wherever the flow runs from;
3. otherwise (a non-editable `pip install .`: the package lives in site-packages) the current
   working directory, so `cpt-to-sft run --config examples/x.yaml` inside a checkout
   resolves like `python -m flows.cpt_to_sft` there, never against site-packages.
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path
from typing import Any

# The directory holding the `tasks` package: a checkout, or site-packages when installed.
REPO_ROOT = Path(__file__).resolve().parents[3]


def project_root() -> Path:
    home = os.environ.get("CPT_TO_SFT_HOME")
    if home:
        return Path(home).expanduser().resolve()
    if (REPO_ROOT / "pyproject.toml").is_file():
        return REPO_ROOT
    return Path.cwd()


def resolve_local(path_or_uri: str) -> str:
    """A relative local path is relative to the project root; URIs and absolute paths are kept."""
    if "://" in path_or_uri or Path(path_or_uri).is_absolute():
        return path_or_uri
    return str(project_root() / path_or_uri)


_VAR = re.compile(r"\$(?:\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand_user_path(value: str) -> str:
    """`value` with `$NAME` and `${NAME}` replaced by the environment's values and a leading `~` or
    `~user` by that home directory, as a shell expands a path; ValueError naming the variable when
    one is unset, not a name, or named like a secret. A `$` not followed by a name stays as it is."""
    from tasks.core.config.tracking import secret_named

    def one(m: re.Match) -> str:
        name = m.group(2) if m.group(2) is not None else m.group(1)
        if not _NAME.fullmatch(name):
            raise ValueError(f"{m.group(0)!r} is no environment variable: write $NAME or ${{NAME}}, or the path itself")
        if secret_named(name):
            raise ValueError(
                f"${name} is named like a secret, and the value would be written into run.json and the logs: "
                "write the path out, or name a variable that holds only it"
            )
        if name not in os.environ:
            raise ValueError(
                f"the environment variable ${name} is not set here: export {name} before the run, or write the path out"
            )
        return os.environ[name]

    out = value
    if out.startswith("~"):  # first, as a shell does: a variable's value is not expanded again
        home = os.path.expanduser(out)
        if home.startswith("~"):  # expanduser keeps it when the user or HOME is unknown
            user = out[1:].split("/", 1)[0]
            said = f"no user {user!r} here" if user else "no home directory (HOME is not set)"
            raise ValueError(f"{out.split('/', 1)[0]!r}: {said}; write the path out")
        out = home
    return _VAR.sub(one, out)


LISTING_CAP = 10_000  # entries of one folder compared with a missing name: a huge folder is not scanned


def _fold(name: str) -> str:
    return unicodedata.normalize("NFC", name).casefold()


def look_alike(fs: Any, path: str) -> tuple[str, list[tuple[str, str]]] | None:
    """(the path that exists, [(the name asked, the name stored)...]) when `path` does not exist but
    one does whose names differ from it only by Unicode normalization (stored NFD, asked NFC) or by
    case, folder by folder from the deepest one that exists; None otherwise. `fs`: fsspec's."""
    parts = path.rstrip("/").split("/")
    k = len(parts)
    while k > 1 and not _exists(fs, "/".join(parts[:k])):
        k -= 1
    if k == len(parts):
        return None
    found, renamed = "/".join(parts[:k]), []
    for name in parts[k:]:
        try:
            listing = fs.ls(found or "/", detail=False)
        except Exception:  # an unreadable folder: no hint, the error stands as it is
            return None
        names = [str(e).rstrip("/").rsplit("/", 1)[-1] for e in listing[:LISTING_CAP]]
        if name not in names:
            same = [n for n in names if _fold(n) == _fold(name)]
            if not same:
                return None
            renamed.append((name, same[0]))
            name = same[0]
        found = f"{found}/{name}"
    return found, renamed


def _exists(fs: Any, path: str) -> bool:
    try:
        return bool(fs.exists(path or "/"))
    except Exception:
        return False


def missing_hint(fs: Any, path: str) -> str:
    """The look-alike of a path that does not exist, said with the fix ("" when there is none)."""
    got = look_alike(fs, path)
    if got is None:
        return ""
    there, renamed = got
    said = []
    for asked, stored in renamed:
        nfc = unicodedata.normalize("NFC", stored)
        how = (
            [f"in Unicode {'NFD' if unicodedata.is_normalized('NFD', stored) else 'another form'}"]
            if nfc != stored
            else []
        )
        how += ["in another case"] if nfc != unicodedata.normalize("NFC", asked) else []
        said.append(
            f"stored as {stored!a}, {' and '.join(how) or 'in another Unicode form'}; the config says {asked!a}"
        )
    return (
        f"; a look-alike exists: {there!r} ({'; '.join(said)}): name it exactly as stored, or rename it to the "
        "config's name"
    )


if __name__ == "__main__":
    print(project_root())
