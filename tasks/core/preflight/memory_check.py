"""Pre-flight's memory checks, from the estimate (tasks/core/preflight/memory.py): each stage's figures per
rank, refused over the GPU's memory or, where the ranks run on this machine, a node's ranks plus the flow
process over its host memory, with the single changes (levers) that fit; the flow process's own work.

    python -c "from tasks.core.preflight.memory_check import fits_with; help(fits_with)"
    cpt-to-sft check --config examples/tiny-cpu.yaml   # its lines in pre-flight's report
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tasks.core.config.layout import ParallelLayout, layout_problems
from tasks.core.config.plugins import PLUGINS
from tasks.core.config.schema import PhaseConfig
from tasks.core.errors import ConfigError, ConversionError
from tasks.core.evaluation.placement import DTYPE_BYTES, eval_dtype, forward_bytes
from tasks.core.models.families import iter_tensors
from tasks.core.preflight.memory import FLOW_BASELINE_BYTES, GB, MemoryEstimate, estimate, human

# -- settings that would make a layout fit -------------------------------------------------------


def _with(phase_cfg: PhaseConfig, plugin: dict[str, Any] | None = None, **fields: Any) -> PhaseConfig:
    data = phase_cfg.model_dump()
    if plugin:
        data["plugin"] = {**data["plugin"], **plugin}
    data.update(fields)
    return PhaseConfig.model_validate(data)


def _plugin_levers(
    phase_cfg: PhaseConfig, name: str, cuda: bool, mixed: dict[str, str]
) -> Iterable[tuple[str, PhaseConfig]]:
    """Another plugin that holds less, for each registry row with a `lever` the layout fits."""
    p = phase_cfg.plugin
    for other, spec in PLUGINS.items():
        if spec.lever is None or other == p.name or (spec.needs_cuda and not cuda):
            continue
        if not spec.supports_tp_pp and (p.tp_size > 1 or p.pp_size > 1):
            continue
        change = dict(spec.lever.fields)
        shown = "".join(f", {k}: {v}" for k, v in change.items())
        change.setdefault("zero_stage", p.zero_stage if p.zero_stage in spec.zero_stages else spec.zero_stages[0])
        yield (
            f"{name}.plugin.name: {other}{shown}" + (", precision: bf16" if mixed else ""),
            _with(phase_cfg, {"name": other, **change, **mixed}),
        )


def _levers(phase_cfg: PhaseConfig, name: str, cuda: bool) -> Iterable[tuple[str, PhaseConfig]]:
    """Single changes that shrink a rank's memory, each named by its config fields, strongest first
    within a lever (they are tried in turn until one fits)."""
    p = phase_cfg.plugin
    spec = PLUGINS[p.name]
    mixed = {} if p.precision != "fp32" else {"precision": "bf16"}
    for z in sorted(z for z in spec.zero_stages if spec.zero_stage(z) > spec.zero_stage(p.zero_stage)):
        yield (
            f"{name}.plugin.zero_stage: {z}" + (", precision: bf16" if mixed else ""),
            _with(phase_cfg, {"zero_stage": z, **mixed}),
        )
    yield from _plugin_levers(phase_cfg, name, cuda, mixed)
    if spec.supports_tp_pp:
        tp = p.tp_size * 2
        while tp <= phase_cfg.launch.nproc_per_node:
            yield f"{name}.plugin.tp_size: {tp}", _with(phase_cfg, {"tp_size": tp})
            tp *= 2
    if not getattr(phase_cfg, "activation_checkpointing", True):
        yield f"{name}.activation_checkpointing: true", _with(phase_cfg, activation_checkpointing=True)
    for o in spec.offload if cuda else ():  # the plugin's own savers: all of the state it can move
        default = type(phase_cfg.plugin).model_fields[o.field].default
        if not isinstance(default, (bool, float)) or getattr(p, o.field) != default:
            continue
        change = {o.field: True if isinstance(default, bool) else 1.0, **dict(o.requires)}
        if p.precision == "fp32" and "zero_stage" in change:
            change.update(mixed)
        label = ", ".join(
            f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in change.items() if getattr(p, k) != v
        )
        yield f"{name}.plugin.{label}", _with(phase_cfg, change)
    mbs, ga = phase_cfg.micro_batch_size // 2, phase_cfg.grad_accum_steps * 2
    while mbs >= 1 and p.pp_size == 1:
        yield (
            f"{name}.micro_batch_size: {mbs} (grad_accum_steps: {ga} keeps the global batch)",
            _with(phase_cfg, micro_batch_size=mbs, grad_accum_steps=ga),
        )
        mbs, ga = mbs // 2, ga * 2


def _rank_levers(phase_cfg: PhaseConfig, name: str) -> Iterable[tuple[str, PhaseConfig]]:
    """Fewer ranks on the node (host memory: each rank holds its own copy of what is not sharded)."""
    for n in range(phase_cfg.launch.nproc_per_node - 1, 0, -1):
        yield (
            f"{name}.launch.nproc_per_node: {n}",
            _with(phase_cfg, launch={**phase_cfg.launch.model_dump(), "nproc_per_node": n}),
        )


def fits_with(
    model_config: dict[str, Any],
    phase_cfg: PhaseConfig,
    name: str,
    capacity: int,
    cuda: bool,
    figure: Callable[[PhaseConfig], int] | None = None,
) -> list[tuple[str, int]]:
    """(the settings, the bytes `figure` says) of each lever's first setting that fits `capacity`; if no
    single one does, the levers applied together in turn, up to the first combination that fits.
    `figure`: a rank's device bytes (the default), or another figure, e.g. a node's host memory
    (`node_host_need`), when fewer ranks are a lever too."""
    before = set(layout_problems(phase_cfg, name, model_config=model_config, tiers=("static", "batch", "model")))
    host = figure is not None

    def valid(candidate: PhaseConfig) -> bool:
        return (
            set(layout_problems(candidate, name, model_config=model_config, tiers=("static", "batch", "model")))
            <= before
        )

    def device(candidate: PhaseConfig) -> int:
        if figure is not None:
            return figure(candidate)
        return estimate(model_config, candidate, phase=name, cuda=cuda).device

    def levers(candidate: PhaseConfig) -> Iterable[tuple[str, PhaseConfig]]:
        yield from _levers(candidate, name, cuda)
        if host:
            yield from _rank_levers(candidate, name)

    found, seen = [], set()
    for label, candidate in levers(phase_cfg):
        lever = label.split(",")[0] if ".plugin.name:" in label else label.split(":")[0]  # each plugin is its own lever
        if lever in seen or not valid(candidate):
            continue
        need = device(candidate)
        if need <= capacity:
            found.append((label, need))
            seen.add(lever)
    if found:
        return found
    combined, labels = phase_cfg, []
    for _ in range(8):  # each round applies the strongest remaining lever to the combination so far
        options = [(device(c), label, c) for label, c in levers(combined) if valid(c)]
        if not options:
            return []
        need, label, combined = min(options, key=lambda o: o[0])
        labels.append(label)
        if need <= capacity:
            return [(" + ".join(labels), need)]
    return []


# -- pre-flight ------------------------------------------------------------------------------------


def rank_host_peak(est: MemoryEstimate) -> int:
    """A rank's largest host figure over its stage: the shard verb, the model built, or the steps."""
    return max(est.host_steady, est.construction_host, est.shard_host)


