"""Pre-flight: every check a run can fail in seconds, before a model is loaded or a rank started.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check

Pure of prefect: the Prefect task (`tasks.flowkit.preflight.preflight`) adds the one check that needs it
(the Hub token in the Secret block `hf-token`) and passes its answer in as `token_present`.
Nothing here reads weights: the base model's config.json, tokenizer_config.json and file list
are enough (for a Hub repo: `hf_hub_download` of those two small files and the repo's file list).

Every check appends to one report; a problem is (config field or file, message with the fix).
All of them are reported together in one `ConfigError`; a clean run returns the report, whose
`checked` lines say what was verified. Machine facts (GPUs, CPUs, free disk) and the token
answer are parameters, so tests inject them instead of needing the machine.

Decisions recorded here:
- vocab_size not divisible by tp_size is REFUSED for hybrid_parallel with tp > 1. ColossalAI
  0.5.0 would pad the embedding and LM head (`make_vocab_size_divisible_by`), and although the
  model save strips the padding (`to_unpadded_tensor`), saving the optimizer state of a padded
  parameter fails (AssertionError in `search_tp_partition_dim`, measured here). The engine turns
  padding off (`make_vocab_size_divisible_by=1`), so the export always holds exactly
  `vocab_size` rows and `tasks.core.models.convert` refuses any padded row it finds. Choose a tp_size
  that divides the vocabulary (or resize the vocabulary to a multiple of it) instead.
- pp must be <= num_hidden_layers, not a divisor of it: ColossalAI's stage manager distributes
  layers unevenly.
- Staging space is an estimate (dense decoder parameter count from config.json): a training
  checkpoint is weights in the training precision + fp32 Adam moments (8 B/param) + fp32 master
  weights when training in bf16/fp16 (4 B/param); a local run root keeps `keep_last + 1` of them
  per stage at once (the new one is committed before the oldest is deleted), plus the three HF
  copies (base, cpt/hf, export). A remote run root stages at most two checkpoints of one stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.core.config.layout import layout_problems
from tasks.core.config.load import (
    gate_problems,
    heldout_source_problems,
    hub_problems,
    parse_fields,
    read_raw_config,
)
from tasks.core.config.paths import resolve_local
from tasks.core.config.schema import PhaseConfig, RunConfig
from tasks.core.config.sequence import sp_factor, sp_size
from tasks.core.errors import ConfigError
from tasks.core.hub.metadata import hub_field_problems
from tasks.core.hub.repo import HubToken
from tasks.core.preflight.base_model import (
    check_base_model,
    check_chat_template,
    check_model_family,
    check_sequence_length,
)
from tasks.core.preflight.benchmark import check_benchmark
from tasks.core.preflight.data import check_data
from tasks.core.preflight.eval_memory import check_eval_memory
from tasks.core.preflight.eval_time import check_eval_time
from tasks.core.preflight.kernels import check_kernels
from tasks.core.preflight.memory_check import check_memory
from tasks.core.preflight.mixture import check_mixture_weights, check_source_epochs
from tasks.core.preflight.model_files import check_lora_targets, check_model_claims, check_model_files
from tasks.core.preflight.model_info import Machine, ModelInfo, estimate_parameters, read_model_info
from tasks.core.preflight.model_shapes import check_model_shapes
from tasks.core.preflight.notices import check_notices
from tasks.core.preflight.report import CheckContext, PreflightReport
from tasks.core.preflight.resume import check_resume
from tasks.core.preflight.storage import (
    check_base_model_links,
    check_paths,
    check_run_root,
    check_staging_space,
    estimate_local_bytes,
)
from tasks.core.preflight.tokens import check_sft_lengths, check_special_tokens
from tasks.core.preflight.tracking import check_tracking

__all__ = [
    "CHECKS",
    "CheckContext",
    "Machine",
    "ModelInfo",
    "PreflightReport",
    "estimate_local_bytes",
    "estimate_parameters",
    "load_for_check",
    "preflight_report",
    "read_model_info",
    "resolve_local",
    "validate",
]


# --------------------------------------------------------------------------------------------
# Loading the config without stopping at the first kind of problem


def load_for_check(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read a local YAML config like `load_config`, deferring the static rules to pre-flight, so a wrong ZeRO precision and a missing data file are reported in the same message.

    Structural problems (unknown or missing fields, wrong types) still raise `ConfigError` here: nothing else can be checked without a well-formed config.
    """
    return parse_fields(read_raw_config(path, overrides), source=str(path))


