"""A benchmark task file is untrusted input: what of lm-eval's YAML dialect the project accepts,
read as data, and the sandbox every template of a task renders in.

    python -m tasks.core.evaluation.task_rules data/sample/benchmarks/veyra_facts.yaml

`parse` reads a task YAML with `TaskLoader` (a yaml SafeLoader subclass): any custom tag
(`!function`, however spelled: `!functio%6E` is the same tag), any alias and a file over
`MAX_BYTES` are refused, naming the file and line. `key_problems` refuses every key lm-eval 0.4.13
would resolve to code or a download (`KEY_RULES`, read from `lm_eval/api/task.py`,
`lm_eval/config/task.py`, `lm_eval/tasks/_factory.py`): a Python task `class`, `custom_dataset`,
`process_docs`, `process_results`, `use_prompt` (promptsource, from the Hub), `include:`, groups
and tags, `unsafe_code`, the `custom` filter, `hf_evaluate` metrics, `datasets.load_dataset`
arguments that choose where data comes from, and keys lm-eval does not know. Metric, aggregation
and filter names come from lm-eval's own registries, and a metric must be one the task's
`output_type` scores (`SCORED`): an unregistered name would make lm-eval fall back to
`evaluate.load(name)`, which runs a local `.py` of that name. `sandbox_lm_eval` replaces
lm-eval's module-wide Jinja environment (`lm_eval.utils.env`, which `apply_template` reads at each
call) with `BoundedSandbox` for the whole process, and its `get_metric` with one that never reaches
`evaluate`; pre-flight and the stage both load tasks through it. Task names and split names are
plain identifiers (`NAME`) before they become a path.
"""

from __future__ import annotations

import functools
import itertools
import re
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import yaml
from jinja2 import BaseLoader, StrictUndefined, nodes
from jinja2 import filters as jinja_filters
from jinja2.environment import Template
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace, generate_lorem_ipsum, pass_environment, pass_eval_context
from jinja2.visitor import NodeTransformer
from markupsafe import EscapeFormatter, Markup

