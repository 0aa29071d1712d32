"""The kernel registry: which fast kernels apply under which plugin on which device, pure data.

    python -c "from tasks.core.config.kernels import Facts, report, resolve_for; print(report(resolve_for('hybrid_parallel', 'bf16', Facts(cuda=False))))"

One `KernelSpec` row is one way of switching one acceleration on: the route it takes (the plugins
it applies to are those whose row lists that route, `PluginSpec.kernel_routes`), what
it needs (CUDA, a precision, an installed package, a model family), how the engine passes it
(a plugin argument, a `from_pretrained` argument or an optimizer argument) and how the engine
checks that it loads. Rows that do the same thing under different plugins share a `name`, which is
what `<phase>.kernels` switches off (`tasks.core.config.schema.PhaseConfig.kernels`). `resolve` is
pure: a stage's config and the device's `Facts` in, each applicable kernel on or off with its
reason out. Pre-flight reports it on the task's machine; the engine resolves it again in the rank
(`tasks/engine/builders.py` `kernel_kwargs`, `tasks/engine/accel.py`), tries to load what is on,
and records what ran in every checkpoint manifest, from where the model card reads it.

Every kernel is off without CUDA: the exactness tests (bitwise resume, fp32 loss equalities,
the export's weight proof) run on CPU, and nothing here changes a CPU run. Facts recorded in the
rows were read in colossalai 0.5.0 and transformers 4.51.3:
- transformers already gives Llama/Qwen2 `sdpa` attention by default (measured here:
  `from_pretrained` and `from_config` of the demo Llama both give `_attn_implementation == 'sdpa'`,
  on CPU too), and sdpa on CUDA dispatches to PyTorch's fused flash / memory-efficient kernels. So
  the attention row for the plugins without shardformer adds `flash_attention_2` (the flash_attn
  package), and "off" keeps transformers' default, never eager.
- shardformer's flash attention (`ColoAttention`) loads flash_attn's kernel where installed and
  torch's CUDA sdpa otherwise (`FlashAttentionLoader`), fp32 included; it needs no package.
- shardformer's fused RMSNorm is apex's: without apex ColossalAI's `FusedRMSNormWithHook` is None
  and the replacement fails, so the row needs the `apex` package.
- shardformer's JIT fused ops (fused bias+dropout+add) are read by the bert/bloom/gpt2/opt/t5/...
  policies only; the llama, mistral, qwen2 and qwen3 policies never look at `enable_jit_fused`, so
  the row is off for them with that reason rather than reported on for a flag that changes nothing.
- torch's fused AdamW (`fused=True`) keeps AdamW's state format (the engine materializes it the
  way torch's lazy init does); Gemini's optimizer is always ColossalAI's HybridAdam (a fused CUDA
  kernel by construction), so no row applies there.
"""

from __future__ import annotations

import glob
import importlib.util
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tasks.core.config.phases import Phase
from tasks.core.config.plugins import PLUGINS, PRECISIONS, KernelRoute

Via = Literal["plugin", "model", "optimizer"]


@dataclass(frozen=True)
class KernelSpec:
    """One way to switch one acceleration on, under the plugins named."""

    name: str  # the key under <phase>.kernels; shared by rows doing the same under other plugins
    label: str  # what runs when it is on, for reports: "shardformer", "transformers flash_attention_2"
    summary: str  # one line for the config field's description
    route: KernelRoute  # the plugins whose row lists this route get it (one route per row of a name)
    via: Via  # how the engine passes it: a plugin argument, a from_pretrained argument, an optimizer argument
    arg: str  # that argument's name
    value: Any = True  # and its value when on (off passes nothing: the library's default)
    needs_cuda: bool = True
    precisions: tuple[str, ...] = PRECISIONS  # training precisions it works in
    package: str | None = None  # an installed distribution it needs (import name), checked without importing it
    model_types: tuple[str, ...] | None = None  # config.json model types it changes anything for; None: every one
    imports: tuple[str, ...] = ()  # modules the engine imports before using it: a failure is "failed to load"
    colossalai_loader: str | None = None  # a colossalai.kernel.kernel_loader class whose .load() the engine runs first

    @property
    def plugins(self) -> tuple[str, ...]:
        """The registered plugins this row applies to, in registry order."""
        return tuple(name for name, spec in PLUGINS.items() if self.route in spec.kernel_routes)


@dataclass(frozen=True)
class Facts:
    """What decides a kernel besides the config: the device, the installed packages, the model."""

    cuda: bool
    packages: frozenset[str] = field(default_factory=frozenset)  # import names found installed
    model_type: str | None = None  # config.json model_type; None: not known (every model-type rule passes)

    @classmethod
    def detect(cls, cuda: bool | None = None, model_type: str | None = None) -> Facts:
        """This machine: CUDA (torch, imported lazily) and which of the rows' packages are installed
        (`importlib.util.find_spec`: nothing is imported, so a broken build is found at load time)."""
        if cuda is None:
            cuda = cuda_available()
        wanted = {row.package for row in KERNELS if row.package}
        return cls(
            cuda=cuda,
            packages=frozenset(p for p in wanted if importlib.util.find_spec(p) is not None),
            model_type=model_type,
        )


