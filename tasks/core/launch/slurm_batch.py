"""The Slurm job of one engine verb, and following it. One engine verb is one batch job: the batch script (on the first node) looks up that node's
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

Render the batch script the backend would submit for a config (prints it, submits nothing):

    python -m tasks.core.launch.slurm_batch examples/tiny-cpu.yaml cpt train
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from tasks.core.config.schema import LaunchConfig
from tasks.core.config.slurm import SlurmConfig
from tasks.core.launch.slurm import FAILURE_STATES, JobInfo, SlurmCli, SlurmError


def engine_program(verb: str, job_path: str | Path) -> list[str]:
    return ["-m", "tasks.engine", verb, "--config", str(job_path)]


def sbatch_directives(
    launch: LaunchConfig, job_name: str, log_dir: str | Path, workdir: str | Path, comment: str = ""
) -> list[str]:
    s = launch.slurm or SlurmConfig()
    args = [
        f"--job-name={job_name}",
        # The comment ties the job to one job file (its digest): a launcher that died before it
        # recorded the job id finds the job again by name and comment (SlurmCli.find).
        *([f"--comment={comment}"] if comment else []),
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
    comment: str = "",
) -> str:
    """The sbatch script that runs `python -m torch.distributed.run ... <program>` on every node.

    `program` is what torchrun runs per rank: `engine_program(verb, job_path)` for a stage, or a
    script path and its arguments. The Python and the job file must be at the same paths on every
    node (a shared filesystem or the same image), as for any multi-node torchrun.
    """
    q = shlex.quote
    prefix = str(Path(log_dir) / "job-")
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {a}" for a in sbatch_directives(launch, job_name, log_dir, workdir, comment)]
    torchrun = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes=$SLURM_NNODES",
        f"--nproc-per-node={launch.nproc_per_node}",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$head_addr:$port"',
        "--rdzv-id=$SLURM_JOB_ID",
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
  {" ".join(a if a.startswith("--") else q(a) for a in torchrun)} \\
  {" ".join(q(a) for a in program)}
"""
    return "\n".join(lines) + "\n" + body


# -- following a job ----------------------------------------------------------------------------


class NodeLogs:
    """Follows the per-node output files of one job, yielding complete lines as (node, line).

    `positions()` is how far each file has been read, in bytes, up to the last complete line; a
    follower built with `start=` those positions goes on from there (a re-attach after the
    process that followed the job died) instead of replaying the output from the beginning.
    """

    def __init__(self, log_dir: str | Path, job_id: str, start: Mapping[str, int] | None = None):
        self.log_dir = Path(log_dir)
        self.job_id = job_id
        self._offsets: dict[str, int] = dict(start or {})
        self._partial: dict[str, bytes] = {}

    def batch_log(self) -> Path:
        return self.log_dir / f"job-{self.job_id}.batch.log"

    def node_files(self) -> dict[str, Path]:
        prefix = f"job-{self.job_id}."
        out = {}
        for path in sorted(self.log_dir.glob(f"{prefix}*.log")):
            node = path.name[len(prefix) : -len(".log")]
            if node != "batch":
                out[node] = path
        return out

    def positions(self) -> dict[str, int]:
        return {name: off - len(self._partial.get(name, b"")) for name, off in self._offsets.items()}

    def poll(self, final: bool = False) -> Iterator[tuple[str, str]]:
        """New complete lines since the last call; `final` also yields an unterminated last line."""
        for node, path in [("batch", self.batch_log()), *self.node_files().items()]:
            try:
                with open(path, "rb") as fh:
                    fh.seek(self._offsets.get(path.name, 0))
                    chunk = fh.read()
                    self._offsets[path.name] = fh.tell()
            except FileNotFoundError:
                continue
            lines = (self._partial.pop(path.name, b"") + chunk).split(b"\n")
            rest = lines.pop()
            if rest and not final:
                self._partial[path.name] = rest
            elif rest:
                lines.append(rest)
            for line in lines:
                yield node, line.decode(errors="replace")


def wait_for_job(
    cli: SlurmCli,
    job_id: str,
    logs: NodeLogs | None = None,
    on_line=None,
    poll_s: float = 1.0,
    timeout: float | None = None,
    on_poll: Callable[[], None] | None = None,
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
        if on_poll is not None:
            on_poll()
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
    return dataclasses.replace(
        last,
        state=state,
        reason=f"{last.reason}; read from the batch output after the controller forgot the job".lstrip("; "),
    )


_SRUN_ERROR = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): (.+)")
_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_RANK_PREFIX = re.compile(r"^\[rank (\d+)\]")
_ERR = re.compile(r"(Traceback|Error|Exception|error:|Killed|Signal)")
_RAISED = re.compile(r"\b\w+(Error|Exception|Interrupt): ")
# torchrun's failure summary per failed rank (`time      : 2026-12-02_07:32:20`, `exitcode  : -9
# (pid: 7)  (SIGKILL)`) and its agent's own line as each rank ends, to the microsecond
# (`E1202 07:32:20.295000 24373 .../api.py:1002] failed (exitcode: -9) local_rank: 0 ...`).
_SUMMARY_TIME = re.compile(r"^\s*time\s*:\s*(\d{4}-\d\d-\d\d_\d\d:\d\d:\d\d)")
_SUMMARY_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_AGENT_FAILED = re.compile(r"^E(\d{4}) (\d\d:\d\d:\d\d(?:\.\d+)?) .*\] failed \(exitcode: (-?\d+)\)")
# What a rank says when it failed only because a peer went away (gloo, NCCL, c10d store).
_PEER_GONE = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|Connection refused|timed out|"
    r"collective operation timeout|remote process exited|DistNetworkError",
    re.IGNORECASE,
)
# A rank SIGTERMed or SIGINTed was stopped from outside (its agent ending the node's other ranks
# after one failed, a cancellation): any other signal (SIGKILL, SIGSEGV, SIGABRT) is a cause.
_STOPPED = {-15, -2}