# --------------------------------------------------------------------------------------------
# Checks: each takes the context and records problems, warnings and what it verified.


def _facts(ctx: CheckContext) -> dict[str, Any]:
    """What every layout rule reads, for each tier's check: a fix one tier offers passes the others' rules too."""
    return {"model_config": ctx.model.config if ctx.model else None, "cuda": bool(ctx.machine.cuda_devices)}


def check_static_rules(ctx: CheckContext) -> None:
    """The config's own rules (hybrid_parallel ZeRO refuses fp32, tp/pp need hybrid_parallel, world size)."""
    before = len(ctx.report.problems)
    for phase in ctx.cfg.phases:
        for where, msg in layout_problems(getattr(ctx.cfg, phase), phase, tiers=("static",), **_facts(ctx)):
            ctx.problem(where, msg)
    for where, msg in heldout_source_problems(ctx.cfg) + gate_problems(ctx.cfg):  # what load_config refuses, here too
        ctx.problem(where, msg)
    if len(ctx.report.problems) == before:
        ctx.ok(
            "static config rules: plugin/ZeRO/precision combinations, world size multiple of tp*pp, pipeline "
            "micro-batches >= pp, "
            "held-out sets of the gate and of each source"
        )


def _phase_layout(ctx: CheckContext, name: str, phase_cfg: PhaseConfig) -> None:
    """The model and batch rules of `tasks.core.config.layout` (the static ones ran in check_static_rules)."""
    p, launch = phase_cfg.plugin, phase_cfg.launch
    mc = ctx.model.config if ctx.model else None
    if mc is not None and p.tp_size > 1 and not isinstance(mc.get("num_attention_heads"), int):
        ctx.warn(
            f"{name}.plugin.tp_size: config.json has no num_attention_heads; tensor-parallel divisibility not checked"
        )
    for where, msg in layout_problems(phase_cfg, name, tiers=("batch", "model"), **_facts(ctx)):
        ctx.problem(where, msg)
    from tasks.core.models.families import policy_problem, sp_family_problem

    if mc is not None and (sp := policy_problem(mc, phase_cfg, name) or sp_family_problem(mc, phase_cfg, name)):
        ctx.problem(*sp)
    world = launch.world_size
    if world % (p.tp_size * p.pp_size) == 0 and not any(
        where.startswith(f"{name}.") for where, _ in ctx.report.problems
    ):
        dp = world // (p.tp_size * p.pp_size * sp_factor(p))
        heads = (
            f", divides {mc.get('num_attention_heads')} heads / {mc.get('num_key_value_heads') or mc.get('num_attention_heads')} "
            "KV heads"
            if mc and p.tp_size > 1
            else ""
        )
        layers = f", {mc.get('num_hidden_layers')} layers" if mc and p.pp_size > 1 else ""
        seq = f" · sp={p.sequence_parallelism.mode} x {sp_size(p)}" if p.sequence_parallelism else ""
        ctx.ok(
            f"{name} layout: {p.name} tp={p.tp_size}{heads} · pp={p.pp_size}{layers}{seq} · dp={dp} = "
            f"{launch.nnodes} node(s) x {launch.nproc_per_node} = {world} ranks, {p.precision}, zero_stage "
            f"{p.zero_stage}"
        )


def check_layout(ctx: CheckContext) -> None:
    """tp divides the attention and KV heads; pp <= layers; tp*pp*dp = world; pipeline batches."""
    for name in ctx.cfg.phases:
        _phase_layout(ctx, name, getattr(ctx.cfg, name))
    if ctx.model is None:
        ctx.warn(
            "layout against the base model not checked: its config.json could not be read or was refused (see problems)"
        )


