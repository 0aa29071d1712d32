"""The launch-backend registry: one `BackendSpec` row per place a stage's torchrun agents can run.

    python -c "from tasks.core.launch.backends import BACKENDS; print({n: b.summary for n, b in BACKENDS.items()})"

`launch.backend` is validated against these keys (`tasks.core.config.schema.LaunchConfig`); the layout
rules (`tasks.core.config.layout`) read `rendezvous` and `static_problems`; pre-flight
(`tasks.core.preflight.checks.check_launch_backend`) calls `preflight`; the Prefect task picks the runner
of the same name from `tasks.core.launch.torchrun.RUNNERS`. Adding a backend (Kubernetes, see docs/scaling.md)
is one row here plus one runner there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from tasks.core.config.schema import LaunchConfig

Problem = tuple[str, str]


@dataclass(frozen=True)
class BackendSpec:
    name: str
    summary: str  # one line for the config field description
    # Who places a multi-node c10d rendezvous: "config" needs launch.rdzv_endpoint (and node_rank
    # per node); "scheduler" means the backend puts it on the job's first node and numbers the
    # nodes itself, so both fields are refused.
    rendezvous: Literal["config", "scheduler"]
    # The LaunchConfig section holding this backend's settings; any other backend's is refused.
    settings: str | None = None
    # Whether ranks on nodes other than the Prefect worker's write checkpoints directly into the
    # stage directory (the run root must then be a path every node sees).
    remote_nodes: bool = False
    # Static rules of the backend's settings (config alone): (launch, "cpt.launch") -> problems.
    static_problems: Callable[[LaunchConfig, str], list[Problem]] | None = None
    # "module:function" of the pre-flight check that asks the cluster:
    # (launch, "cpt.launch", tp_pp) -> problems. Imported only when a stage uses the backend.
    preflight: str | None = None


# sbatch flags the Slurm launcher sets itself: given again they would split or misplace the job.
LAUNCHER_SBATCH_FLAGS = ("-N", "--nodes", "-n", "--ntasks", "--ntasks-per-node", "-o", "--output", "-e", "--error",
                         "-J", "--job-name", "--comment", "--wait", "-W", "--parsable", "--requeue")


def _sbatch_flag_problems(launch: LaunchConfig, where: str) -> list[Problem]:
    out: list[Problem] = []
    for i, arg in enumerate(launch.slurm.extra_sbatch_args if launch.slurm else ()):
        flag = arg.split("=", 1)[0]
        short = any(flag.startswith(f) and len(flag) > 2 for f in LAUNCHER_SBATCH_FLAGS if len(f) == 2)
        if flag in LAUNCHER_SBATCH_FLAGS or short:
            out.append((f"{where}.slurm.extra_sbatch_args[{i}]", f"{arg!r} is set by the launcher (nodes from launch.nnodes, one task per node, its job name, comment and output files); remove it"))
    return out


BACKENDS: dict[str, BackendSpec] = {
    "local": BackendSpec(
        name="local",
        summary="torchrun on the Prefect worker's node; the agents of other nodes are started by you (rdzv_endpoint, node_rank)",
        rendezvous="config",
    ),
    "slurm": BackendSpec(
        name="slurm",
        summary="one Slurm job per engine verb, one torchrun agent on every allocated node (settings: launch.slurm)",
        rendezvous="scheduler",
        settings="slurm",
        remote_nodes=True,
        static_problems=_sbatch_flag_problems,
        preflight="tasks.core.launch.slurm:preflight",
    ),
}


def register(spec: BackendSpec) -> BackendSpec:
    BACKENDS[spec.name] = spec
    return spec
