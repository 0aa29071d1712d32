"""Data integrity: the shard cache is checked before it is trusted, records without training
signal are bad records, empty inputs are counted, readers take what producers write, and a
damaged compressed stream is a file error.

    python -m pytest -q -m "" tests/test_integrity_data.py
"""

from __future__ import annotations

import bz2
import gzip
import json
import os
from pathlib import Path

import pytest
import zstandard

from tasks.core.data.prepare import prepare
from tasks.core.data.records import CorruptFileError, head_records, iter_records
from tasks.core.data.shard import BadRecordError
from tasks.core.models.demo import DEFAULT_CORPUS, build_tokenizer
from tasks.core.run.manifest import MANIFEST
from tests.conftest import prepare_cpt, tiny_config_raw, write_config


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(DEFAULT_CORPUS, vocab_size=512).save_pretrained(d)
    return d


def _text_lines(n: int, tag: str = "r") -> list[str]:
    return [json.dumps({"text": f"{tag} record {i}: Zorvath has {i % 7} moons and {i % 5} rings."}) for i in range(n)]


def _chat(i: int, reply: str | None = None) -> str:
    return json.dumps(
        {
            "messages": [
                {"role": "user", "content": f"question {i}?"},
                {"role": "assistant", "content": f"answer {i}." if reply is None else reply},
            ]
        }
    )


def _prep(uri, tokdir, out, kind="cpt", **kw):
    return prepare(uri, tokdir, out, kind=kind, field="text" if kind == "cpt" else "messages", seq_len=32, **kw)


# ---- records with no training signal, empty inputs ------------------------------------------------


def test_an_empty_assistant_turn_is_a_bad_record_named_by_file_and_line(tokdir, tmp_path):
    lines = [_chat(i) for i in range(130)]
    lines[4] = _chat(4, "")  # line 5
    lines[119] = _chat(119, " \n\t")  # line 120: whitespace only
    src = tmp_path / "sft.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        BadRecordError, match=r"sft\.jsonl:5: message 1 \(assistant\) is empty.*data\.on_bad_record: skip"
    ):
        _prep(str(src), tokdir, tmp_path / "err", kind="sft")
    r = _prep(str(src), tokdir, tmp_path / "skip", kind="sft", on_bad_record="skip")
    assert r.index["totals"]["skipped"] == 2 and r.index["totals"]["records"] == 128
    bad = r.index["files"][0]["bad_records"]
    assert bad[0].startswith(f"{src}:5: ") and bad[1].startswith(f"{src}:120: ") and "whitespace only" in bad[1]


def test_an_empty_cpt_text_is_a_bad_record(tokdir, tmp_path):
    lines = _text_lines(60)
    lines[2] = json.dumps({"text": ""})
    lines[9] = json.dumps({"text": "   "})
    src = tmp_path / "cpt.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadRecordError, match=r"cpt\.jsonl:3: field 'text' is empty"):
        _prep(str(src), tokdir, tmp_path / "err")
    r = _prep(str(src), tokdir, tmp_path / "skip", on_bad_record="skip")
    assert r.index["totals"]["skipped"] == 2 and [b.split(": ")[0] for b in r.index["files"][0]["bad_records"]] == [
        f"{src}:3",
        f"{src}:10",
    ]


def _corpus_with_empty_files(d: Path) -> Path:
    d.mkdir()
    (d / "a.jsonl").write_bytes(b"")  # zero bytes
    (d / "b.jsonl").write_text("\n\n  \n")  # zero records
    (d / "c.jsonl").write_text("\n".join(_text_lines(80)) + "\n")
    return d


def test_empty_input_files_are_counted_in_the_index_and_the_stage_table(tokdir, tmp_path, monkeypatch):
    corpus = _corpus_with_empty_files(tmp_path / "corpus")
    r = _prep(str(corpus), tokdir, tmp_path / "out")
    assert r.index["totals"]["empty_files"] == 2 and r.index["totals"]["records"] == 80

    from tasks.flowkit import ui

    tables = []
    monkeypatch.setattr(ui, "create_table_artifact", lambda rows, **kw: tables.append(rows))
    ui.token_table("cpt", r.index["totals"])
    assert {"split": "empty input files (no record)", "records": 2, "tokens": 0} in tables[0]


