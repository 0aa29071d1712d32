"""The Jinja sandbox every template of a benchmark task renders in: jinja2's immutable sandbox with
lm-eval's settings, and bounds on the work of a render and on what any one step of it builds.

    python -c "from tasks.core.evaluation.sandbox import BoundedSandbox; print(BoundedSandbox().from_string('{{ q|upper }}').render(q='ok'))"

A render may take MAX_STEPS loop steps and calls and produce MAX_OUTPUT characters; no single step
may build more than MAX_OUTPUT either. What can make its output larger than its inputs by a factor
its arguments choose (`*`, `%` and the `format` filter's widths, `center`/`ljust`/`rjust`/`zfill`,
`indent`, `join`, `replace`, `wordwrap`, `batch`/`slice` fills, `tojson`'s indent, `str.format`'s
widths and repeated fields, `translate`, `expandtabs`, `int.to_bytes`, `lipsum`, `regex_replace`,
`sum` of lists) is sized from its arguments before it runs; every other filter, call, `+`, `~` and
printed `{{ value }}` is measured after (so growth by a fixed factor, as escape or urlencode, cannot
compound); a value's size counts a repeated reference each time, as str() writes it. Refused with
jinja2's SecurityError naming the step, the size and the fix (task_rules.py installs the sandbox
over lm-eval's environment).
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from jinja2 import BaseLoader, StrictUndefined, nodes
from jinja2 import filters as jinja_filters
from jinja2.environment import Template
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace, generate_lorem_ipsum, pass_environment, pass_eval_context
from jinja2.visitor import NodeTransformer
from markupsafe import EscapeFormatter, Markup

# --- the sandbox every task template renders in -------------------------------------------------

MAX_STEPS = 1_000_000  # loop iterations and calls in one render; a prompt takes tens
MAX_OUTPUT = 8 << 20  # characters one render may produce or one `*` may build
_budget = threading.local()


def _tick() -> None:
    _budget.steps = getattr(_budget, "steps", 0) + 1
    if _budget.steps > MAX_STEPS:
        raise SecurityError(f"a task template took more than {MAX_STEPS} loop steps and calls in one render")


def _each(iterable: Iterable) -> Iterator:
    for item in iterable:
        _tick()
        yield item


class BoundedTemplate(Template):
    def render(self, *args: Any, **kwargs: Any) -> str:
        _budget.steps = 0
        ctx = self.new_context(dict(*args, **kwargs))
        out, size = [], 0
        try:
            for chunk in self.root_render_func(ctx):
                size += len(chunk)
                if size > MAX_OUTPUT:
                    raise SecurityError(f"a task template rendered more than {MAX_OUTPUT} characters")
                out.append(chunk)
            return "".join(out)
        except Exception:
            self.environment.handle_exception()


# --- output bounds: what any one step of a render may build ---------------------------------------
# The loop and call budget bounds the work of a render, not what one step builds: `'%0300000000d'
# % 1`, `'x'.center(10**9)`, `s|indent(10**9)` or `range(99999)|join(big)` each allocate their whole
# result in one step. Every operation that can make its output larger than its inputs by a factor
# its arguments choose is checked *before* it runs (its output size computed from the arguments);
# every other filter, call, `+`, `~` and printed value is checked after, so growth by a fixed
# factor (escape, urlencode, upper) cannot compound across steps either.

_FIX = "render the document's own fields; padding, repeats and wide fields have no place in a prompt"
_END = object()


def _over(what: str, size: int) -> SecurityError:
    return SecurityError(
        f"a task template's {what} would build {size} characters, over the {MAX_OUTPUT} one render may hold; {_FIX}"
    )


def _size(obj: Any, budget: int = MAX_OUTPUT) -> int:
    """At least how many characters str(obj) writes, counted until past `budget` (then budget + 1):
    a container repeating one reference counts it each time, as str() writes it each time."""
    total, stack = 0, [iter((obj,))]
    while stack:
        o = next(stack[-1], _END)
        if o is _END:
            stack.pop()
            continue
        if isinstance(o, (str, bytes, bytearray)):
            total += len(o)
        elif isinstance(o, bool) or o is None:
            total += 4
        elif isinstance(o, int):
            total += o.bit_length() // 4 + 1
        elif isinstance(o, dict):
            total += 2
            stack.append(iter(o.items()))
        elif isinstance(o, (list, tuple, set, frozenset, type({}.keys()), type({}.values()), type({}.items()))):
            total += 2
            stack.append(iter(o))
        elif isinstance(o, Namespace):
            total += 12
            stack.append(iter(object.__getattribute__(o, "_Namespace__attrs").items()))
        else:
            total += 1
        if total > budget:
            return budget + 1
    return total


def _need(what: str, size: int) -> None:
    if size > MAX_OUTPUT:
        raise _over(what, size)


def _checked(what: str, value: Any) -> Any:
    _need(what, _size(value))
    return value


def _num(value: Any) -> int:
    """A width, count or precision as an int (a digit string too; 0 when it is none)."""
    if isinstance(value, str):
        return int(value) if len(value) <= 18 else 10**18
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


_PRINTF = re.compile(r"%(?:\(([^)]*)\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([diouxXeEfFgGcrsa%])")


def _printf_size(fmt: str, args: Any) -> int:
    """The characters `fmt % args` builds, at least: the text plus, per conversion, the widest of
    its width, its precision and its value (a mapping key's value, or the next positional one)."""
    positional = list(args) if isinstance(args, tuple) else [args]
    total, i = len(fmt), 0

    def take() -> Any:
        nonlocal i
        i += 1
        return positional[i - 1] if i <= len(positional) else None

    for m in _PRINTF.finditer(fmt):
        key, width, prec, conv = m.groups()
        if conv == "%":
            continue
        w = _num(take() if width == "*" else width)
        p = _num(take() if prec == "*" else prec)
        value = (args.get(key) if isinstance(args, dict) else None) if key is not None else take()
        total += max(abs(w), p, _size(value)) + 2
        if total > MAX_OUTPUT:
            break
    return total


def _format_spec_size(spec: str) -> int:
    return max((_num(d) for d in re.findall(r"\d+", spec)), default=0)


class _BoundedFormatter(SandboxedFormatter):
    """str.format in the sandbox, each field's width and value counted before it is formatted."""

    def vformat(self, format_string, args, kwargs):
        self._total = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        self._total += max(_size(value), _format_spec_size(format_spec))
        _need("str.format", self._total)
        return super().format_field(value, format_spec)


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    pass


def _text(value: Any, what: str) -> str:
    _need(what, _size(value))
    return str(value)


# Filters whose output its arguments can make as large as they please: checked before they run
# (the same signature as jinja2's filter, less its context argument).
def _pre_format(value, *args, **kwargs):
    _need("`format` filter", _printf_size(_text(value, "`format` filter"), kwargs or args))


def _pre_center(value, width=80):
    _need("`center` filter", max(_size(value), _num(width)))


def _pre_indent(s, width=4, first=False, blank=False):
    text = _text(s, "`indent` filter")
    pad = len(width) if isinstance(width, str) else _num(width)
    _need("`indent` filter", len(text) + (text.count("\n") + 1) * pad)


def _pre_replace(s, old, new, count=None):
    text, old, new = _text(s, "`replace` filter"), str(old), _text(new, "`replace` filter")
    n = text.count(old) if old else len(text) + 1
    if count is not None and _num(count) >= 0:
        n = min(n, _num(count))
    _need("`replace` filter", len(text) + n * (len(new) - len(old)))


def _pre_wordwrap(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    text = _text(s, "`wordwrap` filter")
    lines = min(len(text), len(text) // max(_num(width), 1) + text.count(" ") + text.count("\n")) + 1
    _need("`wordwrap` filter", len(text) + lines * len(str(wrapstring or "\n")))


def _pre_batch(value, linecount, fill_with=None):
    if fill_with is not None:
        _need("`batch` filter's fill", _num(linecount) * (_size(fill_with) + 2))


def _pre_slice(value, slices, fill_with=None):
    _need("`slice` filter", _num(slices) * (_size(fill_with) + 2 if fill_with is not None else 2))


def _pre_tojson(value, indent=None):
    if (len(indent) if isinstance(indent, str) else _num(indent)) > 64:
        raise SecurityError(f"a task template's `tojson` filter indents by {indent!r} (at most 64); {_FIX}")


def _pre_urlize(value, trim_url_limit=None, nofollow=False, target=None, rel=None, extra_schemes=None):
    for name, arg in (("target", target), ("rel", rel)):
        if arg is not None and _size(arg) > 256:
            raise SecurityError(f"a task template's `urlize` filter adds a {name} of over 256 characters to each link")


_PRE_FILTERS = {
    "format": _pre_format,
    "center": _pre_center,
    "indent": _pre_indent,
    "replace": _pre_replace,
    "wordwrap": _pre_wordwrap,
    "batch": _pre_batch,
    "slice": _pre_slice,
    "tojson": _pre_tojson,
    "urlize": _pre_urlize,
}


def _bounded_filter(name: str, fn: Any) -> Any:
    """jinja2's filter `fn` with its output bounded (before it runs where `_PRE_FILTERS` says how)."""
    head = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # the context jinja2 passes first
    pre = _PRE_FILTERS.get(name)
    what = f"`{name}` filter"

    @functools.wraps(fn)  # keeps jinja_pass_arg
    def run(*args: Any, **kwargs: Any) -> Any:
        if pre is not None:
            pre(*args[head:], **kwargs)
        return _checked(what, fn(*args, **kwargs))

    return run


@pass_eval_context
def _join(eval_ctx, value, d="", attribute=None):
    items = list(value)
    _need("`join` filter", sum(_size(i) for i in items) + max(len(items) - 1, 0) * _size(d))
    return _checked("`join` filter", jinja_filters.sync_do_join(eval_ctx, items, d, attribute))


@pass_environment
def _sum(environment, iterable, attribute=None, start=0):
    """jinja2's `sum`; lists and tuples joined in one pass, not by repeated `+`
    (whose time grows with the square of the count)."""
    if not isinstance(start, (list, tuple)):
        return _checked("`sum` filter", jinja_filters.sync_do_sum(environment, iterable, attribute, start))
    if attribute is not None:
        iterable = map(jinja_filters.make_attrgetter(environment, attribute), iterable)
    items = list(iterable)
    for item in items:
        if type(item) is not type(start):
            raise TypeError(f"can only concatenate {type(start).__name__} (not {type(item).__name__!r})")
    _need("`sum` filter", _size(start) + sum(_size(i) for i in items))
    return type(start)(itertools.chain(start, *items))


def _lipsum(n=5, html=True, min=20, max=100):  # jinja2's names and defaults
    _need("lipsum()", _num(n) * _num(max) * 12)
    return generate_lorem_ipsum(n, html, min, max)


def _regex_replace(string, pattern, repl, count: int = 0):
    """lm-eval's `regex_replace` filter, its output counted as it is built."""
    text = _text(string, "`regex_replace` filter")
    rx = re.compile(pattern)
    # re.sub's own expansion of `repl`, parsed once (Match.expand parses it again at every match)
    expand = re._subx(rx, repl) if hasattr(re, "_subx") else (lambda m: m.expand(repl))
    total = len(text)

    def one(m: re.Match) -> str:
        nonlocal total
        out = expand if isinstance(expand, str) else expand(m)
        total += len(out) - (m.end() - m.start())
        _need("`regex_replace` filter", total)
        return out

    return rx.sub(one, text, count=count)


def _concat(*parts: Any) -> str:
    """jinja2's `~`, its operands counted before they are joined."""
    _need("`~`", sum(_size(p) for p in parts))
    return "".join(str(p) for p in parts)  # str of an undefined raises, as jinja2's own join does


def _finalize(value: Any) -> Any:
    """Every `{{ value }}` is counted before str() writes it (a list may hold one big string 10^5 times)."""
    return _checked("printed value", value)


class _Meter(NodeTransformer):
    """Rewrites a parsed template: every loop counts its steps and every `~` its output."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name("_cpt_each", "load"), [node.iter], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(nodes.Name("_cpt_concat", "load"), node.nodes, [], None, None, lineno=node.lineno)


# Bound methods of str and bytes whose output its arguments size, as jinja2's filters above.
def _method_size(obj: Any, args: tuple, kwargs: dict) -> int | None:
    name, owner = getattr(obj, "__name__", None), getattr(obj, "__self__", None)
    if isinstance(owner, int) and not isinstance(owner, bool) and name == "to_bytes":
        return _num(args[0] if args else kwargs.get("length", 1))
    if not isinstance(owner, (str, bytes)):
        return None
    n = len(owner)
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(n, _num(args[0] if args else kwargs.get("width", 0)))
    if name == "expandtabs":
        return n + owner.count("\t" if isinstance(owner, str) else b"\t") * _num(
            args[0] if args else kwargs.get("tabsize", 8)
        )
    if name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        if not isinstance(old, type(owner)) or not isinstance(new, type(owner)):
            return None
        times = owner.count(old) if old else n + 1
        limit = _num(args[2]) if len(args) > 2 else _num(kwargs.get("count", -1))
        return n + (min(times, limit) if limit >= 0 else times) * (len(new) - len(old))
    if name == "join" and args:
        items = args[0] if isinstance(args[0], (list, tuple)) else None
        if items is None:
            return None
        return sum(_size(i) for i in items) + max(len(items) - 1, 0) * n
    if name == "translate" and args and isinstance(args[0], dict):
        widest = max((_size(v) for v in args[0].values()), default=1)
        return n * max(widest, 1)
    return None


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox (no private attributes, no mutation of the document) with lm-eval's
    settings and its `regex_replace` filter, and bounds: loop steps and calls, and the output of the
    render and of every step that can make text or a sequence larger (`*`, `+`, `%`, `~`, `**`,
    every filter, str.format, the string methods that pad, repeat or join, lipsum)."""

    template_class = BoundedTemplate
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(loader=BaseLoader(), undefined=StrictUndefined, keep_trailing_newline=True, finalize=_finalize)
        self.filters["regex_replace"] = _regex_replace
        self.filters.update({"join": _join, "sum": _sum})
        for name, fn in list(self.filters.items()):
            self.filters[name] = _bounded_filter(name, fn)
        self.globals.update(_cpt_each=_each, _cpt_concat=_concat, lipsum=_lipsum)

    def _parse(self, source, name, filename):
        return _Meter().visit(super()._parse(source, name, filename))

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        f_self = value.__self__
        formatter = (
            _BoundedEscapeFormatter(self, escape=f_self.escape)
            if isinstance(f_self, Markup)
            else _BoundedFormatter(self)
        )
        is_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            return type(f_self)(formatter.vformat(f_self, args, kwargs))

        return functools.update_wrapper(bounded, value)

    def call(self, context, obj, /, *args, **kwargs):
        _tick()
        size = _method_size(obj, args, kwargs)
        if size is not None:
            _need(f"{type(obj.__self__).__name__}.{obj.__name__}()", size)
        return _checked("call", super().call(context, obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise SecurityError(f"a task template raises to the power {right}")
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and n > 0:
                size = _size(seq, MAX_OUTPUT // n + 1) * n
                if size > MAX_OUTPUT:
                    raise SecurityError(
                        f"a task template builds a sequence of {len(seq) * n} items ({size} characters or more) "
                        f"with *, over the {MAX_OUTPUT} one render may hold; {_FIX}"
                    )
        if operator == "+" and isinstance(left, (str, bytes, list, tuple)):
            _need("`+`", _size(left) + _size(right))
        if operator == "%" and isinstance(left, str):
            _need("`%` formatting", _printf_size(left, right))
        return _checked(f"`{operator}`", super().call_binop(context, operator, left, right))
