"""Chat templates rendered as transformers renders them, but under a budget of work, output and time.

    python -c "from tasks.core.data.chat_template import render; print(render('{% for m in messages %}{{ m.content }}{% endfor %}', {'messages': [{'role': 'user', 'content': 'hi'}]}, 'demo'))"

A chat template comes with the model folder, so it is untrusted input. transformers 4.51.3 renders it
in jinja2's `ImmutableSandboxedEnvironment` (no Python internals), which caps one `range()` at
100,000 items but not their product: two nested loops run for hours. Every render of a template in
this project (pre-flight's `tasks.core.preflight.tokens`, and `tasks.core.data.samples.render_chat`
behind data preparation, the stop tokens and evaluation) goes through `render` here, which uses the
same sandbox, options, filters and globals as transformers' `_compile_jinja_template` (so the text
is the same), and meters it through the template's own syntax tree, rewritten once at compile:
every `for` loop's iterable is counted item by item (a recursive loop's `loop(...)` too), every
call is counted, every piece of output (literal text included, inside macros and `set` blocks too)
is charged, and `*`, `**`, `+`, `%`, `~` and the filters and string methods that pad or replace
are checked against the size bound before or after they run. A render past `OPS` steps (plus
`OPS_PER_MESSAGE` a message), `CHARS` characters (plus `CHARS_PER_INPUT` per input character) or
`SECONDS` is stopped, and every failure is a `ChatTemplateError` naming the template's file and
the reason. The metering costs a few microseconds per loop item and output piece.
"""

from __future__ import annotations

import contextvars
import json
import re
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

OPS = 200_000  # loop items and calls for one conversation: a real template takes tens per message
OPS_PER_MESSAGE = 2_000
CHARS = 1 << 20  # characters of any one value and of all output together
CHARS_PER_INPUT = 8  # ... plus this many per character of the conversation
SECONDS = 10.0  # wall clock per render, the last resort (checked every 1,024 steps)
REFUSED = ("budget", "security", "syntax")  # kinds that fail on any conversation: pre-flight refuses them

_ITER, _EMIT, _SIZED = "cpt_to_sft_iter", "cpt_to_sft_emit", "cpt_to_sft_sized"  # not identifiers a template can spell
_WIDTHS = re.compile(r"\d+")


class ChatTemplateError(RuntimeError):
    """A chat template that cannot be rendered: `source` its file, `kind` one of budget, security,
    syntax or error (the template raised, e.g. raise_exception), `reason` the sentence. Not a
    ValueError: data preparation rejects a record on a ValueError, and this is the template's fault."""

    FIXES: ClassVar[dict[str, str]] = {
        "budget": (
            "a chat template renders a conversation in a few thousand steps: remove the loops that multiply "
            "(nested range(), recursion) or restore the model's original template"
        ),
        "security": "it reaches for Python internals, as code injected into a template does: restore the model's original template",
        "syntax": "fix its Jinja syntax",
        "error": "the template itself raised this for the conversation",
    }

    def __init__(self, source: str, kind: str, reason: str):
        self.source, self.kind, self.reason = source, kind, reason
        super().__init__(f"{source}: the chat template cannot be rendered: {reason}; {self.FIXES[kind]}")

    def __reduce__(self):  # a process pool pickles a worker's exception
        return (type(self), (self.source, self.kind, self.reason))


class _Exhausted(Exception):
    pass


class _Budget:
    __slots__ = ("clock", "deadline", "emitted", "max_chars", "max_ops", "ops")

    def __init__(self, max_ops: int, max_chars: int, seconds: float):
        self.max_ops, self.max_chars, self.ops, self.emitted = max_ops, max_chars, 0, 0
        self.deadline, self.clock = time.monotonic() + seconds, 1024

    def tick(self, n: int = 1) -> None:
        self.ops += n
        if self.ops > self.max_ops:
            raise _Exhausted(f"it took more than {self.max_ops:,} steps (loop items and calls) for one conversation")
        if self.ops >= self.clock:
            self.clock = self.ops + 1024
            if time.monotonic() > self.deadline:
                raise _Exhausted(f"it ran longer than {SECONDS:g} s for one conversation")

    def size(self, value: Any, what: str = "a value") -> Any:
        n = _flat_size(value)
        if n > self.max_chars:
            raise _Exhausted(f"{what} of {n:,} characters, over the {self.max_chars:,} one conversation may make")
        return value


_STATE: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


