"""Slurm for the launch backend: the CLI client, the batch script of one engine verb, job states
and the pre-flight checks. Pure of Prefect (no prefect, colossalai or torch.distributed import);
every call to a Slurm client has a timeout, because a dead controller makes them hang.

Render the batch script the backend would submit for a config (prints it, submits nothing):

    python -m tasks.core.slurm deployments/configs/tiny-cpu.yaml cpt train

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

One engine verb is one batch job: the batch script (on the first node) looks up that node's
address and a free port there, then `srun` starts one torchrun agent per node; the agents meet at
a c10d rendezvous keyed by the job id:

    srun --nodes=$SLURM_NNODES --ntasks-per-node=1 --kill-on-bad-exit=1 \\
      bash -c 'exec "$@" >"$0.$SLURMD_NODENAME.log" 2>&1' LOGDIR/job-$SLURM_JOB_ID \\
      python -m torch.distributed.run --nnodes=$SLURM_NNODES --nproc-per-node=N \\
        --rdzv-backend=c10d --rdzv-endpoint=$ADDR:$PORT --rdzv-id=$SLURM_JOB_ID \\
        -m tasks.engine train --config JOB.json

Every node writes its own file `job-<id>.<node>.log` (srun's `%N` is the host name, which is the
same for emulated nodes, so the node name comes from `SLURMD_NODENAME`); `NodeLogs` follows them
and yields (node, line). The batch script's own output (srun's error lines name the failing node
and task) goes to `job-<id>.batch.log`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from tasks.core.config import LaunchConfig, SlurmConfig

DEFAULT_TIMEOUT = 30.0
# Preflight asks the controller with a short bound: a dead one must not stall the run form.
PING_TIMEOUT = 10.0

ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
    "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "SPECIAL_EXIT",
})
# Why a job ended, in words a user can act on; the state itself is always named too.
FAILURE_STATES = {
    "FAILED": "a process exited with an error",
    "NODE_FAIL": "a node stopped responding to the controller (hardware, network or slurmd died); the retry resumes from the newest checkpoint",
    "TIMEOUT": "the job reached its time limit (launch.slurm.time_limit); the retry resumes from the newest checkpoint",
    "OUT_OF_MEMORY": "a process exceeded the memory Slurm granted the job; lower micro_batch_size or ask for more memory (extra_sbatch_args: ['--mem=...'])",
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

    def run(self, *argv: str, timeout: float | None = None, check: bool = True, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        limit = timeout or self.timeout
        full_env = {**os.environ, **self.env, **(env or {})}
        try:
            proc = subprocess.run(list(argv), env=full_env, capture_output=True, text=True, timeout=limit, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]} not found: the Slurm client tools are not installed on this machine") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"`{' '.join(argv[:3])} ...` did not answer within {limit:.0f} s: is slurmctld running and reachable (SLURM_CONF={full_env.get('SLURM_CONF', 'default')})?") from None
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
                name=kv["PartitionName"], state=kv.get("State", ""),
                total_nodes=int(kv.get("TotalNodes", "0") or 0),
                max_nodes=None if max_nodes in ("UNLIMITED", "") else int(max_nodes),
                nodes=kv.get("Nodes", ""), default=kv.get("Default") == "YES",
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
            job_id=kv.get("JobId", job_id), state=kv.get("JobState", "UNKNOWN"), reason=kv.get("Reason", ""),
            exit_code=kv.get("ExitCode", ""), nodes=kv.get("NodeList", ""), batch_host=kv.get("BatchHost", ""),
            name=kv.get("JobName", ""),
        )

    def queue(self, job_ids: Sequence[str] = ()) -> list[tuple[str, str]]:
        argv = ["squeue", "-h", "-o", "%i|%T"]
        if job_ids:
            argv += ["-j", ",".join(job_ids)]
        proc = self.run(*argv, check=False)
        if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
            raise SlurmError(f"squeue exited {proc.returncode}: {proc.stderr.strip()}")
        return [tuple(l.split("|", 1)) for l in proc.stdout.splitlines() if "|" in l]  # type: ignore[misc]

    def cancel(self, job_id: str) -> None:
        self.run("scancel", job_id)

    def hostnames(self, nodelist: str) -> list[str]:
        return self.run("scontrol", "show", "hostnames", nodelist).stdout.split()


# -- the batch script ---------------------------------------------------------------------------


def engine_program(verb: str, job_path: str | Path) -> list[str]:
    return ["-m", "tasks.engine", verb, "--config", str(job_path)]


def sbatch_directives(launch: LaunchConfig, job_name: str, log_dir: str | Path, workdir: str | Path) -> list[str]:
    s = launch.slurm or SlurmConfig()
    args = [
        f"--job-name={job_name}",
        f"--nodes={launch.nnodes}",
        "--ntasks-per-node=1",
        f"--output={Path(log_dir) / 'job-%j.batch.log'}",
        f"--chdir={workdir}",
        # A requeued job would start a second set of agents behind the launcher's back.
        "--no-requeue",
    ]
    if s.partition:
        args.append(f"--partition={s.partition}")
    if s.time_limit:
        args.append(f"--time={s.time_limit}")
    if s.gpus_per_node:
        args.append(f"--gpus-per-node={s.gpus_per_node}")
    if s.account:
        args.append(f"--account={s.account}")
    args.extend(s.extra_sbatch_args)
    return args


def render_batch_script(
    program: Sequence[str],
    launch: LaunchConfig,
    job_name: str,
    log_dir: str | Path,
    workdir: str | Path,
    python: str = sys.executable,
) -> str:
    """The sbatch script that runs `python -m torch.distributed.run ... <program>` on every node.

    `program` is what torchrun runs per rank: `engine_program(verb, job_path)` for a stage, or a
    script path and its arguments. The Python and the job file must be at the same paths on every
    node (a shared filesystem or the same image), as for any multi-node torchrun.
    """
    q = shlex.quote
    prefix = str(Path(log_dir) / "job-")
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {a}" for a in sbatch_directives(launch, job_name, log_dir, workdir)]
    torchrun = [
        python, "-m", "torch.distributed.run",
        "--nnodes=$SLURM_NNODES", f"--nproc-per-node={launch.nproc_per_node}",
        "--rdzv-backend=c10d", '--rdzv-endpoint="$head_addr:$port"', "--rdzv-id=$SLURM_JOB_ID",
    ]
    body = f"""
