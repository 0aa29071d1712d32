"""What re-runs when a setting changes: the stage digests declared in tasks/core/run/stages.py.

    .venv/bin/python -m pytest -q tests/test_digests.py            # the digest function over real configs
    .venv/bin/python -m pytest -q -m "" tests/test_digests.py      # and two re-runs of a finished demo run

The unit part models a re-run: a stage runs again when its own digest changes (its parents the
same) or a parent runs again (the rebuilt parent records a new config digest, which is part of
its content digest). The integration part checks that model against a finished demo run (each
recorded digest is what the function computes from the parents on disk) and runs the flow twice
over a copy of it: once with only settings that change no artifact (every stage skips), once with
a rebuilt CPT checkpoint manifest (same files, new timestamp) and another export dtype (exactly
export and evaluate_sft run again).
"""

from __future__ import annotations

import copy
import json
import time

import pytest

from tasks.core.config.schema import RunConfig
from tasks.core.run.digest import config_digest, content_digest, declared, digest_fields
from tasks.core.run.manifest import MANIFEST, read_manifest, write_manifest
from tasks.core.run.stages import NEVER_DIGESTED, STAGE, run_stages
from tasks.core.run.stages import STAGES as TABLE
from tests.conftest import tiny_config_raw

# The rows of a run without the optional dpo phase, the configs here (the phase's rows: tests/test_dpo_stages.py).
STAGES = run_stages(("cpt", "sft"))

ARTIFACT_STAGES = tuple(s.name for s in STAGES if s.artifact is not None)
CPT_AND_BELOW = {
    "boost_and_shard",
    "train_cpt",
    "unshard",
    "evaluate_cpt",
    "reboost",
    "train_sft",
    "export",
    "evaluate_sft",
    "benchmark",
}
SFT_AND_BELOW = {"reboost", "train_sft", "export", "evaluate_sft", "benchmark"}
EXPORT_AND_BELOW = {"export", "evaluate_sft", "benchmark"}

# Settings that change how a stage runs, never the bytes it writes: nothing runs again.
NOTHING_RERUNS = {
    "cpt.data.tokenize.workers": lambda raw: raw["cpt"]["data"].update(tokenize={"workers": 1}),
    "sft.data.tokenize.chunk_mb": lambda raw: raw["sft"]["data"].update(
        tokenize={"chunk_mb": 0.5}
    ),  # merged chunks: the same shard bytes
    "sft.data.tokenize.local_cluster": lambda raw: raw["sft"]["data"].update(
        tokenize={"local_cluster": {"n_workers": 3}}
    ),
    "cpt.data.tokenize.dask_address": lambda raw: raw["cpt"]["data"].update(
        tokenize={"dask_address": "tcp://scheduler:8786"}
    ),
    "cpt.max_pending_publishes": lambda raw: raw["cpt"].update(max_pending_publishes=7),
    "verify_memory_gb": lambda raw: raw.update(verify_memory_gb=0.001),  # streamed logits checks: bitwise the same
    "cpt.data.max_source_epochs": lambda raw: raw["cpt"]["data"].update(max_source_epochs=3),  # a warning's threshold
    "sft.max_pending_publishes": lambda raw: raw["sft"].update(max_pending_publishes=7),
    # recomputation: bitwise the same losses and weights (tests/test_activation_checkpointing.py)
    "cpt.activation_checkpointing": lambda raw: raw["cpt"].update(activation_checkpointing=True),
    "sft.log_every": lambda raw: raw["sft"].update(log_every=3),  # what the console prints
    "tracking": lambda raw: raw.update(
        tracking={"mlflow": {"uri": "http://127.0.0.1:5000", "experiment": "elsewhere"}}
    ),
    "hub": lambda raw: raw.update(hub={"repo_id": "someone/tiny", "private": False, "tags": ["x"]}),
    "gate thresholds": lambda raw: raw["gate"].update(cpt_max_ppl_increase_pct=5.0, sft_loss_must_improve=False),
}
# Settings an artifact is made from: that stage and everything made from it run again.
RERUNS = {
    "cpt.lr": (lambda raw: raw["cpt"].update(lr=1e-3), CPT_AND_BELOW),
    "cpt.seed": (lambda raw: raw["cpt"].update(seed=7), CPT_AND_BELOW),
    "sft.seed": (lambda raw: raw["sft"].update(seed=7), SFT_AND_BELOW),
    "sft.lora": (
        lambda raw: raw["sft"].update(lora={"r": 16, "alpha": 32}),
        SFT_AND_BELOW,
    ),  # an adapter on a frozen base: other weights
    "export.dtype": (lambda raw: raw["export"].update(dtype="fp32"), EXPORT_AND_BELOW),
    "cpt.eval.batch_size": (lambda raw: raw["cpt"].update(eval={"batch_size": 3}), {"evaluate_cpt"}),
    "sft.eval.dtype": (
        lambda raw: raw["sft"].update(eval={**raw["sft"].get("eval", {}), "dtype": "bf16"}),
        {"evaluate_sft"},
    ),
    "gate.num_prompts": (lambda raw: raw["gate"].update(num_prompts=2), {"evaluate_sft"}),
    "benchmark.num_fewshot": (
        lambda raw: raw.update(benchmark={**raw.get("benchmark", {}), "num_fewshot": 3}),
        {"benchmark"},
    ),
    "cpt.data.text_field": (lambda raw: raw["cpt"]["data"].update(text_field="body"), {"prepare_cpt"} | CPT_AND_BELOW),
    # held-out-only sources live in data/cpt/ beside the held-out split, so CPT re-runs: decide them before the run (README)
    "cpt.eval.heldout_sources": (
        lambda raw: raw["cpt"].update(eval={"heldout_sources": [{"name": "general", "uri": "g.jsonl"}]}),
        {"prepare_cpt"} | CPT_AND_BELOW,
    ),
}