def _budget() -> _Budget:
    b = _STATE.get()
    if b is None:  # only `render` runs these templates
        raise _Exhausted("rendered outside tasks.core.data.chat_template.render")
    return b


def _flat_size(value: Any, memo: dict[int, int] | None = None, depth: int = 0) -> int:
    """Characters a value holds once written out: a string's length; a list's, tuple's or dict's
    items and what they hold, a shared reference counted each time it occurs (memoized, so the
    count itself is cheap however the value was multiplied)."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, (list, tuple, dict)) or depth > 32:
        return 0
    memo = {} if memo is None else memo
    if id(value) in memo:
        return memo[id(value)]
    memo[id(value)] = 0  # a container holding itself counts once
    items = value.values() if isinstance(value, dict) else value
    memo[id(value)] = n = len(value) + sum(_flat_size(v, memo, depth + 1) for v in items)
    return n


def _counted(iterable: Any) -> Iterator[Any]:
    b = _budget()
    for item in iterable:
        b.tick()
        yield item


def _int_args(args: tuple, kwargs: dict) -> list[int]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]


_PADDERS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap"})


def _precheck(b: _Budget, name: str, owner: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a string method or filter whose result would be over the size bound, before it
    allocates: a width over it (center, ljust, zfill, indent, ...), a format width, a replace that
    multiplies."""
    if name in _PADDERS:
        width = max((abs(a) for a in _int_args(args, kwargs)), default=0)
        times = (owner.count("\t") if name == "expandtabs" else owner.count("\n")) + 1 if isinstance(owner, str) else 1
        if width * (times if name in ("expandtabs", "indent") else 1) > b.max_chars:
            raise _Exhausted(f"{name}() to a width over the {b.max_chars:,} characters one conversation may make")
    if not isinstance(owner, str):
        return
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        grow = owner.count(args[0]) * (len(args[1]) - len(args[0])) if args[0] else (len(owner) + 1) * len(args[1])
        if len(owner) + grow > b.max_chars:
            raise _Exhausted(f"replace() making {len(owner) + grow:,} characters, over the {b.max_chars:,} allowed")
    elif name in ("format", "format_map") and any(int(d) > b.max_chars for d in _WIDTHS.findall(owner)):
        raise _Exhausted(f"a format width over the {b.max_chars:,} characters one conversation may make")