set -uo pipefail
# Client calls in the job are bounded too: a controller that went away must not hang the job.
nodes=($(timeout 60 scontrol show hostnames "$SLURM_JOB_NODELIST")) || exit 1
# The rendezvous lives on the first node (where this script runs); use the address Slurm reaches
# it by, which is the node name itself unless the cluster sets NodeAddr.
head_addr=$(timeout 60 scontrol show node -o "${{nodes[0]}}" | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')
head_addr=${{head_addr:-${{nodes[0]}}}}
port=$({q(python)} -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])') || exit 1
echo "@@slurm {{\\"job_id\\": \\"$SLURM_JOB_ID\\", \\"nodes\\": \\"${{nodes[*]}}\\", \\"rdzv_endpoint\\": \\"$head_addr:$port\\"}}"
# One torchrun agent per node, its output in a file named after the node (srun's %N would be
# the host name, the same for every emulated node); exec keeps signals going to torchrun.
srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \\
  bash -c 'exec "$@" >"$0.$SLURMD_NODENAME.log" 2>&1' {q(prefix)}"$SLURM_JOB_ID" \\
  {' '.join(a if a.startswith("--") else q(a) for a in torchrun)} \\
  {' '.join(q(a) for a in program)}
"""
    return "\n".join(lines) + "\n" + body


# -- following a job ----------------------------------------------------------------------------


class NodeLogs:
    """Follows the per-node output files of one job, yielding complete lines as (node, line)."""

    def __init__(self, log_dir: str | Path, job_id: str):
        self.log_dir = Path(log_dir)
        self.job_id = job_id
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}

    def batch_log(self) -> Path:
        return self.log_dir / f"job-{self.job_id}.batch.log"

    def node_files(self) -> dict[str, Path]:
        prefix = f"job-{self.job_id}."
        out = {}
        for path in sorted(self.log_dir.glob(f"{prefix}*.log")):
            node = path.name[len(prefix):-len(".log")]
            if node != "batch":
                out[node] = path
        return out

    def poll(self, final: bool = False) -> Iterator[tuple[str, str]]:
        """New complete lines since the last call; `final` also yields an unterminated last line."""
        for node, path in [("batch", self.batch_log()), *self.node_files().items()]:
            try:
                with open(path, "r", errors="replace") as fh:
                    fh.seek(self._offsets.get(path, 0))
                    chunk = fh.read()
                    self._offsets[path] = fh.tell()
            except FileNotFoundError:
                continue
            text = self._partial.pop(path, "") + chunk
            lines = text.split("\n")
            rest = lines.pop()
            if rest and not final:
                self._partial[path] = rest
            elif rest:
                lines.append(rest)
            for line in lines:
                yield node, line


def wait_for_job(
    cli: SlurmCli,
    job_id: str,
    logs: NodeLogs | None = None,
    on_line=None,
    poll_s: float = 1.0,
    timeout: float | None = None,
) -> JobInfo:
    """Poll the job until it leaves the active states, feeding new log lines to `on_line(node, line)`.

    The final state is the last one `scontrol` reported; a job the controller forgot before it
    was seen to end (longer than MinJobAge between polls) comes back as state UNKNOWN.
    """
    last = JobInfo(job_id=job_id, state="UNKNOWN", reason="the controller forgot the job before its end was seen")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        info = cli.job(job_id)
        if logs is not None and on_line is not None:
            for node, line in logs.poll():
                on_line(node, line)
        if info is None or not info.active:
            final = info or _ended_while_completing(last, logs)
            if logs is not None and on_line is not None:
                for node, line in logs.poll(final=True):
                    on_line(node, line)
            return final
        last = info
        if deadline is not None and time.monotonic() > deadline:
            raise SlurmError(f"job {job_id} still {info.state} after {timeout:.0f} s")
        time.sleep(poll_s)


# slurmstepd writes this into the batch output when it kills a job (scancel, time limit, ...).
_KILLED = re.compile(r"\*\*\* JOB \d+ ON \S+ CANCELLED AT \S+(?: DUE TO (TIME LIMIT|NODE FAILURE|PREEMPTION))?")
_KILLED_STATES = {None: "CANCELLED", "TIME LIMIT": "TIMEOUT", "NODE FAILURE": "NODE_FAIL", "PREEMPTION": "PREEMPTED"}


def _ended_while_completing(last: JobInfo, logs: NodeLogs | None) -> JobInfo:
    """The state of a job the controller forgot while we last saw it COMPLETING.

    A killed job's MinJobAge counts from the kill, and its processes may take longer than that
    to end (KillWait), so it can leave the controller straight from COMPLETING (measured on the
    test cluster, MinJobAge=5). slurmstepd's `*** JOB n ON node CANCELLED AT ... [DUE TO ...] ***`
    line in the batch output then tells the state; without one, the exit code does.
    """
    if last.state != "COMPLETING":
        return last
    state = None
    if logs is not None:
        try:
            m = _KILLED.search(logs.batch_log().read_text(errors="replace"))
        except OSError:
            m = None
        if m:
            state = _KILLED_STATES[m.group(1)]
    if state is None:
        state = "COMPLETED" if last.exit_code in ("", "0:0") else "FAILED"
    return dataclasses.replace(last, state=state, reason=f"{last.reason}; read from the batch output after the controller forgot the job".lstrip("; "))


_SRUN_ERROR = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): (.+)")
_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_RANK_PREFIX = re.compile(r"^\[rank (\d+)\]")
_ERR = re.compile(r"(Traceback|Error|Exception|error:|Killed|Signal)")
_RAISED = re.compile(r"\b\w+(Error|Exception|Interrupt): ")


def failure_message(info: JobInfo, batch_lines: Sequence[str], node_lines: Mapping[str, Sequence[str]], what: str = "") -> str:
    """What went wrong, naming the job state, the failing node(s) and rank(s), with their last lines.

    The node comes from srun's own error line (`srun: error: n2: task 1: Exited with exit code 1`)
    or, failing that, from the nodes whose output shows an error; the rank from torchrun's failure
    summary (`rank : 1 (local_rank: 0)`) or the engine's `[rank N]` prefix on an error line.
    """
    failed_nodes: dict[str, str] = {}
    for line in batch_lines:
        m = _SRUN_ERROR.search(line)
        if m and "Terminated" not in m.group(3) and m.group(1) not in failed_nodes:
            failed_nodes[m.group(1)] = m.group(3).strip()
    if not failed_nodes:
        for node, lines in node_lines.items():
            if any(_ERR.search(l) for l in lines):
                failed_nodes[node] = "printed an error"
    ranks: dict[str, list[str]] = {}
    for node in failed_nodes or node_lines:
        found: list[str] = []
        for line in node_lines.get(node, ()):
            m = _TORCHRUN_RANK.match(line)
            if m and m.group(1) not in found:
                found.append(m.group(1))
        if not found:
            for line in node_lines.get(node, ()):
                m = _RANK_PREFIX.match(line)
                if m and _ERR.search(line) and m.group(1) not in found:
                    found.append(m.group(1))
        if found:
            ranks[node] = found
    state = info.state
    why = FAILURE_STATES.get(state, f"the job ended in state {state}")
    head = f"Slurm job {info.job_id}{' (' + what + ')' if what else ''} ended {state}"
    rc, _, sig = info.exit_code.partition(":")
    if sig not in ("", "0"):
        head += f" (signal {sig})"
    elif rc not in ("", "0"):
        head += f" (exit code {rc})"
    if failed_nodes:
        where = "; ".join(
            f"node {n}" + (f", rank {', '.join(ranks[n])}" if n in ranks else "") + f": {detail}"
            for n, detail in failed_nodes.items()
        )
        head += f" on {where}"
    elif info.nodes:
        head += f" on nodes {info.nodes}"
    if info.reason and info.reason not in ("None", "NonZeroExitCode"):
        head += f" [reason: {info.reason}]"
    parts = [f"{head}. {why}."]
    order = list(failed_nodes) + [n for n in node_lines if n not in failed_nodes]
    for node in order:
        every = list(node_lines.get(node, ()))
        tail = every[-15:]
        # torchrun's failure summary fills the tail; the exception that caused it is above it.
        raised = [l for l in every[:-15] if _RAISED.search(l)][-3:] if node in failed_nodes else []
        if tail:
            parts.append(f"--- node {node} ---")
            parts.extend(raised + (["..."] if raised else []) + tail)
    errs = [l for l in batch_lines if "error" in l.lower()][-5:]
    if errs:
        parts.append("--- batch script ---")
        parts.extend(errs)
    return "\n".join(parts)


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
        out.append((f"{where}.nnodes", f"world size nnodes*nproc_per_node = {launch.nnodes}*{launch.nproc_per_node} = {world} is not a multiple of tp_size*pp_size = {tp_pp}"))
    if s.gpus_per_node and launch.nproc_per_node > s.gpus_per_node:
        out.append((f"{where}.nproc_per_node", f"{launch.nproc_per_node} processes per node but slurm.gpus_per_node is {s.gpus_per_node}: one process per GPU; make them equal"))
    try:
        cli.ping()
        parts = cli.partitions()
    except SlurmError as exc:
        out.append((f, f"the Slurm controller does not answer: {exc}"))
        return out
    if s.partition:
        part = parts.get(s.partition)
        if part is None:
            out.append((f"{f}.partition", f"partition {s.partition!r} does not exist on this cluster; it has {', '.join(sorted(parts)) or 'none'}"))
            return out
    else:
        part = next((p for p in parts.values() if p.default), None)
        if part is None:
            out.append((f"{f}.partition", f"the cluster has no default partition; name one of {', '.join(sorted(parts)) or '(none)'}"))
            return out
    if part.state != "UP":
        out.append((f"{f}.partition", f"partition {part.name!r} is {part.state}, not UP: jobs would wait until an administrator brings it up"))
    limit = part.total_nodes if part.max_nodes is None else min(part.total_nodes, part.max_nodes)
    if launch.nnodes > limit:
        out.append((f"{where}.nnodes", f"{launch.nnodes} nodes do not fit partition {part.name!r}: it has {part.total_nodes} node(s)" + (f" and MaxNodes={part.max_nodes}" if part.max_nodes is not None else "") + f"; use at most {limit}"))
    if s.gpus_per_node:
        try:
            gpus = cli.node_gpus(part.name)
        except SlurmError as exc:
            out.append((f, f"could not list the GPUs of partition {part.name!r}: {exc}"))
            return out
        enough = sum(1 for n in gpus.values() if n >= s.gpus_per_node)
        if enough < launch.nnodes:
            most = max(gpus.values(), default=0)
            out.append((f"{f}.gpus_per_node", f"{launch.nnodes} node(s) x {s.gpus_per_node} GPUs do not fit partition {part.name!r}: {enough} of its nodes have that many GPUs (the most on one node is {most})"))
    return out


def _main(argv: list[str]) -> int:
    from tasks.core.config import load_config

    if len(argv) != 3:
        print("usage: python -m tasks.core.slurm CONFIG.yaml cpt|sft VERB", file=sys.stderr)
        return 2
    cfg = load_config(argv[0])
    stage = getattr(cfg, argv[1])
    job_path = f"{cfg.run_uri}/{argv[1]}/.launch/{argv[2]}.json"
    print(render_batch_script(engine_program(argv[2], job_path), stage.launch, f"{cfg.name}-{argv[1]}-{argv[2]}",
                              f"{cfg.run_uri}/{argv[1]}/.launch", Path(__file__).resolve().parents[2]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
