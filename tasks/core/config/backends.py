"""The launch-backend registry: one `BackendSpec` row per place a stage's torchrun agents can run.

    python -c "from tasks.core.config.backends import BACKENDS; print({n: b.summary for n, b in BACKENDS.items()})"

`launch.backend` is validated against these keys (`tasks.core.config.schema.LaunchConfig`); the layout
rules (`tasks.core.config.layout`) read `rendezvous` and run `static_problems`; pre-flight
(`tasks.core.preflight.checks.check_launch_backend`) calls the backend's cluster check, if it has one, from
`tasks.core.launch.torchrun.PREFLIGHTS`; the Prefect task picks the runner of the same name from
`tasks.core.launch.torchrun.RUNNERS`. A backend owns its settings model and their
rules in a module of its own (Slurm: `tasks.core.config.slurm`), which the schema embeds; this
registry never reads the schema. Adding a backend (Kubernetes, see docs/scaling.md) is one row here,
its settings module, and one runner there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tasks.core.config.slurm import sbatch_flag_problems

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
    # Static rules of the backend's settings (config alone): (its settings section or None,
    # that section's path, e.g. "cpt.launch.slurm") -> problems.
    static_problems: Callable[[Any, str], list[Problem]] | None = None
    # What its pre-flight asks the cluster, said in the reference; the check itself is the launch
    # package's (`tasks.core.launch.torchrun.PREFLIGHTS`, same key), which this leaf never imports.
    cluster_check: str = ""


BACKENDS: dict[str, BackendSpec] = {
    "local": BackendSpec(
        name="local",
        summary="torchrun on the Prefect worker's node; the agents of other nodes are started by you (rdzv_endpoint, "
        "node_rank)",
        rendezvous="config",
    ),
    "slurm": BackendSpec(
        name="slurm",
        summary="one Slurm job per engine verb, one torchrun agent on every allocated node (settings: launch.slurm)",
        rendezvous="scheduler",
        settings="slurm",
        remote_nodes=True,
        static_problems=sbatch_flag_problems,
        cluster_check="sinfo: the controller answers, the partition is up, nodes x GPUs fit it",
    ),
}


def register(spec: BackendSpec) -> BackendSpec:
    BACKENDS[spec.name] = spec
    return spec