def node_host_need(model_config: dict[str, Any], phase_cfg: PhaseConfig, name: str, cuda: bool) -> int:
    """Host bytes one node needs while a stage's ranks run: nproc_per_node ranks at their peak, beside the
    flow process (which launched them and waits, holding its own memory)."""
    est = estimate(model_config, phase_cfg, phase=name, cuda=cuda)
    return phase_cfg.launch.nproc_per_node * rank_host_peak(est) + FLOW_BASELINE_BYTES


def _units(model_config: dict[str, Any]) -> tuple[int, int]:
    """(parameters, the largest unit's: a decoder layer, or a tensor outside the layers)."""
    total, blocks = 0, {}
    for key, _, shape, layer in iter_tensors(model_config):
        n = math.prod(shape)
        total += n
        block = f"layer {layer}" if layer is not None else key
        blocks[block] = blocks.get(block, 0) + n
    return total, max(blocks.values(), default=0)


def flow_process(model_config: dict[str, Any], cfg: Any, cuda: bool) -> list[tuple[str, str, list[tuple[str, int]]]]:
    """What the flow process holds at its peak in each kind of work it does itself, none of them while ranks
    run: (what, the config field that shrinks it, parts summing to the figure). The logits checks
    (load_from_hf, unshard, export, `cpt-to-sft verify`) hold the model whole in fp32 (base/ and cpt/hf/
    are fp32) up to verify_memory_gb, else one unit at a time (tasks/core/models/stream.py), and the probe
    batch's forward; an evaluation on CPU holds one model at a time in its eval dtype and one batch's forward
    with its logits in chunks (tasks/core/evaluation/placement.py `forward_bytes`). An evaluation on a GPU
    is planned by eval_memory.py."""
    from tasks.core.models.fingerprint import PROBE_SHAPE

    total, unit = _units(model_config)
    whole = 4 * total
    streamed = whole > cfg.verify_memory_gb * GB
    probe = forward_bytes(model_config, "fp32", math.prod(PROBE_SHAPE))
    out = [
        (
            "logits checks (load_from_hf, unshard, export)",
            "verify_memory_gb",
            [
                ("flow process baseline", FLOW_BASELINE_BYTES),
                ("the largest unit, streamed" if streamed else "the model in fp32", 4 * unit if streamed else whole),
                ("the probe batch's forward", probe),
            ],
        )
    ]
    for name in cfg.phases:
        phase_cfg = getattr(cfg, name)
        if not phase_cfg.eval.enabled or cuda:
            continue
        dtype = eval_dtype(phase_cfg.eval.dtype, cfg.export.dtype, cuda=False)
        out.append(
            (
                f"evaluate_{name} on CPU ({dtype}, one model at a time)",
                f"{name}.eval.dtype",
                [
                    ("flow process baseline", FLOW_BASELINE_BYTES),
                    (f"one model in {dtype}", DTYPE_BYTES[dtype] * total),
                    (
                        f"a batch's forward ({phase_cfg.eval.batch_size} x {phase_cfg.seq_len} tokens, logits in chunks)",
                        forward_bytes(model_config, dtype, phase_cfg.eval.batch_size * phase_cfg.seq_len),
                    ),
                ],
            )
        )
    return out


