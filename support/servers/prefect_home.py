"""A fresh PREFECT_HOME whose SQLite database Prefect has already migrated.

    python -m support.servers.prefect_home /tmp/prefect-home   # seed a home by hand, print its database

A server started on an empty PREFECT_HOME spends most of its start on Alembic's migrations
(measured here: 11.8 s wall, 11.1 s CPU to a healthy API on a fresh home; 3.7 s and 3.9 s on one
already migrated). The tests that start their own server (the flow CLI's embedded one, `prefect
server start`) each start from an empty home, so they paid that every time. `seeded_home` copies a
database that Prefect's own `create_db` migrated once into the home; the server still runs its
migration check at start (a no-op at head), and everything after is the real server on its own
database. A test about a fresh database's start keeps an empty home.

`seeded_harness` is Prefect's own `prefect_test_harness` (the tests' session server) started on a
copy of the same database instead of an empty one.

The template is built once per machine and Prefect version under the temp dir, written to a
temporary name and renamed, so two xdist workers that race both end with a whole file.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DB_NAME = "prefect.db"  # PREFECT_HOME/prefect.db: Prefect's default SQLite connection URL
_CREATE_DB = (
    "import asyncio\nfrom prefect.server.database import "
    "provide_database_interface\nasyncio.run(provide_database_interface().create_db())\n"
)


def template_db() -> Path:
    """The migrated database for this Prefect version, built on first use."""
    # The installed version from its metadata: `import prefect` would cost a benchmark's parent ~1.7 s CPU.
    root = Path(tempfile.gettempdir()) / f"cpt-to-sft-prefect-db-{importlib.metadata.version('prefect')}"
    db = root / DB_NAME
    if db.is_file():
        return db
    root.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(dir=root, prefix="build-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(build), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    r = subprocess.run(
        [sys.executable, "-c", _CREATE_DB], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    if r.returncode != 0 or not (build / DB_NAME).is_file():
        raise RuntimeError(f"migrating a template Prefect database failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    os.replace(build / DB_NAME, db)
    shutil.rmtree(build, ignore_errors=True)
    return db


def seeded_home(home: Path) -> Path:
    """`home` (created) holding a copy of the migrated database; returns `home`."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template_db(), home / DB_NAME)
    return home


@contextlib.contextmanager
def seeded_harness(server_startup_timeout: int = 120):
    """`prefect.testing.utilities.prefect_test_harness` on an already migrated database.

    The harness makes its own temporary folder (`mkdtemp()`, removed at exit) and points the server
    at `<folder>/prefect-test.db`; that folder is made here with the template copied in under that
    name, so everything else is Prefect's harness unchanged."""
    from unittest import mock

    import prefect.testing.utilities as harness

    folder = tempfile.mkdtemp(prefix="prefect-harness-")
    shutil.copyfile(template_db(), Path(folder) / "prefect-test.db")
    with contextlib.ExitStack() as stack:
        with mock.patch.object(harness, "mkdtemp", lambda: folder):  # called before the harness's first yield
            stack.enter_context(harness.prefect_test_harness(server_startup_timeout=server_startup_timeout))
        yield


if __name__ == "__main__":
    print(seeded_home(Path(sys.argv[1])) / DB_NAME)
