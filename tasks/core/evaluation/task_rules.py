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
`evaluate`; pre-flight and the stage both load tasks through it (the sandbox and its bounds:
tasks/core/evaluation/sandbox.py). Task names and split names are plain identifiers (`NAME`)
before they become a path.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from typing import Any

import yaml
from jinja2 import nodes

from tasks.core.evaluation.sandbox import MAX_OUTPUT, MAX_STEPS, BoundedSandbox  # noqa: F401 (this module's API)

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