def _preflight_data(tiny_model_dir, tmp_path, cpt_uri: str):
    from tasks.core.preflight.checks import check_data, load_for_check
    from tasks.core.preflight.report import CheckContext, PreflightReport

    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["cpt"]["data"] = {"uri": cpt_uri}
    ctx = CheckContext(load_for_check(write_config(tmp_path / "c.yaml", raw)), None, None, None, PreflightReport())
    check_data(ctx)
    return ctx.report


def test_preflight_warns_about_and_counts_empty_input_files(tiny_model_dir, tmp_path):
    corpus = _corpus_with_empty_files(tmp_path / "corpus")
    report = _preflight_data(tiny_model_dir, tmp_path, str(corpus))
    assert not [p for p in report.problems if p[0].startswith("cpt")], report.problems
    assert [
        w for w in report.warnings if "cpt.data.uri: 2 empty input file(s)" in w and "a.jsonl" in w and "b.jsonl" in w
    ], report.warnings
    assert any("cpt data" in c and "c.jsonl" in c for c in report.checked), report.checked


# ---- readers take what producers write ----------------------------------------------------------


def _bom_crlf(path: Path, lines: list[str]) -> Path:
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode())  # BOM, CRLF, no newline after the last line
    return path


def test_bom_crlf_and_a_last_line_without_newline_read_in_the_reader_the_stage_and_preflight(
    tokdir, tiny_model_dir, tmp_path
):
    src = _bom_crlf(tmp_path / "cpt.jsonl", _text_lines(50))
    recs = list(iter_records(str(src)))
    assert [n for n, _ in recs] == list(range(1, 51)) and recs[-1][1] == json.loads(_text_lines(50)[-1])
    assert head_records(str(src), 3)[0][1] == json.loads(_text_lines(1)[0])
    sft = _bom_crlf(tmp_path / "sft.jsonl", [_chat(i) for i in range(40)])
    assert _prep(str(src), tokdir, tmp_path / "cpt").index["totals"]["records"] == 50
    assert _prep(str(sft), tokdir, tmp_path / "sft", kind="sft").index["totals"]["records"] == 40
    report = _preflight_data(tiny_model_dir, tmp_path, str(src))
    assert not [p for p in report.problems if p[0].startswith("cpt")], report.problems


# ---- compressed streams ----------------------------------------------------------------------------


def _zst_blocks(lines: list[str], every: int) -> tuple[bytes, list[int]]:
    """One zstd frame, a block flushed after every `every` lines; the byte offsets after each flush."""
    c = zstandard.ZstdCompressor().compressobj()
    out, cuts = b"", []
    for i in range(0, len(lines), every):
        out += c.compress("".join(x + "\n" for x in lines[i : i + every]).encode()) + c.flush(
            zstandard.COMPRESSOBJ_FLUSH_BLOCK
        )
        cuts.append(len(out))
    return out + c.flush(), cuts


def test_a_truncated_zst_is_a_file_error_with_its_byte_offset_not_an_empty_file(tokdir, tmp_path):
    whole = zstandard.ZstdCompressor().compress("".join(x + "\n" for x in _text_lines(600)).encode())
    src = tmp_path / "one-block.jsonl.zst"
    src.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(
        CorruptFileError,
        match=rf"{src}: the \.zst stream is truncated or corrupt at compressed byte {len(whole) // 2:,}",
    ):
        _prep(str(src), tokdir, tmp_path / "a", on_bad_record="skip")