# How a training stage runs: a change keeps every digest while the global batch stays, so the stage
# continues its checkpoints under the new layout (docs/resume.md).
LAYOUT_KEEPS = {
    "cpt tp=2 on 2 ranks -> torch_ddp on 1 rank": lambda raw: raw["cpt"].update(
        plugin={"name": "torch_ddp", "precision": "fp32"}, launch={"nproc_per_node": 1}
    ),
    "cpt tp=2 -> pp=2": lambda raw: raw["cpt"]["plugin"].update(tp_size=1, pp_size=2),
    "sft low_level_zero on 2 ranks -> 1 rank at twice the accumulation": lambda raw: raw["sft"].update(
        launch={"nproc_per_node": 1}, grad_accum_steps=2
    ),
    "sft micro-batch 4 x 1 -> 2 x 2": lambda raw: raw["sft"].update(micro_batch_size=2, grad_accum_steps=2),
    "sft low_level_zero -> hybrid_parallel ZeRO-1": lambda raw: raw["sft"]["plugin"].update(
        name="hybrid_parallel", zero_stage=1
    ),
    "sft.kernels": lambda raw: raw["sft"].update(kernels={"flash_attention": False}),
    "cpt.launch.nnodes": lambda raw: raw["cpt"].update(launch={"nproc_per_node": 1, "nnodes": 2}),
}
# ... and a layout that changes the global batch changes what the model learns from.
GLOBAL_BATCH_CHANGES = {
    "cpt on 2 ranks -> torch_ddp on 2 ranks (dp 1 -> 2)": (
        lambda raw: raw["cpt"].update(plugin={"name": "torch_ddp", "precision": "fp32"}),
        CPT_AND_BELOW,
    ),
    "sft on 2 ranks -> 1 rank": (lambda raw: raw["sft"].update(launch={"nproc_per_node": 1}), SFT_AND_BELOW),
    "sft.plugin.precision": (
        lambda raw: raw["sft"]["plugin"].update(precision="fp32", name="torch_ddp", zero_stage=0),
        SFT_AND_BELOW,
    ),
}


def _config(raw: dict) -> RunConfig:
    return RunConfig.model_validate(raw)


