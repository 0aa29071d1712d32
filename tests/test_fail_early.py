"""Bad inputs are refused before any launch, and failures carry their cause.

    .venv/bin/python -m pytest -q tests/test_fail_early.py            # unit tier
    .venv/bin/python -m pytest -q -m "" tests/test_fail_early.py      # + load stage, flow, torchrun

One table per kind of bad input. Every refusal is checked for the field or file it names and for
the absence of a traceback; every unit case runs with process launches replaced by functions that
fail the test (`no_launch`, shared with tests/test_preflight.py).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import flows.cpt_to_sft  # noqa: F401 - Prefect sets up its console logging on import: not under a test's capsys
from tasks.core.config.load import load_config, read_raw_config
from tasks.core.errors import ConfigError, ManifestError, StageFailed
from tasks.core.launch.torchrun import run_engine as _REAL_RUN_ENGINE
from tasks.core.run.events import ERROR, INFO, WARNING, parse_line
from tests.conftest import tiny_config_raw, write_config
from tests.test_preflight import CPU2, Case, make_manifest, no_launch  # noqa: F401 - no_launch is an autouse fixture

_REAL_POPEN = subprocess.Popen  # before `no_launch` replaces it: the tests that must launch put it back
TINY_YAML = (Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml").read_text()


def _no_traceback(text: str) -> None:
    assert "Traceback" not in text, text


# -- 1. a key written twice ----------------------------------------------------------------------


def _twice(after: str, line: str) -> str:
    """tiny-cpu.yaml with `line` inserted right after the first line starting with `after`."""
    out, done = [], False
    for old in TINY_YAML.splitlines():
        out.append(old)
        if not done and old.startswith(after):
            out.append(line)
            done = True
    assert done, after
    return "\n".join(out) + "\n"


def _line_of(text: str, start: str, nth: int = 1) -> int:
    hits = [i + 1 for i, line in enumerate(text.splitlines()) if line.startswith(start)]
    return hits[nth - 1]


DUPLICATES = [
    # (where the copy goes, the copied line, the key path, the key's line prefix)
    ("  max_steps: 30", "  max_steps: 300", "cpt.max_steps", "  max_steps:"),
    ("name: tiny-demo", "name: other", "name", "name:"),
    ("  lr: 3.0e-3", "  seed: 99", "cpt.seed", "  seed:"),
]


@pytest.mark.parametrize("after, line, key, prefix", DUPLICATES, ids=[d[2] for d in DUPLICATES])
def test_duplicated_yaml_key_is_refused_naming_both_lines(tmp_path, capsys, after, line, key, prefix):
    from tasks.flowkit.preflight import run_check_cli

    text = _twice(after, line)
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    first = _line_of(text, prefix) if key != "cpt.seed" else _line_of(text, "  seed:")
    second = _line_of(text, prefix, 2)
    for load in (read_raw_config, load_config):  # what the flow reads
        with pytest.raises(ConfigError) as info:
            load(path)
        assert [f for f, _ in info.value.problems] == [key]
        assert f"line {first} and line {second}" in str(info.value) and str(path) in str(info.value)
    # --check: the report, exit 1, nothing launched, no traceback.
    assert run_check_cli(str(path)) == 1
    out = capsys.readouterr()
    assert key in out.out and f"line {first} and line {second}" in out.out and "nothing was launched" in out.out
    _no_traceback(out.out + out.err)


def test_duplicated_key_in_a_job_file_is_refused(tmp_path):
    from tasks.core.run.job import load_job

    path = tmp_path / "job.json"
    path.write_text('{"verb": "train", "phase": "cpt", "verb": "shard"}')
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert [f for f, _ in info.value.problems] == ["verb"] and str(path) in str(info.value)


def test_yaml_merge_keys_and_lists_are_not_duplicates(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("base: &b {x: 1}\nother:\n  <<: *b\n  y: 2\nlist:\n  - {a: 1}\n  - {a: 2}\n")
    assert read_raw_config(path) == {"base": {"x": 1}, "other": {"x": 1, "y": 2}, "list": [{"a": 1}, {"a": 2}]}


# -- 2. precision and device ---------------------------------------------------------------------

FP16_PLUGINS = [
    ("hybrid_parallel", {"zero_stage": 0}),
    ("low_level_zero", {"zero_stage": 2}),
    ("torch_ddp", {}),
    ("gemini", {}),
]


@pytest.mark.parametrize("plugin, extra", FP16_PLUGINS, ids=[p for p, _ in FP16_PLUGINS])
def test_fp16_needs_cuda_on_every_plugin(tmp_path, plugin, extra):
    from tasks.core.config.layout import layout_problems

    case = Case(tmp_path)
    case.raw["sft"]["plugin"] = {"name": plugin, "precision": "fp16", **extra}
    report = case.report()  # pre-flight on a 2-core machine without CUDA
    fields = {f: m for f, m in report.problems}
    assert "sft.plugin.precision" in fields, report.text()
    assert "needs CUDA" in fields["sft.plugin.precision"] and "bf16" in fields["sft.plugin.precision"]
    # On a CUDA machine the same stage passes the device rules (the loss is scaled dynamically).
    stage = load_config(write_config(tmp_path / "c.yaml", case.raw)).sft
    assert layout_problems(stage, "sft", cuda=True, tiers=("static", "device")) == []


def test_fp16_without_dynamic_loss_scaling_is_refused(monkeypatch):
    from tasks.core.config.layout import layout_problems
    from tasks.core.config.plugins import PLUGINS, PluginSpec
    from tasks.core.config.schema import PhaseConfig, PluginConfig

    monkeypatch.setitem(
        PLUGINS, "unscaled", PluginSpec(name="unscaled", summary="fp16 without a loss scaler", loss_scale="none")
    )
    phase_cfg = PhaseConfig.model_construct(plugin=PluginConfig(name="unscaled", precision="fp16"))
    problems = layout_problems(phase_cfg, "cpt", cuda=True)
    assert [f for f, _ in problems] == ["cpt.plugin.precision"] and "dynamic loss scaling" in problems[0][1]
    assert (
        layout_problems(
            PhaseConfig.model_construct(plugin=PluginConfig(name="unscaled", precision="bf16")), "cpt", cuda=True
        )
        == []
    )


def test_every_fp16_plugin_is_built_with_the_dynamic_loss_scale(tmp_path):
    """The real builders hand LOSS_SCALE to ColossalAI (its DynamicGradScaler, torch.cuda.amp's
    GradScaler for torch_ddp). One gloo rank is enough to construct the plugins."""
    import dataclasses

    import torch.distributed as dist

    from tasks.core.config.layout import ParallelLayout
    from tasks.core.config.plugins import LOSS_SCALE, PLUGINS
    from tasks.core.config.schema import PhaseConfig, PluginConfig
    from tasks.engine.builders import booster_mixed_precision, build_plugin, loss_scale_kwargs

    assert all(spec.loss_scale == "dynamic" for spec in PLUGINS.values())
    want = dataclasses.asdict(LOSS_SCALE)
    assert loss_scale_kwargs(PluginConfig(name="low_level_zero", zero_stage=2, precision="bf16")) == {}
    amp = booster_mixed_precision(PluginConfig(name="torch_ddp", precision="fp16"))
    assert amp.torch_amp_kwargs == {
        "init_scale": LOSS_SCALE.initial_scale,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 1000,
    }
    assert booster_mixed_precision(PluginConfig(name="torch_ddp", precision="bf16")) is None
    where = {"hybrid_parallel": "amp_config", "low_level_zero": "zero_optim_kwargs", "gemini": "optim_kwargs"}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        for name, attr in where.items():
            p = PluginConfig(name=name, precision="fp16", zero_stage=2 if name == "low_level_zero" else 0)
            phase_cfg = PhaseConfig.model_construct(plugin=p, grad_accum_steps=1)
            layout = ParallelLayout(name, 1, 1, 1, 1, PLUGINS[name].zero_stage(p.zero_stage), "fp16", 1)
            built = build_plugin(p, phase_cfg, layout, True)
            got = getattr(built, attr)
            assert {k: got[k] for k in want} == want, (name, got)
    finally:
        dist.destroy_process_group()


# -- 4. manifest entries that are not paths ------------------------------------------------------

BAD_NAMES = ["model\x00.safetensors", "config\n.json", "a\x1b[31m.bin", "x\x7f"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=["nul", "newline", "escape", "del"])
def test_control_characters_in_a_manifest_are_refused(tmp_path, capsys, name):
    from tasks.core.run.manifest import MANIFEST, verify_artifact
    from tasks.flowkit.preflight import run_check_cli

    case = Case(tmp_path)
    art = make_manifest(case.run_root, "base", {name: {"size": 1, "sha256": "0" * 64}})
    with pytest.raises(ManifestError) as info:
        verify_artifact(art)
    msg = str(info.value)
    assert str(art) in msg and repr(name) in msg and "not a valid path" in msg and "delete the artifact" in msg
    report = case.report()
    fields = {f: m for f, m in report.problems}
    where = f"{case.run_root}/base/{MANIFEST}"
    assert where in fields and repr(name) in fields[where] and "move it aside or delete" in fields[where], report.text()
    assert run_check_cli(str(write_config(tmp_path / "c.yaml", case.raw))) == 1
    out = capsys.readouterr()
    assert where in out.out and "embedded null byte" not in out.out
    _no_traceback(out.out + out.err)


# -- 5. levels said by the writer, the cause carried ---------------------------------------------

LINES = [
    ("[rank 0] loss went up; Error budget fine", "rank 0", INFO),  # a word is not a level
    ("[rank 1|error] engine train failed: ConfigError", "rank 1", ERROR),
    ("[rank 1|warning] UserWarning: something deprecated", "rank 1", WARNING),
    ('[rank 0] @@progress {"step": 1}', "rank 0", INFO),
    (
        (
            "E1130 11:02:03.456000 4242 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -9) "
            "local_rank: 1"
        ),
        "torchrun",
        ERROR,
    ),
    (
        (
            "W1130 11:02:03.400000 4242 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 12 closing "
            "signal SIGTERM"
        ),
        "torchrun",
        WARNING,
    ),
    ("Traceback (most recent call last):", "torchrun", INFO),
]


@pytest.mark.parametrize("raw, who, level", LINES)
def test_levels_come_from_the_writer_not_from_words(raw, who, level):
    line = parse_line(raw)
    assert (line.who, line.level) == (who, level)


def test_rank_output_marks_its_levels():
    import io

    from tasks.engine import rankio

    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr, sys.__stderr__, dict(rankio._SAY)
    try:
        sys.stdout, sys.stderr, sys.__stderr__ = out, err, err
        rankio._SAY.clear()
        rankio.install(3)
        print("plain")
        sys.stderr.write("a library warning\n")
        rankio.say("engine train failed: boom\nsecond line", ERROR)
    finally:
        for s in rankio._SAY.values():
            s.close_partial()
        sys.stdout, sys.stderr, sys.__stderr__ = saved[:3]
        rankio._SAY.clear()
        rankio._SAY.update(saved[3])
    parsed = [parse_line(x) for x in (out.getvalue() + err.getvalue()).splitlines()]
    assert [(p.body, p.level) for p in parsed] == [
        ("plain", INFO),
        ("a library warning", WARNING),
        ("engine train failed: boom", ERROR),
        ("second line", ERROR),
    ]


def test_failure_cause_is_one_line_from_the_exception():
    from flows.cpt_to_sft import failure_cause

    exc = StageFailed(
        "engine verb 'train' failed on rank 1: x\nengine verb 'train' exited with status 1; last lines per "
        "process:\n--- rank 1 ---",
        cause="rank 1: engine train failed: boom",
    )
    assert failure_cause(exc) == "StageFailed: rank 1: engine train failed: boom"
    assert (
        failure_cause(ConfigError([("base_model.uri", "bad"), ("cpt.lr", "worse")]))
        == "ConfigError: base_model.uri: bad; cpt.lr: worse"
    )
    assert failure_cause(SystemExit(1)).startswith("SystemExit: something in the stage's process called sys.exit(1)")
    import pickle

    assert pickle.loads(pickle.dumps(exc)).cause == exc.cause


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.distributed
def test_a_failing_rank_gives_the_stage_its_cause(tmp_path, tiny_model_dir, monkeypatch):
    """Real torchrun, 2 ranks: the job names a model directory without config.json, so every rank
    refuses before any process group exists; StageFailed's first line is the first error line."""
    from support.engine import phase_raw, write_job
    from tasks.core.config.schema import LaunchConfig
    from tasks.core.run.job import parse_job

    monkeypatch.setattr(subprocess, "Popen", _REAL_POPEN)  # this test launches
    empty = tmp_path / "no-model"
    empty.mkdir()
    section = phase_raw("cpt", {"name": "torch_ddp", "precision": "fp32"})
    job_path = write_job(
        tmp_path / "job.json",
        verb="train",
        phase="cpt",
        phase_cfg=section,
        model_dir=empty,
        stage_dir=tmp_path / "cpt",
        tokenizer_dir=tiny_model_dir,
    )
    job = parse_job(json.loads(job_path.read_text()))
    logger = logging.getLogger("i16-launch")
    handler = _Records()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with pytest.raises(StageFailed) as info:
            _REAL_RUN_ENGINE("train", job, job_path, LaunchConfig(nproc_per_node=2), "i16", logger)
    finally:
        logger.removeHandler(handler)
    exc = info.value
    assert (
        exc.cause.startswith(("rank 0: ", "rank 1: "))
        and "engine train failed: job " in exc.cause
        and "cannot start: model_dir: " in exc.cause
        and "no config.json" in exc.cause
    )
    assert str(exc).splitlines()[0] == f"engine verb 'train' failed on {exc.cause}"
    assert "exited with status 1; last lines per process:" in str(exc)
    errors = [r for r in handler.records if r.levelno == logging.ERROR]
    assert errors and all(r.getMessage().startswith(("[rank 0]", "[rank 1]", "[torchrun]")) for r in errors)
    assert any("no config.json" in r.getMessage() for r in errors)


