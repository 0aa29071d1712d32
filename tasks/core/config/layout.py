"""`ParallelLayout`: a stage's parallel layout, every rule stated once, dp derived.

    python -c "from tasks.core.config.load import load_config; from tasks.core.config.layout import ParallelLayout; \
c = load_config('examples/tiny-cpu.yaml'); print(ParallelLayout.of(c.cpt, 'cpt'))"

torchtitan's `ParallelDims` is the model: a frozen value built from the config validates every layout rule and
derives the data-parallel degree. Each rule names the config field it concerns and the fix; its tier says who
checks it: `static` (the config alone: the loader and pre-flight), `batch` (the config alone, pre-flight and the
engine: a pipeline step splits its rows evenly), `model` (the base's config.json: heads, KV heads, vocabulary,
layers), `device` (whether CUDA is present). Plugin capabilities come from the registry
(`tasks.core.config.plugins`), never from a plugin's name; sequence parallelism's rules are
`tasks.core.config.sequence_rules`, the `model` tier's (the base's shape against tp and pp)
`tasks.core.config.model_rules`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.core.config.backends import BACKENDS
from tasks.core.config.batching import BATCHING
from tasks.core.config.context import CONTEXT_RULES
from tasks.core.config.fixes import Refusal, shown, working_fixes
from tasks.core.config.model_rules import MODEL_RULES
from tasks.core.config.phases import PHASES
from tasks.core.config.plugins import OFFLOAD_FIELDS, PLUGINS, PRECISION_SPECS, PluginSpec
from tasks.core.config.preference import PreferenceFields
from tasks.core.config.schema import PhaseConfig, PluginConfig
from tasks.core.config.sequence import sp_factor, sp_size
from tasks.core.config.sequence_rules import SP_RULES, Problem
from tasks.core.errors import ConfigError

TIERS = ("static", "batch", "model", "device")


@dataclass(frozen=True)
class _Facts:
    phase_cfg: PhaseConfig
    where: str  # "cpt" or "sft": the config path prefix of every field named
    spec: PluginSpec
    model: dict[str, Any] | None  # the base model's config.json
    cuda: bool | None

    @property
    def f(self) -> str:
        return f"{self.where}.plugin"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def num_microbatches(phase_cfg: PhaseConfig) -> int:
    return phase_cfg.plugin.num_microbatches or phase_cfg.grad_accum_steps


def global_batch(phase_cfg: PhaseConfig) -> int:
    """Sequences (SFT packed: rows) per optimizer step over every data-parallel rank, as the engine's
    StageData takes them: micro_batch_size x grad_accum_steps x dp, dp = world / (tp x pp x own sequence group)."""
    dp = phase_cfg.launch.world_size // (
        phase_cfg.plugin.tp_size * phase_cfg.plugin.pp_size * sp_factor(phase_cfg.plugin)
    )
    return phase_cfg.micro_batch_size * phase_cfg.grad_accum_steps * max(1, dp)


def is_zero(spec: PluginSpec, zero_stage: int) -> bool:
    """Whether the plugin shards optimizer state (always, for ZeRO-only plugins)."""
    return spec.zero_stage(zero_stage) > 0 or min(spec.zero_stages) > 0


# -- static ---------------------------------------------------------------------------------------


def _tp_pp_need_support(x: _Facts) -> list[Problem]:
    p, out = x.phase_cfg.plugin, []
    if not x.spec.supports_tp_pp:
        capable = ", ".join(n for n, s in PLUGINS.items() if s.supports_tp_pp)
        names = [n for n, s in PLUGINS.items() if s.supports_tp_pp]
        for f, what in (("tp_size", "tensor"), ("pp_size", "pipeline")):
            if getattr(p, f) != 1:
                out.append(
                    Refusal(
                        f"{x.f}.{f}",
                        f"{what} parallelism needs plugin {capable}, not {p.name}",
                        [{f"plugin.{f}": 1}, *({"plugin.name": n} for n in names)],
                    )
                )
    return out


def _zero_stage_allowed(x: _Facts) -> list[Problem]:
    z = x.phase_cfg.plugin.zero_stage
    if z in x.spec.zero_stages:
        return []
    fixes = [{"plugin.zero_stage": v} for v in x.spec.zero_stages] + [
        {"plugin.name": n} for n, s in PLUGINS.items() if z in s.zero_stages
    ]
    return [Refusal(f"{x.f}.zero_stage", f"{x.spec.zero_hint}, got {z}", fixes)]


def _precision_allowed(x: _Facts) -> list[Problem]:
    p = x.phase_cfg.plugin
    if p.precision in x.spec.precisions:
        return []
    fixes = [{"plugin.precision": v} for v in x.spec.precisions] + [
        {"plugin.name": n} for n, s in PLUGINS.items() if p.precision in s.precisions
    ]
    why = f"{p.name} supports precision {', '.join(x.spec.precisions)}, got {p.precision}"
    return [Refusal(f"{x.f}.precision", why, fixes)]


def _zero_fp32_where_refused(x: _Facts) -> list[Problem]:
    p = x.phase_cfg.plugin
    if p.precision != "fp32" or not x.spec.zero_fp32_refused or not is_zero(x.spec, p.zero_stage):
        return []
    # Every layout that trains in fp32 is offered first: bf16 is 30-60x slower on a CPU without native bf16.
    fixes = [{"plugin.zero_stage": z} for z in x.spec.zero_stages if not is_zero(x.spec, z)]
    fixes += [
        {"plugin.name": n} for n, s in PLUGINS.items() if n != p.name and "fp32" in s.precisions and not s.needs_cuda
    ]
    fixes += [{"plugin.precision": v} for v in x.spec.precisions if v != "fp32" and not PRECISION_SPECS[v].cuda_reason]
    why = f"fp32 with ZeRO is refused under {p.name} (zero_stage {p.zero_stage}): {x.spec.zero_fp32_refused}"
    return [Refusal(f"{x.f}.precision", why, fixes)]


def _rendezvous_by_backend(x: _Facts) -> list[Problem]:
    """Who places a multi-node rendezvous is the backend's `rendezvous` (tasks.core.config.backends)."""
    launch = x.phase_cfg.launch
    spec = BACKENDS.get(launch.backend)
    if spec is None:  # the config's own validator names the unknown backend
        return []
    if spec.rendezvous == "scheduler":
        if launch.rdzv_endpoint or launch.node_rank:
            return [
                (
                    f"{x.where}.launch.rdzv_endpoint",
                    (
                        f"the {spec.name} backend places the rendezvous on the job's first node and numbers the nodes "
                        "itself; remove rdzv_endpoint and node_rank"
                    ),
                )
            ]
        return []
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        return [
            (
                f"{x.where}.launch.rdzv_endpoint",
                (
                    f"nnodes={launch.nnodes} needs a c10d rendezvous endpoint host:port reachable from every node; "
                    "without one the stage would wait forever for nodes that never join (or use a backend that starts "
                    "every node, e.g. backend: slurm)"
                ),
            )
        ]
    return []