MAX_BYTES = 1 << 20  # a task YAML is a few hundred bytes; one this size is no task
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")  # a task or split name: one plain path segment
TEMPLATE_KEYS = ("doc_to_text", "doc_to_target", "doc_to_choice", "gen_prefix", "description")
# What each output type scores, from lm-eval 0.4.13's ConfigurableTask.process_results: a metric
# outside its row is never computed (the task scores nothing). None: any registered metric's function.
SCORED: dict[str, frozenset[str] | None] = {
    "loglikelihood": frozenset({"perplexity", "acc"}),
    "loglikelihood_rolling": frozenset({"word_perplexity", "byte_perplexity", "bits_per_byte"}),
    "multiple_choice": frozenset(
        {"acc", "f1", "mcc", "acc_norm", "acc_bytes", "exact_match", "brier_score", "likelihood", "acc_mutual_info"}
    ),
    "generate_until": None,
}
_DATA = "the task file is data: put the processed documents in the data file and use lm-eval's registered metrics"
# Keys lm-eval would resolve to code, a download or another file: refused with the reason.
KEY_RULES: dict[str, str] = {
    "class": "names a Python task class lm-eval would import and run",
    "custom_dataset": "is a Python function lm-eval would call to build the dataset",
    "process_docs": f"is Python lm-eval would run over the documents; {_DATA}",
    "process_results": f"is Python lm-eval would run to score; {_DATA}",
    "use_prompt": "loads a promptsource template (a package, and the Hub); write doc_to_text instead",
    "include": "pulls in another YAML; write the task whole in one file",
    "group": "makes a group; name each task's YAML in benchmark.tasks instead",
    "tag": "makes a tag; name each task's YAML in benchmark.tasks instead",
    "task_list": "makes a group; name each task's YAML in benchmark.tasks instead",
    "doc_to_image": "is multimodal input; the benchmark scores text models",
    "doc_to_audio": "is multimodal input; the benchmark scores text models",
}
TASK_KEYS = frozenset(
    {
        "task",
        "task_alias",
        "dataset_path",
        "dataset_name",
        "dataset_kwargs",
        "training_split",
        "validation_split",
        "test_split",
        "fewshot_split",
        "description",
        "target_delimiter",
        "fewshot_delimiter",
        "fewshot_config",
        "num_fewshot",
        "metric_list",
        "output_type",
        "generation_kwargs",
        "repeats",
        "filter_list",
        "should_decontaminate",
        "doc_to_decontamination_query",
        "unsafe_code",
        "metadata",
        *TEMPLATE_KEYS,
    }
)
FEWSHOT_KEYS = frozenset(
    {"sampler", "split", "fewshot_indices", "samples", "doc_to_text", "doc_to_choice", "doc_to_target"}
    | {"gen_prefix", "fewshot_delimiter", "target_delimiter"}
)
# datasets.load_dataset's own arguments (4.8.5) besides data_files: where the data come from, the
# cache, the Hub's credentials; the rest of dataset_kwargs is the file builder's settings.
LOAD_ARGS = frozenset(
    {"path", "name", "data_dir", "split", "cache_dir", "features", "download_config", "download_mode"}
    | {"verification_mode", "keep_in_memory", "save_infos", "revision", "token", "use_auth_token"}
    | {"streaming", "num_proc", "storage_options", "config_kwargs", "trust_remote_code"}
)
GENERATION_KEYS = frozenset(
    {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k", "num_beams", "repetition_penalty"}
)


class TaskFileError(ValueError):
    """A task YAML the project does not read: names the file, the line where known, and the fix."""


class TaskLoader(yaml.SafeLoader):
    """YAML's own types only: every custom tag and every alias is refused (a node is built from its
    text once; nothing is looked up, imported or expanded)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            ev = self.peek_event()
            raise TaskFileError(
                f"line {ev.start_mark.line + 1}: the YAML alias *{ev.anchor} is refused in a task file; write the "
                "value out"
            )
        return super().compose_node(parent, index)

    def construct_undefined(self, node):
        raise TaskFileError(
            f"line {node.start_mark.line + 1}: the tag {node.tag} is refused (lm-eval's !function and every other "
            f"custom tag would run Python or build an object); {_DATA}"
        )


TaskLoader.add_constructor(None, TaskLoader.construct_undefined)


def parse(text: str | bytes, uri: str) -> Any:
    """The task YAML's data, or TaskFileError naming `uri` (too large, a tag, an alias, bad YAML)."""
    if len(text) > MAX_BYTES:
        raise TaskFileError(f"{uri}: {len(text)} bytes, over the {MAX_BYTES}-byte limit of a task YAML")
    try:
        return yaml.load(text, Loader=TaskLoader)  # a SafeLoader subclass
    except TaskFileError as exc:
        raise TaskFileError(f"{uri}, {exc}") from None
    except yaml.YAMLError as exc:
        raise TaskFileError(f"{uri}: not valid YAML: {exc}") from None


def check_name(value: Any, field: str) -> str | None:
    """Why `value` cannot be a task's (or split's) name, which becomes a path segment; None: it can."""
    if isinstance(value, str) and NAME.fullmatch(value):
        return None
    return (
        f"{field}: {value!r} is not a plain name (letters, digits, '_', '-', '.', starting with a letter or digit, "
        "at most 100); it becomes a folder name, so name the task e.g. my_task"
    )


def _plain(value: Any) -> bool:
    """A YAML scalar, or a list or mapping of them (no object, however nested)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return True
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _registries():
    import lm_eval.api.metrics  # fills the registries
    import lm_eval.filters  # noqa: F401
    from lm_eval.api import registry

    return registry


def scored_metrics(config: dict) -> set[str]:
    """The metric names the task scores (metric_list's, else the output type's defaults)."""
    ml = config.get("metric_list")
    if isinstance(ml, list):
        return {m.get("metric") for m in ml if isinstance(m, dict) and isinstance(m.get("metric"), str)}
    return set(_registries().DEFAULT_METRIC_REGISTRY.get(config.get("output_type") or "generate_until", ()))


def filter_names(config: dict) -> set[str]:
    fl = config.get("filter_list")
    return {f.get("name") for f in fl if isinstance(f, dict)} if isinstance(fl, list) else {"none"}


def key_problems(config: dict) -> list[str]:
    """Every key of the task that lm-eval would resolve to code or a download, or does not know."""
    out = []
    for key, value in config.items():
        if key in KEY_RULES:
            out.append(f"{key}: {KEY_RULES[key]}")
        elif key not in TASK_KEYS:
            out.append(f"{key}: not a field of an lm-eval task (lm-eval 0.4.13's TaskConfig); remove it")
        elif not _plain(value):
            out.append(f"{key}: must be plain YAML data (strings, numbers, booleans, lists, mappings; quote a date)")
    if config.get("unsafe_code") not in (None, False):
        out.append("unsafe_code: true lets lm-eval run model-written code; remove it")
    kwargs = config.get("dataset_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        out.append("dataset_kwargs: must be a mapping with data_files")
    for key in sorted(set(kwargs or {}) & LOAD_ARGS) if isinstance(kwargs, dict) else ():
        out.append(
            f"dataset_kwargs.{key}: chooses where datasets reads or caches data; only data_files (and the file "
            "builder's own settings) are taken"
        )
    gen = config.get("generation_kwargs")
    for key in sorted(set(gen) - GENERATION_KEYS) if isinstance(gen, dict) else ():
        out.append(f"generation_kwargs.{key}: not taken (only {', '.join(sorted(GENERATION_KEYS))})")
    few = config.get("fewshot_config")
    for key in sorted(set(few) - FEWSHOT_KEYS) if isinstance(few, dict) else ():
        out.append(f"fewshot_config.{key}: {KEY_RULES.get(key, 'not taken')} (only {', '.join(sorted(FEWSHOT_KEYS))})")
    fewshot = few if isinstance(few, dict) else {}
    templates = [(k, config.get(k)) for k in (*TEMPLATE_KEYS, "doc_to_decontamination_query")]
    templates += [(f"fewshot_config.{k}", fewshot.get(k)) for k in TEMPLATE_KEYS if k != "description"]
    for key, template in templates:
        for value in _strings(template):
            if reason := template_problem(value):
                out.append(f"{key}: {reason}")
    return out + registry_problems(config)


def registry_problems(config: dict) -> list[str]:
    """Output type, metric, aggregation, filter and sampler names not in lm-eval's own registries
    (none without lm-eval installed: pre-flight says how to install it)."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        return []
    reg = _registries()
    out: list[str] = []
    otype = config.get("output_type", "generate_until")
    if otype not in SCORED:
        return [f"output_type: {otype!r} is not one of lm-eval's {', '.join(SCORED)}"]
    scored = SCORED[otype]
    ml = config.get("metric_list")
    if ml is not None and not isinstance(ml, list):
        out.append("metric_list: must be a list of {metric, aggregation, higher_is_better}")
    for i, m in enumerate(ml if isinstance(ml, list) else ()):
        where = f"metric_list[{i}]"
        name = m.get("metric") if isinstance(m, dict) else None
        if not isinstance(name, str) or name not in reg.metric_registry:
            out.append(
                f"{where}.metric: {name!r} is not one of lm-eval's registered metrics "
                f"({', '.join(sorted(scored or reg.metric_registry.keys()))}); lm-eval would look an unknown name "
                "up with evaluate.load (a path runs that file)"
            )
        elif scored is not None and name not in scored:
            out.append(
                f"{where}.metric: {name!r} is never scored for output_type {otype} (it scores "
                f"{', '.join(sorted(scored))}); the task would score nothing"
            )
        agg = m.get("aggregation") if isinstance(m, dict) else None
        if agg is not None and (not isinstance(agg, str) or agg not in reg.aggregation_registry):
            out.append(
                f"{where}.aggregation: {agg!r} is not one of lm-eval's aggregations "
                f"({', '.join(sorted(reg.aggregation_registry.keys()))})"
            )
        if isinstance(m, dict) and m.get("hf_evaluate"):
            out.append(f"{where}.hf_evaluate: loads the metric with evaluate.load; use a registered metric")
    fl = config.get("filter_list")
    for i, f in enumerate(fl if isinstance(fl, list) else ()):
        for j, step in enumerate((f.get("filter") or []) if isinstance(f, dict) else []):
            fn = step.get("function") if isinstance(step, dict) else None
            if fn == "custom" or not isinstance(fn, str) or fn not in reg.filter_registry:
                out.append(
                    f"filter_list[{i}].filter[{j}].function: {fn!r} is not one of lm-eval's filters "
                    f"({', '.join(sorted(set(reg.filter_registry.keys()) - {'custom'}))})"
                )
    few = config.get("fewshot_config")
    sampler = few.get("sampler") if isinstance(few, dict) else None
    if sampler is not None:
        from lm_eval.api.samplers import SAMPLER_REGISTRY

        if sampler not in SAMPLER_REGISTRY:
            out.append(f"fewshot_config.sampler: {sampler!r} is not one of lm-eval's ({', '.join(SAMPLER_REGISTRY)})")
    return out


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)