# Device nodes a GPU runtime needs on Linux: NVIDIA's driver, ROCm's, WSL2's GPU paravirtualization,
# and the integrated GPUs of Jetson boards.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg", "/dev/nvmap", "/dev/nvhost-ctrl-gpu")


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, but False without importing torch on a Linux machine that has no
    GPU device node (GPU_DEVICE_NODES): no CUDA can run there, and the import is ~2.5 s of CPU that a
    CPU-only pre-flight, or a re-run that skips every stage, never needs otherwise. Elsewhere, or
    once torch is imported, torch is asked."""
    if (
        "torch" not in sys.modules
        and sys.platform.startswith("linux")
        and not any(glob.glob(p) for p in GPU_DEVICE_NODES)
    ):
        return False
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class KernelState:
    """A kernel's decision for one stage: on or off, and why, as reports and manifests print it."""

    spec: KernelSpec
    on: bool
    reason: str  # "on (shardformer)", "off: no CUDA", "off: switched off in sft.kernels", ...

    @property
    def name(self) -> str:
        return self.spec.name

    def failed(self, error: BaseException | str) -> KernelState:
        """The same kernel after it did not load: off, the error kept in the reason."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return KernelState(self.spec, False, f"off: failed to load: {' '.join(text.split())[:300]}")


KERNELS: list[KernelSpec] = []


def register(spec: KernelSpec) -> KernelSpec:
    """Add a row; a second row of one name takes another route."""
    for row in KERNELS:
        if row.name == spec.name and row.route == spec.route:
            raise ValueError(f"kernel {spec.name!r} already has a row for route {spec.route!r}")
    KERNELS.append(spec)
    return spec


def names() -> tuple[str, ...]:
    """The kernel names <phase>.kernels accepts, in registry order."""
    return tuple(dict.fromkeys(row.name for row in KERNELS))


def summaries() -> dict[str, str]:
    """{name: summary of each row of it}, for the config field's description."""
    out: dict[str, list[str]] = {}
    for row in KERNELS:
        out.setdefault(row.name, []).append(f"{row.label} under {'/'.join(row.plugins)}")
    return {n: ", ".join(v) for n, v in out.items()}


def unknown(switches: Iterable[str]) -> list[str]:
    return [n for n in switches if n not in names()]


def _decide(
    row: KernelSpec, precision: str, switches: Mapping[str, bool], field_path: str, facts: Facts
) -> KernelState:
    if switches.get(row.name, True) is False:
        return KernelState(row, False, f"off: switched off in {field_path}")
    if row.needs_cuda and not facts.cuda:
        return KernelState(row, False, "off: no CUDA")
    if precision not in row.precisions:
        return KernelState(row, False, f"off: needs {' or '.join(row.precisions)} (precision is {precision})")
    if row.package and row.package not in facts.packages:
        return KernelState(row, False, f"off: {row.package} not installed")
    if row.model_types is not None and facts.model_type is not None and facts.model_type not in row.model_types:
        return KernelState(row, False, f"off: ColossalAI 0.5.0's {facts.model_type} policy has no {row.label}")
    return KernelState(row, True, f"on ({row.label})")


def resolve_for(
    plugin: str, precision: str, facts: Facts, switches: Mapping[str, bool] | None = None, field_path: str = "kernels"
) -> dict[str, KernelState]:
    """Each kernel that applies under `plugin`, on or off with its reason, in registry order."""
    routes = PLUGINS[plugin].kernel_routes if plugin in PLUGINS else ()
    out: dict[str, KernelState] = {}
    for row in KERNELS:
        if row.route in routes:
            if row.name in out:
                raise ValueError(f"plugin {plugin!r} lists two routes of kernel {row.name!r}: {routes}")
            out[row.name] = _decide(row, precision, switches or {}, field_path, facts)
    return out


def resolve(phase_cfg: Any, phase: Phase, facts: Facts) -> dict[str, KernelState]:
    """`resolve_for` of a PhaseConfig (`phase` names the config section in the reasons)."""
    return resolve_for(phase_cfg.plugin.name, phase_cfg.plugin.precision, facts, phase_cfg.kernels, f"{phase}.kernels")


def passed(states: Mapping[str, KernelState], via: Via) -> dict[str, Any]:
    """The arguments the engine passes for the kernels that are on, for one `via`."""
    return {s.spec.arg: s.spec.value for s in states.values() if s.on and s.spec.via == via}


def record(states: Mapping[str, KernelState]) -> dict[str, str]:
    """{name: reason}: what manifests, the progress artifact and the card carry."""
    return {n: s.reason for n, s in states.items()}


def describe(recorded: Mapping[str, str]) -> str:
    """'flash attention: on (shardformer); fused normalization: off: no CUDA' from a `record`."""
    return "; ".join(f"{n.replace('_', ' ')}: {why}" for n, why in recorded.items()) or "none applies"


def report(states: Mapping[str, KernelState]) -> str:
    return describe(record(states))


_HALF = ("bf16", "fp16")

register(
    KernelSpec(
        "flash_attention",
        "shardformer",
        "flash attention",
        "shardformer",
        "plugin",
        "enable_flash_attention",
        colossalai_loader="FlashAttentionLoader",
    )
)
register(
    KernelSpec(
        "flash_attention",
        "transformers flash_attention_2",
        "flash attention",
        "hf_model",
        "model",
        "attn_implementation",
        value="flash_attention_2",
        precisions=_HALF,
        package="flash_attn",
        imports=("flash_attn",),
    )
)
register(
    KernelSpec(
        "fused_normalization",
        "shardformer, apex",
        "fused RMSNorm",
        "shardformer",
        "plugin",
        "enable_fused_normalization",
        package="apex",
        imports=("apex.normalization",),
    )
)
register(
    KernelSpec(
        "jit_fused",
        "shardformer JIT fused ops",
        "JIT fused bias/dropout/add",
        "shardformer",
        "plugin",
        "enable_jit_fused",
        model_types=("bert", "blip2", "bloom", "chatglm", "gpt2", "opt", "t5", "vit", "whisper"),
    )
)
register(
    KernelSpec(
        "fused_optimizer",
        "torch AdamW fused",
        "the fused AdamW step",
        "torch_adamw",
        "optimizer",
        "fused",
    )
)