# -- 6. a dead holder on this host ---------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(proc.stdout)


def _holder(host: str, pid_of: str) -> dict:
    pid = {"dead": _dead_pid, "live": os.getpid}[pid_of]()
    return {
        "holder": f"flow run old ({pid_of})",
        "token": "t" * 32,
        "host": host,
        "pid": pid,
        "acquired_at": time.time() - 30,
        "heartbeat_at": time.time(),
        "ttl_s": 600.0,
    }


LEASES = [
    # (holder's host, its pid, taken over at once?)
    ("this", "dead", True),
    ("this", "live", False),
    ("other", "dead", False),  # another host's pid means nothing here: the heartbeat rule holds
]


@pytest.mark.parametrize("host, pid_of, taken", LEASES, ids=[f"{h}-host-{p}-pid" for h, p, _ in LEASES])
def test_a_dead_local_holder_is_taken_over_at_once(tmp_path, monkeypatch, host, pid_of, taken):
    from tasks.core.storage.fs import RunStore
    from tasks.core.storage.lease import LEASE, Lease, LeaseHeld

    monkeypatch.setattr(subprocess, "Popen", _REAL_POPEN)  # to make a pid that has exited
    store = RunStore(str(tmp_path / "run"))
    old = _holder(socket.gethostname() if host == "this" else "some-other-host.example", pid_of)
    store.write_text(LEASE, json.dumps(old))
    said: list[str] = []
    started = time.monotonic()
    if taken:
        lease = Lease(store, holder="flow run new").acquire(log=said.append)
        try:
            assert time.monotonic() - started < 5  # at once, not after the TTL
            assert json.loads(store.read_text(LEASE))["holder"] == "flow run new"
            assert (
                len(said) == 1
                and "flow run old (dead)" in said[0]
                and f"pid {old['pid']}" in said[0]
                and "no longer exists" in said[0]
            )
        finally:
            lease.release()
    else:
        with pytest.raises(LeaseHeld, match=r"flow run old") as info:
            Lease(store, holder="flow run new").acquire(log=said.append)
        assert said == [] and "--break-lease" in str(info.value)
        assert json.loads(store.read_text(LEASE))["token"] == old["token"]


