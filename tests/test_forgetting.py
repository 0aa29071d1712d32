"""Held-out perplexity per source of a mixture, and the forgetting gate (`gate.cpt_max_ppl_increase_pct: {general: N}`).

    python -m pytest tests/test_forgetting.py -q

The models are real and small, trained here in-process with plain torch on the project's own data
path (prepared shards, the blended stream walked by ResumableSampler): a tiny Llama first learns
the general text (the "base"), then continues on the Veyra domain either alone at a high learning
rate (it forgets the general text) or in a 70/30 mixture with the general text replayed (it does
not, to within the limit). evaluate_cpt measures both against the base on each source's own
held-out records, and the gate decides; the domain-alone run also has the general text as a
held-out-only source (eval.heldout_sources), which measures the same forgetting without replay.
"""

from __future__ import annotations

import json

import pytest
import torch

from tasks.core.config.load import parse_config
from tasks.core.config.outputs import GateConfig
from tasks.core.config.schema import EvalConfig
from tasks.core.data.blend import BlendPlan, Source
from tasks.core.data.dataset import TokenDataset
from tasks.core.data.prepare import prepare
from tasks.core.data.stage_data import heldout_by_source, heldout_only_names, heldout_records
from tasks.core.errors import ConfigError
from tasks.core.evaluation import heldout as ev
from tasks.core.evaluation import verdict as gv
from tasks.engine.sampler import ResumableSampler
from tests.conftest import REPO, tiny_config_raw

DOMAIN, GENERAL = str(REPO / "data" / "sample" / "cpt.jsonl"), str(REPO / "data" / "sample" / "general.jsonl")
ONLY_GENERAL = {"enabled": True, "sft_loss_must_improve": False, "generation_must_stop": False}


def _prep(root, name, sources, plan=None, **kw):
    out = root / name
    prepare(
        sources, root / "random", out, kind="cpt", field="text", seq_len=64, heldout_fraction=0.1, blend_plan=plan, **kw
    )
    return out


def _train(root, start, data_dir, name, steps, lr):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(start)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ds = TokenDataset(data_dir)
    sampler = ResumableSampler(
        ds.num_items, 0, 1, seed=1, stream=ds.blend()
    )  # a mixture: its blend; one source: permutations
    for _ in range(steps):
        ids = torch.from_numpy(ds.batch(sampler.next_global(8))["input_ids"])
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(root / name)
    AutoTokenizer.from_pretrained(start).save_pretrained(root / name)
    return root / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    root = tmp_path_factory.mktemp("forgetting")
    build_tiny_model(root / "random", build_tokenizer(DEFAULT_CORPUS, vocab_size=512))
    base = _train(root, root / "random", _prep(root, "general", [Source("general", GENERAL)]), "base", 80, 3e-3)
    mix = _prep(root, "mix", [Source("domain", DOMAIN, 0.7), Source("general", GENERAL, 0.3)], BlendPlan(40, 8, 1))
    by_source = heldout_by_source(mix)
    # The general text neither CPT run trains on, as a file of its own: a held-out-only source
    # (eval.heldout_sources) of the domain-alone run, which replays nothing.
    only = root / "general-heldout.jsonl"
    only.write_text("".join(json.dumps(r) + "\n" for r in by_source["general"]))
    domain = _prep(root, "domain", [Source("domain", DOMAIN)], heldout_sources=[Source("general", str(only))])
    alone = _train(root, base, domain, "domain-alone", 40, 1e-2)
    replay = _train(root, base, mix, "replay", 40, 3e-3)
    pooled = heldout_records(mix)

    def evaluate(cpt):
        return ev.evaluate_cpt(base, cpt, pooled, "text", 64, EvalConfig(), by_source=by_source)

    alone_only = ev.evaluate_cpt(
        base,
        alone,
        heldout_records(domain),
        "text",
        64,
        EvalConfig(),
        by_source=heldout_by_source(domain),
        heldout_only=heldout_only_names(domain),
    )
    return {
        "base": base,
        "by_source": by_source,
        "alone": evaluate(alone),
        "replay": evaluate(replay),
        "domain": domain,
        "alone_only": alone_only,
    }


def test_per_source_perplexity_is_each_sources_own_held_out_set(runs):
    by_source = runs["by_source"]
    assert set(by_source) == {"domain", "general"} and all(by_source.values())
    m = runs["replay"]
    for name, records in by_source.items():  # the same number evaluate_one gives on that source's records alone
        alone = ev.evaluate_one(runs["base"], records, "cpt", "text", 64, EvalConfig())
        assert m["sources"][name]["base"]["loss"] == pytest.approx(alone["loss"], rel=1e-9), name
    assert m["sources"]["domain"]["perplexity_change_pct"] < -50  # CPT learned the domain either way


def test_the_forgetting_gate_fails_without_replay_and_passes_with_it(runs):
    gate = GateConfig(cpt_max_ppl_increase_pct={"general": 25.0}, **ONLY_GENERAL)
    alone, replay = gv.gate_verdict(gate, runs["alone"], None), gv.gate_verdict(gate, runs["replay"], None)
    general = runs["alone"]["sources"]["general"]
    assert (
        general["perplexity_change_pct"] > 1000
    )  # domain alone at a high learning rate: the general text is forgotten
    expected = (
        f"source 'general': CPT held-out perplexity {general['cpt']['perplexity']:.4g} vs base "
        f"{general['base']['perplexity']:.4g} "
        f"({general['perplexity_change_pct']:+.2f}%, allowed at most +25% by gate.cpt_max_ppl_increase_pct.general)"
    )
    assert not alone["passed"] and [r for r in alone["reasons"] if r.startswith("source 'general'")] == [expected]
    assert replay["passed"], replay["reasons"]  # 30 % replay: the general text stays within the limit
    assert 0 < runs["replay"]["sources"]["general"]["perplexity_change_pct"] < 25
    # The evaluation table and the model-index carry each source, the table with the gate's word.
    rows = {r["metric"]: r for r in gv.metrics_table(runs["alone"], None, alone)}
    assert (
        rows["CPT held-out perplexity: general"]["gate"] == "FAIL"
        and rows["CPT held-out perplexity: domain"]["gate"] == "pass"
    )
    names = {r.dataset_name for r in gv.eval_results_for_card({"cpt": runs["replay"]}, "m")}
    assert {"CPT held-out of source general", "CPT held-out of source domain"} <= names


