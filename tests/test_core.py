"""Unit tier: config rules, manifests, storage, launch argv and the import boundary."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pydantic
import pytest
import yaml

from tasks.core.config.load import load_config, parse_config
from tasks.core.config.schema import LaunchConfig
from tasks.core.errors import ArtifactMissing, ConfigError, ManifestError
from tasks.core.launch.torchrun import torchrun_argv
from tasks.core.run.manifest import MANIFEST, read_manifest, safe_relpath, verify_artifact, write_manifest
from tasks.core.storage.fs import RunStore

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"


def tiny_raw() -> dict:
    return yaml.safe_load(TINY.read_text())


def test_shipped_configs_validate():
    for path in sorted(TINY.parent.glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.cpt.max_steps > 0 and cfg.sft.max_steps > 0


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (lambda r: r["cpt"]["plugin"].update(name="deepspeed"), "cpt.plugin.name", "hybrid_parallel"),
        (
            lambda r: r["sft"]["plugin"].update(name="gemini", zero_stage=0, precision="fp32"),
            "sft.plugin.precision",
            "gemini supports precision bf16, fp16",
        ),
        (lambda r: r["cpt"]["plugin"].update(zero_stage=1, precision="fp32"), "cpt.plugin.precision", "ZeRO"),
        (lambda r: r["sft"]["plugin"].update(tp_size=2), "sft.plugin.tp_size", "hybrid_parallel"),
        (lambda r: r["cpt"]["plugin"].update(pp_size=2), "cpt.plugin.num_microbatches", "micro-batches"),
        (lambda r: r["cpt"].update(launch={"nproc_per_node": 3}), "cpt.launch", "multiple of tp_size"),
        (lambda r: r["cpt"].update(typo_field=1), "cpt.typo_field", "Extra inputs"),
        (lambda r: r["sft"].pop("max_steps"), "sft.max_steps", "required"),
        (lambda r: r.update(name="bad name!"), "name", "pattern"),
    ],
)
def test_config_errors_name_the_field(mutate, field, words):
    raw = tiny_raw()
    mutate(raw)
    with pytest.raises(ConfigError) as info:
        parse_config(raw, source="tiny-cpu.yaml")
    fields = [f for f, _ in info.value.problems]
    assert field in fields, str(info.value)
    assert words in str(info.value)


def test_config_reports_every_problem_at_once():
    raw = tiny_raw()
    raw["cpt"]["plugin"].update(zero_stage=1, precision="fp32")
    raw["sft"]["plugin"].update(name="hybrid_parallel", zero_stage=1, precision="fp32")
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert {"cpt.plugin.precision", "sft.plugin.precision"} <= {f for f, _ in info.value.problems}


def test_config_is_frozen_and_documented():
    cfg = load_config(TINY)
    with pytest.raises(pydantic.ValidationError):
        cfg.name = "x"  # type: ignore[misc]
    from tasks.core.config import schema as mod

    for model in (
        mod.RunConfig,
        mod.PhaseConfig,
        mod.PluginConfig,
        mod.LaunchConfig,
        mod.DataConfig,
        mod.ExportConfig,
        mod.HubConfig,
        mod.BaseModelConfig,
    ):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def _artifact(tmp_path: Path) -> Path:
    d = tmp_path / "art"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(b"x" * 100)
    (d / "sub" / "b.txt").write_text("hello")
    write_manifest(d, kind="test", meta={"k": 1}, config_digest="abc")
    return d


def test_manifest_round_trip_and_corruption(tmp_path):
    d = _artifact(tmp_path)
    m = verify_artifact(d)
    assert set(m["files"]) == {"a.bin", "sub/b.txt"} and m["config_digest"] == "abc"
    data = bytearray((d / "a.bin").read_bytes())
    data[10] ^= 0xFF
    (d / "a.bin").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="a.bin fails its sha256"):
        verify_artifact(d)
    (d / "sub" / "b.txt").write_text("hell")
    with pytest.raises(ManifestError, match="sub/b.txt"):
        verify_artifact(d, deep=False)


def test_directory_without_manifest_does_not_exist(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(ArtifactMissing):
        read_manifest(tmp_path / "x")


@pytest.mark.parametrize("bad", ["../etc/passwd", "/etc/passwd", "a/../../b", "a\\b", "./a", ""])
def test_manifest_paths_must_stay_inside(tmp_path, bad):
    with pytest.raises(ManifestError):
        safe_relpath(bad)
    d = _artifact(tmp_path)
    m = json.loads((d / MANIFEST).read_text())
    m["files"][bad] = {"size": 1, "sha256": "0" * 64}
    (d / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ManifestError):
        verify_artifact(d)


def test_manifest_symlink_out_is_refused(tmp_path):
    d = _artifact(tmp_path)
    (tmp_path / "secret").write_text("s")
    (d / "link").symlink_to(tmp_path / "secret")
    m = json.loads((d / MANIFEST).read_text())
    m["files"]["link"] = {"size": 1, "sha256": "0" * 64}
    (d / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="outside the artifact"):
        verify_artifact(d)


def test_local_store_publish_verifies(tmp_path):
    store = RunStore(str(tmp_path / "run"))
    d = store.local_path("stage")
    d.mkdir(parents=True)
    (d / "w").write_bytes(b"123")
    write_manifest(d, kind="t")
    assert store.publish("stage") == store.manifest_digest("stage")
    store.write_text("run.json", "{}")
    assert json.loads(store.read_text("run.json")) == {}
    assert store.move_aside("stage", "test").startswith("stage.superseded-")
    assert not store.exists("stage")


def test_the_torchrun_agent_reports_a_rank_s_status_as_torchrun_does(tmp_path):
    """tasks/engine/agent.py: torch.distributed.run's main without the interpreter's teardown after it. A
    rank that exits 75 (a preempted one's status) ends the launch 1 with torchrun's report naming it. The
    rank is plain Python: one torch import, the agent's. (Every launch of the suite runs through it.)"""
    import subprocess
    import sys

    rank = tmp_path / "rank.py"
    rank.write_text("import sys\nprint('rank ran', flush=True)\nsys.exit(75)\n")
    argv = torchrun_argv("train", "/j.json", LaunchConfig(nproc_per_node=1), "r", python=sys.executable)
    cmd = argv[: argv.index("-m", 3)] + [str(rank)]
    out = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 1 and "rank ran" in out.stdout, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "exitcode  : 75" in out.stderr and "ChildFailedError" in out.stderr, out.stderr[-2000:]


def test_the_agent_forks_only_an_engine_launch_and_names_a_bad_rank_start():
    from tasks.engine.agent import RANK_START_ENV, engine_args, rank_start

    argv = torchrun_argv("train", "/j.json", LaunchConfig(nproc_per_node=2), "r", python="py")[3:]
    assert engine_args(argv) == ["train", "--config", "/j.json"]
    assert engine_args(["--standalone", "--nproc-per-node", "1", "script.py"]) is None
    assert rank_start({RANK_START_ENV: "exec"}) == "exec" and rank_start({RANK_START_ENV: "fork"}) == "fork"
    with pytest.raises(SystemExit, match=f"{RANK_START_ENV}='spawn'.*fork, exec"):
        rank_start({RANK_START_ENV: "spawn"})


def test_torchrun_argv_single_and_multi_node():
    single = torchrun_argv("train", "/j.json", LaunchConfig(nproc_per_node=2), "r", python="py")
    assert single[:3] == ["py", "-m", "tasks.engine.agent"] and "--standalone" in single
    assert single[-5:] == ["-m", "tasks.engine", "train", "--config", "/j.json"]
    multi = torchrun_argv(
        "train",
        "/j.json",
        LaunchConfig(nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="head:29400"),
        "run-cpt",
        python="py",
    )
    assert "--standalone" not in multi
    for flag, value in [
        ("--nnodes", "2"),
        ("--node-rank", "1"),
        ("--rdzv-backend", "c10d"),
        ("--rdzv-endpoint", "head:29400"),
        ("--rdzv-id", "run-cpt"),
    ]:
        assert multi[multi.index(flag) + 1] == value


def test_a_fault_spec_reaches_only_the_launch_of_its_stage():
    from tasks.core.launch.torchrun import FAULT_ENV, engine_env, phase_fault_env

    task_env = {"PATH": "/bin", FAULT_ENV: "kill@step=5@phase=sft; fail@save=2:model"}
    # Inherited by no launch: boost_and_shard, reboost and train CPT build theirs from the task's environment.
    assert FAULT_ENV not in engine_env(environ=task_env) and engine_env(environ=task_env)["PATH"] == "/bin"
    assert engine_env(phase_fault_env("cpt", task_env), environ=task_env)[FAULT_ENV] == "fail@save=2:model"
    # Train SFT's launch gets both: the spec naming it and the one naming no stage.
    assert (
        engine_env(phase_fault_env("sft", task_env), environ=task_env)[FAULT_ENV]
        == "kill@step=5@phase=sft;fail@save=2:model"
    )
    assert phase_fault_env("cpt", {FAULT_ENV: "kill@phase=sft"}) == {} and phase_fault_env("sft", {}) == {}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_import_boundaries():
    root = Path(__file__).resolve().parents[1] / "tasks"
    for path in sorted((root / "core").glob("*.py")):
        bad = {
            m
            for m in _imports(path)
            if m.split(".")[0] in ("prefect", "colossalai") or m.startswith("torch.distributed")
        }
        assert not bad, (
            f"{path.name} imports {bad}: tasks/core must stay free of prefect, colossalai and torch.distributed"
        )
    for path in sorted((root / "engine").glob("*.py")):
        bad = {m for m in _imports(path) if m.split(".")[0] == "prefect"}
        assert not bad, f"{path.name} imports {bad}: the engine runs inside torchrun ranks and never imports prefect"


def test_lease_one_writer_per_run_root(tmp_path):
    import time as _time

    from tasks.core.storage.lease import LEASE, Lease, LeaseHeld, break_lease

    store = RunStore(str(tmp_path / "run"))
    first = Lease(store, holder="flow run alpha (1234)", heartbeat_s=0.05).acquire()
    with pytest.raises(LeaseHeld, match=r"flow run alpha \(1234\)") as info:
        Lease(store, holder="flow run beta").acquire()
    assert "--break-lease" in str(info.value)
    _time.sleep(0.2)  # the heartbeat keeps it fresh
    assert json.loads(store.read_text(LEASE))["heartbeat_at"] > first.record["acquired_at"]
    first.release()
    assert not store.exists(LEASE)
    second = Lease(store, holder="flow run beta").acquire()  # free again
    # A dead run's lease (no heartbeat past its TTL) is taken over, with a log line saying so.
    second._stop.set()
    stale = json.loads(store.read_text(LEASE))
    stale["heartbeat_at"] -= 3600
    store.write_text(LEASE, json.dumps(stale))
    said = []
    third = Lease(store, holder="flow run gamma").acquire(log=said.append)
    assert said and "breaking stale lease of flow run beta" in said[0]
    assert break_lease(store)["holder"] == "flow run gamma" and not store.exists(LEASE)
    third._stop.set()
