"""A real PostgreSQL cluster of its own for a test: initdb, pg_ctl start on a free 127.0.0.1 port, stop.

    python -m support.servers.postgres     # start one, print its URL for Prefect, Ctrl-C stops and removes it

Debian's `postgresql-15` package (scripts/install_system.sh) puts the server binaries under
/usr/lib/postgresql/<version>/bin, off PATH; they are found there or on PATH. PostgreSQL refuses to
run as root, so under root the cluster's directory belongs to the `postgres` user the package
creates and every server command runs as that user; otherwise as the caller. The cluster trusts
connections from 127.0.0.1 (a throwaway database of one test), listens on no other address, keeps
its socket in its own directory, and is stopped by `pg_ctl stop -m fast` (then SIGKILL by PID), and
its directory removed.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

DATABASE = "prefect"
SUPERUSER = "prefect"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin(name: str) -> str:
    """A PostgreSQL server binary: on PATH, else the newest Debian install's."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if not found:
        raise RuntimeError(
            f"PostgreSQL's {name} not found on PATH nor under /usr/lib/postgresql/*/bin: run `sudo bash "
            "scripts/install_system.sh` (Debian's postgresql-15)"
        )
    return found


class Postgres:
    """One cluster in a fresh directory; `url` is the SQLAlchemy/asyncpg URL of its database."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.user = "postgres" if os.geteuid() == 0 else None
        # Not under pytest's tmp_path: its parents are private to root, and the server runs as `postgres`.
        self.root = Path(tempfile.mkdtemp(prefix="cpt-to-sft-pg-"))
        self.data = self.root / "data"
        self.pid: int | None = None

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://{SUPERUSER}@127.0.0.1:{self.port}/{DATABASE}"

    @property
    def dsn(self) -> str:
        """The same database for asyncpg itself."""
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{DATABASE}"

    def _run(self, *argv: str, timeout: float = 120.0) -> str:
        out = subprocess.run(
            list(argv),
            user=self.user,
            cwd=str(self.root),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("PG")}, "LC_ALL": "C"},
        )
        if out.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}{self.log_tail()}"
            )
        return out.stdout

    def start(self, timeout: float = 60.0) -> Postgres:
        if self.user:
            pw = pwd.getpwnam(self.user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self._run(pg_bin("initdb"), "-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "--no-sync", "-E", "UTF8")
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c full_page_writes=off"
        self._run(
            pg_bin("pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.root / "server.log"),
            "-o",
            opts,
            "-w",
            "-t",
            str(int(timeout)),
            "start",
        )
        self.pid = int((self.data / "postmaster.pid").read_text().split()[0])
        self._run(pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, DATABASE)
        return self

    def log_tail(self, n: int = 3000) -> str:
        path = self.root / "server.log"
        try:
            return "\n" + path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.pid is not None:
            try:
                self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "30", "stop")
            except (RuntimeError, subprocess.TimeoutExpired):
                try:
                    os.kill(self.pid, signal.SIGKILL)  # the postmaster; its backends exit with it
                except ProcessLookupError:
                    pass
            self.pid = None
        shutil.rmtree(self.root, ignore_errors=True)


if __name__ == "__main__":
    pg = Postgres().start()
    print(pg.url, flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        pg.stop()