def _backend_settings(x: _Facts) -> list[Problem]:
    """Only the chosen backend's settings section may be set; then the backend's own static rules."""
    launch = x.phase_cfg.launch
    spec = BACKENDS.get(launch.backend)
    if spec is None:
        return []
    out = [
        (
            f"{x.where}.launch.{other.settings}",
            (
                f"is set but backend is {spec.name}, so it would be ignored; set backend: {other.name} or remove the "
                f"{other.settings} section"
            ),
        )
        for other in BACKENDS.values()
        if other.settings and other.settings != spec.settings and getattr(launch, other.settings, None) is not None
    ]
    if not spec.static_problems:
        return out
    if spec.settings:
        return out + spec.static_problems(getattr(launch, spec.settings, None), f"{x.where}.launch.{spec.settings}")
    return out + spec.static_problems(None, f"{x.where}.launch")


def _world_divisible(x: _Facts) -> list[Problem]:
    p, world = x.phase_cfg.plugin, x.phase_cfg.launch.world_size
    if world % (p.tp_size * p.pp_size):
        fixes = (
            [{"launch.nproc_per_node": p.tp_size * p.pp_size * x.phase_cfg.launch.nnodes}]
            if x.phase_cfg.launch.nnodes == 1
            else []
        )
        fixes += [{"plugin.tp_size": d} for d in _divisors(world) if d > 1 and world % (d * p.pp_size) == 0] + [
            {"plugin.tp_size": 1, "plugin.pp_size": 1}
        ]
        return [
            Refusal(
                f"{x.where}.launch",
                f"world size nnodes*nproc_per_node = {world} is not a multiple of tp_size*pp_size = {p.tp_size * p.pp_size}",
                fixes,
            )
        ]
    return []