def _raw(tmp_path) -> dict:
    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    raw.setdefault("gate", {})
    return raw


def _changed(raw: dict, change) -> dict:
    out = copy.deepcopy(raw)
    change(out)
    return out


def rerun_set(old: RunConfig, new: RunConfig, contents: dict[str, str] | None = None) -> set[str]:
    """The stages a re-run with `new` over a finished run made with `old` builds again.

    `contents`: each artifact's content digest in that run (any stand-ins will do: a parent that is
    not rebuilt keeps its content). Run-time inputs (prepare's input files) are the same files."""
    contents = contents or {name: f"content of {name}" for name in ARTIFACT_STAGES}
    rerun: set[str] = set()
    for spec in STAGES:
        if spec.artifact is None:
            continue
        if spec.continues:
            if spec.continues in rerun:
                rerun.add(spec.name)
            continue
        parents = {p: contents[p] for p in spec.parents}
        if any(p in rerun for p in spec.parents) or config_digest(old, spec.name, parents) != config_digest(
            new, spec.name, parents
        ):
            rerun.add(spec.name)
    return rerun


def below(stage: str) -> set[str]:
    """`stage` and every stage made from it, by the declared parents."""
    out = {stage}
    for spec in STAGES:
        if (set(spec.parents) | {spec.continues}) & out:
            out.add(spec.name)
    return out


# ------------------------------------------------------------------------------------------------
# The digest function over real configs (fast tier)


def _paths(value, prefix: str) -> set[str]:
    """Every dotted config path inside a digest field's value."""
    out = {prefix}
    if isinstance(value, dict):
        for k, v in value.items():
            out |= _paths(v, f"{prefix}.{k}")
    return out


def test_every_artifact_stage_declares_a_digest_over_real_config_fields(tmp_path):
    cfg = _config(_raw(tmp_path))
    assert set(declared()) == {s.name for s in TABLE if s.artifact is not None}
    for name in ARTIFACT_STAGES:
        spec = STAGE[name]
        if spec.continues:  # training carries its start checkpoint's digest
            assert STAGE[spec.continues].artifact == spec.artifact and not spec.digest and not spec.parents
            continue
        fields = digest_fields(cfg, name)  # every declared path resolves, or this raises naming it
        assert set(fields) == set(spec.digest) | ({f"{spec.global_batch}.global_batch"} if spec.global_batch else set())
        fields = {k: v for k, v in fields.items() if not k.endswith(".global_batch")}
        assert all(STAGES.index(STAGE[p]) < STAGES.index(spec) for p in spec.parents), f"{name}: a parent runs after it"
        for path in spec.minus:
            assert any(path.startswith(f + ".") for f in spec.digest), (
                f"{name}: minus {path} is under none of its fields"
            )
        # The settings that change no artifact are in no stage's digest, however it is declared.
        inside = set().union(*(_paths(v, k) for k, v in fields.items())) if fields else set()
        assert not {p for p in inside for never in NEVER_DIGESTED if p == never or p.startswith(never + ".")}, name
        assert not inside & set(spec.minus), name


def test_a_never_digested_field_cannot_be_declared(tmp_path, monkeypatch):
    from dataclasses import replace

    bad = replace(STAGE["prepare_cpt"], digest=("cpt.data.tokenize.workers",))
    monkeypatch.setitem(STAGE, "prepare_cpt", bad)
    with pytest.raises(ValueError, match="NEVER_DIGESTED"):
        digest_fields(_config(_raw(tmp_path)), "prepare_cpt")


def test_the_digest_names_the_declared_parents(tmp_path):
    cfg = _config(_raw(tmp_path))
    with pytest.raises(ValueError, match="its StageSpec declares"):
        config_digest(cfg, "unshard", {"boost_and_shard": "x"})
    with pytest.raises(ValueError, match="carries the digest"):
        config_digest(cfg, "train_cpt", {})
    assert config_digest(cfg, "unshard", {"train_cpt": "a"}) != config_digest(cfg, "unshard", {"train_cpt": "b"})