def _ranks_here(phase_cfg: PhaseConfig, machine: Any, cuda: bool) -> bool:
    """Whether this stage's ranks (a node's share) run on the machine pre-flight runs on."""
    from tasks.core.config.backends import BACKENDS

    return not BACKENDS[phase_cfg.launch.backend].remote_nodes and (not cuda or bool(machine.cuda_devices))


def _sum_line(rows: list[tuple[str, int]]) -> str:
    return " + ".join(f"{what} {human(n)}" for what, n in rows) + f" = {human(sum(n for _, n in rows))}"


@dataclass(frozen=True)
class _StageMemory:
    """One stage's memory facts, as its GPU and host checks read them."""

    mc: dict[str, Any]  # the base model's config.json
    phase_cfg: PhaseConfig
    name: str
    est: MemoryEstimate
    cuda: bool

    @property
    def params(self) -> str:
        return f"{self.est.rank_parameters / 1e6:,.1f}M of {self.est.parameters / 1e6:,.1f}M parameters"

    @property
    def built(self) -> str:
        return (
            f"while the model is built {self.est.breakdown('construction')}; "
            f"the shard verb (boost_and_shard / reboost) {self.est.breakdown('shard')}"
        )


def _check_host(ctx: Any, m: _StageMemory) -> None:
    """The node's ranks at their peak plus the flow process against this machine's memory: refused over its
    total (they cannot run here whatever else is running), a warning over what is available now."""
    mc, phase_cfg, name, est, cuda = m.mc, m.phase_cfg, m.name, m.est, m.cuda
    total = getattr(ctx.machine, "host_memory_bytes", None)
    if not total or not _ranks_here(phase_cfg, ctx.machine, cuda):
        return
    n, peak, figure = phase_cfg.launch.nproc_per_node, rank_host_peak(est), which_figure(est)
    need = n * peak + FLOW_BASELINE_BYTES
    which = {"shard": "the shard verb", "host": "the training steps", "construction": "the model's construction"}[
        figure
    ]
    line = (
        f"{name} host memory on this node: {n} rank(s) x {human(peak)} ({which}) + the flow process "
        f"{human(FLOW_BASELINE_BYTES)} = {human(need)}"
    )
    available = getattr(ctx.machine, "host_available_bytes", None)
    if need <= total:
        ctx.ok(f"{line}, of this machine's {human(total)}")
        if available is not None and need > available:
            ctx.warn(
                f"{line}, more than the {human(available)} available now (of {human(total)}): other processes "
                "hold the rest; the stage may be killed for memory unless they end first"
            )
        return
    fixes = fits_with(mc, phase_cfg, name, total, cuda, figure=lambda c: node_host_need(mc, c, name, cuda))
    fix = _fix_text(
        fixes,
        "; no change of zero_stage, plugin, tp_size, activation_checkpointing, micro_batch_size or "
        f"{name}.launch.nproc_per_node fits: run it on a machine with more memory, or over more nodes",
    )
    ctx.problem(
        f"{name}.launch.nproc_per_node",
        f"{line}, more than this machine's {human(total)} of memory (a rank: {est.breakdown(figure)}){fix}",
    )


def which_figure(est: MemoryEstimate) -> str:
    """The parts of a rank's host peak: the shard verb's, the steps', or the construction's."""
    peak = rank_host_peak(est)
    return "shard" if peak == est.shard_host else ("host" if peak == est.host_steady else "construction")


