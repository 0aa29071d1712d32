"""An `s3://` run root with its CPT stage on two Slurm nodes, per-node staging (integration): a real
SeaweedFS S3 server and the real two-node Slurm test cluster.

The flow's first four stages run as Prefect tasks (load_from_hf -> prepare_data -> boost_and_shard -> train_cpt,
HybridParallel tp=2 with one rank on each of n1 and n2). The run's staging_dir differs from the
nodes' staging directories, and each node gets its own (`<staging>/cpt-to-sft-nodes/<node>`), so
no node can read what another one or the worker staged: each node stages the model, the data and
the checkpoint to resume from out of S3 itself and publishes its own checkpoint parts; rank 0
publishes the manifest last. The published checkpoints verify from S3.

    python -m pytest -m "" tests/test_slurm_s3.py
"""

from __future__ import annotations

import pytest

from tasks.core.run.manifest import MANIFEST
from tests.conftest import tiny_config_raw

pytest_plugins = ["tests.conftest_slurm", "tests.conftest_servers"]
pytestmark = pytest.mark.integration

STEPS, EVERY = 4, 2


def test_s3_run_root_with_per_node_staging_on_two_slurm_nodes(
    slurm_cluster, s3_root, prefect_harness, tiny_model_dir, tmp_path, monkeypatch
):
    from prefect import flow

    from tasks.core.config.load import parse_config
    from tasks.core.storage.fs import RunStore
    from tasks.flowkit.stage import outcome
    from tasks.stages.load import load_from_hf
    from tasks.stages.prepare_data import prepare_data
    from tasks.stages.train import boost_and_shard, train_cpt

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # both emulated nodes are 127.0.0.1
    raw = tiny_config_raw(tiny_model_dir, s3_root)
    raw["staging_dir"] = str(tmp_path / "staging")
    raw["cpt"].update(
        max_steps=STEPS,
        checkpoint_every=EVERY,
        launch={
            "backend": "slurm",
            "nnodes": 2,
            "nproc_per_node": 1,
            "slurm": {"partition": "debug", "time_limit": "10"},
        },
    )
    cfg = parse_config(raw)

    @flow(name="slurm-s3-cpt")
    def cpt_only():
        base = outcome(load_from_hf(cfg, return_state=True))
        data = outcome(prepare_data(cfg, "cpt", base, return_state=True))
        a0 = outcome(boost_and_shard(cfg, base, data, return_state=True))
        return outcome(train_cpt(cfg, a0, return_state=True))

    result = cpt_only()
    assert str(result.status) == "completed" and result.uri == f"{s3_root}/cpt/step-{STEPS:06d}"

    store = RunStore(s3_root, staging_dir=str(tmp_path / "verify"))
    for step in (0, EVERY, STEPS):
        manifest = store.verify(f"cpt/step-{step:06d}", deep=True)  # every file, both nodes' parts, from S3
        assert manifest["meta"]["nodes"] == ["n1", "n2"] and manifest["meta"]["world_size"] == 2
    nodes = tmp_path / "staging" / "cpt-to-sft-nodes"
    assert sorted(p.name for p in nodes.iterdir()) == ["n1", "n2"]
    # After the last save each node's directory holds only the parts its own ranks wrote: they
    # do not overlap, each node wrote some (at least its rank's RNG state), and together they
    # are exactly the files the published manifest lists.
    parts = {}
    for node in ("n1", "n2"):
        (final,) = (nodes / node).glob(f"*/cpt/step-{STEPS:06d}")
        parts[node] = {
            p.relative_to(final).as_posix()
            for p in final.rglob("*")
            if p.is_file() and p.relative_to(final).as_posix() != MANIFEST
        }
        assert parts[node], f"node {node} wrote no part of the checkpoint"
    assert not parts["n1"] & parts["n2"]
    assert parts["n1"] | parts["n2"] == set(manifest["files"])
    # The worker's staging holds no checkpoint the nodes wrote there: it only staged in the final
    # one from S3 to read its train state.
    worker_steps = sorted(p.name for p in (tmp_path / "staging").glob("*/cpt/step-*"))
    assert set(worker_steps) <= {"step-000000", f"step-{STEPS:06d}"}, worker_steps
    assert slurm_cluster.leftovers() == []
