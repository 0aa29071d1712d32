"""The kernel registry decides the fast kernels; the builders pass what it names (in-process, no launch).

    .venv/bin/python -m pytest tests/test_kernels.py -q

CUDA is "present" only at the registry level (`Facts(cuda=True)`, `load_kernels(cuda=True)`): the
plugin arguments are computed by the real builders without constructing a plugin, and the
fall-backs are driven by what really fails here: ColossalAI's own flash-attention loader on a
machine without CUDA, and packages that are installed but do not import (a broken build).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tasks.core.config import kernels
from tasks.core.config.kernels import KERNELS, Facts, KernelSpec, passed, resolve, resolve_for
from tasks.core.config.layout import ParallelLayout
from tasks.core.config.load import parse_config
from tasks.core.config.plugins import PLUGINS
from tasks.core.config.schema import RunConfig
from tasks.core.errors import ConfigError
from tasks.engine.builders import plugin_kwargs
from tests.conftest import tiny_config_raw

EVERYTHING = frozenset({"flash_attn", "apex"})


def _cfg(tmp_path, **stages) -> RunConfig:
    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    for stage, update in stages.items():
        raw[stage].update(update)
    return parse_config(raw)


def _layout(phase_cfg, phase: str) -> ParallelLayout:
    return ParallelLayout.of(phase_cfg, phase, cuda=True, tiers=("static",))


def test_on_cpu_every_kernel_is_off_with_its_reason_and_nothing_is_passed(tmp_path):
    for plugin in PLUGINS:
        for precision in ("fp32", "bf16", "fp16"):
            states = resolve_for(plugin, precision, Facts(cuda=False, packages=EVERYTHING, model_type="gpt2"))
            assert {s.reason for s in states.values()} <= {"off: no CUDA"}, (plugin, precision)
            assert not any(passed(states, via) for via in ("plugin", "model", "optimizer"))
    cfg = _cfg(tmp_path)  # the demo: hybrid_parallel tp=2 fp32 -> low_level_zero bf16
    cpt = resolve(cfg.cpt, "cpt", Facts(cuda=False, packages=EVERYTHING))
    assert list(cpt) == ["flash_attention", "fused_normalization", "jit_fused", "fused_optimizer"]
    assert list(resolve(cfg.sft, "sft", Facts(cuda=False))) == ["flash_attention", "fused_optimizer"]
    kw = plugin_kwargs(cfg.cpt.plugin, cfg.cpt, _layout(cfg.cpt, "cpt"), False, cpt)
    assert kw["enable_all_optimization"] is False
    assert not {
        "enable_flash_attention",
        "enable_fused_normalization",
        "enable_jit_fused",
        "gradient_checkpoint_config",
    } & set(kw)


def test_with_cuda_the_builder_passes_the_flags_the_table_names(tmp_path):
    cfg = _cfg(tmp_path, cpt={"plugin": {"name": "hybrid_parallel", "tp_size": 2, "precision": "bf16"}})
    for model_type in ("llama", "gpt2"):
        states = resolve(cfg.cpt, "cpt", Facts(cuda=True, packages=EVERYTHING, model_type=model_type))
        kw = plugin_kwargs(cfg.cpt.plugin, cfg.cpt, _layout(cfg.cpt, "cpt"), True, states)
        for state in states.values():  # exactly the table: an on row's argument with its value, an off row's absent
            if state.spec.via == "plugin":
                assert (kw.get(state.spec.arg) == state.spec.value) if state.on else (state.spec.arg not in kw), state
        assert states["flash_attention"].reason == "on (shardformer)" and states["fused_normalization"].on
        assert passed(states, "optimizer") == {"fused": True} and not passed(states, "model")
    llama = resolve(cfg.cpt, "cpt", Facts(cuda=True, packages=EVERYTHING, model_type="llama"))
    assert llama["jit_fused"].reason == "off: ColossalAI 0.5.0's llama policy has no shardformer JIT fused ops"
    bare = resolve(cfg.cpt, "cpt", Facts(cuda=True, model_type="llama"))
    assert (
        bare["fused_normalization"].reason == "off: apex not installed" and bare["flash_attention"].on
    )  # torch's CUDA sdpa

    # The plugins without shardformer: flash_attention_2 through from_pretrained, in half precision only.
    sft = resolve(cfg.sft, "sft", Facts(cuda=True, packages=EVERYTHING))  # low_level_zero bf16
    assert passed(sft, "model") == {"attn_implementation": "flash_attention_2"} and passed(sft, "optimizer") == {
        "fused": True
    }
    assert sft["flash_attention"].reason == "on (transformers flash_attention_2)"
    assert resolve(cfg.sft, "sft", Facts(cuda=True))["flash_attention"].reason == "off: flash_attn not installed"
    ddp32 = resolve_for("torch_ddp", "fp32", Facts(cuda=True, packages=EVERYTHING))
    assert (
        ddp32["flash_attention"].reason == "off: needs bf16 or fp16 (precision is fp32)" and ddp32["fused_optimizer"].on
    )
    assert list(resolve_for("gemini", "bf16", Facts(cuda=True, packages=EVERYTHING))) == [
        "flash_attention"
    ]  # HybridAdam is Gemini's own

    off = cfg.sft.model_copy(update={"kernels": {"flash_attention": False}})
    assert (
        resolve(off, "sft", Facts(cuda=True, packages=EVERYTHING))["flash_attention"].reason
        == "off: switched off in sft.kernels"
    )


def test_activation_checkpointing_reaches_shardformer_only_with_a_pipeline(tmp_path):
    pp = {
        "plugin": {"name": "hybrid_parallel", "pp_size": 2, "precision": "fp32"},
        "grad_accum_steps": 2,
        "activation_checkpointing": True,
    }
    cfg = _cfg(tmp_path, cpt=pp)
    kw = plugin_kwargs(cfg.cpt.plugin, cfg.cpt, _layout(cfg.cpt, "cpt"), False, {})
    assert kw["gradient_checkpoint_config"].gradient_checkpointing_ratio == 1.0
    tp = _cfg(
        tmp_path, cpt={"activation_checkpointing": True}
    ).cpt  # pp=1: the forward would read a stage manager that is None
    assert "gradient_checkpoint_config" not in plugin_kwargs(tp.plugin, tp, _layout(tp, "cpt"), False, {})


def test_an_unknown_kernel_is_refused_naming_the_field_and_the_registered_ones(tmp_path):
    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    raw["sft"]["kernels"] = {"flash_atention": False}
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    ((where, msg),) = err.value.problems
    assert where == "sft.kernels" and "unknown kernel(s) 'flash_atention'" in msg
    assert "registered kernels: flash_attention, fused_normalization, jit_fused, fused_optimizer" in msg


def test_a_new_kernel_is_one_registry_row(tmp_path):
    row = kernels.register(
        KernelSpec(
            "dummy_fast", "a test kernel", "a dummy", "hf_model", "plugin", "dummy_flag", value=7, needs_cuda=False
        )
    )
    try:
        with pytest.raises(ValueError, match="already has a row"):
            kernels.register(KernelSpec("dummy_fast", "again", "again", "hf_model", "model", "x"))
        cfg = _cfg(
            tmp_path, sft={"plugin": {"name": "torch_ddp", "precision": "fp32"}, "kernels": {"dummy_fast": True}}
        )
        props = RunConfig.model_json_schema()["$defs"]["PhaseConfig"]["properties"]["kernels"]
        assert (
            "dummy_fast" in props["propertyNames"]["enum"]
            and "dummy_fast (a test kernel under low_level_zero/gemini/torch_ddp)" in props["description"]
        )
        states = resolve(cfg.sft, "sft", Facts(cuda=False))
        assert states["dummy_fast"].reason == "on (a test kernel)"  # needs no CUDA: on even here
        assert plugin_kwargs(cfg.sft.plugin, cfg.sft, _layout(cfg.sft, "sft"), False, states) == {"dummy_flag": 7}
    finally:
        KERNELS.remove(row)
    with pytest.raises(ConfigError, match="unknown kernel"):
        _cfg(tmp_path, sft={"kernels": {"dummy_fast": True}})


@pytest.fixture
def broken_packages(tmp_path, monkeypatch):
    """flash_attn and apex 'installed' but failing to import, as a build against another torch does."""
    for name in ("flash_attn", "apex"):
        (tmp_path / "site" / name).mkdir(parents=True)
        (tmp_path / "site" / name / "__init__.py").write_text(
            f"raise ImportError('{name}_cuda.so: undefined symbol: _ZN3c10')\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in ("flash_attn", "apex", "apex.normalization"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_a_kernel_that_fails_to_load_falls_back_with_a_warning_naming_it(
    tmp_path, broken_packages, capsys, tiny_model_dir
):
    from tasks.engine import accel

    cfg = _cfg(tmp_path, cpt={"plugin": {"name": "hybrid_parallel", "tp_size": 2, "precision": "bf16"}})
    # CUDA claimed, CPU device: ColossalAI's FlashAttentionLoader finds no usable kernel, apex does not import.
    states = accel.load_kernels(cfg.cpt, "cpt", tiny_model_dir, cuda=True, device=torch.device("cpu"), rank=0)
    flash, norm = states["flash_attention"], states["fused_normalization"]
    assert not flash.on and flash.reason.startswith(
        "off: failed to load: AssertionError: No usable kernel found for FlashAttentionLoader"
    )
    assert not norm.on and norm.reason == "off: failed to load: ImportError: apex_cuda.so: undefined symbol: _ZN3c10"
    assert (
        states["jit_fused"].reason == "off: ColossalAI 0.5.0's llama policy has no shardformer JIT fused ops"
    )  # config.json says llama
    assert states["fused_optimizer"].reason == "on (torch AdamW fused)"  # torch's fused AdamW also steps on CPU
    err = capsys.readouterr().err
    assert "kernel flash_attention (shardformer) failed to load: AssertionError" in err and "training without it" in err
    assert "kernel fused_normalization (shardformer, apex) failed to load: ImportError" in err
    kw = plugin_kwargs(cfg.cpt.plugin, cfg.cpt, _layout(cfg.cpt, "cpt"), True, states)
    assert not {"enable_flash_attention", "enable_fused_normalization"} & set(kw)

    # flash_attention_2 refused by transformers itself: the model is built with its default attention.
    from transformers import AutoConfig, AutoModelForCausalLM

    sft = accel.load_kernels(cfg.sft, "sft", tiny_model_dir, cuda=True, device=torch.device("cpu"), rank=0)
    assert sft["flash_attention"].on  # the package is found; transformers decides when it builds
    # a config per build, as the engine builds (transformers >= 4.52 writes the refused implementation into it)
    sft, model = accel.load_model(
        sft, lambda **kw: AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir), **kw), rank=0
    )
    reason = sft["flash_attention"].reason  # transformers 4.51 looks for the distribution's metadata first
    assert (
        not sft["flash_attention"].on
        and reason == "off: failed to load: PackageNotFoundError: No package metadata was found for flash_attn"
    )
    assert model.config._attn_implementation == "sdpa"
    assert "kernel flash_attention (transformers flash_attention_2) failed to load" in capsys.readouterr().err


def test_preflight_reports_each_stage_s_kernels(tmp_path):
    from tasks.core.preflight.checks import Machine
    from tests.test_preflight import Case

    case = Case(tmp_path)
    raw = json.loads(json.dumps(case.raw))
    raw["cpt"]["activation_checkpointing"] = True
    raw["sft"]["kernels"] = {"fused_normalization": False}  # a hybrid_parallel kernel, under low_level_zero
    case.raw = raw
    report = case.report()
    assert report.ok, report.problems
    lines = [c for c in report.checked if " kernels" in c]
    assert lines == [
        (
            "cpt kernels: flash attention: off: no CUDA; fused normalization: off: no CUDA; jit fused: off: no CUDA; "
            "fused optimizer: off: no CUDA; activation checkpointing: on"
        ),
        "sft kernels: flash attention: off: no CUDA; fused optimizer: off: no CUDA; activation checkpointing: off",
    ]
    assert (
        "sft.kernels.fused_normalization: applies under hybrid_parallel only; ignored under plugin low_level_zero"
        in report.warnings
    )
    case.machine = Machine(cuda_devices=2, cpu_count=2, free_bytes=10**13)
    gpu = case.report()
    assert any(c.startswith("cpt kernels: flash attention: on (shardformer);") for c in gpu.checked), gpu.checked


def test_the_card_and_the_checkpoint_manifest_carry_what_ran(tmp_path):
    from tasks.core.hub.card import model_card, train_facts
    from tasks.core.run.manifest import MANIFEST

    cfg = _cfg(tmp_path)
    ran = {
        "cpt": {"flash_attention": "on (shardformer)", "fused_optimizer": "off: failed to load: RuntimeError: x"},
        "sft": {"flash_attention": "off: no CUDA"},
    }
    for phase in ("cpt", "sft"):
        step = tmp_path / phase / f"step-{cfg.phase(phase).max_steps:06d}"
        (step / MANIFEST).parent.mkdir(parents=True)
        (step / "train_state.json").write_text(json.dumps({"losses": [2.0]}))
        (step / MANIFEST).write_text(
            json.dumps({"meta": {"kernels": ran[phase], "activation_checkpointing": phase == "sft"}})
        )
    facts = train_facts(cfg, {}, lambda rel: (tmp_path / rel).read_text())
    card = model_card(cfg, {"meta": {}}, facts)
    assert (
        "| kernels | flash attention: on (shardformer); fused optimizer: off: failed to load: RuntimeError: x | flash "
        "attention: off: no CUDA |" in card
    )
    assert "| activation checkpointing | off | on |" in card


def test_the_progress_artifact_says_what_the_launch_runs_with(monkeypatch):
    from tasks.flowkit import ui

    sent = []
    monkeypatch.setattr(ui, "create_progress_artifact", lambda progress, key, description: "artifact-id")
    monkeypatch.setattr(
        ui, "update_progress_artifact", lambda aid, progress, description: sent.append((progress, description))
    )
    progress = ui.Progress("sft", 2, min_interval=3600)
    progress.kernels(
        {
            "kernels": {"flash_attention": "off: no CUDA", "fused_optimizer": "off: no CUDA"},
            "activation_checkpointing": True,
        }
    )
    said = " — kernels: flash attention: off: no CUDA; fused optimizer: off: no CUDA; activation checkpointing: on"
    assert sent == [(0.0, "SFT: step 0 / 2" + said)]
    progress({"step": 2, "loss": 1.5})
    assert sent[-1] == (100.0, "SFT: step 2 / 2, loss 1.5000" + said)
