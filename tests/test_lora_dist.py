"""LoRA SFT in the engine: three torchrun launches under torch_ddp fp32.

    .venv/bin/pytest -q -m distributed tests/test_lora_dist.py

Three launches. The shard verb: the base (a copy of the demo model with a manifest, standing for
cpt/hf) plus a fresh adapter -> step-000000. The train verb with `kill@step=5`: it trains steps 1-5
(checkpoint at 3) and dies; the same job again resumes from step-000003 and trains 4-6, so the two
launches' steps 4 and 5 must agree bitwise (loss and grad norm) for the resume to be exact: the
killed launch is the uninterrupted reference. (One torchrun restart, PET_MAX_RESTARTS=1, would save
a launch, but the restarted ranks' gloo mesh fails to connect under ColossalAI's tcp:// init.)
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from support.engine import engine, phase_raw, shard_train, write_job
from tasks.core.errors import ManifestError
from tasks.core.run.manifest import MANIFEST, manifest_digest, verify_artifact, write_manifest

pytestmark = pytest.mark.distributed

DDP = {"name": "torch_ddp", "precision": "fp32"}
HP = {"name": "hybrid_parallel", "precision": "fp32"}  # tp=1 pp=1 without ZeRO: data parallel, its own checkpoint IO
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("lora")
    base = work / "cpt-hf"
    shutil.copytree(tiny_model_dir, base)
    write_manifest(base, kind="hf-model")  # the base an adapter references by this manifest's digest
    stage_dir = work / "sft"
    section = phase_raw("sft", DDP, lora=LORA, max_steps=6, checkpoint_every=3, keep_last=3)
    common = dict(phase="sft", phase_cfg=section, model_dir=base, tokenizer_dir=base, stage_dir=stage_dir)
    shard_job = write_job(work / "jobs" / "shard.json", verb="shard", **common)
    train_job = write_job(work / "jobs" / "train.json", verb="train", **common)
    # the shard and the killed training in one launch, as the flow shares them (the fault the train part's)
    shard = killed = shard_train(shard_job, train_job, fault="kill@step=5", expect_ok=False)
    resumed = engine("train", train_job, env={"CPT_TO_SFT_FAULT": "kill@step=5"})  # the fault fired once: it resumes
    return dict(base=base, dir=stage_dir, shard=shard, killed=killed, resumed=resumed)


def test_a_lora_checkpoint_holds_the_adapter_and_references_the_base(lora_run):
    assert "trainable of" in lora_run["shard"].output
    # What peft adapted, not what was asked: the log line, the manifest meta and adapter_config.json agree.
    assert "LoRA r=4 alpha=8 on down_proj, q_proj, v_proj: " in lora_run["shard"].output
    for name in ("step-000000", "step-000003", "step-000006"):
        ckpt = lora_run["dir"] / name
        manifest = verify_artifact(ckpt)
        files = set(manifest["files"])
        assert {
            "adapter/adapter_model.safetensors",
            "adapter/adapter_config.json",
            "lr_scheduler.pt",
            "train_state.json",
        } <= files
        assert not any(f.startswith("model/") or (f.startswith("adapter/") and f.endswith(".bin")) for f in files), (
            sorted(files)
        )  # no base copy, no pickled adapter
        meta = manifest["meta"]["lora"]
        assert meta["base"]["digest"] == manifest_digest(lora_run["base"])
        assert 0 < meta["trainable_params"] < meta["total_params"] and meta["config"]["r"] == 4
        assert meta["adapted_modules"] == ["down_proj", "q_proj", "v_proj"]
        assert (
            sorted(json.loads((ckpt / "adapter" / "adapter_config.json").read_text())["target_modules"])
            == meta["adapted_modules"]
        )
        adapter = sum(e["size"] for f, e in manifest["files"].items() if f.startswith("adapter/"))
        optimizer = sum(e["size"] for f, e in manifest["files"].items() if f.startswith("optimizer/"))
        base_bytes = sum(p.stat().st_size for p in lora_run["base"].glob("*.safetensors"))
        assert adapter + optimizer < base_bytes / 4  # the frozen base has no Adam state


def test_a_kill_mid_stage_resumes_bitwise_in_fp32(lora_run):
    assert lora_run["killed"].rc != 0
    first, again = lora_run["killed"].progress, lora_run["resumed"].progress
    assert [p["step"] for p in first] == [1, 2, 3, 4, 5] and [p["step"] for p in again] == [
        4,
        5,
        6,
    ]  # resumed from step-000003
    progress = first + again
    first, again = {p["step"]: p for p in first}, {p["step"]: p for p in again}
    for step in (4, 5):
        assert again[step]["loss"] == first[step]["loss"] and again[step]["grad_norm"] == first[step]["grad_norm"], step
    assert all(p["trainable_params"] < p["total_params"] for p in progress)
    assert progress[-1]["loss"] < progress[0]["loss"]


def test_resume_onto_another_base_is_refused(lora_run, tmp_path):
    from tasks.engine import lora

    ckpt = lora_run["dir"] / "step-000006"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    lora.check_base(manifest, ckpt, lora_run["base"])  # the same base: accepted
    other = tmp_path / "other-base"
    shutil.copytree(lora_run["base"], other)
    write_manifest(other, kind="hf-model", meta={"rebuilt": True})
    with pytest.raises(ManifestError, match="an adapter only fits the weights it was trained against"):
        lora.check_base(manifest, ckpt, other)


def test_the_adapter_loads_through_peft_onto_the_base(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(lora_run["base"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, lora_run["dir"] / "step-000006" / "adapter")
    b = (
        next(m for n, m in model.named_modules() if n.endswith("q_proj") and hasattr(m, "lora_B"))
        .lora_B["default"]
        .weight
    )
    assert b.abs().sum() > 0  # trained: peft initializes B to zero


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_merged_export_matches_peft_and_keeps_every_untouched_tensor(lora_run, tmp_path, dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tasks.core.config.outputs import ExportConfig
    from tasks.core.models.fingerprint import compare_logits, default_rtol, hf_dir_logits, model_logits
    from tasks.core.models.folder import folder_problems
    from tasks.core.models.merge import build_merged_dir

    out = tmp_path / "export"
    built = build_merged_dir(lora_run["dir"] / "step-000006", out, lora_run["base"], ExportConfig(dtype=dtype))
    v = built["verification"]
    assert v["fingerprint_match"] and v["dtype"] == dtype
    layers = json.loads((lora_run["base"] / "config.json").read_text())["num_hidden_layers"]
    assert (
        v["lora"]["touched"] == 3 * layers and v["lora"]["untouched_bitwise"] > 0 and not v["lora"]["untied_head"]
    )  # q, v, down per layer
    assert folder_problems(out) == [] and not list(out.glob("adapter*"))
    base = AutoModelForCausalLM.from_pretrained(lora_run["base"], dtype=torch.float32)
    peft_logits = model_logits(
        PeftModel.from_pretrained(base, lora_run["dir"] / "step-000006" / "adapter").eval(), base.config.vocab_size
    )
    assert compare_logits(hf_dir_logits(out), peft_logits, default_rtol(dtype, "fp32"))["fingerprint_match"]

    # export-adapter/: the adapter alone, loadable by peft through its base_model_name_or_path, the merged export's model.
    from peft import AutoPeftModelForCausalLM

    from tasks.core.errors import ConversionError
    from tasks.core.models.adapter import ADAPTER_FILES, build_adapter_dir

    adapter = tmp_path / "export-adapter"
    adapter.mkdir()
    ref = {"name_or_path": str(lora_run["base"]), "digest": manifest_digest(lora_run["base"])}
    a = build_adapter_dir(
        lora_run["dir"] / "step-000006" / "adapter",
        adapter,
        lora_run["base"],
        out,
        base_ref=ref,
        rtol=v["fingerprint_rtol"],
    )
    assert (
        a["fingerprint_match"]
        and a["base_is"] == "local"
        and a["r"] == 4
        and a["fingerprint_rtol"] == default_rtol(dtype, "fp32")
    )
    assert (
        sorted(p.name for p in adapter.iterdir()) == sorted(ADAPTER_FILES) and folder_problems(adapter) == []
    )  # no weights a loader would take
    auto = AutoPeftModelForCausalLM.from_pretrained(
        adapter, dtype=torch.float32
    )  # finds the base by the reference alone
    assert compare_logits(model_logits(auto.eval(), base.config.vocab_size), peft_logits, 1e-5)["fingerprint_match"]
    other = tmp_path / "other-adapter"
    other.mkdir()
    with pytest.raises(
        ConversionError, match="the adapter and the merged model are not the same model"
    ):  # against the base alone: the trained adapter is missing
        build_adapter_dir(
            lora_run["dir"] / "step-000006" / "adapter",
            other,
            lora_run["base"],
            lora_run["base"],
            base_ref=ref,
            rtol=v["fingerprint_rtol"],
        )


def test_a_lora_stage_continues_under_another_plugin_with_its_optimizer_state(lora_run, tmp_path):
    """The adapter's step-000003 (torch_ddp fp32 on 2 ranks) continued under hybrid_parallel (dp=2, its own
    checkpoint IO) at the same split: each rank's adapter weights and AdamW state after the load are the
    checkpoint's, bitwise (read through the layout-neutral view, which reads a LoRA checkpoint's weights
    from its adapter); steps 4-6 continue the torch_ddp run's losses within fp32 reduction-order noise."""
    from tasks.core.models.convert.state_view import CheckpointState
    from tasks.engine.masters import DUMP_ENV

    stage_dir = tmp_path / "sft"
    src = lora_run["dir"] / "step-000003"
    shutil.copytree(src, stage_dir / "step-000003")
    section = phase_raw("sft", HP, lora=LORA, max_steps=6, checkpoint_every=3, keep_last=3)
    job = write_job(
        tmp_path / "jobs" / "train.json",
        verb="train",
        phase="sft",
        phase_cfg=section,
        model_dir=lora_run["base"],
        tokenizer_dir=lora_run["base"],
        stage_dir=stage_dir,
    )
    run = engine("train", job, env={DUMP_ENV: str(tmp_path / "live")})
    assert (
        "sft: resuming step-000003, written under torch_ddp dp=2 on 2 ranks (2 x 1 a rank), under "
        "hybrid_parallel dp=2 on 2 ranks (2 x 1 a rank): model and optimizer re-sharded"
    ) in run.output, run.output[-3000:]
    view = CheckpointState(src)
    ranks = [torch.load(f, weights_only=True) for f in sorted((tmp_path / "live" / "loaded-step-000003").glob("*.pt"))]
    assert len(ranks) == 2 and all(set(live) == set(view.names()) for live in ranks)
    assert all(".lora_" in name for name in view.names())  # the adapter's parameters only: the base is frozen
    for live in ranks:
        for name, st in live.items():
            assert st["master"] is None and torch.equal(st["weight"], view.master(name)), name
            adam = view.adam(name)
            assert torch.equal(st["exp_avg"], adam["exp_avg"]) and torch.equal(st["exp_avg_sq"], adam["exp_avg_sq"])
            assert float(st["step"]) == adam["step"] == 3.0, name
    view.close()
    assert [p["step"] for p in run.progress] == [4, 5, 6]
    ref = json.loads((lora_run["dir"] / "step-000006" / "train_state.json").read_text())
    got = json.loads((stage_dir / "step-000006" / "train_state.json").read_text())
    assert got["losses"][:3] == ref["losses"][:3] and got["sampler"] == ref["sampler"]
    drift = max(abs(a - b) / abs(b) for a, b in zip(got["losses"][3:], ref["losses"][3:]))
    assert drift < 1e-4, (ref["losses"], got["losses"])
    print(f"\nLoRA torch_ddp -> hybrid_parallel: losses of steps 4-6 within {drift:.2e} (relative) of the run's")