def test_a_zst_cut_at_a_line_boundary_is_never_skipped_into_training(tokdir, tmp_path):
    blob, cuts = _zst_blocks(_text_lines(600), 40)
    src = tmp_path / "cut.jsonl.zst"
    src.write_bytes(blob[: cuts[6]])  # 280 whole lines, no end of frame
    for on_bad in ("error", "skip"):
        with pytest.raises(
            CorruptFileError,
            match=r"cut\.jsonl\.zst: the \.zst stream is truncated or corrupt at compressed byte "
            rf"{cuts[6]:,}.*on_bad_record does not apply",
        ):
            _prep(str(src), tokdir, tmp_path / on_bad, on_bad_record=on_bad)
    (tmp_path / "whole.jsonl.zst").write_bytes(blob)
    assert _prep(str(tmp_path / "whole.jsonl.zst"), tokdir, tmp_path / "whole").index["totals"]["records"] == 600


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".bz2", bz2.compress)])
def test_truncated_or_corrupt_gz_and_bz2_are_file_errors(tokdir, tmp_path, suffix, compress):
    blob = compress("".join(x + "\n" for x in _text_lines(600)).encode())
    cut = tmp_path / f"cut.jsonl{suffix}"
    cut.write_bytes(blob[: len(blob) * 2 // 3])
    with pytest.raises(
        CorruptFileError,
        match=rf"cut\.jsonl\{suffix}: the \{suffix} stream is truncated or corrupt at compressed byte [\d,]+",
    ):
        _prep(str(cut), tokdir, tmp_path / "cut", on_bad_record="skip")
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0xFF
    bad = tmp_path / f"flip.jsonl{suffix}"
    bad.write_bytes(bytes(flipped))
    for on_bad in ("error", "skip"):  # whatever garbage it inflates to, the damage is what is named
        with pytest.raises(
            CorruptFileError, match=rf"flip\.jsonl\{suffix}: the \{suffix} stream is truncated or corrupt"
        ):
            _prep(str(bad), tokdir, tmp_path / f"flip-{on_bad}", on_bad_record=on_bad)


# ---- the shard cache is untrusted --------------------------------------------------------------------


def _flip(path: Path, at: int = 10) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0x01
    path.write_bytes(bytes(b))


@pytest.mark.integration
def test_a_damaged_shard_is_never_rebuilt_from_the_damaged_bytes(prefect_harness, tiny_model_dir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("\n".join(_text_lines(120, "a")) + "\n")
    (corpus / "b.jsonl").write_text("\n".join(_text_lines(90, "b")) + "\n")
    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["cpt"]["data"] = {"uri": str(corpus)}
    cfg = write_config(tmp_path / "c.yaml", raw)
    art = tmp_path / "run/data/cpt"

    first = prepare_cpt(cfg)
    assert first.status == "completed" and first.detail["tokenized"] == 2
    original = json.loads((art / MANIFEST).read_text())["files"]
    index = json.loads((art / "index.json").read_text())
    shard = index["files"][0]["shard"]  # a.jsonl's
    tokens = f"{shard}/train.tokens"
    cached = tmp_path / "run" / "data-cache" / "cpt" / tokens
    # The artifact and the cache never share an inode: damage to one cannot reach the other.
    assert os.stat(art / tokens).st_ino != os.stat(cached).st_ino

    _flip(art / tokens)  # the artifact damaged: its manifest check fails, the intact cache rebuilds it
    again = prepare_cpt(cfg)
    assert again.status == "completed" and again.detail["tokenized"] == 0 and again.detail["cache_dropped"] == []
    assert json.loads((art / MANIFEST).read_text())["files"] == original

    _flip(art / tokens)  # both damaged (a cache written while it was hard-linked, a disk fault)
    _flip(cached)
    third = prepare_cpt(cfg)
    assert third.status == "completed" and third.detail["tokenized"] == 1  # a.jsonl, from its input
    [dropped] = third.detail["cache_dropped"]
    assert dropped.startswith(
        f"{corpus / 'a.jsonl'}: its cached shard is dropped and tokenized again: {cached} fails its sha256 check"
    ), dropped
    assert json.loads((art / MANIFEST).read_text())["files"][tokens]["sha256"] == original[tokens]["sha256"]
    assert json.loads((art / MANIFEST).read_text())["files"] == original
