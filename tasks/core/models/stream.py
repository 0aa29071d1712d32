"""Probe logits of an HF folder in bounded memory: the model's own forward, one unit's weights at a time.

    python -c "from tasks.core.models.fingerprint import hf_dir_logits as f; print(f('runs/demo/export', verify_memory_gb=0).shape)"

A logits check (load_from_hf, unshard, export, `cpt-to-sft verify`) of a model larger than
`verify_memory_gb` does not load it whole (a 70B export would need 140 GB of host RAM in bf16).
The model is built on the meta device (accelerate's `init_empty_weights`, buffers real: RoPE's
inv_freq is computed at init, not saved), and its own `forward` runs the probe batch; a forward
pre-hook on each unit reads that unit's tensors from the safetensors shards (through the index,
one `safe_open` per shard, closed at once so no mapped file pages stay resident) just before it
runs, and a forward hook puts the meta tensors back after it. The units are each decoder layer
(the model's largest `nn.ModuleList`, loaded whole) and every other module owning parameters
directly (embeddings, final norm, LM head, loaded alone). Running transformers' own forward, not a
re-implementation of it, is what keeps the logits bitwise those of `from_pretrained` + forward:
the same ops in the same order on the same values (each tensor cast to the model dtype as
`from_pretrained` casts it). A tied LM head shares its Parameter with the embedding; it is read
again under whichever of its names the folder saved. The process then holds its imports, one unit,
and the probe batch's activations, whatever the number of layers.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from tasks.core.errors import ConversionError
from tasks.core.run import meter

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """{tensor key: the safetensors file holding it}, read as `from_pretrained` finds them: the
    index when there is one, else model.safetensors."""
    from safetensors import safe_open

    d = Path(model_dir)
    if (d / INDEX).is_file():
        return {k: d / v for k, v in json.loads((d / INDEX).read_text())["weight_map"].items()}
    if (d / SINGLE).is_file():
        with safe_open(str(d / SINGLE), framework="pt") as f:
            return dict.fromkeys(f.keys(), d / SINGLE)
    raise ConversionError(f"{d}: neither {INDEX} nor {SINGLE}: not an HF safetensors folder")


def meta_model(model_dir: str | Path, torch_dtype: torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    """The folder's model class built from its config.json with every parameter on the meta device
    (no memory), in `torch_dtype`, eval mode, buffers real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    # Tied again outside the context, as from_pretrained does after loading: inside it, accelerate's
    # register_parameter wraps the assigned head in a new meta Parameter, so the tie is lost.
    model.tie_weights()
    return model.eval()


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (a tied one once) in their dtype: what loading it whole takes."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def stream_units(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """(module, recurse) for each unit loaded at once: every decoder layer with its submodules,
    every other module with its own parameters only."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    layers = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)
    inside = {id(m) for m in layers.modules()} if layers is not None else set()
    units: list[tuple[nn.Module, bool]] = [(layer, True) for layer in (layers or [])]
    for m in model.modules():
        if id(m) not in inside and (m._parameters or m._buffers):
            units.append((m, False))
    return units


class _Streamer:
    """Loads a unit's tensors before its forward and gives the meta ones back after it."""

    def __init__(
        self, model: nn.Module, files: dict[str, Path], model_dir: Path, rename: Callable[[str], str] | None = None
    ):
        self.files, self.model_dir = files, model_dir
        # every name a tensor object answers to (a tied head: its own and the embedding's)
        self.aliases: dict[int, list[str]] = defaultdict(list)
        self.slots: dict[int, list[tuple[nn.Module, str, bool]]] = defaultdict(
            list
        )  # module id -> (owner, name, is_param)
        for prefix, module in model.named_modules(remove_duplicate=False):
            for table, is_param in ((module._parameters, True), (module._buffers, False)):
                for name, t in table.items():
                    if t is None:
                        continue
                    if is_param and not t.is_meta:  # real already (a peft adapter's weights): not the folder's to give
                        continue
                    full = f"{prefix}.{name}" if prefix else name
                    full = rename(full) if rename else full
                    if full not in self.aliases[id(t)]:
                        self.aliases[id(t)].append(full)
                    if is_param or full in files:  # a buffer is read only when the folder saved it
                        self.slots[id(module)].append((module, name, is_param))
        self.saved: dict[int, list[tuple[nn.Module, str, bool, torch.Tensor]]] = {}

    def _key(self, t: torch.Tensor) -> str:
        names = self.aliases[id(t)]
        for name in names:
            if name in self.files:
                return name
        raise ConversionError(
            f"{self.model_dir}: no tensor {' or '.join(names)} in its safetensors files: the folder does not hold "
            "the model its config.json describes"
        )

    def load(self, unit: nn.Module, recurse: bool) -> None:
        from safetensors import safe_open

        slots = [s for m in (unit.modules() if recurse else (unit,)) for s in self.slots.get(id(m), ())]
        tables = [
            (owner, name, is_param, (owner._parameters if is_param else owner._buffers)[name])
            for owner, name, is_param in slots
        ]
        by_file: dict[Path, list[int]] = defaultdict(list)
        keys = [self._key(meta) for *_, meta in tables]
        for i, key in enumerate(keys):
            by_file[self.files[key]].append(i)
        real: dict[int, torch.Tensor] = {}
        for path, idx in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for i in idx:
                    t, meta = f.get_tensor(keys[i]), tables[i][3]
                    # as from_pretrained casts: floating tensors to the model dtype, others as saved
                    real[i] = t.to(meta.dtype) if t.is_floating_point() and meta.is_floating_point() else t
        for i, (owner, name, is_param, meta) in enumerate(tables):
            if tuple(real[i].shape) != tuple(meta.shape):
                raise ConversionError(
                    f"{self.model_dir}: {keys[i]} has shape {tuple(real[i].shape)}, its config.json wants "
                    f"{tuple(meta.shape)}"
                )
            if is_param:
                owner._parameters[name] = nn.Parameter(real[i], requires_grad=False)
            else:
                owner._buffers[name] = real[i]
        self.saved[id(unit)] = tables

    def free(self, unit: nn.Module) -> None:
        for owner, name, is_param, meta in self.saved.pop(id(unit), ()):
            (owner._parameters if is_param else owner._buffers)[name] = meta


def _freed(streamer: _Streamer, unit: nn.Module, progress: meter.Meter) -> None:
    """A unit's forward hook: its weights go, and it counts as done (returns None: the output stays)."""
    streamer.free(unit)
    progress.add()


@contextmanager
def streaming(model: nn.Module, model_dir: str | Path, rename: Callable[[str], str] | None = None) -> Iterator[None]:
    """Within it, each unit of the meta-built `model` holds real weights only while it runs.
    `rename`: the folder's key of a parameter name where the two differ (a peft model wrapping the
    folder's model: tasks/core/models/adapter.py `base_key`); real parameters are left as they are."""
    streamer = _Streamer(model, weight_files(model_dir), Path(model_dir), rename)
    handles = []
    units = stream_units(model)
    # a layer at a time is the slow path (a model larger than verify_memory_gb): say where it is
    progress = meter.meter(
        f"logits check of {'/'.join(Path(model_dir).parts[-2:])}, a layer at a time", len(units), "units"
    )
    for unit, recurse in units:
        handles.append(unit.register_forward_pre_hook(lambda m, _a, r=recurse: streamer.load(m, r)))
        handles.append(unit.register_forward_hook(lambda m, _a, _o: _freed(streamer, m, progress)))
    try:
        yield
    finally:
        progress.finish()
        for h in handles:
            h.remove()
        for unit, _ in stream_units(model):
            streamer.free(unit)