def _pipeline_microbatches(x: _Facts) -> list[Problem]:
    p = x.phase_cfg.plugin
    nmb = num_microbatches(x.phase_cfg)
    if p.pp_size > 1 and nmb < p.pp_size:
        fixes = [{"plugin.num_microbatches": p.pp_size}, {"grad_accum_steps": p.pp_size}]
        return [
            Refusal(
                f"{x.f}.num_microbatches",
                f"pipeline needs at least pp_size={p.pp_size} micro-batches per step, got {nmb}",
                fixes,
            )
        ]
    return []


def _packing_keeps_conversations_apart(x: _Facts) -> list[Problem]:
    # A block phase (CPT) trains on whole seq_len windows of one stream: `batching` changes row phases only.
    spec = BATCHING.get(x.phase_cfg.batching)
    row = PHASES.get(x.where)  # `where` may be any label of a phase section: not a phase, its rules all apply
    if (row is not None and row.blocks) or spec is None or not spec.packs or not x.spec.packing_refused:
        return []
    fixes = [{"plugin.name": n} for n, s in PLUGINS.items() if not s.packing_refused] + [
        {"batching": n} for n, s in BATCHING.items() if not s.packs
    ]
    return [
        Refusal(
            f"{x.where}.batching",
            f"batching {spec.name} is refused under plugin {x.spec.name}: {x.spec.packing_refused}",
            fixes,
        )
    ]


def _pairs_whole_in_one_forward(x: _Facts) -> list[Problem]:
    """A preference pair's loss needs both its sequences' log-probabilities from one forward (the engine's
    `tasks.engine.pairs`): a pipeline schedule's per-micro-batch loss from the model's labels, a sequence
    split over ranks, and packed rows do not give them, so those layouts are refused for a pair phase."""
    row = PHASES.get(x.where)  # a job's section is labelled phase_cfg: its class says it holds pairs
    if not ((row is not None and row.record == "pair") or isinstance(x.phase_cfg, PreferenceFields)):
        return []
    p, out = x.phase_cfg.plugin, []
    runs = "it trains under tensor parallelism (hybrid_parallel tp_size), ZeRO (low_level_zero, gemini) or torch_ddp"
    if p.pp_size > 1:
        why = (
            "pipeline parallelism is refused for preference pairs: the pipeline schedule computes a loss per "
            f"micro-batch from the model's labels, not the pair loss of both sequences; {runs}"
        )
        out.append(Refusal(f"{x.f}.pp_size", why, [{"plugin.pp_size": 1}]))
    if sp_size(p) > 1 or sp_factor(p) > 1:
        why = f"sequence parallelism is refused for preference pairs (a pair is scored whole on each rank); {runs}"
        out.append(Refusal(f"{x.f}.sequence_parallelism", why, [{"plugin.sequence_parallelism": None}]))
    spec = BATCHING.get(x.phase_cfg.batching)
    if spec is not None and spec.packs:
        fixes = [{"batching": n} for n, s in BATCHING.items() if not s.packs]
        why = f"batching {spec.name} is refused for preference pairs: a pair's two rows are batched whole, never packed"
        out.append(Refusal(f"{x.where}.batching", why, fixes))
    return out


