"""Loading a run config: bounded YAML that refuses duplicated keys, dotted overrides, the schema, then the rules.

    python -c "from tasks.core.config.load import load_config; print(load_config('examples/tiny-cpu.yaml'))"

`parse_config` validates every field against the schema (`tasks.core.config.schema`) and, when
they all validate, runs the static rules across fields: the parallel-layout rules of tier static
(`tasks.core.config.layout`) for each stage and the gate's held-out sets. Every problem of a step
is collected into one `ConfigError`. Pre-flight stops after the fields (`parse_fields`) and runs
the rules itself, so they land in its one report with the checks that need a model or a machine.
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tasks.core.config.batching import peer_key_hint
from tasks.core.config.bounded_yaml import check_size, load_bounded
from tasks.core.config.layout import layout_problems
from tasks.core.config.paths import missing_hint
from tasks.core.config.phases import PHASES
from tasks.core.config.schema import PhaseConfig, RunConfig
from tasks.core.errors import ConfigError

Problem = tuple[str, str]


def load_yaml_unique(text: str, source: str) -> Any:
    """yaml.safe_load that refuses a mapping key written twice, naming the key path and both lines, and
    a document whose aliases, size or nesting are over the bounds (`tasks.core.config.bounded_yaml`)."""
    return load_bounded(text, source)


def read_raw_config(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The YAML mapping of a local config file with dotted overrides like {"run_root": "/x"}."""
    path = Path(path)
    if not path.is_file():
        from fsspec.implementations.local import LocalFileSystem

        alike = missing_hint(LocalFileSystem(), str(path.absolute()))
        raise ConfigError(
            [(str(path), f"config file not found{alike or '; pass --config with an existing YAML file'}")]
        )
    check_size(path.stat().st_size, str(path))  # judged before reading: a config is a few KB
    try:
        raw = load_yaml_unique(path.read_text(), str(path))
    except yaml.YAMLError as exc:
        raise ConfigError([(str(path), f"not valid YAML: {exc}")]) from None
    if not isinstance(raw, dict):
        raise ConfigError([(str(path), "expected a YAML mapping at the top level")])
    for key, value in (overrides or {}).items():
        apply_override(raw, key, value)
    return raw


def _kind(node: Any) -> str:
    return {bool: "true/false", int: "a number", float: "a number", str: "a string"}.get(
        type(node), type(node).__name__
    )


