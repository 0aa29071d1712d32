"""Run one daemon under a small child subreaper that reaps every orphan the daemon leaves.

    python -m support.servers.reaper slurmd -D -N n1 -f slurm.conf

slurmd double-forks each job's slurmstepd, which then re-parents to the nearest child subreaper
above it, or to PID 1. A test process can itself be a subreaper (a local stage makes its task
process one while it runs, and a test that drives the process tree makes itself one): without this
wrapper the slurmstepds of a test cluster would become that test process's children and stay
zombies it never reaps, and slurmd stops launching new jobs on such a node (seen: the second job
on a cluster under a subreaper pytest never started). This wrapper is their subreaper instead and
reaps them at once.

The wrapper forwards SIGTERM, SIGINT and SIGHUP to the daemon and exits with the daemon's status.
Send SIGKILL to its process group (the wrapper is started in a session of its own) to kill both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tasks.core.launch.proctree import become_subreaper


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m support.servers.reaper COMMAND [ARGS...]", file=sys.stderr)
        return 2
    become_subreaper()
    child = subprocess.Popen(argv)

    def forward(sig: int, _frame) -> None:
        try:
            os.kill(child.pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.wait()  # the daemon, or any orphan re-parented to this process
        except ChildProcessError:
            return 1
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            return child.returncode if child.returncode >= 0 else 128 - child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