def check_machine(ctx: CheckContext) -> None:
    """Processes vs visible GPUs (or CPU cores); plugins that need CUDA."""
    m = ctx.machine
    for name in ctx.cfg.phases:
        phase_cfg = getattr(ctx.cfg, name)
        n = phase_cfg.launch.nproc_per_node
        for where, msg in layout_problems(phase_cfg, name, tiers=("device",), **_facts(ctx)):
            ctx.problem(where, msg)
        if m.cuda_devices:
            if n > m.cuda_devices:
                ctx.problem(
                    f"{name}.launch.nproc_per_node",
                    f"{n} processes per node requested but {m.cuda_devices} GPU(s) are visible "
                    f"(CUDA_VISIBLE_DEVICES); set nproc_per_node <= {m.cuda_devices}",
                )
            else:
                ctx.ok(f"{name} processes: {n} per node <= {m.cuda_devices} visible GPU(s)")
        elif n > m.cpu_count:
            ctx.warn(
                f"{name}.launch.nproc_per_node: {n} CPU ranks on {m.cpu_count} core(s) oversubscribes the CPU; it "
                "runs, slowly"
            )
        else:
            ctx.ok(f"{name} processes: {n} CPU rank(s) (gloo) on {m.cpu_count} core(s), no GPU visible")


def check_hub(ctx: CheckContext) -> None:
    """A well-formed target repo id and a token the Hub accepts when a push is configured."""
    hub = ctx.cfg.hub
    if hub is None:
        ctx.ok("hub: not configured, the export is not pushed")
        return
    for where, msg in hub_problems(
        ctx.cfg
    ):  # the adapter push: an adapter to push, a place other than beside the merged weights
        ctx.problem(where, msg)
    # what the Hub refuses or shows otherwise: non-ASCII (look-alike) repo ids, a license it does not list,
    # tags with newlines or markup (tasks/core/hub/metadata.py)
    fields = hub_field_problems(hub, ctx.cfg.base_model.hub_id)
    for where, msg in fields:
        ctx.problem(where, msg)
    repo_ok = not any(where in ("hub.repo_id", "hub.adapter_repo_id") for where, _ in fields)
    if ctx.token_present is False:
        ctx.problem(
            "hub",
            "a push is configured but no Hub token was found: export HF_TOKEN on the worker, create the Prefect "
            "Secret block 'hf-token', "
            "or run `hf auth login` on the worker (never put the token in the config)",
        )
    elif ctx.token_present is None:
        ctx.warn("hub token presence not checked")
    if ctx.hub_token is not None:
        _check_token(ctx, hub.repo_id, repo_ok)
    elif repo_ok and ctx.token_present:
        ctx.ok(f"hub: repo id {hub.repo_id} well formed, token available (not shown)")


def _check_token(ctx: CheckContext, repo_id: str, repo_ok: bool) -> None:
    """The Hub answers `whoami` for the token push will use: a refused token fails here, not
    after training; an unreachable Hub is a warning (it may answer by the time the push runs)."""
    from tasks.core.hub.repo import refused_token_message, whoami

    tok = ctx.hub_token
    answer = whoami(tok)
    if answer.user is not None:
        if repo_ok:
            ctx.ok(
                f"hub: repo id {repo_id} well formed; {answer.endpoint} accepts the token from {tok.source} (user "
                f"{answer.user}; token not shown)"
            )
    elif answer.refused:
        ctx.problem("hub", refused_token_message(tok, answer.endpoint, answer.status, answer.reason))
    else:
        if repo_ok:
            ctx.ok(f"hub: repo id {repo_id} well formed, token available from {tok.source} (not shown)")
        ctx.warn(
            f"hub: the token from {tok.source} was not verified: {answer.endpoint} did not answer whoami "
            f"({answer.status or answer.reason}); the push at the end needs that Hub"
        )