# -- 3. pickle weights, converted once in the load stage -----------------------------------------


def _pickle_model(src: Path, dest: Path, shards: int = 1, tied: bool = False) -> tuple[Path, dict]:
    """The tiny model (or a tied copy) with its weights as pytorch_model.bin (or N shards + index)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    dest.mkdir(parents=True)
    for f in src.iterdir():
        if (
            f.is_file()
            and not f.name.endswith((".safetensors", ".safetensors.index.json"))
            and f.name != "manifest.json"
        ):
            shutil.copy2(f, dest / f.name)
    model = AutoModelForCausalLM.from_pretrained(src, tie_word_embeddings=tied)
    if tied:
        model.tie_weights()
        config = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
        model.save_pretrained(dest.parent / "hf-reference")  # what HF itself writes for a tied model
    state = model.state_dict()
    if shards == 1:
        torch.save(state, dest / "pytorch_model.bin")
    else:
        keys = sorted(state)
        weight_map = {}
        for i in range(shards):
            name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
            part = {k: state[k] for k in keys[i::shards]}
            torch.save(part, dest / name)
            weight_map.update({k: name for k in part})
        (dest / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dest, {k: v.detach().clone() for k, v in state.items()}


class _RunsCode:
    """A pickle whose unpickling would create a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _load(tmp_path: Path, model: Path, allow_pickle: bool = True):
    from tasks.stages.load import load_from_hf

    raw = tiny_config_raw(model, tmp_path / "run")
    raw["base_model"]["allow_pickle"] = allow_pickle
    cfg = load_config(write_config(tmp_path / "c.yaml", raw))
    return cfg, load_from_hf(cfg, return_state=True)