def _lora_in_sft_only(x: _Facts) -> list[Problem]:
    why = PHASES[x.where].lora_refused if x.where in PHASES else None
    if why is not None and x.phase_cfg.lora is not None:
        return [
            Refusal(
                f"{x.where}.lora",
                why,
                [{"lora": None}],
            )
        ]
    return []


def _lora_supported_by_plugin(x: _Facts) -> list[Problem]:
    if x.phase_cfg.lora is None:
        return []
    others = [{"plugin.name": n} for n, s in PLUGINS.items() if not s.lora.refused and n != x.spec.name]
    full = {"lora": None}  # full fine-tuning
    if x.spec.lora.refused:
        return [
            Refusal(
                f"{x.where}.lora", f"LoRA is refused under plugin {x.spec.name}: {x.spec.lora.refused}", [*others, full]
            )
        ]
    for f, reason in (("tp_size", x.spec.lora.tp1_reason), ("pp_size", x.spec.lora.pp1_reason)):
        if reason and getattr(x.phase_cfg.plugin, f) > 1:
            return [
                Refusal(
                    f"{x.f}.{f}",
                    f"LoRA under {x.spec.name} needs {f} 1 ({reason}), got {getattr(x.phase_cfg.plugin, f)}",
                    [{f"plugin.{f}": 1}, *others, full],
                )
            ]
    return []


def _qlora_export_not_built(x: _Facts) -> list[Problem]:
    # peft#2105: an adapter trained on the 4-bit base and merged onto the unquantized one is another
    # model; the export here merges onto cpt/hf as it is, so a QLoRA run would export the wrong model.
    if x.phase_cfg.lora is not None and x.phase_cfg.lora.quantize:
        return [
            Refusal(
                f"{x.where}.lora.quantize",
                (
                    "QLoRA is not supported yet: the export merges the adapter onto cpt/hf unquantized, not onto the "
                    "dequantized 4-bit base it was trained against (peft#2105), so the merged model would differ"
                ),
                [{"lora.quantize": False}],
            )
        ]
    return []


def _offload_where_the_plugin_has_it(x: _Facts) -> list[Problem]:
    """A memory saver the plugin lacks would be ignored silently (a run that then runs out of GPU
    memory, or trains slower for nothing); one it has acts only under its `requires`."""
    p, out = x.phase_cfg.plugin, []
    for name in OFFLOAD_FIELDS:
        value, default = getattr(p, name), PluginConfig.model_fields[name].default
        row = x.spec.offload_field(name)
        if row is None:
            if value != default:
                has = [n for n, s in PLUGINS.items() if s.offload_field(name)]
                out.append(
                    Refusal(
                        f"{x.f}.{name}",
                        f"plugin {p.name} has no {name} (plugins that have it: {', '.join(has) or 'none'})",
                        [{f"plugin.{name}": default}, *({"plugin.name": n} for n in has)],
                    )
                )
            continue
        unmet = [(f, want) for f, want in row.requires if getattr(p, f) != want]
        if value != default and unmet:
            need = ", ".join(f"{f}: {shown(want)}" for f, want in unmet)
            out.append(
                Refusal(
                    f"{x.f}.{name}",
                    f"{name}: {shown(value)} acts only with {need} ({row.why})",
                    [{f"plugin.{f}": want for f, want in unmet}, {f"plugin.{name}": default}],
                )
            )
    return out


# -- batch ----------------------------------------------------------------------------------------


