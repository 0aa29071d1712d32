"""Inside a rank: the stage's fast kernels loaded (or fallen back from, loudly) and activation
checkpointing switched on, before the plugin and the model are built.

    torchrun --nproc_per_node=2 -m tasks.engine train --config JOB.json   # Engine.__init__ calls load_kernels

`tasks.core.config.kernels` decides what should be on from the config and the machine; here each
kernel that is on is tried the way it will be used (its modules imported, ColossalAI's kernel
loader run, the fused AdamW stepped once on this device). A kernel that fails is switched off with a
warning naming it and the error, and recorded as "off: failed to load: <error>" in the manifests;
a run never silently trains without a kernel it reports. `load_model` does the same for the
`from_pretrained`/`from_config` arguments (transformers checks flash_attn itself when it builds).

Activation checkpointing is the HF model's own switch, `gradient_checkpointing_enable` with
`use_reentrant=False` (the non-reentrant torch.utils.checkpoint: no inputs needing grad, works under
DDP/ZeRO hooks), flipped before the plugin wraps the model. Shardformer's Llama/Qwen2 forwards read
the same flag (and, with a pipeline, the plugin's gradient_checkpoint_config, builders.py).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tasks.core.config.kernels import Facts, KernelState, passed, record, report, resolve
from tasks.core.config.phases import Phase
from tasks.core.errors import ConfigError
from tasks.core.run.events import DETAIL, WARNING, format_event
from tasks.core.run.events import KERNELS as KERNELS_EVENT
from tasks.engine import rankio

__all__ = ["announce", "checkpoint_activations", "load_kernels", "load_model", "model_type", "optimizer_kwargs"]

Kernels = dict[str, KernelState]


def model_type(model_dir: Path) -> str | None:
    """config.json's model_type, None where it cannot be read."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None  # check_inputs has refused a missing config.json already; unknown passes every model rule


def _warn(rank: int, state: KernelState) -> None:
    if rank == 0:  # every rank falls back the same way; one line says it
        rankio.say(
            f"kernel {state.name} ({state.spec.label}) {state.reason[len('off: ') :]}; training without it", WARNING
        )


def _probe(state: KernelState, device: torch.device) -> None:
    """Use the kernel once the way the stage will; raises what loading it raises."""
    spec = state.spec
    for module in spec.imports:
        importlib.import_module(module)
    if spec.colossalai_loader:
        from colossalai.kernel import kernel_loader

        getattr(kernel_loader, spec.colossalai_loader)().load()
    if spec.via == "optimizer":
        p = torch.nn.Parameter(torch.zeros(4, device=device))
        opt = torch.optim.AdamW([p], lr=1e-3, **{spec.arg: spec.value})
        p.grad = torch.ones_like(p)
        opt.step()


def load_kernels(
    phase_cfg: Any,
    phase: str,
    model_dir: Path,
    cuda: bool,
    device: torch.device,
    rank: int,
    probe: Callable[[KernelState, torch.device], None] = _probe,
) -> Kernels:
    """The registry's decision for this stage on this rank's machine, each kernel that is on tried
    once; one that fails is off ("failed to load: ...") with a warning naming it."""
    states = resolve(phase_cfg, phase, Facts.detect(cuda=cuda, model_type=model_type(model_dir)))
    for name, state in list(states.items()):
        if not state.on or state.spec.via == "model":  # transformers checks those when it builds the model
            continue
        try:
            probe(state, device)
        except Exception as exc:  # an import error, a kernel build failure, an unsupported device
            states[name] = state.failed(exc)
            _warn(rank, states[name])
    return states


def load_model(states: Kernels, build: Callable[..., torch.nn.Module], rank: int) -> tuple[Kernels, torch.nn.Module]:
    """`build(**kwargs)` with the model arguments of the kernels that are on (attn_implementation);
    if transformers refuses them, the model is built without, and those kernels are recorded off."""
    kwargs = passed(states, "model")
    if not kwargs:
        return states, build()
    try:
        return states, build(**kwargs)
    except (ImportError, ValueError, RuntimeError, OSError) as exc:
        states = dict(states)
        for name, state in states.items():
            if state.on and state.spec.via == "model":
                states[name] = state.failed(exc)
                _warn(rank, states[name])
        return states, build()


def optimizer_kwargs(states: Mapping[str, KernelState]) -> dict[str, Any]:
    return passed(states, "optimizer")


def checkpoint_activations(model: torch.nn.Module, phase_cfg: Any, phase: Phase) -> bool:
    """Switch the HF model's gradient checkpointing on when the phase asks; whether it is on."""
    if not phase_cfg.activation_checkpointing:
        return False
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            [
                (
                    f"{phase}.activation_checkpointing",
                    f"{type(model).__name__} does not support gradient checkpointing in transformers; set it to false",
                )
            ]
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return True


def announce(states: Mapping[str, KernelState], activation_checkpointing: bool, rank: int) -> None:
    """One log line and one @@kernels event (rank 0): what this launch runs with."""
    if rank != 0:
        return
    ac = "on" if activation_checkpointing else "off"
    rankio.say(f"kernels: {report(states)}; activation checkpointing: {ac}", DETAIL)
    print(
        format_event(KERNELS_EVENT, {"kernels": record(states), "activation_checkpointing": activation_checkpointing}),
        flush=True,
    )
