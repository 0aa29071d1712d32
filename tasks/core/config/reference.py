"""The configuration reference, written from the schema and the registries (never by hand).

    python -m tasks.core.config.reference > docs/reference/config.md

Every field of `RunConfig` with its type, default, constraints and description, section by
section, then the registry rows a user chooses from (plugins, their offload fields, batching
modes, kernels, launch backends, precisions) with what each requires. `tests/test_docs.py`
regenerates it and fails when the checked-in page differs, so a field added to the schema or a
row added to a registry shows up in the docs in the same commit.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from tasks.core.config.backends import BACKENDS
from tasks.core.config.batching import BATCHING, PAD_MULTIPLE
from tasks.core.config.kernels import KERNELS
from tasks.core.config.plugins import PLUGINS, PRECISION_SPECS
from tasks.core.config.preference import LOSSES
from tasks.core.config.schema import RunConfig

COMMAND = "python -m tasks.core.config.reference > docs/reference/config.md"
INTRO = (
    "One YAML file per run, read into the frozen pydantic model `RunConfig` (`tasks/core/config/schema.py`). "
    "Unknown fields are errors, every problem is reported at once with its field path, and a key written twice is "
    "refused. "
    "`cpt` and `sft` are both a phase section (`PhaseConfig`), documented once as `<phase>`; `dpo`, left out unless a "
    "run tunes on preference pairs, is a phase section too, and its own fields are listed under `dpo`. "
    "Rules across fields (layout, precision, LoRA, offload) are checked when the config is read and by pre-flight: "
    "see [Troubleshooting](../troubleshooting.md). `cpt-to-sft schema` prints the same schema as JSON."
)


def _type_name(tp: Any) -> str:
    """A readable type: `int`, `str | list[str] | null`, `one of: a, b`, `PluginConfig`."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(tp)[0])
    if origin is typing.Literal:
        return "one of: " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        args = typing.get_args(tp)
        name = getattr(origin, "__name__", str(origin))
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return f"list[{_type_name(args[0])}]"
        return f"{name}[{', '.join(_type_name(a) for a in args if a is not Ellipsis)}]"
    return getattr(tp, "__name__", str(tp))