def check_memory(ctx: Any) -> None:
    """Each stage's per-rank estimate in the report; a refusal when it exceeds the GPU memory the
    stage declares (`launch.gpu_memory_gb`) or this machine's GPU, with the settings that fit; a
    refusal when a node's ranks and the flow process exceed this machine's memory where they run here,
    with the levers that fit; the flow process's own figures (logits checks, evaluation on CPU)."""
    if ctx.model is None:
        return
    mc = ctx.model.config
    for name in ctx.cfg.phases:
        phase_cfg: PhaseConfig = getattr(ctx.cfg, name)
        declared = getattr(phase_cfg.launch, "gpu_memory_gb", None)
        detected = getattr(ctx.machine, "gpu_memory_bytes", None) if ctx.machine.cuda_devices else None
        capacity = int(declared * GB) if declared else detected
        cuda = bool(declared) or bool(ctx.machine.cuda_devices)
        try:
            ParallelLayout.of(phase_cfg, name, model_config=mc, tiers=("static", "batch", "model"))
            est = estimate(mc, phase_cfg, phase=name, cuda=cuda)
        except (ConfigError, ConversionError, KeyError) as exc:  # the layout/family checks name the problem
            ctx.warn(f"{name} memory not estimated: {exc.problems[0][1] if isinstance(exc, ConfigError) else exc}")
            continue
        m = _StageMemory(mc, phase_cfg, name, est, cuda)
        if not cuda:
            ctx.ok(
                f"{name} memory per rank (estimate, {m.params}): host RAM steady on this CPU rank "
                f"{est.breakdown('host')}; {m.built}; no GPU: the host is the limit"
            )
        else:
            _check_gpu(ctx, m, declared, capacity)
        _check_host(ctx, m)
    _check_flow(ctx, mc)


def _check_gpu(ctx: Any, m: _StageMemory, declared: float | None, capacity: int | None) -> None:
    """The rank's estimate against the GPU memory the stage declares or this machine's GPU has."""
    mc, phase_cfg, name, est, cuda, params, built = m.mc, m.phase_cfg, m.name, m.est, m.cuda, m.params, m.built
    source = f"{name}.launch.gpu_memory_gb = {declared:g}" if declared else "the visible GPU"
    parts = f"{params}: {est.breakdown('device')}"
    host = f"host {est.breakdown('host')}; {built}"
    if capacity is None:
        ctx.ok(
            f"{name} memory per rank (estimate): {human(est.device)} GPU ({parts}), {host}; GPU memory unknown: "
            f"set {name}.launch.gpu_memory_gb to check it"
        )
    elif est.device <= capacity:
        ctx.ok(
            f"{name} memory per rank (estimate): {human(est.device)} GPU of {human(capacity)} ({source}; {parts}), {host}"
        )
    else:
        fixes = fits_with(mc, phase_cfg, name, capacity, cuda)
        fix = _fix_text(
            fixes,
            "; no change of zero_stage, plugin, tp_size, offload, activation_checkpointing or "
            f"micro_batch_size fits: add nodes ({name}.launch.nnodes) "
            "to shard ZeRO state further, or use GPUs with more memory",
        )
        ctx.problem(
            f"{name}.launch.gpu_memory_gb" if declared else f"{name}.plugin",
            f"{name} needs {human(est.device)} of GPU memory per rank ({parts}), "
            f"more than the {human(capacity)} of {source}{fix}",
        )


def _check_flow(ctx: Any, mc: dict[str, Any]) -> None:
    """The flow process's figures in the report; refused over this machine's memory (it runs here)."""
    try:
        figures = flow_process(mc, ctx.cfg, cuda=bool(ctx.machine.cuda_devices))
    except (ConversionError, KeyError) as exc:
        ctx.warn(f"the flow process's memory not estimated: {exc}")
        return
    total = getattr(ctx.machine, "host_memory_bytes", None)
    for what, field, rows in figures:
        need = sum(n for _, n in rows)
        line = f"flow process, {what} (estimate): {_sum_line(rows)}"
        if not total or need <= total:
            ctx.ok(line + (f", of this machine's {human(total)}" if total else ""))
            continue
        fix = (
            f"set {field} lower (the model is then streamed a unit at a time)"
            if field == "verify_memory_gb"
            else f"set {field}: bf16 (half the model), or a smaller {field.rsplit('.', 1)[0]}.batch_size"
        )
        ctx.problem(field, f"{line}, more than this machine's {human(total)} of memory; {fix}")


def _fix_text(fixes: list[tuple[str, int]], otherwise: str) -> str:
    """The levers that fit, each with its figure, or what to do when none does."""
    return ("; it fits with " + ", or ".join(f"{label} ({human(b)})" for label, b in fixes)) if fixes else otherwise
