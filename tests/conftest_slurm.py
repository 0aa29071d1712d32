"""The real two-node Slurm cluster as a session fixture; test modules opt in with
`pytest_plugins = ["tests.conftest_slurm"]`.

- `slurm_cluster`: one `SlurmCluster` (munged, slurmctld, slurmd n1 and n2; about 1.3 s to start)
  for the session, its `SLURM_CONF` exported to os.environ (restored afterwards) so every Slurm
  client, the launcher included, finds it the standard way. Skipped only on a developer machine
  without Slurm (or without root); in CI (`CI=true`) a missing Slurm is a failure, because
  `.ci/run` installs it. Teardown cancels every job, waits for an empty queue, stops the daemons
  and fails if a slurmstepd or engine process outlived them.
"""

from __future__ import annotations

import os

import pytest

from support.servers import patched_env
from support.servers.slurm import SlurmCluster, slurm_available


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    problem = None
    if not slurm_available():
        problem = "Slurm is not installed (slurmctld/slurmd/sbatch/munged); run: sudo bash scripts/install_system.sh"
    elif os.geteuid() != 0:
        problem = "the Slurm test cluster needs root (slurmd runs jobs as their submitting user)"
    if problem:
        if _in_ci():
            pytest.fail(f"{problem} (CI=true: .ci/run installs Slurm as root, so this must not happen)")
        pytest.skip(problem)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        with patched_env(cluster.env()):
            yield cluster
    finally:
        left = cluster.stop()
    if left:
        pytest.fail("processes outlived the Slurm test cluster:\n" + "\n".join(left))
