"""Which modules a LoRA `target_modules` adapts, decided before launch the way peft decides it in a rank.

    python -m tasks.core.models.lora_targets build/demo-inputs/tiny-llama q_proj qkv_proj   # or all-linear, or 're:<regex>'

peft (0.21.2, as 0.13.2 did) reads `target_modules` three ways (`tuners_utils.check_target_module_exists`,
`_maybe_include_all_linear_layers`): the string `all-linear` is every `nn.Linear`'s last name part
except the output embedding; any other string is a regex that must match a module's whole name
(`re.fullmatch`); a list adapts a module whose name equals an entry or ends in `.<entry>`. peft
raises only when nothing at all matches: an entry that matches nothing is dropped without a word
(training fewer modules than the config and adapter_config.json say), and a matched module LoRA
cannot wrap (a decoder layer, a norm) fails inside the rank. `resolve` gives the same answer from a
module table: pre-flight builds it from config.json through the family registry (`model_modules`,
no torch), the engine from the real model, and both refuse with `problems`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tasks.core.models.families import family_config, iter_tensors


def field(phase: str = "sft") -> str:
    """The config field a phase's targets are read from, as errors name it: `dpo.lora.target_modules`."""
    return f"{phase}.lora.target_modules"


ALL_LINEAR = "all-linear"  # peft's shorthand (INCLUDE_LINEAR_LAYERS_SHORTHAND), matched case-insensitively
# What peft's LoRA wraps among a decoder's modules (nn.Linear, transformers' Conv1D, nn.Embedding);
# every other kind it matches is refused inside the rank ("Target module ... is not supported").
LORA_KINDS = frozenset({"linear", "embedding"})


@dataclass(frozen=True)
class Resolution:
    adapted: tuple[str, ...]  # whole module names, in model order
    unmatched: tuple[str, ...]  # list entries that match no module (or a regex that matches none)
    unsupported: tuple[str, ...]  # matched modules LoRA cannot wrap, as "name (kind)"

    @property
    def names(self) -> list[str]:
        """The adapted modules' last name parts, sorted: a list form that adapts exactly these modules."""
        return sorted({m.rsplit(".", 1)[-1] for m in self.adapted})


def is_all_linear(targets: str | Sequence[str]) -> bool:
    return isinstance(targets, str) and targets.lower() == ALL_LINEAR


def matches(targets: str | Sequence[str], key: str) -> bool:
    """peft's `check_target_module_exists` (no layers_to_transform: this project never sets it)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    return key in targets or any(key.endswith(f".{t}") for t in targets)


def resolve(
    targets: str | Sequence[str], modules: Mapping[str, str], output_embedding: str | None = "lm_head"
) -> Resolution:
    """What `targets` adapts among `modules` (whole name -> kind: linear, embedding, norm, container, other)."""
    asked = targets
    if is_all_linear(targets):
        targets = sorted(
            {n.rsplit(".", 1)[-1] for n, kind in modules.items() if kind == "linear" and n != output_embedding}
        )
    hit = [n for n in modules if n and matches(targets, n)]
    if isinstance(targets, str):
        unmatched = () if hit else (targets,)
    else:
        unmatched = tuple(t for t in targets if not any(n == t or n.endswith(f".{t}") for n in hit))
    if not hit and not unmatched:  # all-linear on a model without a linear module
        unmatched = (str(asked),)
    return Resolution(
        adapted=tuple(n for n in hit if modules[n] in LORA_KINDS),
        unmatched=unmatched,
        unsupported=tuple(f"{n} ({modules[n]})" for n in hit if modules[n] not in LORA_KINDS),
    )


def linear_names(modules: Mapping[str, str]) -> list[str]:
    """The last name parts of the model's linear and embedding modules: what a target may name."""
    return sorted({n.rsplit(".", 1)[-1] for n, kind in modules.items() if kind in LORA_KINDS})


def problems(
    targets: str | Sequence[str], modules: Mapping[str, str], where: str, output_embedding: str | None = "lm_head"
) -> list[str]:
    """Sentences naming each target that adapts nothing or something LoRA cannot wrap, with the model's modules."""
    r = resolve(targets, modules, output_embedding)
    names = ", ".join(linear_names(modules))
    out = []
    for t in r.unmatched:
        what = (
            f"the regex {t!r} matches no module name of {where}"
            if isinstance(targets, str)
            else f"{t!r} matches no module of {where}"
        )
        out.append(
            f"{what}; its linear and embedding modules are {names}: name some of them, or use 'all-linear' (without "
            "the list)"
        )
    if r.unsupported:
        shown = ", ".join(r.unsupported[:4]) + (f" and {len(r.unsupported) - 4} more" if len(r.unsupported) > 4 else "")
        out.append(
            f"LoRA can adapt only linear and embedding modules, but the targets match {shown} of {where}; "
            f"name the linear modules inside instead ({names})"
        )
    return out


def model_modules(model_config: Mapping[str, object]) -> dict[str, str]:
    """Every module of the model config.json describes (whole name -> kind), from its family's
    tensor table: a 2-D weight is a linear module (an embedding when it indexes the vocabulary in
    the family's head), a 1-D one a norm; the modules holding them are containers. Parameterless
    modules (rotary embedding, activations) are not listed: LoRA cannot adapt them either."""
    family, config = family_config(model_config)
    head = {r.key for r in family.head}
    kinds: dict[str, str] = {}
    keys = [(k, len(shape)) for k, _, shape, _ in iter_tensors(model_config)]
    keys += [
        (k, 2) for k in (family.tied if config.get("tie_word_embeddings") else {})
    ]  # a tied head is still a module
    for key, ndim in keys:
        module, _, part = key.rpartition(".")
        if part != "weight":
            continue
        kinds[module] = ("embedding" if key in head and key in family.vocab_dims else "linear") if ndim == 2 else "norm"
    containers = {module.rsplit(".", i)[0] for module in kinds for i in range(1, module.count(".") + 1)}
    return {**{c: "container" for c in sorted(containers) if c not in kinds}, **kinds}


def output_embedding(model_config: Mapping[str, object]) -> str | None:
    """The module all-linear leaves out (peft: the model's output embeddings): the family's vocabulary-indexed tail tensor."""
    family, _ = family_config(model_config)
    tail = [r.key for r in family.tail if r.key in family.vocab_dims]
    return tail[0].rpartition(".")[0] if tail else None


def _main(argv: list[str]) -> int:
    import json
    from pathlib import Path

    mc = json.loads((Path(argv[0]) / "config.json").read_text())
    # names (a list), all-linear, or re:<regex>
    targets: str | list[str] = (
        argv[1].removeprefix("re:")
        if len(argv) == 2 and (is_all_linear(argv[1]) or argv[1].startswith("re:"))
        else argv[1:]
    )
    modules = model_modules(mc)
    for line in problems(targets, modules, argv[0], output_embedding(mc)) or [
        f"adapts {', '.join(resolve(targets, modules, output_embedding(mc)).names)}"
    ]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