def _rows_divide_microbatches(x: _Facts) -> list[Problem]:
    phase_cfg = x.phase_cfg
    if phase_cfg.plugin.pp_size <= 1:
        return []
    nmb, rows = num_microbatches(phase_cfg), phase_cfg.micro_batch_size * phase_cfg.grad_accum_steps
    if rows % nmb:
        why = (
            f"a pipeline step splits micro_batch_size*grad_accum_steps = {rows} sequences per data-parallel "
            f"rank into {nmb} micro-batches, which does not divide"
        )
        return [
            Refusal(
                f"{x.f}.num_microbatches",
                why,
                [{"plugin.num_microbatches": d} for d in _divisors(rows) if d >= phase_cfg.plugin.pp_size][:3],
            )
        ]
    return []


# -- device ---------------------------------------------------------------------------------------


def _cuda_only_plugin(x: _Facts) -> list[Problem]:
    if x.cuda is False and x.spec.needs_cuda:
        return [
            Refusal(
                f"{x.f}.name",
                f"{x.spec.name} needs CUDA ({x.spec.cuda_reason}) and no GPU is visible here (or run this stage on a "
                "CUDA node)",
                [{"plugin.name": n} for n, s in PLUGINS.items() if not s.needs_cuda],
            )
        ]
    return []


def _cuda_only_precision(x: _Facts) -> list[Problem]:
    p = x.phase_cfg.plugin
    why = PRECISION_SPECS[p.precision].cuda_reason
    if x.cuda is False and why:
        cpu_ok = [n for n, s in PRECISION_SPECS.items() if not s.cuda_reason]
        return [
            Refusal(
                f"{x.f}.precision",
                f"precision {p.precision} needs CUDA ({why}) and this stage runs on CPU (or run this stage on a CUDA "
                "node)",
                [{"plugin.precision": n} for n in cpu_ok],
            )
        ]
    return []


def _fp16_needs_dynamic_loss_scale(x: _Facts) -> list[Problem]:
    p = x.phase_cfg.plugin
    if PRECISION_SPECS[p.precision].loss_scaling and x.spec.loss_scale != "dynamic":
        return [
            Refusal(
                f"{x.f}.precision",
                f"precision {p.precision} needs dynamic loss scaling (small gradients underflow to zero otherwise) "
                f"and {p.name} is built without it",
                [{"plugin.precision": n} for n, s in PRECISION_SPECS.items() if not s.loss_scaling],
            )
        ]
    return []


def _qlora_needs_cuda_and_bitsandbytes(x: _Facts) -> list[Problem]:
    lora = x.phase_cfg.lora
    if lora is None or not lora.quantize or x.cuda is None:
        return []
    missing = [
        why
        for why, bad in (
            ("no GPU is visible here", x.cuda is False),
            ("bitsandbytes is not installed", importlib.util.find_spec("bitsandbytes") is None),
        )
        if bad
    ]
    if not missing:
        return []
    return [
        Refusal(
            f"{x.where}.lora.quantize",
            (
                f"QLoRA loads the frozen base in 4-bit NF4 through bitsandbytes, whose kernels run on CUDA only, and "
                f"{' and '.join(missing)} (or run this stage on a CUDA node with bitsandbytes installed)"
            ),
            [{"lora.quantize": False}],
        )
    ]


RULES: tuple[tuple[str, Callable[[_Facts], list[Problem]]], ...] = (
    ("static", _tp_pp_need_support),
    ("static", _zero_stage_allowed),
    ("static", _precision_allowed),
    ("static", _zero_fp32_where_refused),
    ("static", _rendezvous_by_backend),
    ("static", _backend_settings),
    ("static", _world_divisible),
    ("static", _pipeline_microbatches),
    ("static", _fp16_needs_dynamic_loss_scale),
    ("static", _packing_keeps_conversations_apart),
    ("static", _pairs_whole_in_one_forward),
    ("static", _lora_in_sft_only),
    ("static", _lora_supported_by_plugin),
    ("static", _qlora_export_not_built),
    ("static", _offload_where_the_plugin_has_it),
    *CONTEXT_RULES,
    ("batch", _rows_divide_microbatches),
    *MODEL_RULES,
    ("device", _cuda_only_plugin),
    ("device", _cuda_only_precision),
    ("device", _qlora_needs_cuda_and_bitsandbytes),
    *SP_RULES,
)