def template_problem(source: str) -> str | None:
    """Why a task template is refused before anything renders it: it does not parse, or it reaches
    a private attribute (the sandbox would stop it at render time too); None: it may render."""
    try:
        tree = BoundedSandbox().parse(source)
    except Exception as exc:  # jinja2's TemplateSyntaxError and the bound's SecurityError
        return f"not a valid Jinja template: {exc}"
    for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
        name = node.attr if isinstance(node, nodes.Getattr) else getattr(node.arg, "value", None)
        if isinstance(name, str) and name.startswith("_"):
            return (
                f"the template reaches {name!r}; a task's templates render in a sandbox and may read only the "
                "document's fields"
            )
    return None


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


def _registered_metric(name, hf_evaluate_metric: bool = False):
    """lm-eval's get_metric without its evaluate.load fallback: a registered name, or an error."""
    reg = _registries()
    if hf_evaluate_metric or not isinstance(name, str) or name not in reg.metric_registry:
        raise ValueError(f"metric {name!r} is not one of lm-eval's registered metrics; evaluate.load is not used")
    return reg.metric_registry.get(name)


def sandbox_lm_eval() -> None:
    """From now on, in this process, lm-eval renders every task template in `BoundedSandbox` and
    finds metrics only in its registry (idempotent; lm-eval reads both names at each use)."""
    import lm_eval.api.task as task_mod
    import lm_eval.utils as lm_utils

    if not isinstance(lm_utils.env, BoundedSandbox):
        lm_utils.env = BoundedSandbox()
    task_mod.get_metric = _registered_metric


def main(argv: list[str] | None = None) -> int:
    for uri in argv if argv is not None else sys.argv[1:]:
        with open(uri, "rb") as fh:
            config = parse(fh.read(MAX_BYTES + 1), uri)
        problems = key_problems(config) if isinstance(config, dict) else ["not a mapping"]
        print(f"{uri}: " + ("; ".join(problems) if problems else "ok"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
