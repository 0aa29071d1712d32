"""Unit tier: the dpo phase's rows of the stage table, the gate's DPO limits and the record of the DPO figures.

    .venv/bin/python -m pytest -q -m "" tests/test_dpo_stages.py

A run without a `dpo:` section has today's rows, each the table's row itself (so every digest is
today's); with it, the phase's rows run in table order and the export, evaluate_sft and the gate
follow by their rows' `with_phase`. The whole flow with DPO: tests/test_dpo_flow.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from support import REPO

SAMPLE = REPO / "data" / "sample" / "dpo.jsonl"
TODAY = (
    "load_from_hf",
    "prepare_cpt",
    "prepare_sft",
    "boost_and_shard",
    "train_cpt",
    "unshard",
    "evaluate_cpt",
    "reboost",
    "train_sft",
    "export",
    "evaluate_sft",
    "benchmark",
    "gate",
    "push_to_hub",
)
DPO_ROWS = ("prepare_dpo", "unshard_sft", "reference", "reboost_dpo", "train_dpo", "evaluate_dpo")


def _cfg(tmp_path, dpo: bool, **gate):
    from support.tiny import tiny_config_raw
    from tasks.core.config.load import parse_config

    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    if dpo:
        raw["dpo"] = {
            "data": {"uri": str(SAMPLE)},
            "plugin": {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
            "max_steps": 4,
            "seq_len": 128,
            "lr": 1.0e-5,
        }
    raw["gate"] = {**(raw.get("gate") or {}), **gate}
    return parse_config(raw)


def test_without_dpo_the_run_has_todays_rows_each_the_tables_own():
    from tasks.core.run.stages import STAGE, run_stages

    rows = run_stages(("cpt", "sft"))
    assert tuple(s.name for s in rows) == TODAY
    assert all(s is STAGE[s.name] for s in rows)  # not a copy: every digest and read is today's


def test_with_dpo_the_phases_rows_run_in_order_and_the_export_follows_the_last_phase():
    from tasks.core.run.stages import STAGE, exported_phase, run_stage, run_stages

    phases = ("cpt", "sft", "dpo")
    names = [s.name for s in run_stages(phases)]
    assert [n for n in names if n not in DPO_ROWS] == list(TODAY)
    assert names[names.index("train_sft") + 1 : names.index("export")] == [
        "unshard_sft",
        "reference",
        "reboost_dpo",
        "train_dpo",
    ]
    assert names.index("prepare_dpo") < names.index("boost_and_shard")  # every prepare before the first launch
    assert names.index("evaluate_sft") < names.index("evaluate_dpo") < names.index("gate")
    export = run_stage(phases, "export")
    assert (export.source, export.parents, export.reads) == ("dpo", ("train_dpo",), ("train_dpo",))
    assert exported_phase(phases) == "dpo" and exported_phase(("cpt", "sft")) == "sft"
    ev = run_stage(phases, "evaluate_sft")  # the SFT model is sft/hf now; the generation check stays the export's
    assert ev.parents == ("unshard", "unshard_sft", "export") and ev.source == "sft/hf"
    assert run_stage(phases, "gate").reads == (*STAGE["gate"].reads, "evaluate_dpo")
    assert run_stage(phases, "train_dpo").reads == ("reboost_dpo", "reference")
    assert run_stage(phases, "reboost_dpo").parents == ("unshard_sft", "prepare_dpo", "reference")
    with pytest.raises(KeyError, match="'train_dpo' is a row of the dpo phase, which this run does not train"):
        run_stage(("cpt", "sft"), "train_dpo")


def test_the_digests_follow_the_rows_a_run_has(tmp_path):
    from tasks.core.run.digest import config_digest, digest_fields

    plain, dpo = _cfg(tmp_path, False), _cfg(tmp_path, True)
    # every stage of a run without dpo: the same fields as with it (the phase adds rows, changes no other field)
    assert all(digest_fields(plain, n) == digest_fields(dpo, n) for n in TODAY)
    assert config_digest(plain, "export", {"train_sft": "a"}) != config_digest(dpo, "export", {"train_dpo": "a"})
    with pytest.raises(ValueError, match=r"its StageSpec declares \['train_dpo'\]"):
        config_digest(dpo, "export", {"train_sft": "a"})
    with pytest.raises(KeyError, match="dpo phase, which this run does not train"):
        digest_fields(plain, "reference")
    assert "dpo" in digest_fields(dpo, "reboost_dpo") and "dpo.plugin" not in str(digest_fields(dpo, "reboost_dpo"))


def test_every_row_of_a_dpo_run_has_real_digest_fields_and_a_task_taking_what_it_reads(tmp_path):
    import flows.cpt_to_sft  # noqa: F401 - binds every stage module's task
    from tasks.core.run.digest import digest_fields
    from tasks.core.run.stages import run_stages
    from tasks.flowkit import pipeline

    cfg = _cfg(tmp_path, True)
    rows = run_stages(cfg.phases)
    for i, spec in enumerate(rows):
        earlier = {s.name for s in rows[:i]}
        assert set(spec.reads) <= earlier and set(spec.parents) <= earlier, f"{spec.name} reads a later stage"
        if spec.artifact is not None and not spec.continues:
            digest_fields(cfg, spec.name)  # every declared path resolves on a dpo config, or this raises naming it
        results = {s.name: f"<{s.name}>" for s in rows}
        args = pipeline.arguments(spec, pipeline.TASKS[spec.name], cfg, results)
        assert [results[r] for r in spec.reads] == [a for a in args if a in results.values()], spec.name


def test_stop_after_a_dpo_stage_is_refused_for_a_run_without_dpo():
    from tasks.core.errors import ConfigError
    from tasks.flowkit.run import check_stop_after

    check_stop_after("train_dpo")  # a row of the table: the command line takes it
    check_stop_after("train_dpo", ("cpt", "sft", "dpo"))
    with pytest.raises(ConfigError) as err:
        check_stop_after("train_dpo", ("cpt", "sft"))
    ((field, message),) = err.value.problems
    assert field == "stop_after" and "is no stage of this run (its phase is not configured)" in message
    assert "train_dpo" not in message.split("use one of: ")[1]


# ---------------------------------------------------------------------------------------------
# the gate's limits


def _dpo_metrics(accuracy=0.75, margin=0.4, sft_tok=-1.0, dpo_tok=-1.6):
    side = lambda acc, m, tok: {
        "accuracy": acc,
        "margin": m,
        "chosen_logp": tok * 10,
        "chosen_logp_per_token": tok,
        "loss": math.log(2),
        "prefers_chosen": 0.5,
    }
    return {"pairs": 4, "sft": side(0.0, 0.0, sft_tok), "dpo": side(accuracy, margin, dpo_tok)}


def _verdict(gate_fields, dpo, trains=True):
    from tasks.core.config.outputs import GateConfig
    from tasks.core.evaluation.verdict import gate_verdict

    gate = GateConfig(
        sft_loss_must_improve=False, generation_must_stop=False, cpt_max_ppl_increase_pct=None, **gate_fields
    )
    return gate_verdict(gate, None, None, None, dpo, trains_dpo=trains)


def test_the_gate_sees_a_wider_margin_bought_with_less_likely_good_answers():
    m = _dpo_metrics()  # margin up, accuracy 0.75, chosen replies 0.6 nats/token less likely
    ok = _verdict({"dpo_min_accuracy": 0.7}, m)
    assert ok["passed"] and {c["check"] for c in ok["checks"]} == {"dpo_accuracy", "dpo_margin"}
    held = _verdict({"dpo_max_chosen_logp_drop": 0.5}, m)
    assert not held["passed"]
    (reason,) = held["reasons"]
    assert "a drop of 0.6000 nats, at most 0.5 by gate.dpo_max_chosen_logp_drop" in reason
    assert not _verdict({"dpo_min_accuracy": 0.8}, m)["passed"]
    low = _verdict({}, _dpo_metrics(margin=-0.1))  # the default: the margin must be above 0
    assert low["reasons"] == ["DPO held-out reward margin -0.1000 (must be above 0 by gate.dpo_min_margin)"]


def test_the_dpo_limits_apply_only_to_a_run_that_trains_dpo():
    assert _verdict({"dpo_min_accuracy": 0.9}, None, trains=False) == {
        "enabled": True,
        "passed": True,
        "reasons": [],
        "checks": [],
    }
    missing = _verdict({}, None)  # trained, but no held-out pairs evaluated: the limit cannot be checked
    assert missing["reasons"] == [
        "no DPO evaluation was recorded (dpo.eval has no held-out pairs); gate.dpo_min_margin is set"
    ]


# ---------------------------------------------------------------------------------------------
# the record: the card, the console's table


def test_the_dpo_figures_stand_beside_the_sft_models_in_the_card_and_the_console():
    from tasks.core.hub.outcome import evaluation_section
    from tasks.core.run.trainlog import key_figure

    m = _dpo_metrics()
    verdict = _verdict({"dpo_min_accuracy": 0.7, "dpo_max_chosen_logp_drop": 0.5}, m)
    ran = {s: {"status": "completed"} for s in ("evaluate_cpt", "evaluate_sft", "benchmark", "evaluate_dpo")}
    text = evaluation_section({"dpo": m}, {"gate": {"status": "failed-gate", "detail": verdict}, **ran})
    assert "| DPO held-out preference accuracy | SFT 0.0000 | DPO 0.7500 | +0.7500 | pass |" in text
    assert "| chosen replies' log-likelihood per token | SFT -1.0000 | DPO -1.6000 | -0.6000 | FAIL |" in text
    assert "Every evaluation ran: `evaluate_cpt`, `evaluate_sft`, `benchmark`, `evaluate_dpo`." in text
    assert "evaluate_dpo" not in evaluation_section({}, {"gate": {"status": "passed", "detail": {}}})
    row = {"stage": "evaluate_dpo", "status": "completed", "detail": {"metrics": m}}
    assert key_figure(row) == "preference accuracy 0.75, margin 0.4; chosen log-likelihood/token -1.000 → -1.600"


def test_the_held_out_pairs_score_the_sft_model_against_itself_at_margin_zero(tiny_model_dir, tmp_path):
    """evaluate_dpo's computation on real prepared pairs: a model against itself is the starting point."""
    from tasks.core.config.preference import PAIR_FIELDS_DEFAULT
    from tasks.core.data.prepare import prepare
    from tasks.core.evaluation.reference import PairScoring, evaluate_pairs

    lines = SAMPLE.read_text().splitlines()[:8]
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    prepare(
        str(tmp_path / "pairs.jsonl"),
        tiny_model_dir,
        tmp_path / "prep",
        kind="dpo",
        field=PAIR_FIELDS_DEFAULT,
        seq_len=128,
        heldout_fraction=0.5,
    )
    m = evaluate_pairs(tiny_model_dir, tiny_model_dir, tmp_path / "prep", PairScoring(beta=0.1))
    assert m["pairs"] > 0 and m["sft"] == m["dpo"] and m["chosen_logp_change"] == 0.0
    assert m["dpo"]["margin"] == 0.0 and m["dpo"]["loss"] == pytest.approx(math.log(2))
    assert m["dpo"]["chosen_logp"] < 0 and 0.0 <= m["dpo"]["prefers_chosen"] <= 1.0


