"""Pre-flight's kernel report: what each stage's fast kernels and activation checkpointing will be,
decided by the kernel registry (tasks/core/config/kernels.py) for this machine and the base model.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check   # "cpt kernels: flash attention: off: no CUDA; ..."

A report line, never a problem: a kernel that cannot run is off, with its reason, and the run goes
on without it. The ranks decide again on their own machine (a Slurm node may have what this one
lacks) and the checkpoint manifests record what they ran.
"""

from __future__ import annotations

from tasks.core.config.kernels import KERNELS, Facts, report, resolve
from tasks.core.preflight.report import CheckContext


def check_kernels(ctx: CheckContext) -> None:
    model_type = ctx.model.config.get("model_type") if ctx.model else None
    facts = Facts.detect(cuda=bool(ctx.machine.cuda_devices), model_type=model_type)
    for name in ctx.cfg.phases:
        phase_cfg = getattr(ctx.cfg, name)
        states = resolve(phase_cfg, name, facts)
        where = (
            ""
            if phase_cfg.launch.backend == "local"
            else f" (on this machine; the {phase_cfg.launch.backend} nodes decide again)"
        )
        ac = "on" if phase_cfg.activation_checkpointing else "off"
        ctx.ok(f"{name} kernels{where}: {report(states)}; activation checkpointing: {ac}")
        for kernel in phase_cfg.kernels:
            if kernel not in states:
                plugins = sorted({p for row in KERNELS if row.name == kernel for p in row.plugins})
                ctx.warn(
                    f"{name}.kernels.{kernel}: applies under {', '.join(plugins)} only; ignored under plugin "
                    f"{phase_cfg.plugin.name}"
                )
