"""Fast engine unit tests (no torchrun): plugin refusal, CPU patches, faults, schedule, checkpoints.

pytest tests/test_plugins.py
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.core.config.schema import PhaseConfig, PluginConfig
from tasks.core.errors import ConfigError
from tasks.core.run.manifest import MANIFEST, write_manifest
from tasks.engine import checkpoint as ckpt
from tasks.engine import faults
from tasks.engine.builders import can_no_sync, check_supported, make_plugin
from tasks.engine.preconditions import parse_job


def _phase_cfg(plugin: dict, **kw) -> PhaseConfig:
    return PhaseConfig(data={"uri": "x.jsonl"}, plugin=plugin, max_steps=10, seq_len=16, lr=1e-3, **kw)


# -- plugins ---------------------------------------------------------------------------------------


def test_gemini_refused_on_cpu_naming_the_field():
    with pytest.raises(ConfigError) as exc:
        check_supported(PluginConfig(name="gemini", precision="bf16"), "sft", cuda=False)
    msg = str(exc.value)
    assert "sft.plugin.name" in msg and "CUDA" in msg and "low_level_zero" in msg
    assert exc.value.problems[0][0] == "sft.plugin.name"


def test_make_plugin_refuses_gemini_before_any_process_group():
    # No torch.distributed init here: the refusal must come first.
    phase_cfg = _phase_cfg({"name": "gemini", "precision": "bf16"})
    with pytest.raises(ConfigError, match=r"cpt\.plugin\.name"):
        make_plugin(phase_cfg.plugin, phase_cfg, phase="cpt", cuda=False)


def test_gemini_accepted_with_cuda_and_ddp_fp16_refused_on_cpu():
    check_supported(PluginConfig(name="gemini", precision="bf16"), "sft", cuda=True)
    with pytest.raises(ConfigError, match=r"cpt\.plugin\.precision"):
        check_supported(PluginConfig(name="torch_ddp", precision="fp16"), "cpt", cuda=False)
    for ok in (
        {"name": "hybrid_parallel", "tp_size": 2},
        {"name": "low_level_zero", "zero_stage": 2},
        {"name": "torch_ddp", "precision": "fp32"},
    ):
        check_supported(PluginConfig(**ok), "cpt", cuda=False)


def test_no_sync_only_where_colossalai_allows_it():
    assert not can_no_sync(PluginConfig(name="low_level_zero", zero_stage=2))
    assert can_no_sync(PluginConfig(name="low_level_zero", zero_stage=1))
    assert can_no_sync(PluginConfig(name="torch_ddp", precision="fp32"))


# -- offload: the plugins' own memory savers, as registry data ----------------------------------------

OFFLOAD_OK = [
    ({"name": "low_level_zero", "zero_stage": 2, "cpu_offload": True}, {"cpu_offload": True}),
    ({"name": "hybrid_parallel", "zero_stage": 1, "cpu_offload": True}, {"cpu_offload": True}),
    (
        {"name": "gemini", "offload_optim_frac": 0.5},
        {"placement_policy": "static", "offload_optim_frac": 0.5, "offload_param_frac": 0.0},
    ),
    (
        {"name": "gemini", "offload_optim_frac": 1.0, "offload_param_frac": 1.0},
        {"placement_policy": "static", "offload_optim_frac": 1.0, "offload_param_frac": 1.0},
    ),
    (
        {"name": "gemini", "placement_policy": "auto"},
        {"placement_policy": "auto", "offload_optim_frac": 0.0, "offload_param_frac": 0.0},
    ),
]


@pytest.mark.parametrize(
    "plugin, passed", OFFLOAD_OK, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items() if k != "name")
)
def test_offload_fields_are_accepted_and_passed_where_the_plugin_has_them(plugin, passed):
    from tasks.core.config.kernels import Facts, resolve
    from tasks.core.config.layout import ParallelLayout, layout_problems
    from tasks.engine.builders import plugin_kwargs, plugin_meta

    phase_cfg = _phase_cfg({"precision": "bf16", **plugin}, launch={"nproc_per_node": 2})
    assert layout_problems(phase_cfg, "sft", cuda=True) == []
    kwargs = plugin_kwargs(
        phase_cfg.plugin,
        phase_cfg,
        ParallelLayout.of(phase_cfg, "sft", cuda=True),
        True,
        resolve(phase_cfg, "sft", Facts(cuda=True)),
    )
    assert {k: kwargs[k] for k in passed} == passed
    assert {
        k: plugin_meta(phase_cfg.plugin, phase_cfg)[k] for k in passed
    } == passed  # recorded in every checkpoint manifest


OFFLOAD_REFUSED = [
    (
        {"name": "torch_ddp", "cpu_offload": True},
        "sft.plugin.cpu_offload",
        "plugins that have it: hybrid_parallel, low_level_zero",
    ),
    (
        {"name": "gemini", "cpu_offload": True},
        "sft.plugin.cpu_offload",
        "plugins that have it: hybrid_parallel, low_level_zero",
    ),
    (
        {"name": "low_level_zero", "zero_stage": 2, "offload_optim_frac": 0.5},
        "sft.plugin.offload_optim_frac",
        "plugins that have it: gemini",
    ),
    (
        {"name": "hybrid_parallel", "offload_param_frac": 1.0},
        "sft.plugin.offload_param_frac",
        "plugins that have it: gemini",
    ),
    (
        {"name": "low_level_zero", "zero_stage": 2, "placement_policy": "auto"},
        "sft.plugin.placement_policy",
        "plugins that have it: gemini",
    ),
    (
        {"name": "hybrid_parallel", "tp_size": 2, "cpu_offload": True},
        "sft.plugin.cpu_offload",
        "acts only with zero_stage: 1",
    ),
    (
        {"name": "gemini", "placement_policy": "auto", "offload_optim_frac": 1.0},
        "sft.plugin.offload_optim_frac",
        "acts only with placement_policy: static",
    ),
    (
        {"name": "gemini", "offload_param_frac": 0.5},
        "sft.plugin.offload_param_frac",
        "acts only with offload_optim_frac: 1.0",
    ),
]


@pytest.mark.parametrize(
    "plugin, field, says", OFFLOAD_REFUSED, ids=lambda v: v if isinstance(v, str) and "." in v else None
)
def test_offload_fields_are_refused_where_the_plugin_lacks_them_naming_the_field(plugin, field, says, tmp_path):
    from tasks.core.config.load import parse_config
    from tests.conftest import tiny_config_raw

    raw = tiny_config_raw(tmp_path / "m", tmp_path / "r")
    raw["sft"]["plugin"] = {"precision": "bf16", **plugin}
    with pytest.raises(ConfigError) as exc:  # static tier: where the config is read, before any launch
        parse_config(raw)
    assert [f for f, _ in exc.value.problems] == [field], exc.value.problems
    assert says in exc.value.problems[0][1]


def test_every_offload_row_is_an_argument_of_its_plugin_class():
    import importlib
    import inspect

    from tasks.core.config.plugins import OFFLOAD_FIELDS, PLUGINS
    from tasks.engine.builders import BUILDERS

    assert set(OFFLOAD_FIELDS) <= set(PluginConfig.model_fields)
    for name, spec in PLUGINS.items():
        module, _, cls = BUILDERS[name].factory.partition(":")
        params = inspect.signature(getattr(importlib.import_module(module), cls).__init__).parameters
        for o in spec.offload:
            assert o.field in OFFLOAD_FIELDS and o.field in params, (name, o.field)
            assert all(f in PluginConfig.model_fields for f, _ in o.requires)
        assert all(h.offload in {o.field for o in spec.offload} for h in spec.holds if h.offload), name


def test_an_offload_row_on_a_new_plugin_is_accepted_passed_and_estimated():
    from tasks.core.config import plugins
    from tasks.core.config.layout import ParallelLayout, layout_problems
    from tasks.core.preflight.memory import LLAMA3, estimate
    from tasks.engine import builders

    plugins.register(
        plugins.PluginSpec(
            name="dummy_offload",
            summary="a test plugin",
            zero_stages=(1,),
            no_sync_zero_stages=(),
            offload=(plugins.Offload("cpu_offload", moves_step=True),),
            holds=(plugins.Held("weights", "weights"), plugins.Held("moments", 8, sharded=True, offload="cpu_offload")),
        )
    )
    builders.BUILDERS["dummy_offload"] = builders.Builder(
        factory=lambda **kw: kw, kwargs=lambda p, phase_cfg, layout, cuda: {"stage": p.zero_stage}
    )
    try:
        phase_cfg = _phase_cfg(
            {"name": "dummy_offload", "zero_stage": 1, "cpu_offload": True}, launch={"nproc_per_node": 2}
        )
        assert layout_problems(phase_cfg, "sft", cuda=True) == []
        assert builders.make_plugin(phase_cfg.plugin, phase_cfg, phase="sft", cuda=False, kernels={}) == {
            "stage": 1,
            "cpu_offload": True,
        }
        on, off = (
            estimate(LLAMA3["Llama-3-8B"], s, phase="sft", cuda=True)
            for s in (phase_cfg, _phase_cfg({"name": "dummy_offload", "zero_stage": 1}, launch={"nproc_per_node": 2}))
        )
        moments = 8 * math.ceil(on.rank_parameters / 2)
        assert off.device - on.device >= moments and on.offloaded >= moments and off.offloaded == 0
        assert (
            "cpu_offload"
            in layout_problems(_phase_cfg({"name": "torch_ddp", "precision": "fp32", "cpu_offload": True}), "sft")[0][0]
        )
        assert ParallelLayout.of(phase_cfg, "sft").plugin == "dummy_offload"
    finally:
        plugins.PLUGINS.pop("dummy_offload", None)
        builders.BUILDERS.pop("dummy_offload", None)
    assert (
        "dummy_offload"
        not in layout_problems(_phase_cfg({"name": "torch_ddp", "precision": "fp32", "cpu_offload": True}), "sft")[0][1]
    )


# -- transformers compatibility -----------------------------------------------------------------------


def test_hf_compat_rebuilds_colossalai_forwards_for_the_installed_transformers_and_refuses_others(monkeypatch):
    import sys

    from tasks.engine import hf_compat

    # the replacements match ColossalAI 0.5.0's files exactly, whichever transformers is installed
    for name in hf_compat.MODULES:
        path, source = hf_compat.edited_source(name)
        assert "layer_outputs[0]" not in source and "_update_causal_mask" not in source, path
        assert "past_key_value=" not in source, path  # 4.56 renamed it: the old name warns on every forward
    assert "StaticCache,\n" not in hf_compat.edited_source("colossalai.shardformer.modeling.llama")[1]
    assert hf_compat.check()  # the pinned 4.57.x: ColossalAI's forwards need the replacements
    done = hf_compat.apply()
    assert hf_compat.apply() == [] and hf_compat.is_applied()
    # the Llama policy imports (4.52+ broke it at import), its forward is the rebuilt one
    from colossalai.shardformer.policies.llama import LlamaPipelineForwards

    assert set(done) <= set(hf_compat.MODULES)
    assert LlamaPipelineForwards is sys.modules["colossalai.shardformer.modeling.llama"].LlamaPipelineForwards
    assert sys.modules["colossalai.shardformer.modeling.llama"]._cpt_to_sft_hf_compat
    # ColossalAI's save_config_file sets config.torch_dtype at every save: 4.57's notice of it stays off the console
    log = logging.getLogger("transformers.configuration_utils")
    assert not log.filter(logging.makeLogRecord({"msg": "`torch_dtype` is deprecated! Use `dtype` instead!"}))
    assert log.filter(logging.makeLogRecord({"msg": "any other warning"}))
    for package, version, says in (
        ("transformers", "4.60.0", "transformers 4.60.0 is installed"),
        ("transformers", "4.51.3", "transformers 4.51.3 is installed"),  # the project passes 4.56's `dtype`
        ("colossalai", "0.5.1", "colossalai 0.5.1 is installed"),
    ):
        with monkeypatch.context() as m:
            # the module now in sys.modules: importing ColossalAI's qwen2 modeling puts another transformers there
            m.setattr(sys.modules[package], "__version__", version)
            with pytest.raises(hf_compat.UnsupportedStack, match=says) as err:
                hf_compat.apply()
            assert "with transformers 4.57.x" in str(err.value) and "scripts/install.sh" in str(err.value)


# -- CPU compatibility -------------------------------------------------------------------------------


def test_cpu_compat_apply_is_idempotent_and_works():
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    from tasks.engine import cpu_compat

    cpu_compat.apply()
    before = {n: getattr(CpuAccelerator, n) for n in cpu_compat._ACCELERATOR_PATCHES}
    assert cpu_compat.apply() == []  # second call patches nothing
    assert {n: getattr(CpuAccelerator, n) for n in before} == before
    assert cpu_compat.is_applied()
    acc = CpuAccelerator()
    acc.synchronize()
    acc.empty_cache()
    assert acc.current_device() == 0 and acc.device_count() == 1
    assert torch.equal(acc.get_rng_state(), torch.get_rng_state())
    state = torch.get_rng_state()
    acc.manual_seed(5)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(5).get_state())
    torch.set_rng_state(state)
    with acc.stream(acc.Stream()):
        acc.current_stream().wait_stream(acc.Stream())
    assert torch.distributed.is_hccl_available() is False
    torch.cuda.set_device(torch.device("cpu"))  # shardformer's GPT-2 forward, per block: a no-op for a CPU tensor
    with pytest.raises(ValueError, match="Expected a cuda device"):  # anything else still reaches torch's own
        torch.cuda.set_device(torch.device("meta"))


def test_zero_sanity_check_keeps_the_dtype_check():
    from types import SimpleNamespace

    from tasks.engine import cpu_compat

    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float32))
    fake = SimpleNamespace(optim=SimpleNamespace(param_groups=[{"params": [p]}]), _dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="same dtype"):
        cpu_compat._zero_sanity_checks(fake)
    fake._dtype = torch.float32
    cpu_compat._zero_sanity_checks(fake)


# -- faults ---------------------------------------------------------------------------------------------


def test_fault_specs_parse():
    got = faults.parse("kill@step=3@phase=cpt; kill@save=6:manifest ;fail@phase=sft;fail@step=4@rank=0")
    assert [(f.action, f.trigger, f.step, f.part, f.phase, f.rank) for f in got] == [
        ("kill", "step", 3, None, "cpt", None),
        ("kill", "save", 6, "manifest", None, None),
        ("fail", "phase", None, None, "sft", None),
        ("fail", "step", 4, None, None, 0),
    ]
    assert got[0].acting_rank(2) == 1 and got[1].acting_rank(2) == 0 and got[0].acting_rank(1) == 0
    assert faults.parse("") == [] and faults.parse(None) == []


@pytest.mark.parametrize(
    "bad",
    [
        "kil@step=3",
        "kill",
        "kill@step=x",
        "kill@save=3",
        "kill@save=3:nowhere",
        "kill@step=3@phase=rlhf",
        "kill@when=3",
        "kill@step=3@color=red",
        "hold@save=3:model",
        "hold@phase=cpt",
    ],
)
def test_bad_fault_specs_are_errors(bad):
    with pytest.raises(ValueError, match="CPT_TO_SFT_FAULT"):
        faults.parse(bad)


def test_fault_fires_once_per_stage_dir(tmp_path):
    inj = faults.Injector("sft", tmp_path, rank=0, world_size=2, value="fail@phase=sft;fail@step=2@phase=cpt")
    assert len(inj.faults) == 1  # the cpt-only spec is dropped in sft
    other_rank = faults.Injector("sft", tmp_path, rank=1, world_size=2, value="fail@phase=sft")
    with pytest.raises(RuntimeError, match="injected failure"):
        inj.at_start()
    with pytest.raises(RuntimeError, match="injected failure"):
        other_rank.at_start()  # same attempt: fires on every rank even though rank 0 marked it first
    assert list((tmp_path / ".faults").iterdir())
    retry = faults.Injector("sft", tmp_path, rank=0, world_size=2, value="fail@phase=sft")
    retry.at_start()  # marked by the earlier attempt: the retry runs on


def test_hold_waits_for_the_notice_then_runs_on(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(faults, "HOLD_S", 60.0)  # a hold that should not wait would take this long
    polls = []

    def noticed() -> bool:  # the notice arrives on the third look
        polls.append(1)
        return len(polls) >= 3

    inj = faults.Injector("cpt", tmp_path, rank=0, world_size=2, value="hold@step=1")
    inj.after_step(0, noticed=noticed)
    assert polls == []  # not its step
    inj.after_step(1, noticed=noticed)
    assert len(polls) == 3
    t0 = time.monotonic()
    retry = faults.Injector("cpt", tmp_path, rank=0, world_size=2, value="hold@step=1")
    retry.after_step(1, noticed=lambda: False)  # marked: a requeued attempt does not wait again
    other = faults.Injector("cpt", tmp_path / "b", rank=1, world_size=2, value="hold@step=1@rank=0")
    other.after_step(1, noticed=lambda: False)  # rank=0 only: rank 1 runs on
    assert time.monotonic() - t0 < 30


# -- LR schedule --------------------------------------------------------------------------------------


def test_lr_schedule_shapes():
    from tasks.engine.optim import lr_factor

    kw = dict(warmup=2, max_steps=10, min_ratio=0.1)
    cos = [lr_factor(s, schedule="cosine", **kw) for s in range(10)]
    assert cos[:3] == [0.5, 1.0, 1.0] and math.isclose(lr_factor(10, schedule="cosine", **kw), 0.1)
    assert all(a >= b for a, b in itertools.pairwise(cos[1:]))
    assert lr_factor(6, schedule="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(9, schedule="constant", **kw) == 1.0


def test_scheduler_state_loads_weights_only(tmp_path):
    from tasks.engine.optim import make_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    sched = make_scheduler(opt, _phase_cfg({"name": "torch_ddp", "precision": "fp32"}, warmup_steps=2))
    for _ in range(3):
        opt.step()
        sched.step()
    torch.save(sched.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    assert state["last_epoch"] == 3


# -- job file ------------------------------------------------------------------------------------------


def test_job_errors_name_every_key(tmp_path):
    with pytest.raises(ConfigError) as exc:
        parse_job({"verb": "fly", "phase": "ppo", "model_dir": "rel/path", "extra": 1}, verb="train")
    fields = {f for f, _ in exc.value.problems}
    assert {
        "verb",
        "phase",
        "model_dir",
        "extra",
        "phase_cfg",
        "trust_remote_code",
        "tokenizer_dir",
        "stage_dir",
        "config_digest",
    } <= fields


# -- checkpoints -------------------------------------------------------------------------------------


def _fake_ckpt(stage_dir: Path, step: int, phase: str = "cpt", digest: str = "d", key: str = "phase") -> Path:
    d = stage_dir / ckpt.step_name(step)
    (d / "model").mkdir(parents=True)
    (d / "model" / "model.safetensors.index.json").write_text("{}")
    (d / "lr_scheduler.pt").write_bytes(b"x")
    (d / "train_state.json").write_text(json.dumps({"step": step}))
    write_manifest(d, kind=ckpt.KIND, meta={key: phase, "step": step}, config_digest=digest)
    return d


def test_a_run_root_written_when_the_phase_was_called_stage_still_resumes(tmp_path):
    """Job files, checkpoint manifests and engine records written before the rename name the phase
    "stage": each is read as its phase (writers write "phase"); a job file giving both is refused."""
    from tasks.core.config.load import parse_config
    from tasks.core.config.phases import phase_of
    from tasks.core.run.job import Job
    from tests.conftest import tiny_config_raw

    assert (phase_of({"stage": "sft"}), phase_of({"phase": "dpo", "stage": "train_dpo"}), phase_of({})) == (
        "sft",
        "dpo",
        None,
    )
    _fake_ckpt(tmp_path / "cpt", 3, key="stage")  # an interrupted run's checkpoint
    assert ckpt.find_resume(tmp_path / "cpt", "cpt", "d").step == 3
    assert ckpt.find_resume(tmp_path / "cpt", "sft", "d").step is None  # still another phase's
    cfg = parse_config(tiny_config_raw(tmp_path / "model", tmp_path / "run"))
    new = Job(
        verb="train",
        phase="cpt",
        phase_cfg=cfg.cpt,
        trust_remote_code=False,
        model_dir=tmp_path / "model",
        tokenizer_dir=tmp_path / "model",
        stage_dir=tmp_path / "cpt",
        parent=None,
        config_digest="d",
    )
    raw = new.model_dump(mode="json")
    assert "phase" in raw and "stage" not in raw  # written with the new key only
    old = {("stage" if k == "phase" else k): v for k, v in raw.items()}
    assert parse_job(old, verb="train") == new
    with pytest.raises(ConfigError) as exc:
        parse_job({**raw, "stage": "cpt"})
    assert [f for f, _ in exc.value.problems] == ["stage"]


def test_find_resume_skips_torn_corrupt_and_foreign(tmp_path):
    for s in (0, 3, 6, 9, 12):
        _fake_ckpt(tmp_path, s)
    (tmp_path / "step-000012" / MANIFEST).unlink()  # torn: no manifest
    (tmp_path / "step-000009" / "lr_scheduler.pt").write_bytes(b"y")  # corrupt: same size, other bytes
    _fake_ckpt(tmp_path, 15, digest="other")  # another config
    (tmp_path / ".step-000018.tmp").mkdir()  # an unfinished save
    rp = ckpt.find_resume(tmp_path, "cpt", "d")
    assert rp.step == 6 and rp.path.name == "step-000006"
    why = dict(rp.skipped)
    assert list(why) == ["step-000015", "step-000012", "step-000009"]
    assert "config digest" in why["step-000015"]
    assert f"no {MANIFEST}" in why["step-000012"]
    assert "lr_scheduler.pt fails its sha256" in why["step-000009"]
    assert ckpt.find_resume(tmp_path, "sft", "d").step is None  # wrong stage everywhere
    assert ckpt.remove_leftovers(tmp_path) == [".step-000018.tmp"]
    assert rp.announce("cpt") == (
        "resuming cpt from step-000006: the newest checkpoint whose manifest verifies, skipping 3 newer unusable "
        "one(s) listed above"
    )


def test_a_fresh_run_starts_from_the_sharded_base_and_says_so(tmp_path):
    _fake_ckpt(tmp_path, 0)
    rp = ckpt.find_resume(tmp_path, "cpt", "d")
    assert rp.step == 0 and rp.announce("cpt") == "starting cpt from step-000000: the sharded base model"
    # SFT's step 0 is the CPT model reboost sharded, not the base
    assert rp.announce("sft") == "starting sft from step-000000: the CPT model (cpt/hf), sharded for sft"


def test_gemma3_says_why_it_trains_with_sdpa_beside_transformers_eager_advice():
    from tasks.core.models.families import attention_note

    note = attention_note({"model_type": "gemma3_text", "attn_logit_softcapping": None})
    assert note.startswith("gemma3_text: transformers' advice to train Gemma 3 with eager attention is not taken")
    assert "attn_logit_softcapping" in note and "sdpa computes the same attention as eager" in note
    # where config.json sets soft-capping the advice holds, and the line says so instead
    assert "only eager attention applies it" in attention_note(
        {"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}
    )
    assert attention_note({"model_type": "llama"}) == ""  # no warning from transformers, no line


def test_retention_keeps_step0_and_last_n(tmp_path):
    for s in (0, 2, 4, 6, 8):
        _fake_ckpt(tmp_path, s)
    assert ckpt.retain(tmp_path, keep_last=2) == ["step-000004", "step-000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000", "step-000006", "step-000008"]
    assert ckpt.retain(tmp_path, keep_last=2) == []


def test_commit_replaces_a_stale_directory(tmp_path):
    old = _fake_ckpt(tmp_path, 3)
    tmp = tmp_path / ckpt.tmp_name(3)
    tmp.mkdir()
    (tmp / "new").write_text("1")
    ckpt.commit(tmp, old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003"]
    assert (old / "new").is_file() and not (old / MANIFEST).exists()


def test_checkpoint_blocks_are_sized_by_the_largest_tensor_within_floor_and_default():
    def llama(hidden: int, inter: int, vocab: int, layers: int = 2) -> dict:
        return {
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": inter,
            "vocab_size": vocab,
            "num_hidden_layers": layers,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
        }

    assert ckpt.save_shard_mib(llama(1024, 2560, 32000), 4) == 125  # the embedding, 32000 x 1024 fp32
    assert ckpt.save_shard_mib(llama(1024, 2560, 32000), 2) == ckpt.SAVE_SHARD_FLOOR_MIB  # 62.5 MiB in bf16
    assert (
        ckpt.save_shard_mib(llama(64, 128, 512), 4) == ckpt.SAVE_SHARD_FLOOR_MIB
    )  # the demo model: one file, as before
    assert (
        ckpt.save_shard_mib(llama(8192, 28672, 128256), 2) == ckpt.COLOSSALAI_SHARD_MIB
    )  # 70B: never above the default
    assert ckpt.save_shard_mib({"model_type": "not-a-family"}, 4) == ckpt.COLOSSALAI_SHARD_MIB


def test_rng_round_trip_is_json_and_safetensors(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)
    ckpt.write_rng(tmp_path, 1, ckpt.capture_rng())
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    assert ckpt.restore_rng(tmp_path, 1)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-00001.json", "rank-00001.safetensors"]
    assert not ckpt.restore_rng(tmp_path, 0)


# -- output ----------------------------------------------------------------------------------------


def test_rank_prefix_writes_whole_lines():
    from tasks.engine.rankio import RankPrefixed

    buf = io.StringIO()
    s = RankPrefixed(buf, "[rank 3] ")
    s.write("a\nb")
    s.write("c\n\n")
    s.flush()
    s.write("tail")
    assert buf.getvalue() == "[rank 3] a\n[rank 3] bc\n[rank 3] \n"
    s.close_partial()
    assert buf.getvalue().endswith("[rank 3] tail\n")
