"""An HF folder's weights read into a boosted, sharded model one tensor at a time.

    python -m tasks.engine.weights HF_DIR      # the files, the tensor count and the largest tensor it would read

ColossalAI's loaders read a whole safetensors file at a time (`HybridParallelCheckpointIO.
load_sharded_model` -> `safetensors.torch.load_file`), and a folder without an index (one
`model.safetensors`, which is how HF saves any model under its 5 GB `max_shard_size`) as a single
state dict (`load_unsharded_model`). A rank then holds its share plus a whole file: the whole model
for a single-file base. Here each tensor is read alone (safetensors' `safe_open` reads only that
tensor's bytes), handed to the modules whose prefix it matches through their own
`_load_from_state_dict` (shardformer's `ParallelModule` cuts a full tensor to this rank's slice
there, as it does under ColossalAI's loader), and dropped before the next is read: a rank's peak is
its share plus one tensor.

Strict, which ColossalAI's sharded loader is not (it sets `strict = False` whatever it is passed):
every parameter and persistent buffer the rank holds must be in the files with a shape its module
accepts; a pipeline stage holds only its layers, so the other stages' tensors are skipped unread. A
tied LM head that HF leaves out of the files is read from the tensor it is tied to
(`tasks.core.models.families.tied_keys`). The engine then refreshes the plugin's master weights from
the loaded ones, as ColossalAI's loader does (`update_master_params`).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.core.errors import ConversionError, ManifestError
from tasks.core.models.families import tied_keys
from tasks.core.models.stream import weight_files


@dataclass(frozen=True)
class Loaded:
    tensors: int  # read from the files (this rank's)
    files: int  # opened
    largest: int  # bytes of the largest tensor read


def weight_map(src: Path) -> dict[str, Path]:
    """{tensor name: its safetensors file} of an HF folder (`tasks.core.models.stream.weight_files`:
    the index, else the one `model.safetensors`); a folder with neither is a ManifestError here."""
    try:
        return weight_files(src)
    except ConversionError as exc:
        raise ManifestError(str(exc)) from None


def _holds(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers this rank's module holds, by state-dict name."""
    held = dict(module.named_parameters())
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                held[f"{prefix}.{name}" if prefix else name] = buf
    return held


def _owners(module: torch.nn.Module, key: str) -> Iterator[tuple[torch.nn.Module, str]]:
    """(submodule, its prefix) along the path of `key`: the modules whose `_load_from_state_dict`
    may take it (a shardformer layer takes its own weight; a plain module its direct tensors)."""
    prefix, node = "", module
    parts = key.split(".")
    for part in parts[:-1]:
        yield node, prefix
        node = node._modules.get(part)
        if node is None:
            return
        prefix += part + "."
    yield node, prefix


def read_into(module: torch.nn.Module, src: Path, model_config: dict) -> Loaded:
    """Read `src`'s tensors into `module` (a boosted model's `unwrap()`) one at a time. The caller
    then refreshes the plugin's master weights (`update_master_params`)."""
    from safetensors import safe_open

    files = weight_map(src)
    held = _holds(module)
    aliases = {k: v for k, v in tied_keys(model_config).items() if k in held and k not in files}
    missing = sorted(k for k in held if k not in files and k not in aliases)
    if missing:
        raise ManifestError(
            f"{src}: weights do not match the model's config: {len(missing)} tensor(s) the model holds are in no "
            f"file, e.g. {missing[:5]}"
        )
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for key in held:
        stored = aliases.get(key, key)
        by_file.setdefault(files[stored], []).append((key, stored))
    errors: list[str] = []
    largest = count = 0
    for name in sorted(by_file):
        for key, stored in by_file[name]:
            # Opened per tensor: safe_open maps the whole file, and the pages a read touched count in
            # the rank's RSS until the mapping goes (a single-file base: the whole model).
            with safe_open(str(name), framework="pt") as f:
                tensor = f.get_tensor(stored)
            largest, count = max(largest, tensor.numel() * tensor.element_size()), count + 1
            state = {key: tensor}
            unexpected: list[str] = []
            for sub, prefix in _owners(module, key):
                sub._load_from_state_dict(state, prefix, {}, False, [], unexpected, errors)
            # shardformer's slice of a full tensor (d_tensor's distribute_tensor) is left in
            # reference cycles: freed by the collector only, which otherwise lets a share's worth
            # pile up before it runs. Young generations only: the cycles are this tensor's, and the
            # imports are frozen (engine __main__).
            del state, tensor
            gc.collect(1)
    if errors:
        raise ManifestError(f"{src}: weights do not match the model's config: " + "; ".join(errors[:3]))
    return Loaded(tensors=count, files=len(by_file), largest=largest)


def save_tied_once(module: torch.nn.Module) -> None:
    """Make state_dict() list a tied tensor once, under its first name (embed_tokens), like HF.

    ColossalAI's general checkpoint IO (low_level_zero, torch_ddp) hands the whole state dict to
    safetensors, which refuses two names for one storage (lm_head.weight is embed_tokens.weight
    in a tied model). HybridParallel's IO already drops the duplicate; from_pretrained re-ties it.
    """

    def hook(mod, state_dict, prefix, local_metadata):
        seen = set()
        for key in [k for k in state_dict if k.startswith(prefix)]:
            t = state_dict[key]
            if not isinstance(t, torch.Tensor):
                continue
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
            if ident in seen:
                del state_dict[key]
            else:
                seen.add(ident)

    module.register_state_dict_post_hook(hook)


def _main(argv: list[str]) -> int:
    from safetensors import safe_open

    src = Path(argv[0])
    files = weight_map(src)
    largest, elements = "", 0
    for name in sorted(set(files.values())):
        with safe_open(str(name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                largest, elements = (key, n) if n > elements else (largest, elements)
    print(
        f"{src}: {len(files)} tensors in {len(set(files.values()))} file(s); the largest, {largest}, has {elements:,} "
        "elements"
    )
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