def check_launch_backend(ctx: CheckContext) -> None:
    """Each stage's launch backend asks its cluster (`tasks.core.launch.torchrun.PREFLIGHTS`: for Slurm the
    controller answers, the partition exists, nodes x GPUs fit it), and a backend whose ranks run
    on other nodes needs a run root every node sees."""
    from tasks.core.config.backends import BACKENDS
    from tasks.core.launch.torchrun import PREFLIGHTS

    for name in ctx.cfg.phases:
        phase_cfg = getattr(ctx.cfg, name)
        launch = phase_cfg.launch
        spec = BACKENDS[launch.backend]
        if (cluster_check := PREFLIGHTS.get(launch.backend)) is None:
            continue
        problems = cluster_check(launch, f"{name}.launch", phase_cfg.plugin.tp_size * phase_cfg.plugin.pp_size)
        for where, msg in problems:
            ctx.problem(where, msg)
        if spec.remote_nodes and launch.nnodes > 1 and "://" in ctx.cfg.run_uri:
            ctx.ok(
                f"{name}: {launch.nnodes} {spec.name} nodes stage {ctx.cfg.run_uri} each into their own directory and "
                "publish their checkpoint parts; the nodes need its credentials"
            )
        elif spec.remote_nodes and launch.nnodes > 1:
            ctx.warn(
                f"{name}.launch: {launch.nnodes} {spec.name} nodes write checkpoints under {ctx.cfg.run_uri}; "
                "it must be a shared filesystem (NFS, Lustre) mounted at the same path on every node, and so must "
                "this checkout and its Python"
            )
        if not problems:
            part = (launch.slurm.partition if launch.slurm else None) or "(default)"
            ctx.ok(
                f"{name} {spec.name}: the cluster answers, {launch.nnodes} node(s) x {launch.nproc_per_node} "
                f"process(es) fit partition {part}"
            )


# The model's own files first: check_model_claims bounds config.json's sizes by them before any check
# that builds from those sizes (the layout's family, the tables, the estimates) reads them.
CHECKS: tuple[Callable[[CheckContext], None], ...] = (
    check_base_model,
    check_base_model_links,
    check_model_files,
    check_model_claims,
    check_static_rules,
    check_layout,
    check_machine,
    check_kernels,
    check_model_shapes,
    check_sequence_length,
    check_chat_template,
    check_data,
    check_special_tokens,
    check_sft_lengths,
    check_mixture_weights,
    check_source_epochs,
    check_run_root,
    check_paths,
    check_launch_backend,
    check_notices,
    check_staging_space,
    check_resume,
    check_memory,
    check_eval_memory,
    check_eval_time,
    check_benchmark,
    check_hub,
    check_model_family,
    check_lora_targets,
    check_tracking,
)


def preflight_report(
    cfg: RunConfig,
    *,
    machine: Machine | None = None,
    token_present: bool | None = None,
    model: ModelInfo | None = None,
    hub_token: HubToken | None = None,
) -> PreflightReport:
    """Run every check; never raises for a problem, returns them all in the report.

    `token_present`: whether HF_TOKEN or the Secret `hf-token` exists (the caller looks; None
    means "not checked"). `model`: the base model's metadata (read here when None). `hub_token`:
    the token itself with its source, asked `whoami` at HF_ENDPOINT (None: presence only).
    """
    started = time.monotonic()
    report = PreflightReport()
    if model is None:
        try:
            model = read_model_info(cfg.base_model.uri, cfg.base_model.revision)
        except ConfigError as exc:
            report.problems += exc.problems
    ctx = CheckContext(cfg, machine or Machine.detect(), token_present, model, report, hub_token)
    for check in CHECKS:
        try:
            check(ctx)
        except ConfigError as exc:
            for p in exc.problems:
                ctx.problem(*p)
    report.seconds = time.monotonic() - started
    return report


def validate(cfg: RunConfig, **kwargs: Any) -> PreflightReport:
    """`preflight_report`, raising one ConfigError with every problem; the report when clean."""
    return preflight_report(cfg, **kwargs).raise_for_problems()
