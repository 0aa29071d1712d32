"""The phase registry: CPT and SFT are rows, and a new phase is one more row (no launch here).

pytest tests/test_phases.py
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from tasks.core.config import phases
from tasks.core.config.phases import PHASES, PhaseSpec
from tasks.core.data.dataset import TokenDataset
from tasks.core.data.encoders import TextEncoder
from tasks.core.data.prepare import prepare
from tasks.core.data.records import read_records
from tasks.core.data.samples import pack_cpt
from tasks.core.models.demo import DEFAULT_CORPUS, build_tokenizer

CPT, _ = DEFAULT_CORPUS


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DEFAULT_CORPUS, vocab_size=512)


@pytest.fixture(scope="module")
def tokdir(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(d)
    return d


class ShoutEncoder(TextEncoder):
    """A dummy phase's own encoder: the text record upper-cased, then packed as CPT packs it."""

    def encode(self, value: str) -> str:
        return value.upper()

    def add(self, side: str, value: str, encoded: str) -> None:
        super().add(side, encoded, encoded)


@pytest.fixture
def shout_phase():
    """A third phase, `shout`: records in field `line`, its own encoder, trained in blocks."""
    module = types.ModuleType("dummy_phase_encoders")
    module.ShoutEncoder = ShoutEncoder
    sys.modules[module.__name__] = module
    row = phases.register(
        PhaseSpec(
            name="shout",
            title="SHOUT",
            record="text",
            field="text_field",
            default_field="line",
            encoder="dummy_phase_encoders:ShoutEncoder",
            unit="blocks",
            blocks=True,
            evaluation="perplexity",
        )
    )
    try:
        yield row
    finally:
        PHASES.pop("shout", None)
        sys.modules.pop(module.__name__, None)


def test_cpt_and_sft_are_rows_each_naming_its_record_field_encoder_unit_and_evaluation():
    from tasks.core.config.preference import PreferenceData
    from tasks.core.config.schema import DataConfig
    from tasks.core.data.shard import encoder_class

    assert list(PHASES) == ["cpt", "sft", "dpo"]
    for row in PHASES.values():
        data = PreferenceData(uri="x") if row.record == "pair" else DataConfig(uri="x")
        assert getattr(data, row.field) == row.default_field  # the record field is a data.* setting of the phase
        assert encoder_class(row.name).masked == row.rows  # a row phase keeps a label mask, a block phase not
    assert PHASES["cpt"].blocks and PHASES["sft"].rows and PHASES["dpo"].rows
    assert PHASES["sft"].generation and PHASES["sft"].lora_refused is None and PHASES["cpt"].lora_refused
    assert [n for n, row in PHASES.items() if row.optional] == ["dpo"]  # off unless its section is configured


def test_a_new_phase_row_tokenizes_its_own_field_with_its_own_encoder_through_the_one_tokenize_path(
    shout_phase, tok, tokdir, tmp_path
):
    records = [{"line": r["text"]} for r in read_records(str(CPT))]
    corpus = tmp_path / "shout.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    r = prepare(str(corpus), tokdir, tmp_path / "prep", kind="shout", field=shout_phase.default_field, seq_len=32)
    assert r.index["kind"] == "shout" and r.index["field"] == "line"
    assert r.index["totals"]["cpt_blocks"] > 0  # the row says blocks: samples are counted as blocks
    ds = TokenDataset(tmp_path / "prep")
    want = pack_cpt(tok, [{"text": x["line"].upper()} for x in records], seq_len=32).numpy()
    got = ds.batch(range(ds.num_items))
    assert np.array_equal(got["input_ids"], want) and np.array_equal(got["labels"], want)
    # The shard's own key says which phase made it: the same file as CPT is another cache entry.
    cpt = prepare(str(corpus), tokdir, tmp_path / "prep", kind="cpt", field="line", seq_len=32)
    assert cpt.tokenized == [str(corpus)] and not np.array_equal(
        TokenDataset(tmp_path / "prep").batch(range(1))["input_ids"], want[:1]
    )


def test_a_name_that_is_no_phase_is_refused_naming_the_phases():
    from tasks.core.data.shard import ShardSpec

    with pytest.raises(ValueError, match=r"kind='shout': use one of 'cpt', 'sft', 'dpo'"):
        ShardSpec(kind="shout", field="line", seq_len=8, tokenizer_sha256="0")
    with pytest.raises(ValueError, match="phase 'train_cpt': use one of cpt, sft, dpo"):
        phases.phase("train_cpt")


def test_a_phase_section_is_read_through_the_config_and_a_stage_name_is_refused(tmp_path):
    from support.tiny import tiny_config_raw
    from tasks.core.config.load import parse_fields

    cfg = parse_fields(tiny_config_raw(tmp_path / "model", tmp_path / "run"))
    assert [cfg.phase(p) for p in cfg.phases] == [cfg.cpt, cfg.sft]  # the phases it trains: no dpo section
    with pytest.raises(KeyError, match="'export' is not a training phase; the phases are cpt, sft, dpo"):
        cfg.phase("export")