PICKLES = [
    ("single", 1, False),
    ("sharded", 3, False),
    ("tied", 1, True),
]


@pytest.mark.integration
@pytest.mark.parametrize("name, shards, tied", PICKLES, ids=[p[0] for p in PICKLES])
def test_pickle_weights_are_converted_once_in_the_load_stage(
    prefect_harness, tiny_model_dir, tmp_path, name, shards, tied
):
    from tasks.core.models.convert import load_state_dict_from_dir
    from tasks.core.preflight.checks import load_for_check, preflight_report
    from tasks.core.run.manifest import verify_artifact

    model, original = _pickle_model(tiny_model_dir, tmp_path / "model", shards=shards, tied=tied)
    raw = tiny_config_raw(model, tmp_path / "run")
    raw["base_model"]["allow_pickle"] = True
    report = preflight_report(load_for_check(write_config(tmp_path / "p.yaml", raw)), machine=CPU2)
    assert any("converts them once to safetensors with torch.load(weights_only=True)" in w for w in report.warnings), (
        report.text()
    )
    cfg, state = _load(tmp_path, model)
    assert state.is_completed(), state.message
    base = tmp_path / "run" / "base"
    manifest = verify_artifact(base)
    names = sorted(manifest["files"])
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))], names
    conv = manifest["meta"]["converted_from_pickle"]
    assert conv["loader"] == "torch.load(weights_only=True)" and conv["source_layout"] == "pickle"
    assert sorted(conv["files"]) == sorted(p.name for p in model.iterdir() if p.name.startswith("pytorch_model"))
    assert manifest["fingerprint"] is not None and manifest["meta"]["weights"] == [
        n for n in names if n.endswith(".safetensors") and n != "fingerprint.safetensors"
    ]
    converted = load_state_dict_from_dir(base)
    if tied:  # stored once, as save_pretrained does
        assert (
            set(converted) == set(load_state_dict_from_dir(model.parent / "hf-reference"))
            and "lm_head.weight" not in converted
        )
    else:
        assert set(converted) == set(original)
    for key, tensor in converted.items():
        assert tensor.dtype == original[key].dtype and bool((tensor == original[key]).all()), key
    # What the shard stage checks before it starts: safetensors only, and now there are some.
    from support.engine import write_job
    from tasks.engine.preconditions import check_inputs, parse_job

    run = cfg.model_dump(mode="json")
    run["cpt"]["data"]["uri"] = str(Path(__file__).resolve().parents[1] / run["cpt"]["data"]["uri"])
    job = parse_job(
        json.loads(
            write_job(
                tmp_path / "job.json",
                verb="shard",
                phase="cpt",
                phase_cfg=run["cpt"],
                model_dir=base,
                stage_dir=tmp_path / "cpt",
            ).read_text()
        )
    )
    check_inputs(job)