def test_a_dpo_run_takes_an_sft_adapter_and_a_pair_mixture_and_its_limits_need_held_out_pairs(tmp_path):
    from support.tiny import tiny_config_raw
    from tasks.core.config.load import parse_config
    from tasks.core.errors import ConfigError
    from tasks.core.hub.card import adapter_card

    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    raw["sft"]["lora"] = {"r": 4, "alpha": 8}  # unshard_sft merges it into sft/hf, DPO's start
    raw["dpo"] = {
        "data": {"sources": [{"name": n, "uri": str(SAMPLE), "weight": 0.5} for n in ("a", "b")]},
        "plugin": {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
        "max_steps": 4,
        "seq_len": 128,
        "lr": 1.0e-5,
        "eval": {"heldout_fraction": 0.0},
    }
    raw["hub"] = {"repo_id": "org/m", "push_adapter": True}
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    said = dict(err.value.problems)
    assert set(said) == {"gate.dpo_min_margin", "hub.push_adapter"}, said  # the pair mixture is no problem
    assert "needs a DPO held-out set" in said["gate.dpo_min_margin"]
    # the export takes DPO's model: SFT's adapter is merged into it, so there is no adapter to push
    assert (
        "DPO trains the whole model (dpo.lora is not set), and the export is its model; set dpo.lora"
        in said["hub.push_adapter"]
    )
    raw["dpo"]["lora"] = {"r": 4, "alpha": 8}  # DPO's own adapter on sft/hf: the one pushed
    raw["dpo"]["eval"] = {"heldout_fraction": 0.1}
    raw["hub"]["adapter_repo_id"] = "org/m-adapter"
    cfg = parse_config(raw)
    assert cfg.sft.lora is not None and cfg.dpo.lora is not None and cfg.dpo.data.mixture
    # the adapter pushed alone is DPO's, based on sft/hf, and its card says so
    card = adapter_card(cfg, {"meta": {"base": {"digest": "d" * 64, "name_or_path": "/runs/x/sft/hf"}}})
    assert "the model the run's DPO started from (`sft/hf`" in card and 'from_pretrained("path/to/sft/hf")' in card
    del raw["dpo"]  # without the phase: none applies, and SFT's adapter is the one pushed
    parse_config(raw)


@pytest.mark.parametrize("streamed", [False, True])
def test_unshard_sft_merges_an_sft_adapter_into_a_plain_fp32_model(tiny_model_dir, tmp_path, streamed):
    """sft.lora before DPO: unshard_sft's conversion of a LoRA checkpoint is the adapter merged onto cpt/hf
    (the whole-model merge and the streamed one), a plain fp32 HF folder whose logits are peft's and whose
    untouched tensors are the base's bitwise: the model DPO boosts, scores and compares."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from support.tiny import tiny_config_raw
    from tasks.core.config.load import parse_config
    from tasks.core.models.folder import folder_problems
    from tasks.stages.unshard import hf_of_checkpoint

    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["sft"]["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    raw["dpo"] = {"data": {"uri": str(SAMPLE)}, "plugin": {"name": "torch_ddp", "precision": "fp32"}}
    raw["dpo"].update(max_steps=2, seq_len=128, lr=1e-5)
    if streamed:  # a budget under the model's bytes: the merge and its proof a layer at a time
        raw["verify_memory_gb"] = 1e-6
    cfg = parse_config(raw)
    torch.manual_seed(0)  # an adapter as SFT leaves it: B trained away from zero, so the merge changes q and v
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    peft.save_pretrained(tmp_path / "ckpt" / "adapter", safe_serialization=True)
    built = hf_of_checkpoint(cfg, "sft", tmp_path / "ckpt", tmp_path / "sft-hf", tiny_model_dir)
    v = built["verification"]
    layers = peft.config.num_hidden_layers
    assert v["lora"]["touched"] == 2 * layers and v["lora"]["merge"] == ("streamed" if streamed else "whole")
    assert built["context"] == {} and not folder_problems(tmp_path / "sft-hf")  # no adapter file beside the weights
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "sft-hf")  # plain transformers: no peft needed
    assert merged.dtype == torch.float32 and not any("lora" in k for k in merged.state_dict())
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        want = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), tmp_path / "ckpt" / "adapter"
        )(ids).logits
        got = merged(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    base = {k: x for f in sorted(tiny_model_dir.glob("*.safetensors")) for k, x in load_file(f).items()}
    out = {k: x for f in sorted((tmp_path / "sft-hf").glob("*.safetensors")) for k, x in load_file(f).items()}
    changed = {k for k in out if not torch.equal(out[k], base[k].float())}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed


def test_preflight_names_a_bad_pair_of_a_mixture_source_by_its_field_file_and_line(tmp_path):
    """Before any launch: each source of a pair mixture read by the pair reader, a bad pair named by the source's
    field, its file and its line."""
    from tests.test_preflight import Case, write_jsonl

    case = Case(tmp_path)
    good = json.loads(SAMPLE.read_text().splitlines()[0])
    bad = write_jsonl(tmp_path / "b.jsonl", [good, {"prompt": "Hi", "chosen": "Same.", "rejected": "Same."}])
    mix = [{"name": "a", "uri": str(SAMPLE), "weight": 0.7}, {"name": "b", "uri": bad, "weight": 0.3}]
    dpo = {"data": {"sources": mix}, "plugin": {"name": "torch_ddp"}, "max_steps": 2, "seq_len": 128, "lr": 1e-5}
    case.raw["dpo"] = dpo
    report = case.report()
    said = [msg for field, msg in report.problems if field == "dpo.data.sources[1] (b).uri"]
    assert len(said) == 1 and f"{bad}:2" in said[0] and "hold the same reply" in said[0], report.text()
    assert not [f for f, _ in report.problems if f.startswith("dpo.data.sources[0]")], report.text()
