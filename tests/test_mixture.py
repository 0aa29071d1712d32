"""Weighted data mixtures (`data.sources`): the blend prepare_data decides once, and training's walk of it.

    python -m pytest tests/test_mixture.py -q

In-process, on the demo tokenizer and the sample corpora cut into sources of different sizes. The
oracles: the weights (every realized share within 1 % absolute), pack_cpt over each source's own
records (no block straddles two sources), a second prepare (the same bytes), and a sampler
restored mid-blend (the same units). The process pool and Dask runs of the same mixture, under
Prefect, are in tests/test_prepare_stage.py; a kill and bitwise fp32 resume mid-blend in the tp2
fixture of tests/test_engine_dist.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.core.config.load import parse_config
from tasks.core.data.blend import BLEND_FILE, BlendError, BlendPlan, Source, check_plan, interleave
from tasks.core.data.dataset import TokenDataset
from tasks.core.data.index import PrepareError
from tasks.core.data.inputs import InputError
from tasks.core.data.order import Packs
from tasks.core.data.prepare import prepare
from tasks.core.data.samples import pack_cpt
from tasks.core.errors import ConfigError
from tasks.core.models.demo import DEFAULT_CORPUS, build_tokenizer
from tasks.engine.sampler import ResumableSampler
from tests.conftest import REPO, tiny_config_raw

CPT, SFT = DEFAULT_CORPUS


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DEFAULT_CORPUS, vocab_size=512)


@pytest.fixture(scope="module")
def tokdir(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(d)
    return d


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(path: Path, records: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """The CPT sample cut into three sources of 480, 90 and 30 records, each a directory."""
    root = tmp_path_factory.mktemp("three")
    recs = _records(CPT)
    cuts = {"big": recs[:480], "mid": recs[480:570], "small": recs[570:]}
    return {name: _write(root / name / "part-0.jsonl", part) and str(root / name) for name, part in cuts.items()}, cuts


def _cpt(uri, tokdir, out, plan=None, **kw):
    return prepare(uri, tokdir, out, kind="cpt", field="text", seq_len=32, heldout_fraction=0.0, blend_plan=plan, **kw)


PLAN = BlendPlan(max_steps=125, global_batch=8, seed=1234)  # 1000 blocks: `small` repeated, `big` subsampled


def test_cpt_blend_meets_the_weights_and_keeps_blocks_in_their_source(tok, tokdir, three, tmp_path):
    dirs, cuts = three
    weights = {"big": 0.6, "mid": 0.3, "small": 0.1}
    r = _cpt(
        [Source(n, dirs[n], weights[n] * 10) for n in dirs], tokdir, tmp_path / "prep", PLAN
    )  # unnormalized weights
    rows = {s["name"]: s for s in r.index["sources"]}
    ds = TokenDataset(tmp_path / "prep")
    stream = np.asarray(ds.blend(), np.int64)
    assert len(stream) == PLAN.units == r.index["blend"]["positions"]
    # Each source's blocks are pack_cpt over its own records: none straddles two sources.
    ends = np.cumsum([rows[n]["samples_available"] for n in dirs])
    assert ds.num_items == ends[-1] == r.index["totals"]["cpt_blocks"]
    start = 0
    for n, end in zip(dirs, ends):
        assert np.array_equal(ds.batch(range(start, end))["input_ids"], pack_cpt(tok, cuts[n], seq_len=32).numpy()), n
        start = end
    # Shares, from the stream itself and in the report, within 1 % of the normalized weights.
    of = np.searchsorted(ends, stream, side="right")
    for s, n in enumerate(dirs):
        share = float(np.mean(of == s))
        assert abs(share - weights[n]) <= 0.01 and abs(rows[n]["token_share"] - weights[n]) <= 0.01, (n, share, rows[n])
        assert rows[n]["weight"] == pytest.approx(weights[n]) and rows[n]["samples"] == int(np.sum(of == s))
        assert rows[n]["epochs"] == pytest.approx(rows[n]["samples"] / rows[n]["samples_available"], abs=1e-4)
        # A pass at a time: every block of a source once before any block twice.
        picks = stream[of == s]
        first = picks[: rows[n]["samples_available"]]
        assert len(set(first.tolist())) == len(first)
    assert rows["small"]["epochs"] > 1 > rows["big"]["epochs"]  # repeated and subsampled
    # Megatron's rule holds at every prefix: no source is ever more than one sample off its share.
    src = interleave([0.6, 0.3, 0.1], 5000)
    lag = np.cumsum(np.eye(3)[src], axis=0) - np.outer(np.arange(1, 5001), [0.6, 0.3, 0.1])
    assert np.abs(lag).max() <= 1.0


def test_the_blend_is_the_same_bytes_across_runs_and_workers_and_follows_an_added_file(tokdir, three, tmp_path):
    dirs, _ = three
    mix = {n: tmp_path / "corpus" / n for n in dirs}
    for n, d in mix.items():
        shutil.copytree(dirs[n], d)
    sources = [
        Source("big", str(mix["big"]), 0.6),
        Source("mid", str(mix["mid"]), 0.3),
        Source("small", str(mix["small"]), 0.1),
    ]
    one = _cpt(sources, tokdir, tmp_path / "one", PLAN)
    pool = _cpt(sources, tokdir, tmp_path / "pool", PLAN, workers=2)  # spawned process pool
    assert len(pool.tokenized) == 3 and pool.index == one.index
    assert (tmp_path / "one" / BLEND_FILE).read_bytes() == (tmp_path / "pool" / BLEND_FILE).read_bytes()
    again = _cpt(sources, tokdir, tmp_path / "one", PLAN)
    assert again.tokenized == [] and again.index == one.index
    before = (tmp_path / "one" / BLEND_FILE).read_bytes()

    # A file added to one source: only it is tokenized, and the blend is what a fresh prepare makes.
    _write(mix["small"] / "part-1.jsonl", _records(CPT)[:40])
    grown = _cpt(sources, tokdir, tmp_path / "one", PLAN)
    assert [Path(u).name for u in grown.tokenized] == ["part-1.jsonl"] and len(grown.reused) == 3
    fresh = _cpt(sources, tokdir, tmp_path / "fresh", PLAN)
    after = (tmp_path / "one" / BLEND_FILE).read_bytes()
    assert after != before and after == (tmp_path / "fresh" / BLEND_FILE).read_bytes() and grown.index == fresh.index
    small = next(s for s in grown.index["sources"] if s["name"] == "small")
    assert small["files"] == [2, 4] and small["samples"] == 100  # the same share, drawn from more blocks
    # Another seed or other steps: another blend.
    other = _cpt(sources, tokdir, tmp_path / "one", BlendPlan(125, 8, seed=1))
    assert other.tokenized == [] and (tmp_path / "one" / BLEND_FILE).read_bytes() != after


def test_resume_mid_blend_continues_the_same_units(tokdir, three, tmp_path):
    dirs, _ = three
    _cpt([Source(n, dirs[n], w) for n, w in zip(dirs, (0.6, 0.3, 0.1))], tokdir, tmp_path / "prep", PLAN)
    ds = TokenDataset(tmp_path / "prep")

    def sampler():
        return ResumableSampler(ds.num_items, 0, 2, seed=PLAN.seed, stream=ds.blend())

    whole = sampler()
    ref = [whole.next_global(8) for _ in range(PLAN.max_steps)]
    assert np.array_equal(np.concatenate(ref), np.asarray(ds.blend()))  # the stream, walked as it is
    assert whole.state_dict() == {"epoch": 1, "offset": 0, "seed": PLAN.seed}  # the plan, used up exactly
    first = sampler()
    got = [first.next_global(8) for _ in range(77)]
    resumed = sampler()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [resumed.next_global(8) for _ in range(PLAN.max_steps - 77)]
    assert got == ref
    assert [ds.batch(u)["input_ids"].tolist() for u in got[77:80]] == [
        ds.batch(u)["input_ids"].tolist() for u in ref[77:80]
    ]


def test_sft_mixture_of_two_chat_sources(tok, tokdir, tmp_path):
    chats = _records(SFT)
    a, b = _write(tmp_path / "a.jsonl", chats[:150]), _write(tmp_path / "b.jsonl", chats[150:])
    sources = [Source("general", a, 0.25), Source("domain", b, 0.75)]

    def sft(out, plan):
        return prepare(
            sources,
            tokdir,
            tmp_path / out,
            kind="sft",
            field="messages",
            seq_len=128,
            heldout_fraction=0.0,
            blend_plan=plan,
        )

    # Padded and grouped: the global batch counts conversations.
    r = sft("padded", BlendPlan(max_steps=50, global_batch=8, seed=7))
    rows = {s["name"]: s for s in r.index["sources"]}
    assert r.index["blend"]["unit"] == "conversations" and r.index["blend"]["positions"] == 400
    for n, w in (("general", 0.25), ("domain", 0.75)):
        assert abs(rows[n]["sample_share"] - w) <= 0.01, rows[n]
        assert rows[n]["epochs"] == pytest.approx(rows[n]["samples"] / rows[n]["samples_available"], abs=1e-4)
    assert rows["domain"]["epochs"] > 4 and sum(x["token_share"] for x in rows.values()) == pytest.approx(1.0, abs=1e-5)
    ds = TokenDataset(tmp_path / "padded")
    stream = np.asarray(ds.blend(), np.int64)
    lengths = ds.lengths()
    # The report's token shares are those of the conversations the stream names.
    assert rows["general"]["tokens"] == int(lengths[stream[stream < 150]].sum())
    # Each item is the conversation of its own source: rows of the blend are the source's chats.
    batch = ds.batch(stream[:4])
    assert batch["input_ids"].shape == (4, 128) and (batch["labels"] != -100).any(axis=1).all()

    # Packed: the global batch counts rows; the stream is the fewest conversations whose rows, packed
    # as the ranks pack them, cover the planned rows, so the report is what the steps train on.
    plan = BlendPlan(max_steps=40, global_batch=4, seed=7, packed_seq_len=256)
    packed = sft("packed", plan)
    dsp = TokenDataset(tmp_path / "packed")
    stream = torch.from_numpy(np.asarray(dsp.blend(), np.int64))
    packs = Packs(dsp.lengths(), 256)
    g = torch.Generator().manual_seed(0)
    assert len(packs.order(stream, g)) >= plan.units > len(packs.order(stream[:-1], g))
    assert sum(s["samples"] for s in packed.index["sources"]) == len(stream) == packed.index["blend"]["positions"]
    s1 = ResumableSampler(dsp.num_items, 0, 1, seed=7, group=packs, stream=dsp.blend())
    ref = [s1.next_global(4) for _ in range(plan.max_steps)]
    s2 = ResumableSampler(dsp.num_items, 0, 1, seed=7, group=packs, stream=dsp.blend())
    got = [s2.next_global(4) for _ in range(13)]
    s3 = ResumableSampler(dsp.num_items, 0, 1, seed=7, group=packs, stream=dsp.blend())
    s3.load_state_dict(s2.state_dict())
    assert got + [s3.next_global(4) for _ in range(plan.max_steps - 13)] == ref
    assert s1.state_dict()["epoch"] == 0 or s1.state_dict() == {"epoch": 1, "offset": 0, "seed": 7}  # no second pass


def test_a_plan_other_than_the_blends_is_refused(tokdir, three, tmp_path):
    dirs, _ = three
    r = _cpt([Source("big", dirs["big"], 0.5), Source("small", dirs["small"], 0.5)], tokdir, tmp_path / "prep", PLAN)
    check_plan(r.index, PLAN, tmp_path / "prep", "cpt")
    with pytest.raises(
        BlendError,
        match=r"blended for BlendPlan\(max_steps=125.*trains BlendPlan\(max_steps=300.*prepare the data again",
    ):
        check_plan(r.index, BlendPlan(300, 8, 1234), tmp_path / "prep", "cpt")
    with pytest.raises(BlendError, match="trains None"):
        check_plan(r.index, None, tmp_path / "prep", "cpt")


# --------------------------------------------------------------------------------------------
# Bad input, named by source and field


def _raw(tmp_path, sources):
    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    raw["cpt"]["data"] = {"sources": sources}
    return raw


@pytest.mark.parametrize(
    "sources, field, words",
    [
        (
            [
                {"name": "domain", "uri": "a.jsonl", "weight": 0.7},
                {"name": "general", "uri": "b.jsonl", "weight": -0.3},
            ],
            "cpt.data.sources.1",
            "source 'general': weight -0.3 must be > 0",
        ),
        (
            [{"name": "domain", "uri": "a.jsonl", "weight": 0.7}, {"name": "general", "uri": "b.jsonl", "weight": 0}],
            "cpt.data.sources.1",
            "source 'general': weight 0.0 must be > 0",
        ),
        (
            [{"name": "domain", "uri": "a.jsonl"}, {"name": "domain", "uri": "b.jsonl"}],
            "cpt.data",
            "the name 'domain' is given twice",
        ),
        ([], "cpt.data", "data.sources is empty"),
    ],
)
def test_bad_sources_are_refused_naming_the_source_and_field(tmp_path, sources, field, words):
    with pytest.raises(ConfigError) as info:
        parse_config(_raw(tmp_path, sources))
    assert any(f == field and words in msg for f, msg in info.value.problems), info.value


def test_uri_and_sources_together_are_refused(tmp_path):
    raw = _raw(tmp_path, [{"name": "a", "uri": "a.jsonl"}])
    raw["cpt"]["data"]["uri"] = "b.jsonl"
    with pytest.raises(ConfigError, match="give data.uri .one corpus. or data.sources"):
        parse_config(raw)
    cfg = parse_config(
        _raw(
            tmp_path,
            [
                {"name": "domain", "uri": ["a.jsonl", "c.jsonl"], "weight": 7},
                {"name": "general", "uri": "b.jsonl", "weight": 3},
            ],
        )
    )
    assert cfg.cpt.data.mixture and cfg.cpt.data.uris == ["a.jsonl", "c.jsonl", "b.jsonl"]
    assert [
        s.name for s in parse_config(tiny_config_raw(tmp_path / "model", tmp_path / "run")).cpt.data.source_list
    ] == ["main"]


def test_prepare_names_the_source_that_matches_nothing_or_is_too_small(tokdir, three, tmp_path):
    dirs, _ = three
    with pytest.raises(
        InputError, match=r"data.sources\[1\] \(general\).uri: the glob '.*nothing-\*.jsonl' matches no file"
    ):
        _cpt(
            [Source("domain", dirs["big"], 0.7), Source("general", str(tmp_path / "nothing-*.jsonl"), 0.3)],
            tokdir,
            tmp_path / "p1",
            PLAN,
        )
    with pytest.raises(
        InputError, match=r"data.sources\[1\] \(again\).uri: .*part-0.jsonl' is also a file of source 'domain'"
    ):
        _cpt(
            [Source("domain", dirs["big"], 0.7), Source("again", dirs["big"] + "/part-0.jsonl", 0.3)],
            tokdir,
            tmp_path / "p2",
            PLAN,
        )
    tiny = _write(tmp_path / "tiny.jsonl", [{"text": "too short"}])
    with pytest.raises(
        PrepareError,
        match=r"source 'tiny' \(.*tiny.jsonl\) has \d+ training tokens, fewer than seq_len=32; add data to it or "
        r"remove it",
    ):
        _cpt([Source("domain", dirs["big"], 0.7), Source("tiny", tiny, 0.3)], tokdir, tmp_path / "p3", PLAN)


def test_prepare_names_a_bad_held_out_only_source(tokdir, three, tmp_path):
    dirs, _ = three

    def only(src):
        return _cpt(dirs["big"], tokdir, tmp_path / "p", heldout_sources=[Source("general", src)])

    with pytest.raises(
        InputError, match=r"eval.heldout_sources\[0\] \(general\).uri: the glob '.*nothing-\*.jsonl' matches no file"
    ):
        only(str(tmp_path / "nothing-*.jsonl"))
    with pytest.raises(
        InputError,
        match=r"eval.heldout_sources\[0\] \(general\).uri: .*part-0.jsonl' is also a file of trained source 'main'; "
        r"a held-out-only source must be text the stage never trains on",
    ):
        only(dirs["big"])
    short = _write(tmp_path / "short.jsonl", [{"text": "too short"}])
    with pytest.raises(
        PrepareError,
        match=r"eval.heldout_sources\[0\] \(general\).uri: 1 records, \d+ tokens, fewer than one block of seq_len=32",
    ):
        only(short)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    with pytest.raises(
        PrepareError, match=r"eval.heldout_sources\[0\] \(general\).uri: .*bad.jsonl:2: no string field 'text'"
    ):
        only(str(bad))
    with pytest.raises(PrepareError, match="held-out-only sources are evaluated by perplexity, a CPT stage's"):
        prepare(
            str(SFT),
            tokdir,
            tmp_path / "sft",
            kind="sft",
            field="messages",
            seq_len=64,
            heldout_sources=[Source("general", short)],
        )


@pytest.mark.parametrize(
    "where, value, field, words",
    [
        (
            "cpt",
            [{"name": "main", "uri": "g.jsonl"}],
            "cpt.eval.heldout_sources[0].name",
            "'main' is also a trained source (cpt.data.uri, the one source named 'main')",
        ),
        (
            "cpt",
            [{"name": "g", "uri": "g.jsonl"}, {"name": "g", "uri": "h.jsonl"}],
            "cpt.eval",
            "the name 'g' is given twice",
        ),
        ("cpt", [], "cpt.eval", "eval.heldout_sources is empty"),
        ("sft", [{"name": "g", "uri": "g.jsonl"}], "sft.eval.heldout_sources", "SFT evaluation has none"),
    ],
)
def test_bad_held_out_only_sources_are_refused_naming_the_field(tmp_path, where, value, field, words):
    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    raw[where].setdefault("eval", {})["heldout_sources"] = value
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert any(f == field and words in msg for f, msg in info.value.problems), info.value.problems


def test_held_out_only_sources_in_the_gate_and_beside_a_mixture(tmp_path):
    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    raw["cpt"]["eval"] = {"heldout_sources": [{"name": "general", "uri": "g.jsonl"}]}
    raw["gate"]["cpt_max_ppl_increase_pct"] = {
        "general": 5.0,
        "main": -1.0,
    }  # one trained source: a mapping needs held-out-only ones
    assert [s.name for s in parse_config(raw).cpt.eval.heldout_sources] == ["general"]
    raw["gate"]["cpt_max_ppl_increase_pct"] = {"genral": 5.0}
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert info.value.problems == [
        (
            "gate.cpt_max_ppl_increase_pct.genral",
            "no CPT source is named 'genral' (cpt.data.uri: main; cpt.eval.heldout_sources: general)",
        )
    ]
    raw["gate"]["cpt_max_ppl_increase_pct"] = {"general": 5.0}
    raw["cpt"]["eval"]["heldout_fraction"] = 0
    with pytest.raises(ConfigError, match="evaluate_cpt does not run without the stage's own held-out set"):
        parse_config(raw)
    raw = _raw(
        tmp_path,
        [{"name": "domain", "uri": "a.jsonl", "weight": 0.7}, {"name": "general", "uri": "b.jsonl", "weight": 0.3}],
    )
    raw["cpt"]["eval"] = {
        "heldout_uri": "h.jsonl",
        "heldout_fraction": 0,
        "heldout_sources": [{"name": "web", "uri": "w.jsonl"}, {"name": "general", "uri": "g.jsonl"}],
    }
    raw["gate"]["cpt_max_ppl_increase_pct"] = {"web": 5.0, "domain": 0.0}
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert [f for f, _ in info.value.problems] == [
        "cpt.eval.heldout_sources[1].name",
        "gate.cpt_max_ppl_increase_pct.domain",
    ], info.value.problems
    assert "has no held-out records of its own under one cpt.eval.heldout_uri" in info.value.problems[1][1]


def test_main_source_name_is_the_configs():
    from tasks.core.config.data import MAIN_SOURCE
    from tasks.core.data.prepare import MAIN_SOURCE as PREPARED

    assert MAIN_SOURCE == PREPARED == "main"


# --------------------------------------------------------------------------------------------
# Pre-flight: each source checked on its own, and its epochs estimated


def test_preflight_names_a_missing_source_and_warns_of_a_repeated_one(tiny_model_dir, tokdir, tmp_path):
    from tasks.core.preflight.checks import Machine, load_for_check, preflight_report
    from tests.conftest import write_config

    small = _write(tmp_path / "small.jsonl", _records(CPT)[:20])
    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["cpt"]["max_steps"] = 100  # 100 steps of 4 blocks of 64 tokens: 40 of them from `small`
    raw["cpt"]["data"] = {
        "sources": [{"name": "domain", "uri": str(CPT), "weight": 0.9}, {"name": "small", "uri": small, "weight": 0.1}],
        "max_source_epochs": 2,
    }
    machine = Machine(cuda_devices=0, cpu_count=2, free_bytes=10**13)
    report = preflight_report(
        load_for_check(write_config(tmp_path / "ok.yaml", raw)), machine=machine, token_present=None
    )
    assert report.ok, report.text()
    warned = [w for w in report.warnings if w.startswith("cpt.data.sources[1] (small):")]
    assert len(warned) == 1 and "more than cpt.data.max_source_epochs=2" in warned[0], report.warnings
    assert not [w for w in report.warnings if "(domain)" in w]
    # The estimate against prepare's exact figure for the same source: within a factor of 1.5.
    estimated = float(warned[0].split("about ")[2].split(" passes")[0])
    exact = prepare(
        [Source("domain", str(CPT), 0.9), Source("small", small, 0.1)],
        tokdir,
        tmp_path / "prep",
        kind="cpt",
        field="text",
        seq_len=64,
        heldout_fraction=0.05,
        blend_plan=BlendPlan(100, 4, 1234),
    ).index["sources"][1]["epochs"]
    assert exact / 1.5 < estimated < exact * 1.5, (estimated, exact)

    raw["cpt"]["data"]["sources"][1]["uri"] = str(tmp_path / "nothing-*.jsonl")
    raw["cpt"]["eval"] = {
        "heldout_sources": [{"name": "web", "uri": str(tmp_path / "none-*.jsonl")}, {"name": "small", "uri": small}]
    }
    report = preflight_report(
        load_for_check(write_config(tmp_path / "bad.yaml", raw)), machine=machine, token_present=None
    )
    assert [msg for f, msg in report.problems if f == "cpt.data.sources[1] (small).uri"] == [
        f"the glob '{tmp_path}/nothing-*.jsonl' matches no file; check the pattern and that the files exist"
    ]
    # A held-out-only source: its URI named by its field, its name clashing with a trained source refused.
    assert [msg for f, msg in report.problems if f == "cpt.eval.heldout_sources[0] (web).uri"] == [
        f"the glob '{tmp_path}/none-*.jsonl' matches no file; check the pattern and that the files exist"
    ]
    assert [f for f, _ in report.problems if f.startswith("cpt.eval.heldout_sources[1]")] == [
        "cpt.eval.heldout_sources[1].name"
    ], report.problems


def test_split_record_and_card_show_the_mixture(tokdir, tmp_path):
    import yaml

    from tasks.core.data.stage_data import corpus_of, split_info
    from tasks.core.evaluation.verdict import eval_results_for_card
    from tasks.core.hub.card import model_card

    raw = yaml.safe_load((REPO / "examples" / "tiny-cpu-mixture.yaml").read_text())
    raw["run_root"] = str(tmp_path / "run")
    cfg = parse_config(raw)
    d = cfg.cpt.data
    sources = [Source(s.name, [str(REPO / u) for u in s.uris], s.weight) for s in d.source_list]
    web = _write(tmp_path / "web.jsonl", _records(CPT)[:8])  # a held-out-only source (its text is no other's file)
    prepare(
        sources,
        tokdir,
        tmp_path / "prep",
        kind="cpt",
        field="text",
        seq_len=cfg.cpt.seq_len,
        heldout_fraction=0.05,
        blend_plan=BlendPlan(cfg.cpt.max_steps, 4, cfg.cpt.seed),
        heldout_sources=[Source("web", web)],
    )
    split = split_info(tmp_path / "prep", corpus_of(d))
    assert [(s["name"], s["records"], s["inputs"][0]["uri"]) for s in split["heldout_sources"]] == [("web", 8, web)]
    assert split["data_uri"] == {"domain": "data/sample/cpt.jsonl", "general": "data/sample/general.jsonl"}
    assert [(s["name"], s["weight"], s["token_share"]) for s in split["sources"]] == [
        ("domain", 0.7, 0.7),
        ("general", 0.3, 0.3),
    ]
    assert all(s["heldout_records"] > 0 for s in split["sources"])  # the hash split holds out records of every source
    card = model_card(cfg, {}, {"cpt": {"split": split}})
    assert "CPT mixture (blended once for the planned steps):" in card
    assert "| general | 0.300 | 0.3000 |" in card and "| domain | 0.700 | 0.7000 |" in card
    web_sha = split["heldout_sources"][0]["inputs"][0]["checksum"]
    assert "CPT held-out-only sources (evaluated base vs CPT, never trained on):" in card
    assert f"| web | `web.jsonl` | `{web_sha}` | 8 | {split['heldout_sources'][0]['tokens']:,} |" in card
    metrics = {"cpt": {"split": split, "base": {"perplexity": 9.0}, "cpt": {"perplexity": 3.0}}}
    assert eval_results_for_card(metrics, "m")  # a mixture's corpus (a mapping) names the held-out set after the stage