@pytest.mark.parametrize("setting", sorted(NOTHING_RERUNS))
def test_a_setting_that_changes_no_artifact_reruns_nothing(tmp_path, setting):
    raw = _raw(tmp_path)
    assert rerun_set(_config(raw), _config(_changed(raw, NOTHING_RERUNS[setting]))) == set()


@pytest.mark.parametrize("setting", sorted(LAYOUT_KEEPS))
def test_a_new_layout_keeping_the_global_batch_reruns_nothing(tmp_path, setting):
    raw = _raw(tmp_path)
    new = _config(_changed(raw, LAYOUT_KEEPS[setting]))  # a valid config: the layout rules pass it
    assert rerun_set(_config(raw), new) == set()


@pytest.mark.parametrize("setting", sorted(GLOBAL_BATCH_CHANGES))
def test_a_layout_that_changes_the_global_batch_reruns_its_stage(tmp_path, setting):
    change, expected = GLOBAL_BATCH_CHANGES[setting]
    raw = _raw(tmp_path)
    assert rerun_set(_config(raw), _config(_changed(raw, change))) == expected


@pytest.mark.parametrize("setting", sorted(RERUNS))
def test_a_setting_reruns_its_stage_and_everything_below(tmp_path, setting):
    change, expected = RERUNS[setting]
    raw = _raw(tmp_path)
    got = rerun_set(_config(raw), _config(_changed(raw, change)))
    assert got == expected
    assert got == below(next(s.name for s in STAGES if s.name in expected))  # the declared parents agree


def test_content_digest_is_the_files_and_config_digest_not_the_manifest_bytes(tmp_path):
    art = tmp_path / "art"
    (art / "sub").mkdir(parents=True)
    (art / "a.bin").write_bytes(b"weights")
    (art / "sub" / "b.json").write_text("{}")
    first = write_manifest(
        art, kind="hf-model", meta={"seconds": 1.5}, parent={"uri": "x", "digest": "old"}, config_digest="c1"
    )
    blob = (art / MANIFEST).read_bytes()
    time.sleep(1.1)  # created_at has a one-second resolution
    (art / MANIFEST).unlink()
    again = write_manifest(
        art, kind="hf-model", meta={"seconds": 9.0}, parent={"uri": "x", "digest": "new"}, config_digest="c1"
    )
    assert (art / MANIFEST).read_bytes() != blob and again["created_at"] != first["created_at"]
    assert content_digest(again) == content_digest(first) == content_digest(read_manifest(art))
    assert content_digest({**again, "config_digest": "c2"}) != content_digest(again)
    (art / "a.bin").write_bytes(b"weightz")
    assert content_digest(write_manifest(art, kind="hf-model", config_digest="c1")) != content_digest(first)


# ------------------------------------------------------------------------------------------------
# Against a finished demo run, and two flow re-runs over a copy of it (integration)


def _statuses(summary: dict) -> dict[str, str]:
    return {s["stage"]: s["status"] for s in summary["stages"]}


def _rels(summary: dict) -> dict[str, str]:
    return {s["stage"]: s["rel"] for s in summary["stages"] if s.get("rel")}


@pytest.mark.integration
@pytest.mark.e2e
def test_each_recorded_digest_is_what_the_function_computes(demo_run):
    assert demo_run.rc == 0
    cfg, rels = _config(demo_run.raw), _rels(demo_run.summary)
    recorded = {name: read_manifest(demo_run.run_root / rels[name])["config_digest"] for name in ARTIFACT_STAGES}
    contents = {name: content_digest(read_manifest(demo_run.run_root / rels[name])) for name in ARTIFACT_STAGES}
    for name in ARTIFACT_STAGES:
        spec = STAGE[name]
        if spec.continues:
            assert recorded[name] == recorded[spec.continues]
        elif spec.name == "benchmark":  # its digest also covers the task files and lm-eval's version
            from tasks.core.evaluation.benchmark import fingerprint, lm_eval_version, read_task

            inputs = {"tasks": fingerprint([read_task(u) for u in cfg.benchmark.tasks]), "lm_eval": lm_eval_version()}
            assert config_digest(cfg, name, {p: contents[p] for p in spec.parents}, inputs) == recorded[name], name
        elif spec.name not in ("prepare_cpt", "prepare_sft"):  # prepare's digest also covers its input files
            assert config_digest(cfg, name, {p: contents[p] for p in spec.parents}) == recorded[name], name
    # The model above, with the real content digests, agrees with itself for the settings tested.
    assert rerun_set(cfg, _config(_changed(demo_run.raw, RERUNS["export.dtype"][0])), contents) == EXPORT_AND_BELOW


