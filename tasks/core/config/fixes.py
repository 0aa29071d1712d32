"""A refusal's fixes as data: each one a set of dotted overrides that together make the rule pass.

    python -c "from tasks.core.config.fixes import render; print(render('cpt', {'plugin.zero_stage': 1, 'plugin.precision': 'bf16'}))"

A layout rule (tasks/core/config/layout.py) returns `Refusal(field, why, fixes)`: a (field, message)
pair like every other problem, which also carries its candidate fixes, keys relative to the stage
section (`plugin.zero_stage`). `layout_problems` keeps only the fixes that work, applying each to
the stage and running every rule it can decide again, whichever tier refused (a fix after which
another rule still refuses is completed with that rule's own fix, so two fields that must change
together are offered together), and renders them into the message with the full config path, so
what the message says is what a test can apply.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Fix = dict[str, Any]


class Refusal(tuple):
    """(field, message), plus `why` (the message without its fixes) and the candidate `fixes`."""

    fixes: tuple[Fix, ...]
    why: str
    rule: str = ""  # the layout rule that refused (set by layout_problems)

    def __new__(cls, field: str, why: str, fixes: list[Fix] | tuple[Fix, ...] = (), message: str | None = None):
        self = super().__new__(cls, (field, message or why))
        self.why, self.fixes = why, tuple(fixes)
        return self

    def with_fixes(self, fixes: list[Fix], where: str) -> Refusal:
        """The same refusal whose message ends with the fixes that work (in the config's words)."""
        said = "; or ".join(render(where, f) for f in fixes)
        out = Refusal(self[0], self.why, fixes, message=f"{self.why}; {said}" if said else self.why)
        out.rule = self.rule
        return out


def shown(value: Any) -> str:
    """A value as the YAML file would say it."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def render(where: str, fix: Fix) -> str:
    """'set cpt.plugin.zero_stage: 1 and cpt.plugin.precision: bf16'."""
    return "set " + " and ".join(f"{where}.{k}: {shown(v)}" for k, v in fix.items())


def dotted(where: str, fix: Fix) -> Fix:
    """The fix as overrides of the whole config (`--set` keys)."""
    return {f"{where}.{k}": v for k, v in fix.items()}


def apply(section: dict[str, Any], fix: Fix) -> dict[str, Any]:
    """A copy of a phase section (plain data) with the fix's dotted keys set."""
    import copy

    out = copy.deepcopy(section)
    for key, value in fix.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[leaf] = value
    return out


def apply_model(model: Any, fix: Fix) -> Any:
    """A copy of a (pydantic) config section with the fix's dotted keys set, unvalidated: the
    values come from the rules' own fixes."""
    updates: dict[str, Any] = {}
    for key, value in fix.items():
        head, _, rest = key.partition(".")
        if rest:
            inner = updates.get(head, getattr(model, head))
            if inner is None:
                return None
            updates[head] = apply_model(inner, {rest: value})
        else:
            updates[head] = value
    return model.model_copy(update=updates)


def working_fixes(
    section: Any, refused: Refusal, found: list[Refusal], broken: Callable[[Any], list[Refusal] | None]
) -> list[Fix]:
    """`refused.fixes` that work on the stage `section`, each completed in every way that works;
    `broken` gives a section's refusals (None: the fix does not apply), `found` those it has now.
    A fix works when every rule passes with it applied, the refusals `found` of other rules included
    (size 3 refused for the heads is not fixed by a seq_len that is a multiple of 3): another rule's
    refusal is completed with that rule's own fixes, and where those alone would do, they are the fix."""
    said = {(p.rule, p[0]) for p in found if not p.fixes}  # refusals said in words: nothing to complete them with
    before = {(p.rule, p[0]) for p in found}
    out: list[Fix] = []
    for fix in refused.fixes:
        for done in _completed(section, fix, refused, said, broken, depth=2):
            extra = {k: v for k, v in done.items() if k not in fix}
            if extra and _only_before(section, fix, before, broken) and _passes(section, extra, refused, said, broken):
                done = extra  # another refusal's own fix settles this one too: the seq_len change is not needed
            if done not in out:
                out.append(done)
    return out


def _only_before(
    section: Any, fix: Fix, before: set[tuple[str, str]], broken: Callable[[Any], list[Refusal] | None]
) -> bool:
    """Whether what still refuses with `fix` applied refused before it too (the fix broke nothing new)."""
    changed = apply_model(section, fix)
    after = None if changed is None else broken(changed)
    return after is not None and all((p.rule, p[0]) in before for p in after)


def _passes(
    section: Any, fix: Fix, refused: Refusal, said: set[tuple[str, str]], broken: Callable[[Any], list[Refusal] | None]
) -> bool:
    changed = apply_model(section, fix)
    after = None if changed is None else broken(changed)
    return after is not None and all((p.rule, p[0]) in said and p.rule != refused.rule for p in after)


def _completed(
    section: Any,
    fix: Fix,
    refused: Refusal,
    said: set[tuple[str, str]],
    broken: Callable[[Any], list[Refusal] | None],
    depth: int,
) -> Iterator[Fix]:
    """`fix`, completed with other rules' fixes where the stage still breaks them (up to `depth`
    more), each way the stage then breaks no rule but those said in words (`said`)."""
    changed = apply_model(section, fix)
    after = None if changed is None else broken(changed)
    if after is None or any(p.rule == refused.rule for p in after):
        return
    left = [p for p in after if (p.rule, p[0]) not in said]
    if not left:
        yield fix
        return
    if depth == 0:
        return
    for extra in left[0].fixes:
        if not any(_overlap(a, b) for a in extra for b in fix):
            yield from _completed(section, {**fix, **extra}, refused, said, broken, depth - 1)


def _overlap(a: str, b: str) -> bool:
    """Two dotted keys that set the same value, or one inside the other (`plugin.x` and `plugin.x.mode`)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")