def _constraints(info: FieldInfo) -> str:
    out = []
    for m in info.metadata:
        for cls, sym, attr in (
            (Ge, "≥", "ge"),
            (Gt, ">", "gt"),
            (Le, "≤", "le"),
            (Lt, "<", "lt"),
            (MinLen, "length ≥", "min_length"),
            (MaxLen, "length ≤", "max_length"),
        ):
            if isinstance(m, cls):
                out.append(f"{sym} {getattr(m, attr)}")
        pattern = getattr(m, "pattern", None)
        if isinstance(pattern, str):
            out.append(f"matches `{pattern}`")
    return ", ".join(out)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "**required**"
    if info.default_factory is not None:
        value = info.default_factory()
        if isinstance(value, BaseModel):
            return "(section defaults)"
    else:
        value = info.default
    if value is None:
        return "null"
    if value is PydanticUndefined:
        return ""
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`"


def _models_in(tp: Any) -> list[type[BaseModel]]:
    """Pydantic models a field's type holds (a section, an optional section, a list of sections)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for a in typing.get_args(tp) for m in _models_in(a)]


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def sections(model: type[BaseModel] = RunConfig, path: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """(dotted path, model) for the model and every section below it; `cpt` and `sft` share one."""
    yield path, model
    for name, info in model.model_fields.items():
        for sub in _models_in(info.annotation):
            is_list = typing.get_origin(info.annotation) is list or any(
                typing.get_origin(a) is list for a in typing.get_args(info.annotation)
            )
            child = f"{path}.{name}" if path else name
            yield from sections(sub, child + ("[]" if is_list else ""))


def _registry_types() -> dict[tuple[str, str], str]:
    """Fields whose values are a registry's keys: their type is that list, linked to its table below."""
    from tasks.core.config.kernels import names as kernel_names

    def one_of(keys, anchor: str) -> str:
        return "one of: " + ", ".join(keys) + f" ([table](#{anchor}))"

    return {
        ("PluginConfig", "name"): one_of(PLUGINS, "plugins"),
        ("PluginConfig", "precision"): one_of(PRECISION_SPECS, "precisions"),
        ("LaunchConfig", "backend"): one_of(BACKENDS, "launch-backends"),
        ("PhaseConfig", "batching"): one_of(BATCHING, "batching-modes"),
        ("PhaseConfig", "kernels"): "mapping of " + ", ".join(kernel_names()) + " to bool ([table](#kernels))",
        ("DpoConfig", "loss"): "one of: " + ", ".join(LOSSES),
    }


def _fields_table(path: str, model: type[BaseModel], inherited: frozenset[str] = frozenset()) -> list[str]:
    lines = ["| field | type | default | constraints | description |", "|---|---|---|---|---|"]
    registry_types = _registry_types()
    for name, info in model.model_fields.items():
        if name in inherited:
            continue
        key = f"{path}.{name}" if path else name
        desc = info.description or ""
        type_ = registry_types.get((model.__name__, name)) or _type_name(info.annotation)
        lines.append(
            f"| `{key}` | {_cell(type_)} | {_cell(_default(info))} | {_cell(_constraints(info))} | {_cell(desc)} |"
        )
    return lines


def _registry_tables() -> list[str]:
    out = [
        "## Plugins",
        "",
        "`<phase>.plugin.name`: rows of `tasks/core/config/plugins.py` `PLUGINS`.",
        "",
        "| plugin | what | tp/pp | zero_stage | precisions | needs CUDA | LoRA | SFT packing | offload fields |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, s in PLUGINS.items():
        zero = f"always {s.implicit_zero}" if s.implicit_zero is not None else ", ".join(map(str, s.zero_stages))
        cuda = f"yes: {s.cuda_reason}" if s.needs_cuda else "no"
        lora = f"refused: {s.lora.refused}" if s.lora.refused else "yes"
        pack = f"refused: {s.packing_refused}" if s.packing_refused else "yes"
        off = ", ".join(f"`{o.field}`" for o in s.offload) or "none"
        out.append(
            f"| `{n}` | {_cell(s.summary)} | {'yes' if s.supports_tp_pp else 'no'} | {zero} | {', '.join(s.precisions)} "
            "| "
            f"{_cell(cuda)} | {_cell(lora)} | {_cell(pack)} | {off} |"
        )
    out += [
        "",
        "## Offload fields",
        "",
        (
            "Each is a `<phase>.plugin` field, accepted only under a plugin that has it (`PluginSpec.offload`); "
            "set elsewhere it is refused, naming the plugins that have it."
        ),
        "",
        "| field | plugin | requires | why |",
        "|---|---|---|---|",
    ]
    for n, s in PLUGINS.items():
        for o in s.offload:
            req = ", ".join(f"`{k}: {v}`" for k, v in o.requires) or "nothing"
            out.append(f"| `{o.field}` | `{n}` | {req} | {_cell(o.why)} |")
    out += [
        "",
        "## Precisions",
        "",
        "`<phase>.plugin.precision`: rows of `PRECISION_SPECS`.",
        "",
        "| precision | needs CUDA | loss scaling |",
        "|---|---|---|",
    ]
    for n, p in PRECISION_SPECS.items():
        out.append(
            f"| `{n}` | {_cell('yes: ' + p.cuda_reason) if p.cuda_reason else 'no'} | {'dynamic' if p.loss_scaling else 'no'} "
            "|"
        )
    out += [
        "",
        "## Batching modes",
        "",
        "`<phase>.batching` (SFT): rows of `tasks/core/config/batching.py` `BATCHING`.",
        "",
        "| mode | what | groups by length | micro-batch width | packs chats | keys of other trainers it answers |",
        "|---|---|---|---|---|---|",
    ]
    for n, b in BATCHING.items():
        width = "seq_len" if b.pads_to == "seq_len" else f"longest row, rounded up to {PAD_MULTIPLE}"
        peers = ", ".join(f"`{k}`" for k in b.peer_keys) or ""
        out.append(
            f"| `{n}` | {_cell(b.summary)} | {'yes' if b.groups_by_length else 'no'} | {width} | {'yes' if b.packs else 'no'} "
            f"| {peers} |"
        )
    out += [
        "",
        "## Kernels",
        "",
        (
            "`<phase>.kernels: {NAME: false}` switches one off; each is on by default where its requirements hold "
            "(rows of `tasks/core/config/kernels.py` `KERNELS`; rows of one name cover other plugins)."
        ),
        "",
        "| kernel | runs | plugins | passed as | needs CUDA | precisions | package | model types |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k in KERNELS:
        types_ = ", ".join(k.model_types) if k.model_types is not None else "any"
        out.append(
            f"| `{k.name}` | {_cell(k.label)} | {', '.join(k.plugins)} | {k.via} `{k.arg}` | {'yes' if k.needs_cuda else 'no'} "
            "| "
            f"{', '.join(k.precisions)} | {k.package or ''} | {types_} |"
        )
    out += [
        "",
        "## Launch backends",
        "",
        "`<phase>.launch.backend`: rows of `tasks/core/config/backends.py` `BACKENDS`.",
        "",
        "| backend | what | rendezvous placed by | settings section | cluster pre-flight |",
        "|---|---|---|---|---|",
    ]
    for n, b in BACKENDS.items():
        settings = f"`launch.{b.settings}`" if b.settings else ""
        out.append(f"| `{n}` | {_cell(b.summary)} | {b.rendezvous} | {settings} | {_cell(b.cluster_check)} |")
    return out


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        f"<!-- generated by `{COMMAND}`; tests/test_docs.py fails when it is out of date: do not edit by hand -->",
        "",
        INTRO,
        "",
    ]
    seen: set[type[BaseModel]] = set()
    for path, model in sections():
        if model in seen:
            continue
        seen.add(model)
        title = (
            path.replace("cpt.", "<phase>.").replace("cpt", "<phase>")
            if path.startswith("cpt")
            else (path or "top level")
        )
        lines += [f"## `{title}`" if path else "## Top level", ""]
        doc = (model.__doc__ or "").strip().split("\n\n")[0]
        if doc and model is not RunConfig:
            lines += [" ".join(doc.split()), ""]
        # a section extending one documented above (dpo: a phase section) lists only its own fields
        bases = [b for b in model.__mro__[1:] if b in seen and b is not model]
        inherited = frozenset(
            n for b in bases for n, f in b.model_fields.items() if f.annotation == model.model_fields[n].annotation
        )
        if bases:
            lines += [f"Every field of `{bases[0].__name__}` too; its own:", ""]
        lines += _fields_table(title if path else "", model, inherited) + [""]
    lines += _registry_tables()
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