def _metered_filter(name: str, func: Callable) -> Callable:
    from jinja2.utils import _PassArg, pass_context

    how = _PassArg.from_obj(func)

    @pass_context  # never folded into a constant at compile time, so always metered
    def wrapper(context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.tick()
        _precheck(b, name, value, args, kwargs)
        if how is _PassArg.context:
            out = func(context, value, *args, **kwargs)
        elif how is _PassArg.eval_context:
            out = func(context.eval_ctx, value, *args, **kwargs)
        elif how is _PassArg.environment:
            out = func(context.environment, value, *args, **kwargs)
        else:
            out = func(value, *args, **kwargs)
        return b.size(out, f"filter {name} made a value")

    return wrapper


@lru_cache(maxsize=32)
def _environment() -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import pass_context

    class Generation(Extension):
        """transformers' `{% generation %}` tag as it renders outside its assistant-mask mode: the body."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Metered(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            b = _budget()
            if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept cheap
                if len(left) + len(right) > b.max_chars:
                    b.size(left + right, "the operator + made a value")
                return left + right
            b.tick()
            ints = isinstance(left, int) and isinstance(right, int)
            if operator == "**" and ints and (right > 4096 or abs(left).bit_length() * max(right, 0) > 1 << 20):
                raise _Exhausted(f"a power {left} ** {right} too large to compute")
            if operator == "*":
                if ints and left.bit_length() + right.bit_length() > 1 << 20:
                    raise _Exhausted("a product too large to compute")
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(n, int) and _flat_size(seq) * n > b.max_chars:
                    raise _Exhausted(
                        f"a repetition of {_flat_size(seq) * n:,} characters, over the {b.max_chars:,} one "
                        "conversation may make"
                    )
            if operator == "%" and isinstance(left, str):
                _precheck(b, "format", left, (), {})
            return b.size(super().call_binop(context, operator, left, right), f"the operator {operator} made a value")

        def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
            b = _budget()
            b.tick()
            if isinstance(obj, LoopContext) and args:  # a recursive loop's next level: its items count too
                args = (_counted(args[0]), *args[1:])
            target = getattr(obj, "__wrapped__", obj)
            _precheck(b, getattr(target, "__name__", "a call"), getattr(target, "__self__", None), args, kwargs)
            out = super().call(context, obj, *args, **kwargs)
            return b.size(out, "a call made a value")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = Metered(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _metered_filter(name, f) for name, f in env.filters.items()}

    @pass_context
    def emit(context: Any, value: Any) -> Any:
        b = _budget()
        b.emitted += len(value) if isinstance(value, str) else len(str(value))
        if b.emitted > b.max_chars:
            raise _Exhausted(f"it wrote more than {b.max_chars:,} characters for one conversation")
        return value

    @pass_context
    def sized(context: Any, value: Any) -> Any:
        return _budget().size(value, "a ~ concatenation made a value")

    env.filters[_ITER] = pass_context(lambda context, value: _counted(value))
    env.filters[_EMIT], env.filters[_SIZED] = emit, sized
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _meter(tree: Any) -> Any:
    """The template's syntax tree with every loop, output piece and `~` routed through the meters."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def wrap(node: Any, name: str) -> Any:
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    class Meter(NodeTransformer):
        def visit_For(self, node: Any) -> Any:
            self.generic_visit(node)
            node.iter = wrap(node.iter, _ITER)
            return node

        def visit_Output(self, node: Any) -> Any:
            self.generic_visit(node)
            node.nodes = [
                wrap(nodes.Const(n.data, lineno=n.lineno) if isinstance(n, nodes.TemplateData) else n, _EMIT)
                for n in node.nodes
            ]
            return node

        def visit_Concat(self, node: Any) -> Any:
            self.generic_visit(node)
            return wrap(node, _SIZED)

    return Meter().visit(tree)


@lru_cache(maxsize=32)
def compile_template(text: str) -> Any:
    """The metered template (cached: a compile costs milliseconds, a render a fraction of one)."""
    env = _environment()
    return env.from_string(_meter(env.parse(text)))


def render(
    template: str,
    context: dict[str, Any],
    source: str | Callable[[], str],
    *,
    ops: int | None = None,
    chars: int | None = None,
    seconds: float = SECONDS,
) -> str:
    """`template` rendered with `context` (messages, add_generation_prompt, the special tokens),
    within the budget (by default scaled to `context["messages"]`); ChatTemplateError naming
    `source` (a file, or a callable giving it, asked only on failure) otherwise."""
    import jinja2

    messages = context.get("messages") or []
    n_chars = sum(
        len(m.get("content") or "") for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)
    )
    budget = _Budget(
        ops if ops is not None else OPS + OPS_PER_MESSAGE * len(messages),
        chars if chars is not None else CHARS + CHARS_PER_INPUT * n_chars,
        seconds,
    )

    def fail(kind: str, reason: str) -> ChatTemplateError:
        return ChatTemplateError(source() if callable(source) else source, kind, reason)

    token = _STATE.set(budget)
    try:
        return compile_template(template).render(**context)
    except jinja2.TemplateSyntaxError as exc:
        raise fail("syntax", f"line {exc.lineno}: {exc.message}") from None
    except jinja2.exceptions.SecurityError as exc:
        raise fail("security", f"the sandbox stopped it ({exc})") from None
    except _Exhausted as exc:
        raise fail("budget", str(exc)) from None
    except (RecursionError, MemoryError) as exc:
        raise fail(
            "budget",
            f"it {'recursed deeper than Python allows' if isinstance(exc, RecursionError) else 'ran out of memory'}",
        ) from None
    except Exception as exc:  # the template raised (raise_exception, an undefined name, a type error in it)
        raise fail("error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    finally:
        _STATE.reset(token)


def template_file(folder: str | Path) -> str:
    """Where a tokenizer folder's chat template is written: chat_template.jinja, chat_template.json,
    else tokenizer_config.json (the order transformers reads them in)."""
    root = Path(folder)
    for name in ("chat_template.jinja", "chat_template.json"):
        if (root / name).is_file():
            return str(root / name)
    return str(root / "tokenizer_config.json")


def render_with_tokenizer(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> str:
    """What `tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`
    returns, rendered under the budget."""
    context = {
        "messages": messages,
        "tools": None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
        **tokenizer.special_tokens_map,
    }
    return render(
        tokenizer.get_chat_template(), context, lambda: template_file(getattr(tokenizer, "name_or_path", "") or ".")
    )