def failure_message(
    info: JobInfo, batch_lines: Sequence[str], node_lines: Mapping[str, Sequence[str]], what: str = ""
) -> str:
    """What went wrong, naming the job state, the failing node(s) and rank(s), with their last lines.

    The node comes from srun's own error line (`srun: error: n2: task 1: Exited with exit code 1`)
    or, failing that, from the nodes whose output shows an error; the rank from torchrun's failure
    summary (`rank : 1 (local_rank: 0)`) or the engine's `[rank N]` prefix on an error line.
    Several failed nodes are listed cause first (`_cause_rank`).
    """
    failed_nodes: dict[str, str] = {}
    for line in batch_lines:
        m = _SRUN_ERROR.search(line)
        if not m or m.group(1) in failed_nodes:
            continue
        if "Terminated" not in m.group(3):
            failed_nodes[m.group(1)] = m.group(3).strip()
        elif sig := _signal_death(node_lines.get(m.group(1), ())):
            # srun terminates the other nodes once one agent exits, and on a loaded machine the
            # peer of a SIGKILLed rank can exit first: the node its own log shows dying is a cause.
            failed_nodes[m.group(1)] = f"a rank died by signal {sig}, then srun terminated the node"
        elif rc := _own_exit(node_lines.get(m.group(1), ())):
            # Likewise a rank that raised: its peer saw the connection close and its agent exited
            # first, and srun terminated this node while its own agent was still reporting.
            failed_nodes[m.group(1)] = f"Exited with exit code {rc}, then srun terminated the node"
    if not failed_nodes:
        for node, lines in node_lines.items():
            if any(_ERR.search(x) for x in lines):
                failed_nodes[node] = "printed an error"
    # srun reports nodes in the order their agents exited, which on a loaded machine can be the
    # peer of a killed rank first: the cause leads, its casualties follow.
    srun_order = list(failed_nodes)
    failed_nodes = {
        n: failed_nodes[n]
        for n in sorted(srun_order, key=lambda n: (_cause_rank(node_lines.get(n, ())), srun_order.index(n)))
    }
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
        raised = [x for x in every[:-15] if _RAISED.search(x)][-3:] if node in failed_nodes else []
        if tail:
            parts.append(f"--- node {node} ---")
            parts.extend(raised + (["..."] if raised else []) + tail)
    errs = [x for x in batch_lines if "error" in x.lower()][-5:]
    if errs:
        parts.append("--- batch script ---")
        parts.extend(errs)
    return "\n".join(parts)


def _exit_codes(lines: Sequence[str]) -> Iterator[int]:
    """The ranks' exit codes torchrun reported on this node (its summary, its agent's lines)."""
    for line in lines:
        if m := _SUMMARY_EXIT.match(line) or _AGENT_FAILED.match(line):
            yield int(m.group(m.re.groups))


def _signal_death(lines: Sequence[str]) -> int | None:
    """The signal a rank of this node died by, per torchrun's summary, when it was no stop request."""
    return next((-rc for rc in _exit_codes(lines) if rc < 0 and rc not in _STOPPED), None)


def _own_exit(lines: Sequence[str]) -> int | None:
    """The exit code a rank of this node failed with on its own (not a peer gone, no signal)."""
    return next((rc for rc in _exit_codes(lines) if rc > 0), None) if _cause_rank(lines)[0] == 1 else None


def _cause_rank(lines: Sequence[str]) -> tuple:
    """How likely a failed node's output is the cause of a multi-node failure; lower sorts first.

    First a node where a rank died by a signal that is no stop request (SIGKILL: the OOM killer,
    a fault; SIGSEGV), then one whose ranks failed on their own, then one whose ranks only report
    a peer gone (connection reset or closed, a collective timed out): that peer's node is the
    cause. Within each, the earliest failure torchrun recorded (its summary's `time`, to the
    second, then its agent's line, to the microsecond); a node without either sorts last.
    """
    coarse: list[str] = []
    fine: list[tuple[str, str]] = []
    peer = False
    for line in lines:
        if m := _SUMMARY_TIME.match(line):
            coarse.append(m.group(1))
        elif m := _AGENT_FAILED.match(line):
            fine.append((m.group(1), m.group(2)))
        elif _PEER_GONE.search(line) and _ERR.search(line):
            peer = True
    kind = 0 if _signal_death(lines) is not None else 2 if peer else 1
    unknown = "~"  # sorts after any digit
    return kind, min(coarse, default=unknown), min(fine, default=(unknown, unknown))


def _main(argv: list[str]) -> int:
    from tasks.core.config.load import load_config

    if len(argv) != 3:
        print("usage: python -m tasks.core.launch.slurm CONFIG.yaml cpt|sft VERB", file=sys.stderr)
        return 2
    cfg = load_config(argv[0])
    phase_cfg = cfg.phase(argv[1])
    job_path = f"{cfg.run_uri}/{argv[1]}/.launch/{argv[2]}.json"
    print(
        render_batch_script(
            engine_program(argv[2], job_path),
            phase_cfg.launch,
            f"{cfg.name}-{argv[1]}-{argv[2]}",
            f"{cfg.run_uri}/{argv[1]}/.launch",
            Path(__file__).resolve().parents[3],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
