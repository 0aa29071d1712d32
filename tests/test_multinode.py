"""Multi-node launch: two torchrun agents ("nodes") on 127.0.0.1 meet at one c10d rendezvous and run
a CPT stage together (distributed tier): `shard` (boost under plugin A, save step-000000), then
`train` (4 steps, a checkpoint every 2), each node with one process, HybridParallel tp=2 across
the two nodes. Both agents' commands come from `tasks.core.launch.torchrun.torchrun_argv`, as in production
where every node runs the same command with its own --node-rank.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from pathlib import Path

import pytest

from support.engine import prepared_data
from support.servers.prefect_ops import free_port, stop_group
from tests.conftest import REPO, tiny_config_raw

pytestmark = pytest.mark.distributed

STEPS, EVERY = 4, 2


def _job(tmp: Path, model_dir: Path, verb: str, run: dict, digest: str) -> Path:
    """The job file the stage tasks write (tasks/stages/train.py:_job)."""
    path = tmp / "jobs" / f"cpt-{verb}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "verb": verb,
                "phase": "cpt",
                "phase_cfg": run["cpt"],
                "trust_remote_code": run["base_model"]["trust_remote_code"],
                "model_dir": str(model_dir),
                "tokenizer_dir": str(model_dir),
                "data_dir": str(prepared_data(run["cpt"], "cpt", model_dir, tmp / "data-cpt")),
                "stage_dir": str(tmp / "run" / "cpt"),
                "parent": {"uri": str(model_dir), "digest": "base-digest"},
                "config_digest": digest,
            },
            indent=2,
        )
    )
    return path


def _two_nodes(verb: str, job: Path, timeout: float = 400.0) -> list[str]:
    from tasks.core.config.schema import LaunchConfig
    from tasks.core.launch.torchrun import engine_env, torchrun_argv

    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    try:
        for node_rank in (0, 1):
            launch = LaunchConfig(
                nproc_per_node=1, nnodes=2, node_rank=node_rank, rdzv_endpoint=endpoint, rdzv_id=f"multinode-{verb}"
            )
            argv = torchrun_argv(verb, job, launch, rdzv_id="unused")
            assert argv[argv.index("--rdzv-backend") + 1] == "c10d" and argv[argv.index("--node-rank") + 1] == str(
                node_rank
            )
            # Keep every connection on the loopback interface (the "nodes" share this machine).
            argv[3:3] = ["--local-addr", "127.0.0.1"]
            procs.append(
                subprocess.Popen(
                    argv,
                    cwd=str(REPO),
                    env=engine_env({"GLOO_SOCKET_IFNAME": "lo"}),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    start_new_session=True,
                )
            )
        outs = []
        deadline = time.monotonic() + timeout
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                stop_group(p, timeout=5)
    for node_rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node_rank} agent of `{verb}` exited {p.returncode}:\n{out[-5000:]}"
    return outs


def test_two_torchrun_agents_rendezvous_and_run_a_cpt_stage(tiny_model_dir, tmp_path):
    from tasks.core.config.load import parse_config
    from tasks.core.run.manifest import verify_artifact

    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["cpt"].update(
        max_steps=STEPS,
        checkpoint_every=EVERY,
        launch={"nproc_per_node": 1, "nnodes": 2, "rdzv_endpoint": "127.0.0.1:29400"},
    )
    assert raw["cpt"]["plugin"]["tp_size"] == 2  # tensor parallel across the two "nodes"
    run = parse_config(raw).model_dump(mode="json")
    digest = "c" * 64

    outs = _two_nodes("shard", _job(tmp_path, tiny_model_dir, "shard", run, digest))
    outs += _two_nodes("train", _job(tmp_path, tiny_model_dir, "train", run, digest))

    # One global rank per node: each agent's process got its own RANK from the rendezvous. A rank
    # with nothing to say prints no line (the engine states its own output levels; rank 1 logs
    # nothing at info), so no agent shows two ranks, and both ranks' saved state proves both ran.
    seen = [set(re.findall(r"^\[rank (\d+)(?:\|\w+)?\]", out, re.MULTILINE)) for out in outs]
    assert all(len(ranks) <= 1 for ranks in seen), seen
    assert "0" in set().union(*seen[2:])

    stage_dir = tmp_path / "run" / "cpt"
    start = verify_artifact(stage_dir / "step-000000")
    final = verify_artifact(stage_dir / f"step-{STEPS:06d}")
    for manifest in (start, final):
        assert manifest["config_digest"] == digest
        assert manifest["meta"]["world_size"] == 2
    assert {p.name for p in (stage_dir / f"step-{STEPS:06d}" / "rng").glob("*.json")} == {
        "rank-00000.json",
        "rank-00001.json",
    }
    assert final["meta"]["step"] == STEPS and final["meta"]["plugin"]["tp"] == 2
    state = json.loads((stage_dir / f"step-{STEPS:06d}" / "train_state.json").read_text())
    assert len(state["losses"]) == STEPS and not any(math.isnan(x) for x in state["losses"])
    progress = [json.loads(m) for o in outs[2:] for m in re.findall(r"^\[rank 0\] @@progress (.*)$", o, re.MULTILINE)]
    assert [p["step"] for p in progress] == list(range(1, STEPS + 1))