@pytest.fixture(scope="module")
def reruns(demo_run, tmp_path_factory):
    """Two flow re-runs over one copy of the demo run: (1) only settings that change no artifact
    (tokenize runners, max_pending_publishes, and the copy has no tracking where the demo had
    MLflow); (2) cpt's final checkpoint manifest rebuilt (same files, a new created_at) and
    export.dtype fp32. The Hub is left out here: a configured hub pushes (the unit covers it)."""
    from flows.cli import flow_main as main
    from tests.conftest import write_config

    run = demo_run.copy_to(tmp_path_factory.mktemp("digests"))
    assert "tracking" in demo_run.raw and "tracking" not in run.raw
    raw = _changed(run.raw, NOTHING_RERUNS["cpt.data.tokenize.workers"])
    for name in ("sft.data.tokenize.local_cluster", "cpt.max_pending_publishes", "sft.max_pending_publishes"):
        NOTHING_RERUNS[name](raw)
    rc1 = main(["--config", str(write_config(run.config, raw))])
    first = json.loads((run.run_root / "run.json").read_text())

    rel = _rels(demo_run.summary)["train_cpt"]
    ckpt = run.run_root / rel
    old = read_manifest(ckpt)
    old_bytes = (ckpt / MANIFEST).read_bytes()
    time.sleep(1.1)  # created_at has a one-second resolution
    (ckpt / MANIFEST).unlink()
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    write_manifest(
        ckpt,
        kind=old["kind"],
        meta=old["meta"],
        parent=old["parent"],
        config_digest=old["config_digest"],
        fingerprint=old["fingerprint"],
        exclude=on_disk - set(old["files"]),
    )
    rebuilt = read_manifest(ckpt)
    raw2 = _changed(raw, RERUNS["export.dtype"][0])
    rc2 = main(["--config", str(write_config(run.config, raw2))])
    second = json.loads((run.run_root / "run.json").read_text())
    return {
        "rc": (rc1, rc2),
        "first": first,
        "second": second,
        "old": old,
        "old_bytes": old_bytes,
        "rebuilt": rebuilt,
        "rebuilt_bytes": (ckpt / MANIFEST).read_bytes(),
        "run_root": run.run_root,
    }


@pytest.mark.integration
@pytest.mark.e2e
def test_settings_that_change_no_artifact_rerun_no_stage(reruns):
    assert reruns["rc"][0] == 0
    st = _statuses(reruns["first"])
    assert {name: st[name] for name in ARTIFACT_STAGES} == dict.fromkeys(ARTIFACT_STAGES, "skipped")


@pytest.mark.integration
@pytest.mark.e2e
def test_a_rebuilt_identical_parent_reruns_nothing_and_export_dtype_reruns_export_and_below(reruns):
    old, rebuilt = reruns["old"], reruns["rebuilt"]
    assert reruns["rebuilt_bytes"] != reruns["old_bytes"] and rebuilt["created_at"] != old["created_at"]
    assert rebuilt["files"] == old["files"] and content_digest(rebuilt) == content_digest(old)
    assert reruns["rc"][1] == 0
    st = _statuses(reruns["second"])
    assert {name for name in ARTIFACT_STAGES if st[name] == "completed"} == EXPORT_AND_BELOW
    assert {name for name in ARTIFACT_STAGES if st[name] == "skipped"} == set(ARTIFACT_STAGES) - EXPORT_AND_BELOW
    export = read_manifest(reruns["run_root"] / "export")
    assert export["meta"]["dtype"] == "fp32"