def apply_override(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted `key` of `raw` to `value`: a missing or null mapping on the way is created, a
    list item is named by its index (`cpt.elastic.notices.0.grace_s`); a key that leads into
    anything else, or past a list's end, is a ConfigError naming the key and the fix."""
    node: Any = raw
    parts = key.split(".")
    for i, part in enumerate(parts):
        here, last = ".".join(parts[:i]), i == len(parts) - 1
        if isinstance(node, list):
            if not (part.isascii() and part.isdigit()) or int(part) >= len(node):
                span = f"index 0 to {len(node) - 1}" if node else "none: it is empty"
                what = f"no item {part}" if part.isdigit() else f"{part!r} is no index"
                why = (
                    f"{what}: {here} is a list of {len(node)} item(s) ({span}); name an item by its index "
                    f"(--set {here}.0.<field>=...), or give the whole list (--set '{here}=[...]')"
                )
                raise ConfigError([(key, why)])
            part = int(part)
        elif not isinstance(node, dict):
            why = f"{here} is {_kind(node)}, not a mapping or a list, so it has no {part!r}; set {here} itself"
            raise ConfigError([(key, f"{why} (--set {here}=...)")])
        if last:
            node[part] = value
            return
        if isinstance(node, dict) and node.get(part) is None:
            where = ".".join(parts[: i + 1])
            if parts[i + 1].isdigit() and _is_list(parts[: i + 1]):
                why = f"{where} is not set in the config, so it has no item {parts[i + 1]}; give the whole list"
                raise ConfigError([(key, f"{why} (--set '{where}=[...]'), or write it into the config file")])
            node[part] = {}  # absent or null (e.g. `hub: null`): the override gives it its first field
        node = node[part]


def _is_list(parts: list[str]) -> bool:
    """Whether the config field at the key path `parts` (field names only) holds a list."""
    models: list[type[BaseModel]] = [RunConfig]
    for i, part in enumerate(parts):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return False
        if i == len(parts) - 1:
            return any(_sequence(f.annotation) for f in fields)
        models = [m for f in fields for m in _models_in(f.annotation)]
    return False


def _sequence(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (list, tuple):
        return True
    return (
        any(_sequence(a) for a in typing.get_args(annotation)) if typing.get_origin(annotation) is not None else False
    )


def plugin_problems(phase_cfg: PhaseConfig, where: str) -> list[Problem]:
    """The layout rules that hold for any model and machine (`tasks.core.config.layout`, tier static)."""
    return layout_problems(phase_cfg, where, tiers=("static",))


def gate_problems(cfg: RunConfig) -> list[Problem]:
    """An enabled gate threshold needs the held-out set it is measured on."""
    g = cfg.gate
    if not g.enabled:
        return []
    out: list[Problem] = []
    needs = [
        ("cpt_max_ppl_increase_pct", "cpt", g.cpt_max_ppl_increase_pct is not None),
        ("sft_loss_must_improve", "sft", g.sft_loss_must_improve),
        ("generation_must_stop", "sft", g.generation_must_stop),
        # the dpo phase's limits, measured on its held-out pairs: only in a run that trains it
        *(
            (name, "dpo", getattr(g, name) is not None)
            for name in ("dpo_min_accuracy", "dpo_min_margin", "dpo_max_chosen_logp_drop")
            if cfg.dpo is not None
        ),
    ]
    for name, phase, active in needs:
        if active and not cfg.phase(phase).eval.enabled:
            out.append(
                (
                    f"gate.{name}",
                    (
                        f"needs a {phase.upper()} held-out set, but {phase}.eval.heldout_fraction is 0 and no "
                        "heldout_uri is set; "
                        "give one, or turn this check off (gate.enabled: false disables the whole gate)"
                    ),
                )
            )
    limits = g.cpt_max_ppl_increase_pct
    if isinstance(limits, dict):  # per source: each one measured on its own held-out records
        data, names = cfg.cpt.data, [s.name for s in cfg.cpt.data.source_list]
        only = [s.name for s in cfg.cpt.eval.heldout_sources or ()]
        split_per_source = not (
            data.mixture and cfg.cpt.eval.heldout_uri
        )  # one heldout_uri cannot be told apart by trained source
        if not data.mixture and not only:
            out.append(
                (
                    "gate.cpt_max_ppl_increase_pct",
                    (
                        "a mapping of limits per source needs a cpt.data.sources mixture or cpt.eval.heldout_sources; "
                        "give one number for the held-out set"
                    ),
                )
            )
            return out
        if not split_per_source and not only:
            out.append(
                (
                    "gate.cpt_max_ppl_increase_pct",
                    (
                        "limits per source need the hash split of each source (cpt.eval.heldout_fraction), not one "
                        "cpt.eval.heldout_uri"
                    ),
                )
            )
        known = f"cpt.data.sources: {', '.join(names)}" if data.mixture else f"cpt.data.uri: {names[0]}"
        known += f"; cpt.eval.heldout_sources: {', '.join(only)}" if only else ""
        for k in limits:
            if k in names and not split_per_source:
                out.append(
                    (
                        f"gate.cpt_max_ppl_increase_pct.{k}",
                        (
                            f"trained source {k!r} has no held-out records of its own under one cpt.eval.heldout_uri; "
                            "use the hash split (cpt.eval.heldout_fraction) or limit only cpt.eval.heldout_sources"
                        ),
                    )
                )
            elif k not in names and k not in only:
                out.append((f"gate.cpt_max_ppl_increase_pct.{k}", f"no CPT source is named {k!r} ({known})"))
    return out


def heldout_source_problems(cfg: RunConfig) -> list[Problem]:
    """Held-out-only sources: CPT only, measured beside the stage's own held-out set, named apart from what is trained."""
    out: list[Problem] = []
    if cfg.sft.eval.heldout_sources:
        out.append(
            (
                "sft.eval.heldout_sources",
                (
                    "held-out-only sources are measured by evaluate_cpt (perplexity per source); SFT evaluation has "
                    "none: "
                    "remove it, or move it to cpt.eval.heldout_sources"
                ),
            )
        )
    ev = cfg.cpt.eval
    if not ev.heldout_sources:
        return out
    if not ev.enabled:
        out.append(
            (
                "cpt.eval.heldout_sources",
                (
                    "evaluate_cpt does not run without the stage's own held-out set (cpt.eval.heldout_fraction is 0 "
                    "and no "
                    "heldout_uri is set); give one"
                ),
            )
        )
    trained = [s.name for s in cfg.cpt.data.source_list]
    for i, s in enumerate(ev.heldout_sources):
        if s.name in trained:
            where = "cpt.data.sources" if cfg.cpt.data.mixture else "cpt.data.uri, the one source named"
            out.append(
                (
                    f"cpt.eval.heldout_sources[{i}].name",
                    (
                        f"{s.name!r} is also a trained source ({where} {s.name!r}); a held-out-only source "
                        "needs a name of its own: rename it"
                    ),
                )
            )
    return out


def hub_problems(cfg: RunConfig) -> list[Problem]:
    """The adapter push needs an adapter, and a place for it other than beside the merged weights."""
    hub = cfg.hub
    if hub is None:
        return []
    out: list[Problem] = []
    last = list(cfg.phases)[-1]  # the phase the export converts (sft, or dpo in a run that trains it)
    if hub.push_adapter and cfg.phase(last).lora is None:
        out.append(
            (
                "hub.push_adapter",
                (
                    f"there is no adapter to push: {PHASES[last].title} trains the whole model ({last}.lora is not "
                    f"set), and the export is its model; set {last}.lora, or push_adapter: false"
                ),
            )
        )
    if hub.adapter_repo_id is not None and not hub.push_adapter:
        out.append(
            (
                "hub.adapter_repo_id",
                (
                    "is set but hub.push_adapter is false, so nothing goes there; set push_adapter: true, or remove "
                    "adapter_repo_id"
                ),
            )
        )
    if hub.adapter_repo_id is not None and hub.adapter_repo_id == hub.repo_id:
        out.append(
            (
                "hub.adapter_repo_id",
                (
                    f"is hub.repo_id ({hub.repo_id}): the adapter would sit beside the merged weights, which loaders "
                    "would "
                    "apply it on top of; name another repo, or leave it unset for the subfolder adapter/ of hub.repo_id"
                ),
            )
        )
    return out


def static_problems(cfg: RunConfig) -> list[Problem]:
    """Every rule across fields that the config alone decides: each stage's layout, the held-out-only sources, the gate, the Hub push."""
    problems: list[Problem] = []
    for phase in cfg.phases:
        problems += plugin_problems(cfg.phase(phase), phase)
    return problems + heldout_source_problems(cfg) + gate_problems(cfg) + hub_problems(cfg)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold: itself, or inside Optional/Union/list/dict/Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is dict:
        args = args[1:]  # a dict's values, never its keys
    return (
        [m for arg in args for m in _models_in(arg)]
        if origin is not None or isinstance(annotation, types.UnionType)
        else []
    )


def field_names_at(loc: tuple[Any, ...], root: type[BaseModel] = RunConfig) -> list[str]:
    """The field names of the model(s) that the key path `loc` (a pydantic error's, without the
    unknown key) points into; [] where the path leads to no model."""
    models = [root]
    for part in loc:
        if isinstance(part, int):  # a list index: the models stay those of the element type
            continue
        models = [
            m for model in models if part in model.model_fields for m in _models_in(model.model_fields[part].annotation)
        ]
    return sorted({name for model in models for name in model.model_fields})


def unknown_key_hint(loc: tuple[Any, ...], msg: str) -> str:
    """An unknown key's message (`msg`, pydantic's) with the nearest valid key, or else the valid ones."""
    names = field_names_at(loc[:-1])
    peer = peer_key_hint(str(loc[-1])) if "batching" in names else None
    if peer:
        return f"{msg}; this project chooses it as a batching mode: set {'.'.join(str(x) for x in loc[:-1])}.{peer}"
    near = difflib.get_close_matches(str(loc[-1]), names, n=1)
    if near:
        return f"{msg}; did you mean {near[0]!r}?"
    return f"{msg}; the keys here are: {', '.join(names)}" if names else msg


def parse_fields(raw: dict[str, Any], source: str = "config") -> RunConfig:
    """The RunConfig of `raw` with every field validated, the rules across fields not yet run."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        problems = [
            (
                ".".join(str(x) for x in err["loc"]) or source,
                unknown_key_hint(err["loc"], err["msg"]) if err["type"] == "extra_forbidden" else err["msg"],
            )
            for err in exc.errors()
        ]
        raise ConfigError(problems, header=f"invalid configuration in {source}") from None


def parse_config(raw: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate every field, then (when they all validate) every static rule; one ConfigError for either."""
    cfg = parse_fields(raw, source)
    problems = static_problems(cfg)
    if problems:
        raise ConfigError(problems, header=f"invalid configuration in {source}")
    return cfg


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read YAML (local path), apply dotted overrides, validate."""
    return parse_config(read_raw_config(path, overrides), source=str(path))
