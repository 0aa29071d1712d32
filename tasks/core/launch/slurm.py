"""Slurm for the launch backend: the CLI client, job states and the pre-flight checks. Pure of
Prefect (no prefect, colossalai or torch.distributed import); every call to a Slurm client has a
timeout, because a dead controller makes them hang. The batch script of one engine verb and
following a job are `tasks.core.launch.slurm_batch`.

Ask a cluster what pre-flight would say about a config's stages (submits nothing):

    python -m tasks.core.launch.slurm examples/tiny-cpu.yaml

The client: the plain `sbatch` / `srun` / `squeue` / `scontrol` / `scancel` CLI, not submitit.
submitit works against a cluster without accounting, but it reads job states with `sacct`, so
there it logs a warning on every poll and reports every job as UNKNOWN: it cannot tell FAILED
from TIMEOUT from CANCELLED, which the stage's error message must name. (Measured with
submitit 1.5.4 on the test cluster: a 2-node job that exits 3 at once stayed `UNKNOWN` for every
poll, each poll logged "Bypassing sacct error ... status may be inaccurate", and `job.result()`
was still waiting, with growing poll intervals, 3 minutes after the job had ended.) It also submits pickled
Python callables, while a stage is a command line (`torchrun ... -m tasks.engine VERB`), and its
job folder layout would be a second record next to the stage directory. The CLI is on every
Slurm login node, speaks the same protocol, and `scontrol show job` gives the state, reason,
exit code and nodes of a job for `MinJobAge` seconds after it ends (300 s by default) with or
without accounting. `sacct` is never called.

"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tasks.core.config.schema import LaunchConfig
from tasks.core.config.slurm import SlurmConfig

DEFAULT_TIMEOUT = 30.0
# Preflight asks the controller with a short bound: a dead one must not stall the run form.
PING_TIMEOUT = 10.0

ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
        "RESV_DEL_HOLD",
        "SPECIAL_EXIT",
    }
)
# Why a job ended, in words a user can act on; the state itself is always named too.
FAILURE_STATES = {
    "FAILED": "a process exited with an error",
    "NODE_FAIL": "a node stopped responding to the controller (hardware, network or slurmd died); the retry resumes "
    "from the newest checkpoint",
    "TIMEOUT": "the job reached its time limit (launch.slurm.time_limit); the retry resumes from the newest checkpoint",
    "OUT_OF_MEMORY": "a process exceeded the memory Slurm granted the job; lower micro_batch_size or ask for more "
    "memory (extra_sbatch_args: ['--mem=...'])",
    "CANCELLED": "the job was cancelled (scancel, the flow run's cancellation, or an administrator)",
    "PREEMPTED": "the job was preempted by a higher-priority job",
    "BOOT_FAIL": "a node failed to boot",
    "DEADLINE": "the job passed its deadline",
}


class SlurmError(RuntimeError):
    """A Slurm client call failed or did not answer in time."""


@dataclasses.dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: str
    reason: str = ""
    exit_code: str = ""
    nodes: str = ""
    batch_host: str = ""
    name: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED"


@dataclasses.dataclass(frozen=True)
class Partition:
    name: str
    state: str
    total_nodes: int
    max_nodes: int | None
    nodes: str
    default: bool


def parse_kv(line: str) -> dict[str, str]:
    """`scontrol show ... -o` output: Key=Value pairs; a value may contain spaces (Reason, Command)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"(?:^|\s)([A-Za-z][\w/:.]*)=(.*?)(?=\s+[A-Za-z][\w/:.]*=|\s*$)", line):
        out[m.group(1)] = m.group(2)
    return out


