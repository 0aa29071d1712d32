"""The Slurm backend's settings (`launch.slurm`) and their static rule: pure data, no cluster.

    python -c "from tasks.core.config.slurm import SlurmConfig, sbatch_flag_problems; \
print(sbatch_flag_problems(SlurmConfig(extra_sbatch_args=('--nodes=2',)), 'cpt.launch.slurm'))"

The run schema embeds `SlurmConfig` as `LaunchConfig.slurm`; the backend registry
(`tasks.core.config.backends`) runs `sbatch_flag_problems` as the row's static rule. Asking the
cluster (pre-flight) and the batch script are `tasks.core.launch.slurm` and `slurm_batch`.
"""

from __future__ import annotations

from pydantic import Field

from tasks.core.config.base import Frozen

Problem = tuple[str, str]

# sbatch flags the Slurm launcher sets itself: given again they would split or misplace the job.
LAUNCHER_SBATCH_FLAGS = (
    "-N",
    "--nodes",
    "-n",
    "--ntasks",
    "--ntasks-per-node",
    "-o",
    "--output",
    "-e",
    "--error",
    "-J",
    "--job-name",
    "--comment",
    "--wait",
    "-W",
    "--parsable",
    "--requeue",
)


class SlurmConfig(Frozen):
    partition: str | None = Field(
        default=None,
        description="Slurm partition the stage's jobs go to (sbatch --partition); null: the cluster's default "
        "partition.",
    )
    time_limit: str | None = Field(
        default=None,
        description=(
            "Wall-clock limit of each job in Slurm's syntax (sbatch --time), e.g. '2-00:00:00' or '90' (minutes); "
            "null: the partition's default. "
            "A job that hits it ends TIMEOUT and the retry resumes from the newest checkpoint."
        ),
    )
    gpus_per_node: int = Field(
        default=0,
        ge=0,
        description="GPUs requested on every node (sbatch --gpus-per-node); 0 requests none (CPU ranks).",
    )
    account: str | None = Field(
        default=None, description="Slurm account charged for the jobs (sbatch --account); null: your default account."
    )
    extra_sbatch_args: tuple[str, ...] = Field(
        default=(),
        description=(
            "More sbatch flags, one per item, e.g. ['--qos=high', '--exclusive', '--constraint=h100']. "
            "Node count, tasks per node, job name, comment and output files are set by the launcher and refused here."
        ),
    )


def sbatch_flag_problems(slurm: SlurmConfig | None, where: str) -> list[Problem]:
    """Extra sbatch flags the launcher sets itself; `where` is the section's path ("cpt.launch.slurm")."""
    out: list[Problem] = []
    for i, arg in enumerate(slurm.extra_sbatch_args if slurm else ()):
        flag = arg.split("=", 1)[0]
        short = any(flag.startswith(f) and len(flag) > 2 for f in LAUNCHER_SBATCH_FLAGS if len(f) == 2)
        if flag in LAUNCHER_SBATCH_FLAGS or short:
            out.append(
                (
                    f"{where}.extra_sbatch_args[{i}]",
                    (
                        f"{arg!r} is set by the launcher (nodes from launch.nnodes, one task per node, its job name, "
                        "comment and output files); remove it"
                    ),
                )
            )
    return out