def test_a_held_out_only_source_measures_forgetting_without_replay(runs):
    domain, m = runs["domain"], runs["alone_only"]
    # Its records are the held-out set's, never the training data's: the shards and the index's
    # sources are those of the same corpus prepared without it (every shard reused, nothing tokenized).
    index = json.loads((domain / "index.json").read_text())
    again = prepare(
        [Source("domain", DOMAIN)],
        domain.parent / "random",
        domain,
        kind="cpt",
        field="text",
        seq_len=64,
        heldout_fraction=0.1,
    )
    assert again.tokenized == [] and {k: v for k, v in index.items() if k != "heldout_sources"} == again.index
    assert [(s["name"], s["records"]) for s in index["heldout_sources"]] == [
        ("general", len(runs["by_source"]["general"]))
    ]
    # evaluate_cpt measures it like a trained source (the same numbers as the mixture's general held-out split, the same records).
    assert set(m["sources"]) == {"domain", "general"} and m["sources"]["general"]["held_out_only"] is True
    assert "held_out_only" not in m["sources"]["domain"] and m["sources"]["domain"]["perplexity_change_pct"] < -50
    for side in ("base", "cpt"):
        assert m["sources"]["general"][side]["loss"] == pytest.approx(
            runs["alone"]["sources"]["general"][side]["loss"], rel=1e-9
        )
    # The gate limits it by name: domain alone at a high learning rate fails on the general text, naming source and limit.
    v = gv.gate_verdict(GateConfig(cpt_max_ppl_increase_pct={"general": 25.0}, **ONLY_GENERAL), m, None)
    assert [c["check"] for c in v["checks"] if not c["ok"]] == ["cpt_perplexity:general"]
    assert (
        v["reasons"][0].startswith("source 'general': CPT held-out perplexity")
        and "allowed at most +25% by gate.cpt_max_ppl_increase_pct.general" in v["reasons"][0]
    )
    rows = {r["metric"]: r for r in gv.metrics_table(m, None, v)}
    assert rows["CPT held-out perplexity: general (held out only, never trained on)"]["gate"] == "FAIL"
    assert rows["CPT held-out perplexity: domain"]["gate"] == "pass"
    assert "CPT held-out of source general (never trained on)" in {
        r.dataset_name for r in gv.eval_results_for_card({"cpt": m}, "m")
    }


def test_unnamed_sources_must_not_get_worse_and_missing_ones_fail():
    def src(change):
        return {
            "base": {"perplexity": 10.0, "loss": 2.3},
            "cpt": {"perplexity": 10.0 * (1 + change / 100), "loss": 2.3},
            "perplexity_change_pct": change,
        }

    cpt = {
        "base": {"perplexity": 10.0},
        "cpt": {"perplexity": 9.0},
        "perplexity_change_pct": -10.0,
        "sources": {
            "domain": src(1.0),
            "general": src(3.0),
            "tiny": {"skipped": "2 held-out records, fewer tokens than one block of seq_len=64"},
        },
    }
    v = gv.gate_verdict(GateConfig(cpt_max_ppl_increase_pct={"general": 5.0, "tiny": 5.0}, **ONLY_GENERAL), cpt, None)
    assert [c["check"] for c in v["checks"] if not c["ok"]] == ["cpt_perplexity:domain", "cpt_perplexity:tiny"]
    assert "allowed at most +0% by gate.cpt_max_ppl_increase_pct (a source it does not name: 0)" in v["reasons"][0]
    assert "source 'tiny': no held-out perplexity (2 held-out records, fewer tokens" in v["reasons"][1]
    one = gv.gate_verdict(
        GateConfig(cpt_max_ppl_increase_pct={"general": 5.0}, **ONLY_GENERAL),
        {k: cpt[k] for k in cpt if k != "sources"},
        None,
    )
    assert not one["passed"] and "no per-source metrics" in one["reasons"][0]


def test_per_source_limits_are_checked_against_the_sources(tmp_path):
    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    raw["gate"]["cpt_max_ppl_increase_pct"] = {"general": 5.0}
    with pytest.raises(
        ConfigError,
        match="gate.cpt_max_ppl_increase_pct: a mapping of limits per source needs a cpt.data.sources mixture",
    ):
        parse_config(raw)
    raw["cpt"]["data"] = {
        "sources": [
            {"name": "domain", "uri": DOMAIN, "weight": 0.7},
            {"name": "general", "uri": GENERAL, "weight": 0.3},
        ]
    }
    assert parse_config(raw).gate.cpt_max_ppl_increase_pct == {"general": 5.0}
    raw["gate"]["cpt_max_ppl_increase_pct"] = {"genral": 5.0}
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert (
        "gate.cpt_max_ppl_increase_pct.genral",
        "no CPT source is named 'genral' (cpt.data.sources: domain, general)",
    ) in info.value.problems