class SlurmCli:
    """The Slurm command-line clients with a timeout on every call. `env` adds variables (a test
    cluster's SLURM_CONF); otherwise the standard configuration lookup applies."""

    def __init__(self, env: Mapping[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.env = dict(env or {})
        self.timeout = timeout

    def run(
        self, *argv: str, timeout: float | None = None, check: bool = True, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        limit = timeout or self.timeout
        full_env = {**os.environ, **self.env, **(env or {})}
        try:
            proc = subprocess.run(
                list(argv),
                env=full_env,
                capture_output=True,
                text=True,
                timeout=limit,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]} not found: the Slurm client tools are not installed on this machine") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(
                f"`{' '.join(argv[:3])} ...` did not answer within {limit:.0f} s: is slurmctld running and reachable "
                f"(SLURM_CONF={full_env.get('SLURM_CONF', 'default')})?"
            ) from None
        if check and proc.returncode != 0:
            msg = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            raise SlurmError(f"`{' '.join(argv[:3])} ...` exited {proc.returncode}: {' | '.join(msg[-3:])}")
        return proc

    # -- cluster ------------------------------------------------------------------------------

    def ping(self, timeout: float = PING_TIMEOUT) -> None:
        self.run("sinfo", "-h", "-o", "%P", timeout=timeout)

    def partitions(self) -> dict[str, Partition]:
        out = self.run("scontrol", "show", "partition", "-o").stdout
        parts = {}
        for line in out.splitlines():
            kv = parse_kv(line)
            if "PartitionName" not in kv:
                continue
            max_nodes = kv.get("MaxNodes", "UNLIMITED")
            parts[kv["PartitionName"]] = Partition(
                name=kv["PartitionName"],
                state=kv.get("State", ""),
                total_nodes=int(kv.get("TotalNodes", "0") or 0),
                max_nodes=None if max_nodes in ("UNLIMITED", "") else int(max_nodes),
                nodes=kv.get("Nodes", ""),
                default=kv.get("Default") == "YES",
            )
        return parts

    def node_gpus(self, partition: str) -> dict[str, int]:
        """GPUs each node of the partition offers (its `gpu` GRES count; 0 without one)."""
        out = self.run("sinfo", "-h", "-N", "-p", partition, "-o", "%N|%G").stdout
        gpus: dict[str, int] = {}
        for line in out.splitlines():
            node, _, gres = line.partition("|")
            total = 0
            for item in gres.split(","):
                m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
                if m:
                    total += int(m.group(1))
            gpus[node.strip()] = total
        return gpus

    # -- jobs -----------------------------------------------------------------------------------

    def sbatch(self, script: Path, env: Mapping[str, str] | None = None) -> str:
        out = self.run("sbatch", "--parsable", str(script), env=env).stdout.strip()
        job_id = out.split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch did not print a job id: {out!r}")
        return job_id

    def job(self, job_id: str) -> JobInfo | None:
        """The job's state from the controller; None once it has forgotten it (MinJobAge after the end)."""
        proc = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return None
            raise SlurmError(f"`scontrol show job {job_id}` exited {proc.returncode}: {proc.stderr.strip()}")
        kv = parse_kv(proc.stdout.strip().splitlines()[0])
        return JobInfo(
            job_id=kv.get("JobId", job_id),
            state=kv.get("JobState", "UNKNOWN"),
            reason=kv.get("Reason", ""),
            exit_code=kv.get("ExitCode", ""),
            nodes=kv.get("NodeList", ""),
            batch_host=kv.get("BatchHost", ""),
            name=kv.get("JobName", ""),
        )

    def queue(self, job_ids: Sequence[str] = ()) -> list[tuple[str, str]]:
        argv = ["squeue", "-h", "-o", "%i|%T"]
        if job_ids:
            argv += ["-j", ",".join(job_ids)]
        proc = self.run(*argv, check=False)
        if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
            raise SlurmError(f"squeue exited {proc.returncode}: {proc.stderr.strip()}")
        return [tuple(ln.split("|", 1)) for ln in proc.stdout.splitlines() if "|" in ln]  # type: ignore[misc]

    def find(self, name: str, comment: str) -> list[str]:
        """Ids of this user's queued or running jobs named `name` whose comment is `comment`: how a
        launcher that died between `sbatch` returning and recording the id finds its job again."""
        argv = ["squeue", "-h", "-n", name, "-o", "%i|%T|%k"]
        user = os.environ.get("USER") or _user()
        if user:
            argv += ["-u", user]
        out = self.run(*argv).stdout
        return [
            i
            for i, state, c in (line.split("|", 2) for line in out.splitlines() if line.count("|") >= 2)
            if c.strip() == comment and state in ACTIVE_STATES
        ]

    def cancel(self, job_id: str) -> None:
        self.run("scancel", job_id)


# -- pre-flight -----------------------------------------------------------------------------------


def preflight(launch: LaunchConfig, where: str, tp_pp: int = 1, cli: SlurmCli | None = None) -> list[tuple[str, str]]:
    """Slurm problems of one stage's launch section as (field, message); nothing is submitted.

    The controller must answer `sinfo` within PING_TIMEOUT; the partition must exist and be up;
    `nnodes` must fit it (its node count and MaxNodes), and so must `gpus_per_node` on at least
    `nnodes` of its nodes; `tp_size * pp_size` must divide the world size.
    """
    if launch.backend != "slurm":
        return []
    cli = cli or SlurmCli()
    s = launch.slurm or SlurmConfig()
    f = f"{where}.slurm"
    out: list[tuple[str, str]] = []
    world = launch.nnodes * launch.nproc_per_node
    if world % tp_pp:
        out.append(
            (
                f"{where}.nnodes",
                (
                    f"world size nnodes*nproc_per_node = {launch.nnodes}*{launch.nproc_per_node} = {world} is not a "
                    f"multiple of tp_size*pp_size = {tp_pp}"
                ),
            )
        )
    if s.gpus_per_node and launch.nproc_per_node > s.gpus_per_node:
        out.append(
            (
                f"{where}.nproc_per_node",
                (
                    f"{launch.nproc_per_node} processes per node but slurm.gpus_per_node is {s.gpus_per_node}: one "
                    "process per GPU; make them equal"
                ),
            )
        )
    try:
        cli.ping()
        parts = cli.partitions()
    except SlurmError as exc:
        out.append((f, f"the Slurm controller does not answer: {exc}"))
        return out
    if s.partition:
        part = parts.get(s.partition)
        if part is None:
            out.append(
                (
                    f"{f}.partition",
                    f"partition {s.partition!r} does not exist on this cluster; it has {', '.join(sorted(parts)) or 'none'}",
                )
            )
            return out
    else:
        part = next((p for p in parts.values() if p.default), None)
        if part is None:
            out.append(
                (
                    f"{f}.partition",
                    f"the cluster has no default partition; name one of {', '.join(sorted(parts)) or '(none)'}",
                )
            )
            return out
    if part.state != "UP":
        out.append(
            (
                f"{f}.partition",
                f"partition {part.name!r} is {part.state}, not UP: jobs would wait until an administrator brings it up",
            )
        )
    limit = part.total_nodes if part.max_nodes is None else min(part.total_nodes, part.max_nodes)
    if launch.nnodes > limit:
        cap = f" and MaxNodes={part.max_nodes}" if part.max_nodes is not None else ""
        out.append(
            (
                f"{where}.nnodes",
                (
                    f"{launch.nnodes} nodes do not fit partition {part.name!r}: it has {part.total_nodes} node(s){cap}; "
                    f"use at most {limit}"
                ),
            )
        )
    if s.gpus_per_node:
        try:
            gpus = cli.node_gpus(part.name)
        except SlurmError as exc:
            out.append((f, f"could not list the GPUs of partition {part.name!r}: {exc}"))
            return out
        enough = sum(1 for n in gpus.values() if n >= s.gpus_per_node)
        if enough < launch.nnodes:
            most = max(gpus.values(), default=0)
            out.append(
                (
                    f"{f}.gpus_per_node",
                    (
                        f"{launch.nnodes} node(s) x {s.gpus_per_node} GPUs do not fit partition {part.name!r}: "
                        f"{enough} of its nodes have that many GPUs (the most on one node is {most})"
                    ),
                )
            )
    return out


def _user() -> str | None:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return None


def _main(argv: list[str]) -> int:
    from tasks.core.config.load import load_config

    if len(argv) != 1:
        print("usage: python -m tasks.core.launch.slurm CONFIG.yaml", file=sys.stderr)
        return 2
    cfg = load_config(argv[0])
    bad = 0
    for name in cfg.phases:
        phase_cfg = cfg.phase(name)
        if phase_cfg.launch.backend != "slurm":
            print(f"{name}: backend {phase_cfg.launch.backend}, not Slurm")
            continue
        problems = preflight(
            phase_cfg.launch, f"{name}.launch", tp_pp=phase_cfg.plugin.tp_size * phase_cfg.plugin.pp_size
        )
        bad += len(problems)
        print(f"{name}: " + ("ok" if not problems else "\n  ".join(f"{f}: {m}" for f, m in problems)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
