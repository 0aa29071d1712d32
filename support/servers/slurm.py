"""A real two-node Slurm cluster on 127.0.0.1 for tests and benchmarks, started and stopped by PID.

One `munged` (its own key and socket), one `slurmctld` and two `slurmd -N n1|n2` emulating two
nodes, each daemon on a free port picked per run, every file under one directory. Clients find
the cluster through `SLURM_CONF` (`env()`); nothing under /etc is read or written. Root only
(slurmd runs jobs as their submitting user and must be able to switch to it).

    sudo python -m support.servers.slurm /tmp/slurm-test     # run one by hand; prints its env

Config lines that matter (measured on Debian's slurm-wlm 22.05):
- `ProctrackType=proctrack/pgid`: linuxproc leaks orphaned children of a cancelled step;
- `TaskPlugin=task/none` and no cgroup plugin anywhere: a container has no writable cgroup tree;
- `MinJobAge=5`: a finished job leaves squeue/scontrol after 5 s instead of 300, so `sbatch --wait`
  and queue-empty waits return promptly (the launcher must read a job's final state within it);
- `KillWait=2`: SIGTERM -> SIGKILL of a cancelled step's processes after 2 s, not 30;
- no accounting (`accounting_storage/none`): `sacct` fails, so states come from squeue/scontrol;
- `SlurmdParameters=config_overrides`: both emulated nodes share the host's 2 cores, so the
  configured CPUs are taken as given instead of draining a node whose hardware differs;
- `AuthInfo=socket=...`: the cluster's own munged, so several clusters can run on one machine.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from support.servers.seaweed import free_ports

_REPO = Path(__file__).resolve().parents[2]

NODES = ("n1", "n2")
PARTITION = "debug"
CPUS_PER_NODE = 2
# Every client call is bounded: a dead controller makes Slurm clients retry for a long time.
CLIENT_TIMEOUT = 20.0
# Processes that must not outlive the cluster (checked at teardown).
_LEFTOVER_PATTERNS = ("slurmstepd", "tasks.engine", "torch.distributed.run")


def slurm_available() -> bool:
    return all(shutil.which(b, path=_path()) for b in ("slurmctld", "slurmd", "sbatch", "munged"))


def _path() -> str:
    return os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"


class SlurmCluster:
    """`start()` brings munged, slurmctld and both slurmd up and waits until both nodes are idle;
    `stop()` cancels every job, waits for the queue to drain and ends the daemons by PID."""

    def __init__(self, base_dir: Path, cluster_name: str | None = None):
        self.base = Path(base_dir)
        self.name = cluster_name or "t" + secrets.token_hex(3)
        self.munge_dir = self.base / "munge"
        self.socket = self.munge_dir / "munge.socket"
        self.conf = self.base / "slurm.conf"
        ctld, *node_ports = free_ports(1 + len(NODES))
        self.ctld_port = ctld
        self.node_ports = dict(zip(NODES, node_ports))
        self.procs: dict[str, subprocess.Popen] = {}
        self.startup_s: float | None = None

    # -- environment and client calls -------------------------------------------------------

    def env(self) -> dict[str, str]:
        """What a client (sbatch, srun, squeue, ... and the launcher) needs to find this cluster."""
        return {"SLURM_CONF": str(self.conf), "PATH": _path()}

    def client(self, *argv: str, timeout: float = CLIENT_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, **self.env()}
        proc = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    def node_states(self) -> dict[str, str]:
        out = self.client("sinfo", "-h", "-N", "-o", "%N %T").stdout
        return dict(line.split(None, 1) for line in out.splitlines() if line.strip())

    def queue(self) -> list[str]:
        return [ln for ln in self.client("squeue", "-h", "-o", "%i %T").stdout.splitlines() if ln.strip()]

    # -- configuration ------------------------------------------------------------------------

    def slurm_conf(self) -> str:
        b = self.base
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={b / 'state'}",
            f"SlurmdSpoolDir={b / 'spool'}/%n",
            f"SlurmctldPidFile={b / 'slurmctld.pid'}",
            f"SlurmdPidFile={b / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={b / 'slurmctld.log'}",
            f"SlurmdLogFile={b / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MinJobAge=5",
            "KillWait=2",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "MessageTimeout=5",
        ]
        for node, port in self.node_ports.items():
            lines.append(
                f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} Port={port} "
                f"CPUs={CPUS_PER_NODE} State=UNKNOWN"
            )
        lines.append(f"PartitionName={PARTITION} Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        if os.geteuid() != 0:
            raise RuntimeError("the Slurm test cluster needs root (slurmd switches to the job's user)")
        t0 = time.monotonic()
        for sub in ("state", "spool/n1", "spool/n2"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        self.munge_dir.mkdir(parents=True, exist_ok=True)
        # munged refuses a socket directory that others can write to, and clients need to enter it.
        os.chmod(self.munge_dir, 0o755)
        self.conf.write_text(self.slurm_conf())
        try:
            self._start_munged()
            self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.conf)])
            self._wait(
                lambda: self.client("sinfo", "-h", timeout=5, check=False).returncode == 0,
                30,
                "slurmctld to answer sinfo",
            )
            for node in NODES:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
            self._wait(
                lambda: set(self.node_states().values()) == {"idle"} and len(self.node_states()) == len(NODES),
                timeout,
                "both nodes to be idle",
            )
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _start_munged(self) -> None:
        key = self.munge_dir / "munge.key"
        key.write_bytes(secrets.token_bytes(128))
        os.chmod(key, 0o600)
        self._spawn(
            "munged",
            [
                "munged",
                "-F",
                "--force",
                f"--socket={self.socket}",
                f"--key-file={key}",
                f"--pid-file={self.munge_dir / 'munged.pid'}",
                f"--log-file={self.munge_dir / 'munged.log'}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
            ],
        )
        self._wait(self.socket.exists, 15, "munged's socket")

    def _spawn(self, name: str, argv: list[str]) -> None:
        # Under support/servers/reaper.py: the daemon's orphans (each job's slurmstepd) are reaped by
        # it, never adopted by a test process that happens to be a child subreaper.
        exe = shutil.which(argv[0], path=_path()) or argv[0]
        env = {
            **os.environ,
            **self.env(),
            "PYTHONPATH": os.pathsep.join(p for p in (str(_REPO), os.environ.get("PYTHONPATH")) if p),
        }
        with open(self.base / f"{name}.stdout", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "support.servers.reaper", exe, *argv[1:]],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(_REPO),
                start_new_session=True,
            )

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode} while waiting for {what}:\n{self.log_tail(name)}"
                    )
            try:
                if ready():
                    return
            except (subprocess.TimeoutExpired, RuntimeError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}:\n{self.log_tail('slurmctld')}")

    def cancel_all(self, timeout: float = 60.0) -> None:
        """scancel every job and wait until the queue is empty (MinJobAge=5 bounds the wait)."""
        self.client("scancel", "--full", "-u", "root", check=False)
        deadline = time.monotonic() + timeout
        while self.queue():
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs still queued {timeout:.0f}s after scancel: {self.queue()}")
            time.sleep(0.5)

    def stop(self) -> list[str]:
        """Cancel jobs, end the daemons, and return the processes left behind (should be none)."""
        ctld = self.procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            try:
                self.cancel_all()
            except (subprocess.TimeoutExpired, RuntimeError):
                pass
        # slurmd first (it would retry registering with a stopped controller), munged last.
        order = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                # slurmd ignores SIGTERM while it is still retrying its registration: SIGKILL the
                # reaper's process group, the daemon with it.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        return self.leftovers()

    def leftovers(self) -> list[str]:
        """slurmstepd or engine processes still alive that belong to this cluster's jobs."""
        out = []
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            try:
                cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                environ = (pid_dir / "environ").read_bytes()
            except OSError:
                continue
            if any(p in cmd for p in _LEFTOVER_PATTERNS) and (
                f"SLURM_CONF={self.conf}".encode() in environ
                or str(self.base) in cmd
                or (cmd.startswith("slurmstepd") and self._stepd_is_ours(pid_dir))
            ):
                out.append(f"{pid_dir.name}: {cmd.strip()}")
        return out

    def _stepd_is_ours(self, pid_dir: Path) -> bool:
        # slurmstepd's environment is its parent slurmd's; look for our config path in it.
        try:
            return f"SLURM_CONF={self.conf}".encode() in (pid_dir / "environ").read_bytes()
        except OSError:
            return False

    def log_tail(self, name: str, n: int = 30) -> str:
        for path in (self.base / f"{name}.log", self.base / f"{name}.stdout"):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            if text.strip():
                return f"--- {path} ---\n" + "\n".join(text.splitlines()[-n:])
        return ""


def _main(argv: list[str]) -> int:
    base = Path(argv[0] if argv else "/tmp/slurm-test")
    cluster = SlurmCluster(base).start()
    for k, v in cluster.env().items():
        print(f"export {k}={v}")
    print(f"# up in {cluster.startup_s:.2f}s; nodes {cluster.node_states()}; Ctrl+C stops it", file=sys.stderr)
    try:
        cluster.procs["slurmctld"].wait()
    except KeyboardInterrupt:
        pass
    left = cluster.stop()
    print(f"# stopped; left behind: {left or 'nothing'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
