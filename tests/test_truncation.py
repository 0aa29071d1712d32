"""Chats longer than seq_len: one rule for every batching mode (sft.truncation), counted per source and
said in index.json, run.json, the stage's log line, the UI's stage table, the model card and pre-flight.

    python -m pytest -q -m "" tests/test_truncation.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tasks.core.data.dataset import IGNORE_INDEX, TokenDataset
from tasks.core.data.prepare import prepare
from tasks.core.models.demo import DEFAULT_CORPUS, IM_END, build_tokenizer
from tests.conftest import tiny_config_raw, write_config

SEQ = 96


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    t = build_tokenizer(DEFAULT_CORPUS, vocab_size=512)
    t.save_pretrained(d)
    t.dir = d
    return t


def _turns(n: int, words: int) -> list[dict]:
    out = []
    for i in range(n):
        out += [
            {"role": "user", "content": f"question {i} about the moons?"},
            {"role": "assistant", "content": " ".join(["the moon has rings"] * words)},
        ]
    return out


def _corpus(path: Path, tok) -> Path:
    chats = [
        [{"role": "system", "content": "be brief"}, *_turns(1, 1)],  # fits
        [{"role": "system", "content": "be brief"}, *_turns(4, 2)],  # longer than SEQ; each exchange fits
        _turns(1, 30),  # one reply longer than SEQ by itself
    ]
    lengths = [len(tok.apply_chat_template(c, tokenize=True)) for c in chats]
    assert lengths[0] <= SEQ < lengths[1] and lengths[2] > SEQ, lengths
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return path


def _runs(labels: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of every run of labelled positions of one row."""
    on = np.concatenate([[False], labels != IGNORE_INDEX, [False]])
    edges = np.flatnonzero(np.diff(on.astype(np.int8)))
    return list(zip(edges[::2], edges[1::2]))


def test_each_rule_is_one_row_set_for_every_batching_and_no_reply_is_trained_cut(tok, tmp_path):
    corpus = _corpus(tmp_path / "chats.jsonl", tok)
    eot = tok.convert_tokens_to_ids(IM_END)
    seen = {}
    for rule in ("drop", "cut", "split_turns"):
        r = prepare(
            str(corpus), tok.dir, tmp_path / rule, kind="sft", field="messages", seq_len=SEQ, truncation_rule=rule
        )
        t, src = r.index["totals"]["truncation"], r.index["sources"][0]["truncation"]
        assert (
            t == src
            and t["chats"] == 3
            and t["over_seq_len"] == 2
            and r.index["truncation"] == {"rule": rule, "seq_len": SEQ}
        )
        ds = TokenDataset(tmp_path / rule)
        n = ds.num_items
        # padded/grouped read ds.batch, packed ds.batch_packed, over the same rows: the rule is decided once, in prepare.
        for batch in (ds.batch(range(n)), ds.batch(range(n), width=SEQ), ds.batch_packed([[i] for i in range(n)], SEQ)):
            for row_ids, row_labels in zip(batch["input_ids"], batch["labels"]):
                runs = _runs(row_labels)
                assert runs, rule
                # Every trained reply ends with the end of turn: none is trained as if it ended where it was cut.
                assert all(row_ids[b - 1] == eot for _, b in runs), (rule, row_ids.tolist(), row_labels.tolist())
        seen[rule] = (n, t)
    assert seen["drop"] == (
        1,
        {"chats": 3, "over_seq_len": 2, "dropped": 2, "cut": 0, "split": 0, "split_rows": 0, "exchanges_left_out": 0},
    )
    # cut: the multi-turn chat keeps its first whole exchanges; the long reply, cut, has no label left and goes.
    assert seen["cut"][0] == 2 and seen["cut"][1]["cut"] == 2
    # split_turns: the multi-turn chat becomes rows of whole exchanges; the one exchange longer than SEQ is left out.
    assert (
        seen["split_turns"][1]["split"] == 1
        and seen["split_turns"][1]["dropped"] == 1
        and seen["split_turns"][0] == 1 + seen["split_turns"][1]["split_rows"] >= 3
    )


