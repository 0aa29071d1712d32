"""YAML from untrusted files, parsed under a bound: on size, on nesting, and on what aliases expand to.

    python -c "from tasks.core.config.bounded_yaml import load_bounded; print(load_bounded('a: &x [1, 2]\\nb: [*x, *x]', 'demo'))"

PyYAML composes a document into a node graph in which an alias is the anchored node itself, so
`a: &a [x, x]`, `b: &b [*a, *a]`, ... stays a few hundred bytes while its expansion doubles per
level; whatever walks the expansion (the duplicate-key scan, pydantic, `yaml.safe_dump`, a JSON
dump into run.json) then takes hours. Here the graph is walked once, each node visited once
(memoized), counting how many nodes its full expansion holds (merge keys `<<` included, which
PyYAML's constructor flattens into copies); a document over `max_nodes` expanded nodes, over
`max_bytes`, nested deeper than `max_depth` or holding a recursive alias is refused with a
ConfigError naming the file and the fix, before anything is constructed. The same single walk
finds a mapping key written twice (PyYAML silently keeps the last), naming both lines.

Used for the run config and `--set` values (`tasks.core.config.load`) and offered to every other
reader of YAML a user supplies (benchmark task files: `loader=` takes their SafeLoader subclass).
"""

from __future__ import annotations

from typing import Any

import yaml

from tasks.core.errors import ConfigError

MAX_BYTES = 1 << 20  # a run config is a few KB; a task file tens of KB
MAX_NODES = 100_000  # expanded nodes (scalars, sequences, mappings, keys): a config has a few hundred
MAX_DEPTH = 64  # nesting levels; PyYAML's own recursive composer fails near 300
_MERGE = "tag:yaml.org,2002:merge"


def _refuse(source: str, why: str) -> ConfigError:
    return ConfigError([(source, why)], header=f"refused to parse {source}")


def check_size(size: int, source: str, max_bytes: int = MAX_BYTES) -> None:
    """Refuse a file of `size` bytes over the bound (callers judge a file by its size before reading it)."""
    if size > max_bytes:
        raise _refuse(
            source,
            f"{size:,} bytes, over the {max_bytes:,} a YAML file here may hold; is it the right file? "
            "Split it, or move data into the files it names",
        )


class _Walk:
    """One pass over a composed node graph: expanded sizes (memoized per node) and duplicated keys."""

    def __init__(self, source: str, max_nodes: int, max_depth: int, unique_keys: bool):
        self.source, self.max_nodes, self.max_depth, self.unique_keys = source, max_nodes, max_depth, unique_keys
        self.size: dict[int, int] = {}
        self.open: set[int] = set()
        self.dups: list[tuple[str, int, int]] = []

    def __call__(self, node: yaml.Node, path: str, depth: int) -> int:
        key = id(node)
        if key in self.size:
            return self.size[key]
        line = node.start_mark.line + 1
        if key in self.open:
            raise _refuse(
                self.source,
                f"line {line} ({path or 'top'}): an alias refers to a node that contains it (a recursive "
                "structure has no finite value); write the value out instead of the alias",
            )
        if depth > self.max_depth:
            raise _refuse(
                self.source,
                f"line {line} ({path or 'top'}): nested more than {self.max_depth} levels deep; flatten the structure",
            )
        self.open.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, value_node in node.value:
                name = (
                    key_node.value
                    if isinstance(key_node, yaml.ScalarNode)
                    else f"<key at line {key_node.start_mark.line + 1}>"
                )
                where = f"{path}.{name}" if path else str(name)
                if self.unique_keys and key_node.tag != _MERGE:  # `<<: *anchor` may repeat by design
                    if name in seen:
                        self.dups.append((where, seen[name], key_node.start_mark.line + 1))
                    else:
                        seen[name] = key_node.start_mark.line + 1
                total += self(key_node, where, depth + 1) + self(value_node, where, depth + 1)
                self._check(total, node, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                total += self(item, f"{path}[{i}]", depth + 1)
                self._check(total, node, path)
        self.open.discard(key)
        self.size[key] = total
        return total

    def _check(self, total: int, node: yaml.Node, path: str) -> None:
        if total > self.max_nodes:
            raise _refuse(
                self.source,
                f"line {node.start_mark.line + 1} ({path or 'top'}): more than {self.max_nodes:,} values once its "
                "aliases are expanded (anchors `&` referred to by `*`, nested, multiply the values below them; a "
                "config holds a few hundred); use fewer nested aliases, or write the values out",
            )


def load_bounded(
    text: str,
    source: str,
    *,
    loader: type[yaml.SafeLoader] = yaml.SafeLoader,
    unique_keys: bool = True,
    max_bytes: int = MAX_BYTES,
    max_nodes: int = MAX_NODES,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """The one document of `text` (`source`: the file, for messages), constructed by `loader` only
    after the bounds hold; ConfigError naming `source` otherwise, or naming each key written twice
    (with `unique_keys`). yaml.YAMLError (a syntax error, a tag the loader refuses) passes through."""
    check_size(len(text.encode("utf-8", "surrogatepass")), source, max_bytes)
    doc = loader(text)
    try:
        try:
            node = doc.get_single_node()
        except RecursionError:
            raise _refuse(source, f"nested too deeply to parse (more than {max_depth} levels); flatten it") from None
        if node is None:
            return None
        walk = _Walk(source, max_nodes, max_depth, unique_keys)
        walk(node, "", 0)
        if walk.dups:
            raise ConfigError(
                [
                    (
                        key,
                        (
                            f"written twice in {source} (line {a} and line {b}); YAML would silently keep the "
                            "second value. Delete one of them"
                        ),
                    )
                    for key, a, b in walk.dups
                ],
                header=f"duplicated keys in {source}",
            )
        return doc.construct_document(node)
    finally:
        doc.dispose()