@pytest.mark.integration
def test_a_pickle_that_would_run_code_is_refused(prefect_harness, tiny_model_dir, tmp_path):
    import torch

    model, _ = _pickle_model(tiny_model_dir, tmp_path / "model")
    marker = tmp_path / "pwned"
    # as many bytes as the model's parameters, so the size bound passes and the unpickler meets the payload
    pad = torch.zeros(300_000)
    torch.save({"model.embed_tokens.weight": _RunsCode(marker), "pad": pad}, model / "pytorch_model.bin")
    _, state = _load(tmp_path, model)
    assert state.is_failed()
    with pytest.raises(ConfigError) as info:
        state.result()
    msg = str(info.value)
    assert (
        [f for f, _ in info.value.problems] == ["base_model.uri"]
        and "pytorch_model.bin" in msg
        and "weights_only" in msg
    )
    assert not marker.exists()
    assert not (tmp_path / "run" / "base" / "manifest.json").exists()
    assert not list((tmp_path / "run").glob("base*.pickle"))  # the moved pickles are gone too


# -- 5. the flow refuses at pre-flight: the report, exit 1, no traceback --------------------------


@pytest.mark.integration
def test_the_flow_refuses_at_preflight_with_the_report_and_no_traceback(
    prefect_harness, tiny_model_dir, tmp_path, capfd
):
    from flows.cli import flow_main as main
    from flows.cpt_to_sft import cpt_to_sft
    from tasks.flowkit.preflight import REFUSED

    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["sft"]["plugin"] = {"name": "low_level_zero", "zero_stage": 2, "precision": "fp16"}
    cfg = write_config(tmp_path / "fp16.yaml", raw)
    assert main(["--config", str(cfg)]) == 1
    out = capfd.readouterr()
    lines = [x for x in out.err.splitlines() if x.strip()]
    assert lines[-1] == REFUSED and any("sft.plugin.precision" in x and "needs CUDA" in x for x in lines)
    _no_traceback(out.out + out.err)
    assert not (tmp_path / "run" / "base").exists()  # nothing ran
    state = cpt_to_sft(config=str(cfg), return_state=True)
    assert state.is_failed() and state.name == "Refused" and "sft.plugin.precision" in state.message
    # A duplicated key is refused the same way by the flow.
    dup = tmp_path / "dup.yaml"
    dup.write_text(_twice("  max_steps: 30", "  max_steps: 300"))
    assert main(["--config", str(dup)]) == 1
    out = capfd.readouterr()
    assert "cpt.max_steps" in out.err and REFUSED in out.err.splitlines()[-1]
    _no_traceback(out.out + out.err)