def test_split_turns_counts_every_exchange_it_leaves_out(tok, tmp_path):
    """ "1 split into 2 rows" once read as nothing lost: the exchange longer than seq_len by itself,
    inside a chat that was split and in a chat of which nothing fits, is counted in index.json, the
    stage's run.json detail, the sentence and the model card."""
    from tasks.core.config.load import load_config
    from tasks.core.data.stage_data import split_info
    from tasks.core.hub.card import model_card
    from tasks.core.storage.fs import RunStore
    from tasks.stages.prepare_data import _recorded_truncation

    short, long = _turns(1, 2), _turns(1, 30)
    chats = [[*short, *long, *short, *short], long]  # one long exchange between fitting ones; one chat all long
    corpus = tmp_path / "chats.jsonl"
    corpus.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    out = tmp_path / "run" / "data" / "sft"
    r = prepare(str(corpus), tok.dir, out, kind="sft", field="messages", seq_len=SEQ, truncation_rule="split_turns")
    t = r.index["totals"]["truncation"]
    assert r.index["sources"][0]["truncation"] == t
    assert (t["over_seq_len"], t["split"], t["split_rows"], t["dropped"], t["exchanges_left_out"]) == (2, 1, 2, 1, 2)
    said = (
        "2 of 2 training chats longer than seq_len=96: 1 split into 2 rows of whole turns, 1 dropped (no exchange "
        "fits), 2 exchanges longer than seq_len by itself left out (sft.truncation: split_turns)"
    )
    recorded = _recorded_truncation(RunStore(str(tmp_path / "run")), "data/sft", "sft", SEQ)  # run.json's detail
    assert recorded["truncation"]["exchanges_left_out"] == 2 and recorded["note"] == said
    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run", sft={"seq_len": SEQ, "truncation": "split_turns"})
    card = model_card(
        load_config(str(write_config(tmp_path / "c.yaml", raw))),
        {"meta": {}},
        {"sft": {"split": split_info(out, str(corpus))}},
    )
    assert f"- SFT: {said}." in card


def test_every_chat_longer_than_seq_len_under_drop_is_refused_before_launch_and_by_prepare(
    tok, tiny_model_dir, tmp_path
):
    """Once: pre-flight warned, then prepare_sft failed blaming heldout_fraction. Now pre-flight reads
    the source to its end, finds no chat that fits and refuses naming the cause and the fixes;
    prepare_sft's own error (a run without pre-flight) says the same cause."""
    from tasks.core.data.index import PrepareError
    from tasks.core.preflight.checks import Machine, load_for_check, preflight_report

    corpus = tmp_path / "long.jsonl"
    chats = [[{"role": "user", "content": f"chat {i}"}, *_turns(2, 30)[1:]] for i in range(70)]  # past the sample
    corpus.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run", sft={"seq_len": SEQ})
    raw["sft"]["data"] = {"uri": str(corpus)}
    report = preflight_report(load_for_check(write_config(tmp_path / "c.yaml", raw)), machine=Machine(0, 2, 10**13))
    said = dict(report.problems).get("sft.data.uri", "")
    assert "every chat of this source (70, read to the end) is longer than sft.seq_len=96" in said, report.text()
    assert "raise sft.seq_len to at least" in said and "set sft.truncation: cut or split_turns" in said
    with pytest.raises(PrepareError) as err:
        prepare(str(corpus), tok.dir, tmp_path / "out", kind="sft", field="messages", seq_len=SEQ, heldout_fraction=0.1)
    assert "every one of the" in str(err.value) and "longer than seq_len=96" in str(err.value), str(err.value)
    assert "heldout_fraction" not in str(err.value) and "sft.truncation: cut or split_turns" in str(err.value)