def layout_problems(
    phase_cfg: PhaseConfig,
    where: str,
    *,
    model_config: dict[str, Any] | None = None,
    cuda: bool | None = None,
    tiers: tuple[str, ...] = TIERS,
) -> list[Problem]:
    """Every broken rule of the chosen tiers, as (config field, message with the fixes that work). `model` rules need
    `model_config`, `device` rules `cuda` (else skipped); each `Refusal` keeps the fixes (`.fixes`, overrides of the
    phase section) that pass every rule these facts decide (whichever tier refused), so the message offers only what
    runs."""
    found = _broken(phase_cfg, where, model_config, cuda, tiers)
    if not found:
        return found

    # A fix is checked against every tier these facts decide, not only the tier that refused: a
    # static refusal's fix must also pass the model's rules when the model is known.
    def broken(changed: PhaseConfig) -> list[Refusal]:
        return _broken(changed, where, model_config, cuda, TIERS)

    every = broken(phase_cfg)
    return [p.with_fixes(working_fixes(phase_cfg, p, every, broken), where) if p.fixes else p for p in found]


def _broken(
    phase_cfg: PhaseConfig, where: str, model_config: dict[str, Any] | None, cuda: bool | None, tiers: tuple[str, ...]
) -> list[Refusal]:
    spec = PLUGINS.get(phase_cfg.plugin.name)
    if spec is None:  # the config's own validator names the unknown plugin
        return [
            Refusal(
                f"{where}.plugin.name",
                f"unknown plugin {phase_cfg.plugin.name!r}; registered plugins: {', '.join(PLUGINS)}",
            )
        ]
    facts = _Facts(phase_cfg, where, spec, model_config, cuda)
    out: list[Refusal] = []
    for tier, rule in RULES:
        if tier in tiers:
            for p in rule(facts):
                p = p if isinstance(p, Refusal) else Refusal(*p)
                p.rule = rule.__name__
                if p not in out:
                    out.append(p)
    return out


@dataclass(frozen=True)
class ParallelLayout:
    """A validated layout: tp x pp x dp (x sp, a sequence group of its own) = world size, under one plugin."""

    plugin: str
    tp: int
    pp: int
    dp: int
    world_size: int
    zero_stage: int  # the stage the plugin really runs
    precision: str
    num_microbatches: int
    sp: int = 1  # ranks one sequence is split over (under split_gather/ring: the tp group); sp_mode its mode
    sp_mode: str | None = None

    @property
    def spec(self) -> PluginSpec:
        return PLUGINS[self.plugin]

    @classmethod
    def of(
        cls,
        phase_cfg: PhaseConfig,
        where: str,
        *,
        model_config: dict[str, Any] | None = None,
        cuda: bool | None = None,
        tiers: tuple[str, ...] = TIERS,
        header: str | None = None,
    ) -> ParallelLayout:
        """The layout of `stage`, or one ConfigError naming every broken rule of `tiers`."""
        problems = layout_problems(phase_cfg, where, model_config=model_config, cuda=cuda, tiers=tiers)
        if problems:
            raise ConfigError(problems, header=header or f"stage {where} cannot run with this layout")
        p, world = phase_cfg.plugin, phase_cfg.launch.world_size
        spec = PLUGINS[p.name]
        return cls(
            plugin=p.name,
            tp=p.tp_size,
            pp=p.pp_size,
            dp=world // (p.tp_size * p.pp_size * sp_factor(p)),
            world_size=world,
            zero_stage=spec.zero_stage(p.zero_stage),
            precision=p.precision,
            num_microbatches=num_microbatches(phase_cfg),
            sp=sp_size(p),
            sp_mode=getattr(p.sequence_parallelism, "mode", None),
        )
