"""Which files may sit in an HF model folder: the one rule the export, `cpt-to-sft verify`, the
push and pre-flight apply alike.

    python -c "from pathlib import Path; from tasks.core.models.folder import folder_problems; print(folder_problems(Path('runs/demo/export')))"

Serving engines (vLLM, SGLang) and `from_pretrained` read the folder's top level: without an
index they load every `*.safetensors` there as weights, and a PEFT adapter beside merged weights
makes loaders apply it (or refuse) on top of weights it was already merged into. So a folder whose
top level holds weights may hold, as `.safetensors`, only its weight shards (the index's
`weight_map` values, else `model.safetensors`), and no adapter files. Subfolders (the provenance
folder `.cpt-to-sft/`, a plugin checkpoint's `model/`) are not what a loader globs, so the rule
looks at the top level only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

# The file names of an HF model folder, spelled here (the converter, tasks.core.models.convert.dtypes,
# reads them from this module): the rule needs no converter, so checking a folder imports no torch.
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def top_level_names(folder: Path) -> list[str]:
    """The plain files directly in `folder` (what a weight loader's glob sees)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


def weight_shards(folder: Path, names: Iterable[str]) -> set[str] | None:
    """The weight files the folder declares (index's weight_map values, else model.safetensors),
    or None when it holds no merged weights at all (not an HF model folder)."""
    names = set(names)
    if SAFE_INDEX_NAME in names:
        try:
            return set(json.loads((folder / SAFE_INDEX_NAME).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{folder / SAFE_INDEX_NAME}: unreadable weight index ({type(exc).__name__}: {exc}); rebuild the folder (delete it and re-run its stage)") from None
    return {SAFE_WEIGHTS_NAME} if SAFE_WEIGHTS_NAME in names else None


def folder_problems(folder: Path, names: Iterable[str] | None = None, require_weights: bool = True) -> list[str]:
    """Every violation of the rule, each a sentence naming the file and the fix; [] when clean.

    `names`: the relative paths to judge (a manifest's files, what a push sends); by default the
    files on disk. Only top-level names count; without merged weights nothing is judged.
    `require_weights=False` leaves a missing shard to the manifest check that owns it.
    """
    names = sorted({n for n in (top_level_names(folder) if names is None else names) if "/" not in n})
    weights = weight_shards(folder, names)
    if weights is None:
        return []
    fix = "delete it, or rebuild the folder (delete it and re-run its stage)"
    out = []
    for name in names:
        if name in ADAPTER_FILES:
            out.append(f"{folder} holds {name}: adapter files beside merged weights (loaders would apply the adapter on top of weights it is already merged into); {fix}")
        elif name.endswith(".safetensors") and name not in weights:
            out.append(f"{folder} holds {name}: a .safetensors file that is not a weight shard of the model "
                       f"(serving engines such as vLLM and SGLang load every *.safetensors in the folder as weights); {fix}")
    missing = sorted(weights - set(names))
    if missing and require_weights:
        named_by = SAFE_INDEX_NAME if SAFE_INDEX_NAME in names else "the folder"
        out.append(f"{folder} lacks weight file(s) {', '.join(missing)} that {named_by} names; rebuild the folder (delete it and re-run its stage)")
    return out