def test_preflight_warns_when_sampled_chats_are_longer_than_seq_len(tok, tiny_model_dir, tmp_path):
    from tasks.core.preflight.checks import Machine, load_for_check, preflight_report

    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run", sft={"seq_len": SEQ})
    raw["sft"]["data"] = {"uri": str(_corpus(tmp_path / "chats.jsonl", tok))}
    report = preflight_report(load_for_check(write_config(tmp_path / "c.yaml", raw)), machine=Machine(0, 2, 10**13))
    assert report.ok, report.text()
    said = (
        "with sft.truncation: drop they are left out of training. Raise sft.seq_len, or choose sft.truncation: "
        "cut or split_turns;"
    )
    assert [w for w in report.warnings if w.startswith("sft.data.uri: 2 of the first 3 chats") and said in w], (
        report.warnings
    )


@pytest.mark.integration
def test_prepare_sft_says_what_it_dropped_in_index_run_json_log_stage_table_and_card(
    prefect_harness, tok, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """Through the CLI up to prepare_sft (no training process): the counts everywhere the issue asks."""
    import logging
    import sys
    import time

    from flows.cli import flow_main as main
    from tasks.core.config.load import load_config
    from tasks.core.data.stage_data import split_info
    from tasks.core.hub.card import model_card
    from tasks.flowkit import ui

    # Prefect's console handler keeps the stderr of the test that first logged (pytest's capture,
    # closed since): this test's CLI run writes to the live one.
    for logger in [
        logging.getLogger(),
        *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]:
        for h in logger.handlers:
            if getattr(getattr(h, "stream", None), "closed", False) and hasattr(h, "console"):
                monkeypatch.setattr(h, "stream", sys.stderr)
                monkeypatch.setattr(h.console, "file", sys.stderr)
    tables = {}
    monkeypatch.setattr(ui, "create_table_artifact", lambda rows, key, description: tables.update({key: rows}))
    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run", sft={"seq_len": SEQ})
    raw["sft"]["data"] = {"uri": str(_corpus(tmp_path / "chats.jsonl", tok))}
    raw["sft"]["eval"] = {"heldout_fraction": 0.0}  # every chat is a training chat: the counts are exact
    raw["gate"] = {"enabled": False}
    path = write_config(tmp_path / "c.yaml", raw)
    assert main(["--config", str(path), "--stop-after", "prepare_sft"]) == 0
    said = "2 of 3 training chats longer than seq_len=96: 2 dropped (sft.truncation: drop)"
    index = json.loads((tmp_path / "run/data/sft/index.json").read_text())
    assert index["sources"][0]["truncation"]["dropped"] == 2 and index["totals"]["truncation"]["over_seq_len"] == 2
    stages = {s["stage"]: s for s in json.loads((tmp_path / "run/run.json").read_text())["stages"]}
    detail = stages["prepare_sft"]["detail"]
    assert detail["truncation"]["rule"] == "drop" and detail["truncation"]["dropped"] == 2 and detail["note"] == said
    assert detail["sources"]["main"]["truncation"]["dropped"] == 2
    # The stage's log line, a warning in the task run's log (what the UI shows; the console prints
    # the same record), read back from the Prefect API the run logged to.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterLevel
    from prefect.client.schemas.sorting import LogSort

    deadline = time.monotonic() + 30  # Prefect's log worker sends in batches, after the flow returned
    while True:
        with get_client(sync_client=True) as client:
            warned = [
                log.message
                for log in client.read_logs(
                    LogFilter(level=LogFilterLevel(ge_=logging.WARNING)), limit=200, sort=LogSort.TIMESTAMP_DESC
                )
            ]
        if any(f"prepare_sft: {said}" in m for m in warned) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert any(f"prepare_sft: {said}" in m for m in warned), warned[-20:]
    assert [row["note"] for row in tables["cpt-to-sft-stages"] if row["stage"] == "prepare_sft"] == [said]
    card = model_card(
        load_config(str(path)),
        {"meta": {}},
        {"sft": {"split": split_info(tmp_path / "run/data/sft", str(tmp_path / "chats.jsonl"))}},
    )
    assert f"- SFT: {said}." in card
    cpt = stages["prepare_cpt"]["detail"]["truncation"]
    assert cpt["rule"] == "split" and cpt["documents"] > 0  # CPT documents longer than a block are split, and counted
