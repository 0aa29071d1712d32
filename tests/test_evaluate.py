"""Unit tier: held-out splits, evaluation metrics, the generation check and the publish gate.

.venv/bin/python -m pytest -q tests/test_evaluate.py
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from tasks.core.config.load import parse_config
from tasks.core.config.outputs import GateConfig
from tasks.core.config.schema import EvalConfig
from tasks.core.data.records import read_records
from tasks.core.data.split import overlap, record_id, split_by_fraction, split_by_heldout
from tasks.core.errors import ConfigError
from tasks.core.evaluation import heldout as ev
from tasks.core.evaluation import verdict as gv
from tasks.core.evaluation.generation import generation_check, generation_eos_problem, prompt_messages, stop_problem
from tasks.core.run import meter
from tests.conftest import REPO, tiny_config_raw

SAMPLE = REPO / "data" / "sample"


@pytest.fixture(scope="module")
def cpt_records():
    return read_records(str(SAMPLE / "cpt.jsonl"))


@pytest.fixture(scope="module")
def sft_records():
    return read_records(str(SAMPLE / "sft.jsonl"))


# ------------------------------------------------------------------------------------------------
# Split


@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.1, 0.3])
def test_split_never_shares_a_record(sft_records, cpt_records, fraction):
    for records in (sft_records, cpt_records):
        s = split_by_fraction(records, fraction)
        assert not overlap(s)
        assert len(s.train) + len(s.heldout) == len(records) and s.heldout and s.train
        assert s.info["heldout_records"] == len(s.heldout) and s.info["method"] == "hash-fraction"


def test_split_is_deterministic_and_order_independent(sft_records):
    a = split_by_fraction(sft_records, 0.1)
    shuffled = list(sft_records)
    random.Random(7).shuffle(shuffled)
    b = split_by_fraction(shuffled, 0.1)
    assert {record_id(r) for r in a.heldout} == {record_id(r) for r in b.heldout}
    assert (
        a.info["heldout_ids_sha256"] == b.info["heldout_ids_sha256"]
        and a.info["train_ids_sha256"] == b.info["train_ids_sha256"]
    )
    # Within a side, records keep file order; appending data never moves an old record across.
    assert a.heldout == [r for r in sft_records if record_id(r) in {record_id(x) for x in a.heldout}]
    extra = split_by_fraction(
        sft_records
        + [
            {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(50)
        ],
        0.1,
    )
    assert {record_id(r) for r in a.heldout} <= {record_id(r) for r in extra.heldout}


def test_split_sends_duplicates_to_one_side_and_holds_out_at_least_one():
    records = [{"text": "same"}] * 5 + [{"text": f"t{i}"} for i in range(4)]
    s = split_by_fraction(records, 0.001)  # no hash falls that low: the lowest id is held out
    assert len({record_id(r) for r in s.heldout}) == 1 and not overlap(s)
    held = record_id(s.heldout[0])
    assert all(record_id(r) != held for r in s.train)
    with pytest.raises(ValueError, match="cannot be split"):
        split_by_fraction([{"text": "x"}] * 3, 0.1)


def test_split_by_heldout_uri_drops_identical_training_records(sft_records):
    heldout = sft_records[:10]
    s = split_by_heldout(sft_records, heldout, "s3://b/heldout.jsonl")
    assert not overlap(s) and s.heldout == heldout
    assert s.info["dropped_from_train"] == len(sft_records) - len(s.train) >= 10
    with pytest.raises(ValueError, match="nothing left to train on"):
        split_by_heldout(heldout, heldout, "x.jsonl")


def test_prepared_data_holds_the_split_and_refuses_another_tokenizer(tmp_path, tiny_model_dir):
    """Evaluation reads the held-out records prepare_data kept (split_by_fraction's, in file order);
    a model whose tokenizer differs from the shards' is refused naming both fingerprints."""
    import shutil

    from tasks.core.data.index import tokenizer_fingerprint
    from tasks.core.data.prepare import prepare
    from tasks.core.data.split import split_by_fraction
    from tasks.core.data.stage_data import check_against_model, heldout_records, split_info

    records = read_records(str(SAMPLE / "sft.jsonl"))
    prepare(
        str(SAMPLE / "sft.jsonl"),
        tiny_model_dir,
        tmp_path / "data",
        kind="sft",
        field="messages",
        seq_len=64,
        heldout_fraction=0.1,
    )
    split = split_by_fraction(records, 0.1)
    assert heldout_records(tmp_path / "data") == split.heldout
    info = split_info(tmp_path / "data", "data/sample/sft.jsonl")
    assert info["method"] == "hash-fraction" and info["heldout_records"] == len(split.heldout)
    assert info["train_records"] + info["dropped_no_labels"] + info["truncation"]["dropped"] == len(
        split.train
    )  # sft.truncation: drop
    assert check_against_model(tmp_path / "data", tiny_model_dir, "sft")["tokenizer_sha256"] == tokenizer_fingerprint(
        tiny_model_dir
    )
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 77  # any byte change makes it another tokenizer
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not the one .* was prepared with") as e:
        check_against_model(tmp_path / "data", other, "sft")
    assert tokenizer_fingerprint(other) in str(e.value) and tokenizer_fingerprint(tiny_model_dir) in str(e.value)


def test_training_digest_changes_with_the_split_only(tiny_model_dir, tmp_path):
    from tasks.core.run.digest import config_digest

    def stage_config_digest(cfg, stage, parent, data):  # the digest of boost_and_shard, carried on by train_cpt
        return config_digest(cfg, "boost_and_shard", {"load_from_hf": parent, "prepare_cpt": data})

    raw = tiny_config_raw(tiny_model_dir, tmp_path)
    d0 = stage_config_digest(parse_config(raw), "cpt", "p", "d")
    raw["cpt"]["eval"] = {"batch_size": 2, "max_batches": 3, "dtype": "bf16"}
    assert stage_config_digest(parse_config(raw), "cpt", "p", "d") == d0  # evaluation knobs never re-train
    raw["cpt"]["eval"] = {"heldout_fraction": 0.2}
    assert stage_config_digest(parse_config(raw), "cpt", "p", "d") != d0
    raw["gate"] = {"enabled": False}
    assert stage_config_digest(parse_config(raw), "cpt", "p", "d") == stage_config_digest(
        parse_config({**raw, "gate": {}}), "cpt", "p", "d"
    )
    # Where the data was tokenized never re-trains; the prepared data itself (its content) does.
    d1 = stage_config_digest(parse_config(raw), "cpt", "p", "d")
    raw["cpt"]["data"] = {**raw["cpt"]["data"], "tokenize": {"local_cluster": {"n_workers": 2}}}
    assert stage_config_digest(parse_config(raw), "cpt", "p", "d") == d1
    assert stage_config_digest(parse_config(raw), "cpt", "p", "another data manifest") != d1


def test_gate_config_needs_the_heldout_sets_it_measures(tiny_model_dir, tmp_path):
    from tasks.core.config import schema as mod

    raw = tiny_config_raw(tiny_model_dir, tmp_path)
    raw["sft"]["eval"] = {"heldout_fraction": 0}
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert {"gate.sft_loss_must_improve", "gate.generation_must_stop"} <= {f for f, _ in info.value.problems}
    raw["gate"]["enabled"] = False
    parse_config(raw)  # a disabled gate needs nothing
    for model in (mod.EvalConfig, mod.GateConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


# ------------------------------------------------------------------------------------------------
# Metrics


def test_identical_models_give_identical_metrics_equal_to_transformers_loss(tiny_model_dir, cpt_records, sft_records):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = EvalConfig(batch_size=64)
    held = split_by_fraction(cpt_records, 0.05).heldout
    m = ev.evaluate_cpt(tiny_model_dir, tiny_model_dir, held, "text", 64, cfg)
    assert m["base"] == m["cpt"] and m["perplexity_change_pct"] == 0.0 and m["tokens"] == m["sequences"] * 63
    # Reference: transformers' own mean loss over the same packed blocks (one batch).
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = ev.cpt_batch(tok, held, "text", 64, cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = float(model(input_ids=batch["input_ids"], labels=batch["labels"]).loss)
    assert m["base"]["loss"] == pytest.approx(ref, rel=1e-5)
    assert m["base"]["perplexity"] == pytest.approx(torch.tensor(ref).exp().item(), rel=1e-5)
    # Batch size is memory only; each batch scored is progress, with an ETA (the stage's lines)
    records: list[dict] = []
    with meter.reporting(records.append, interval_s=0):
        small = ev.evaluate_cpt(tiny_model_dir, tiny_model_dir, held, "text", 64, EvalConfig(batch_size=3))
    assert small["base"]["loss"] == pytest.approx(m["base"]["loss"], rel=1e-6)
    done = [r for r in records if r["finished"]]
    assert len(done) == 2 and all(r["done"] == r["total"] == m["sequences"] for r in done), records
    assert any(0 < r["done"] < r["total"] and r["eta_s"] is not None for r in records)

    s = ev.evaluate_sft(
        tiny_model_dir, tiny_model_dir, split_by_fraction(sft_records, 0.1).heldout, "messages", 128, cfg
    )
    assert s["pre_sft"] == s["sft"] and s["loss_change"] == 0.0 and s["tokens"] > 0


def test_max_batches_limits_the_evaluated_rows(tiny_model_dir, cpt_records):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = ev.cpt_batch(tok, cpt_records[:40], "text", 64, EvalConfig(batch_size=2, max_batches=3))
    assert batch["input_ids"].shape == (6, 64)
    with pytest.raises(ValueError, match="heldout_fraction"):
        ev.cpt_batch(tok, cpt_records[:1], "text", 4096, EvalConfig())


# ------------------------------------------------------------------------------------------------
# Generation check


@pytest.fixture()
def model_copy(tiny_model_dir, tmp_path):
    d = tmp_path / "export"
    shutil.copytree(tiny_model_dir, d)
    return d


def test_generation_check_fails_when_generation_config_lacks_end_of_turn(model_copy, sft_records):
    path = model_copy / "generation_config.json"
    gen = json.loads(path.read_text())
    assert gen["eos_token_id"] == [1, 4]  # <|end_of_text|>, <|im_end|>
    gen["eos_token_id"] = 1
    path.write_text(json.dumps(gen))
    records: list[dict] = []
    with meter.reporting(records.append, interval_s=0):
        summary, rows = generation_check(model_copy, sft_records[:3], "messages", max_new_tokens=4, num_prompts=2)
    assert [(r["done"], r["total"], r["finished"]) for r in records] == [(0, 2, False), (1, 2, False), (2, 2, True)]
    assert records[1]["eta_s"] is not None and "greedy generations of" in records[0]["what"]
    assert summary["passed"] is False and summary["end_of_turn"] == {"id": 4, "token": "<|im_end|>"}
    assert (
        "generation_config.json eos_token_id [1] lacks the chat template's end-of-turn token '<|im_end|>' (id 4)"
        in summary["problems"][0]
    )
    assert len(rows) == 2 and all(r["prompt"][-1]["role"] == "user" and r["new_tokens"] <= 4 for r in rows)
    verdict = gv.gate_verdict(
        GateConfig(), None, {"pre_sft": {"loss": 2.0}, "sft": {"loss": 1.0}, "generation": summary}
    )
    assert any("lacks the chat template's end-of-turn token" in r for r in verdict["reasons"])
    path.unlink()
    summary, _ = generation_check(model_copy, sft_records[:1], "messages", max_new_tokens=2, num_prompts=1)
    assert "generation_config.json is missing" in summary["problems"][0]


def test_generation_eos_check_passes_on_the_demo_model(tiny_model_dir):
    from transformers import AutoTokenizer

    eos, eot, problem = generation_eos_problem(tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert problem is None and eot == 4 and eos == [1, 4]
    assert prompt_messages(
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "a2"},
        ]
    )[-1] == {"role": "user", "content": "u2"}


# ------------------------------------------------------------------------------------------------
# Gate


def _cpt(base_ppl=100.0, cpt_ppl=50.0):
    return {
        "base": {"loss": 4.6, "perplexity": base_ppl},
        "cpt": {"loss": 3.9, "perplexity": cpt_ppl},
        "perplexity_change_pct": 100 * (cpt_ppl - base_ppl) / base_ppl,
    }


def _sft(pre=2.0, post=1.5, stopped=4, problems=()):
    return {
        "pre_sft": {"loss": pre},
        "sft": {"loss": post},
        "loss_change": post - pre,
        "generation": {
            "passed": stopped == 4 and not problems,
            "problems": list(problems),
            "stopped": stopped,
            "prompts": 4,
            "max_new_tokens": 64,
        },
    }


@pytest.mark.parametrize(
    "gate, cpt, sft, passed, failing",
    [
        ({}, _cpt(), _sft(), True, []),
        ({}, _cpt(cpt_ppl=100.0), _sft(), True, []),  # 0% increase is allowed by default
        ({}, _cpt(cpt_ppl=101.0), _sft(), False, ["cpt_perplexity"]),
        ({"cpt_max_ppl_increase_pct": 5.0}, _cpt(cpt_ppl=104.0), _sft(), True, []),
        ({"cpt_max_ppl_increase_pct": -100.0}, _cpt(), _sft(), False, ["cpt_perplexity"]),  # impossible
        ({"cpt_max_ppl_increase_pct": None}, _cpt(cpt_ppl=1e9), _sft(), True, []),
        ({}, _cpt(), _sft(post=2.0), False, ["sft_loss"]),
        ({"sft_loss_must_improve": False}, _cpt(), _sft(post=3.0), True, []),
        ({}, _cpt(), _sft(stopped=3), False, ["generation_stops"]),
        ({"generation_must_stop": False}, _cpt(), _sft(stopped=0), True, []),
        ({}, None, _sft(), False, ["cpt_perplexity"]),
        ({}, _cpt(cpt_ppl=200.0), _sft(post=9.0, stopped=0), False, ["cpt_perplexity", "sft_loss", "generation_stops"]),
        ({"enabled": False}, _cpt(cpt_ppl=200.0), _sft(post=9.0, stopped=0), True, []),
    ],
)
def test_gate_verdict(gate, cpt, sft, passed, failing):
    v = gv.gate_verdict(GateConfig(**gate), cpt, sft)
    assert v["passed"] is passed
    assert [c["check"] for c in v["checks"] if not c["ok"]] == failing or not v["enabled"]
    assert len(v["reasons"]) == (len(failing) if v["enabled"] else 0)
    if not v["enabled"]:
        assert [c["check"] for c in v["checks"] if not c["ok"]] == [
            "cpt_perplexity",
            "sft_loss",
            "generation_stops",
        ]  # still reported
    rows = gv.metrics_table(cpt, sft, v)
    assert rows and all(set(r) == {"metric", "before", "after", "change", "gate"} for r in rows)


def test_the_gate_states_a_generation_failure_once():
    v = gv.gate_verdict(GateConfig(), _cpt(), _sft(stopped=1, problems=[stop_problem(1, 4, 64)]))
    assert v["reasons"] == ["3 of 4 greedy generations did not stop at an eos token within max_new_tokens=64"]
    eos = "the tokenizer has no eos token"
    v = gv.gate_verdict(GateConfig(), _cpt(), _sft(stopped=4, problems=[eos]))
    assert v["reasons"] == [f"4 of 4 greedy generations stopped within 64 tokens; {eos}"]


def test_cli_exit_status_of_a_failed_gate(monkeypatch, capsys):
    import flows.cpt_to_sft as flow_mod
    from flows.cli import EXIT_FAILED_GATE, flow_main

    summary = {
        "run_root": "/r",
        "complete": False,
        "export": "/r/export",
        "seconds": 1.0,
        "gate": {"status": "failed-gate", "passed": False, "reasons": ["SFT held-out loss 2 vs pre-SFT 1"]},
    }
    from prefect.states import Completed

    # flow_main() asks the flow for its final state (return_state=True) and reads the summary from it.
    monkeypatch.setattr(flow_mod, "cpt_to_sft", lambda **kw: Completed(name="FailedGate", data=summary))
    assert flow_main(["--config", "x.yaml"]) == EXIT_FAILED_GATE == 3
    assert "gate failed, nothing pushed, every artifact kept: SFT held-out loss" in capsys.readouterr().err
    monkeypatch.setattr(
        flow_mod,
        "cpt_to_sft",
        lambda **kw: Completed(data={**summary, "complete": True, "gate": {"status": "passed", "passed": True}}),
    )
    assert flow_main(["--config", "x.yaml"]) == 0


def test_eval_results_for_card_render_a_model_index():
    from huggingface_hub import ModelCardData

    metrics = {
        "cpt": {**_cpt(), "split": {"method": "hash-fraction", "fraction": 0.05, "data_uri": "data/sample/cpt.jsonl"}},
        "sft": {**_sft(), "split": {"method": "heldout-uri", "heldout_uri": "s3://b/chat-heldout.jsonl"}},
    }
    results = gv.eval_results_for_card(metrics)
    yaml_text = ModelCardData(model_name="tiny-demo", eval_results=results).to_yaml()
    assert "model-index:" in yaml_text and "name: tiny-demo" in yaml_text
    assert "value: 50.0" in yaml_text and "type: perplexity" in yaml_text and "chat-heldout.jsonl" in yaml_text
    assert "CPT held-out (0.05 hash split of cpt.jsonl)" in yaml_text
    assert gv.eval_results_for_card({"cpt": None, "sft": None}) == []
