"""Prepared data (memory-mapped token shards) against the in-memory path it replaces.

    python -m pytest tests/test_dataprep.py -q

The oracle is the landed in-memory path: read_records + split_by_fraction + pack_cpt / encode_sft
over the same records. The prepared reader must give the same blocks, rows and labels, and the
same held-out records.
"""

from __future__ import annotations

import gzip
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tasks.core.data.dataset import TokenDataset
from tasks.core.data.index import PrepareError, check_fits_model, tokenizer_fingerprint
from tasks.core.data.inputs import InputError, resolve_inputs
from tasks.core.data.prepare import prepare
from tasks.core.data.records import read_records
from tasks.core.data.samples import encode_sft, pack_cpt
from tasks.core.data.shard import BadRecordError, token_dtype
from tasks.core.data.split import split_by_fraction, split_by_heldout
from tasks.core.models.demo import DEFAULT_CORPUS, build_tokenizer
from tasks.engine.sampler import ResumableSampler

CPT, SFT = DEFAULT_CORPUS


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DEFAULT_CORPUS, vocab_size=512)


@pytest.fixture(scope="module")
def tokdir(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(d)
    return d


def _all(ds: TokenDataset) -> dict[str, np.ndarray]:
    return ds.batch(range(ds.num_items))


def _prep(uri, tokdir, out, **kw):
    kw.setdefault("kind", "cpt")
    kw.setdefault("field", "text" if kw["kind"] == "cpt" else "messages")
    kw.setdefault("seq_len", 64)
    return prepare(uri, tokdir, out, **kw)


def _heldout_records(out, index) -> list[dict]:
    recs = []
    for f in index["files"]:
        with open(out / f["shard"] / "heldout.jsonl", encoding="utf-8") as fh:
            recs += [json.loads(line) for line in fh]
    return recs


# --------------------------------------------------------------------------------------------
# Equivalence with the in-memory path


def test_cpt_sample_matches_pack_cpt(tok, tokdir, tmp_path):
    records = read_records(str(CPT))
    split = split_by_fraction(records, 0.05)
    blocks = pack_cpt(tok, split.train, seq_len=64).numpy()
    r = _prep(str(CPT), tokdir, tmp_path, heldout_fraction=0.05)
    ds = TokenDataset(tmp_path, 64)
    assert ds.num_items == blocks.shape[0] and ds.num_items > 100
    got = _all(ds)
    assert np.array_equal(got["input_ids"], blocks) and np.array_equal(got["labels"], blocks)
    assert _heldout_records(tmp_path, r.index) == split.heldout
    assert r.index["totals"]["heldout_records"] == len(split.heldout) and r.index["dtype"] == "uint16"
    # Another seq_len packs the same stream differently, with no new tokenization.
    r2 = _prep(str(CPT), tokdir, tmp_path, heldout_fraction=0.05, seq_len=100)
    assert r2.tokenized == [] and np.array_equal(
        _all(TokenDataset(tmp_path, 100))["input_ids"], pack_cpt(tok, split.train, seq_len=100).numpy()
    )
    # What StageData does with the sampler's indices, on both paths.
    s_old, s_new = ResumableSampler(blocks.shape[0], 0, 1, seed=3), ResumableSampler(ds.num_items, 0, 1, seed=3)
    for _ in range(3):
        i_old, i_new = s_old.next_indices(8), s_new.next_indices(8)
        assert i_old == i_new and np.array_equal(ds.batch(i_new)["input_ids"], blocks[i_old])


def test_sft_sample_matches_encode_sft(tok, tokdir, tmp_path):
    records = read_records(str(SFT))
    split = split_by_fraction(records, 0.05)
    want = {k: v.numpy() for k, v in encode_sft(tok, split.train, seq_len=96, truncation="drop").items()}
    r = _prep(str(SFT), tokdir, tmp_path, kind="sft", seq_len=96, heldout_fraction=0.05)
    got = _all(TokenDataset(tmp_path))
    assert set(got) == set(want)
    for k, v in want.items():
        assert np.array_equal(got[k], v), k
    assert _heldout_records(tmp_path, r.index) == split.heldout
    # A seq_len most chats exceed: each sft.truncation rule gives what encode_sft gives under it.
    for rule in ("drop", "cut", "split_turns"):
        out2 = tmp_path / f"short-{rule}"
        want2 = {k: v.numpy() for k, v in encode_sft(tok, split.train, seq_len=48, truncation=rule).items()}
        r2 = _prep(str(SFT), tokdir, out2, kind="sft", seq_len=48, heldout_fraction=0.05, truncation_rule=rule)
        got2 = _all(TokenDataset(out2))
        t = r2.index["totals"]["truncation"]
        assert (
            t["chats"] == len(split.train)
            and t["over_seq_len"] > 0
            and r2.index["truncation"] == {"rule": rule, "seq_len": 48}
        )
        if rule != "split_turns":  # one row per kept chat
            assert (
                r2.index["totals"]["dropped_no_labels"] + t["dropped"] == len(split.train) - want2["input_ids"].shape[0]
            )
        for k, v in want2.items():
            assert np.array_equal(got2[k], v), (rule, k)
    with pytest.raises(ValueError, match="prepared for seq_len=48, not 96"):
        TokenDataset(out2, 96)


def test_no_record_below_fraction_holds_out_the_lowest_id(tok, tokdir, tmp_path):
    # 30 records and a tiny fraction: split_by_fraction's fallback holds out exactly one, by id.
    records = read_records(str(CPT))[:30]
    corpus = tmp_path / "c"
    corpus.mkdir()
    for name, part in (("a.jsonl", records[:15]), ("b.jsonl", records[15:])):
        (corpus / name).write_text("".join(json.dumps(x) + "\n" for x in part))
    split = split_by_fraction(records, 1e-6)
    assert len(split.heldout) == 1
    r = _prep(str(corpus), tokdir, tmp_path / "out", heldout_fraction=1e-6, seq_len=16)
    assert _heldout_records(tmp_path / "out", r.index) == split.heldout
    assert np.array_equal(
        _all(TokenDataset(tmp_path / "out"))["input_ids"], pack_cpt(tok, split.train, seq_len=16).numpy()
    )


def test_heldout_uri_drops_its_records_from_training(tok, tokdir, tmp_path):
    records = read_records(str(CPT))
    held = records[10:20] + [{"text": "a record only the held-out set has"}]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(x) + "\n" for x in held))
    split = split_by_heldout(records, held, "held.jsonl")
    r = _prep(str(CPT), tokdir, tmp_path / "out", heldout_uri=str(tmp_path / "held.jsonl"))
    assert r.index["split"]["method"] == "heldout-uri" and r.index["files"][0]["dropped_in_heldout_set"] == 10
    assert np.array_equal(
        _all(TokenDataset(tmp_path / "out"))["input_ids"], pack_cpt(tok, split.train, seq_len=64).numpy()
    )
    with pytest.raises(PrepareError, match="not both"):
        _prep(str(CPT), tokdir, tmp_path / "out", heldout_uri=str(tmp_path / "held.jsonl"), heldout_fraction=0.05)


# --------------------------------------------------------------------------------------------
# A corpus of several files, in several formats; incremental preparation


def _write(path, records):
    data = "".join(json.dumps(x) + "\n" for x in records).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


def test_directory_of_mixed_formats_and_adding_a_file(tok, tokdir, tmp_path):
    records = read_records(str(CPT))
    q = len(records) // 5
    parts = [records[i * q : (i + 1) * q] for i in range(4)] + [records[4 * q :]]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write(corpus / "a.jsonl", parts[0])
    _write(corpus / "b.jsonl.gz", parts[1])
    _write(corpus / "c.jsonl", parts[2])
    pq.write_table(pa.Table.from_pylist(parts[3]), corpus / "d.parquet")
    (corpus / "_SUCCESS").write_text("")  # a writer's marker, not data
    out = tmp_path / "prep"

    r1 = _prep(str(corpus), tokdir, out, heldout_fraction=0.05)
    names = [f["input"]["uri"].rsplit("/", 1)[-1] for f in r1.index["files"]]
    assert names == ["a.jsonl", "b.jsonl.gz", "c.jsonl", "d.parquet"] and len(r1.tokenized) == 4
    split = split_by_fraction([r for part in parts[:4] for r in part], 0.05)
    assert np.array_equal(_all(TokenDataset(out))["input_ids"], pack_cpt(tok, split.train, seq_len=64).numpy())

    again = _prep(str(corpus), tokdir, out, heldout_fraction=0.05)
    assert again.tokenized == [] and again.index == r1.index  # the skip rule: same inputs, same index

    _write(corpus / "e.jsonl.zst", parts[4])
    r2 = _prep(str(corpus), tokdir, out, heldout_fraction=0.05)
    assert [u.rsplit("/", 1)[-1] for u in r2.tokenized] == ["e.jsonl.zst"] and len(r2.reused) == 4
    split = split_by_fraction(records, 0.05)
    assert np.array_equal(_all(TokenDataset(out))["input_ids"], pack_cpt(tok, split.train, seq_len=64).numpy())
    assert _heldout_records(out, r2.index) == split.heldout

    # Same size, same name, different bytes: the checksum, not the name, decides.
    text = (corpus / "a.jsonl").read_text()
    (corpus / "a.jsonl").write_text(text.replace("a", "e", 1))
    r3 = _prep(str(corpus), tokdir, out, heldout_fraction=0.05)
    assert [u.rsplit("/", 1)[-1] for u in r3.tokenized] == ["a.jsonl"]


def test_inputs_list_glob_and_refusals(tmp_path):
    for n in ("b.jsonl", "a.jsonl", "c.txt"):
        (tmp_path / n).write_text('{"text": "x"}\n')
    got = resolve_inputs(str(tmp_path / "*.jsonl"))
    assert [f.uri.rsplit("/", 1)[-1] for f in got] == ["a.jsonl", "b.jsonl"]
    assert all(f.checksum.startswith("sha256:") and f.size == 14 for f in got)
    listed = resolve_inputs([str(tmp_path / "c.txt"), str(tmp_path / "a.jsonl")])
    assert [f.uri.rsplit("/", 1)[-1] for f in listed] == ["c.txt", "a.jsonl"]  # a list keeps its order
    with pytest.raises(InputError, match=r"the glob .*\*\.parquet' matches no file"):
        resolve_inputs(str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no .jsonl, .parquet file"):
        resolve_inputs(str(tmp_path / "empty"))
    with pytest.raises(InputError, match="does not exist"):
        resolve_inputs(str(tmp_path / "nope.jsonl"))
    with pytest.raises(InputError, match="named twice"):
        resolve_inputs([str(tmp_path / "a.jsonl"), str(tmp_path / "*.jsonl")])
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "e.jsonl").write_text("")
    with pytest.raises(InputError, match="holds no records"):
        resolve_inputs(str(tmp_path / "z"))


def test_empty_and_too_small_corpora_are_refused(tokdir, tmp_path):
    (tmp_path / "blank.jsonl").write_text("\n   \n\n")
    with pytest.raises(PrepareError, match="the corpus has no usable record"):
        _prep(str(tmp_path / "blank.jsonl"), tokdir, tmp_path / "o1")
    (tmp_path / "tiny.jsonl").write_text('{"text": "tiny"}\n')
    with pytest.raises(PrepareError, match="fewer than seq_len=64"):
        _prep(str(tmp_path / "tiny.jsonl"), tokdir, tmp_path / "o2")
    with pytest.raises(PrepareError, match="1 distinct"):
        _prep(str(tmp_path / "tiny.jsonl"), tokdir, tmp_path / "o3", heldout_fraction=0.05)


# --------------------------------------------------------------------------------------------
# Bad records: named by the user's file and line, error or skip


def _cpt_lines(n, tag):
    return [json.dumps({"text": f"{tag} record {i}: Zorvath has {i % 7} moons."}) for i in range(n)]


def _sft_lines(n, tag):
    out = []
    for i in range(n):
        msgs = [
            {"role": "user", "content": f"{tag} {i}: how many moons?"},
            {"role": "assistant", "content": f"{i % 7} moons."},
        ]
        out.append(json.dumps({"messages": msgs}))
    return out


BAD = {
    "malformed JSON": ("cpt", b'{"text": "half a record', r"b\.jsonl:300: malformed JSON"),
    "non-UTF-8": (
        "cpt",
        b'{"text": "caf\xe9 au lait"}',
        r"b\.jsonl:300: bytes that are not UTF-8 \(0xe9 at character 14\)",
    ),
    "no assistant turn": (
        "sft",
        json.dumps({"messages": [{"role": "user", "content": "anyone?"}]}).encode(),
        r"b\.jsonl:300: no assistant message",
    ),
}


def _bad_corpus(tmp_path, kind, bad_line):
    lines = _cpt_lines if kind == "cpt" else _sft_lines
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.jsonl").write_text("\n".join(lines(350, "a")) + "\n")
    b = [x.encode() for x in lines(400, "b")]
    b[299] = bad_line  # line 300
    (d / "b.jsonl").write_bytes(b"\n".join(b) + b"\n")
    return d


@pytest.mark.parametrize("case", list(BAD))
def test_bad_record_error_names_file_and_line(tokdir, tmp_path, case):
    kind, line, match = BAD[case]
    d = _bad_corpus(tmp_path, kind, line)
    with pytest.raises(BadRecordError, match=match + r".*data\.on_bad_record: skip"):
        # One case on the process pool: its error must come back the same, after the other file finished.
        _prep(str(d), tokdir, tmp_path / "out", kind=kind, workers=2 if case == "malformed JSON" else 1)
    # The good file's shard was kept: the retry after the fix tokenizes only the fixed file.
    (d / "b.jsonl").write_text("\n".join((_cpt_lines if kind == "cpt" else _sft_lines)(400, "b")) + "\n")
    r = _prep(str(d), tokdir, tmp_path / "out", kind=kind)
    assert [u.rsplit("/", 1)[-1] for u in r.tokenized] == ["b.jsonl"]


@pytest.mark.parametrize("case", list(BAD))
def test_bad_record_skip_counts_and_caps(tokdir, tmp_path, case):
    kind, line, match = BAD[case]
    d = _bad_corpus(tmp_path, kind, line)
    r = _prep(str(d), tokdir, tmp_path / "out", kind=kind, on_bad_record="skip", max_bad_records=1)
    b = r.index["files"][1]
    assert b["skipped"] == 1 and b["records"] == 399 and r.index["totals"]["skipped"] == 1
    assert len(b["bad_records"]) == 1 and __import__("re").search(match, b["bad_records"][0])
    assert r.index["totals"]["train_records"] == 350 + 399 - (
        0 if kind == "cpt" else r.index["totals"]["dropped_no_labels"]
    )
    with pytest.raises(BadRecordError, match=r"more than data\.max_bad_records=0"):
        _prep(str(d), tokdir, tmp_path / "out0", kind=kind, on_bad_record="skip", max_bad_records=0)


def test_missing_field_and_overlong_record(tokdir, tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ok ok ok ok ok ok ok ok"}\n{"body": "x"}\n{"text": "' + "y" * 500 + '"}\n')
    with pytest.raises(
        BadRecordError, match=r"d\.jsonl:2: no field 'text' \(fields: \['body'\]\); set data\.text_field"
    ):
        _prep(str(p), tokdir, tmp_path / "o1", seq_len=4)
    with pytest.raises(BadRecordError, match=r"d\.jsonl:3: the line has over 100 characters \(513\)"):
        _prep(str(p), tokdir, tmp_path / "o2", seq_len=4, max_record_chars=100, on_bad_record="skip", max_bad_records=1)


# --------------------------------------------------------------------------------------------
# Token width and the tokenizer fingerprint


def test_token_dtype_fits_the_vocabulary():
    assert token_dtype(512) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(152064) == np.uint32


def _wordlevel_tokenizer(n: int):
    """A word-level tokenizer of n words plus eos: a vocabulary past uint16 in well under a second."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(n)} | {"<unk>": n, "<eos>": n + 1}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="<eos>")


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    big = _wordlevel_tokenizer(70000)
    d = tmp_path / "bigtok"
    big.save_pretrained(d)
    records = [{"text": f"w{69999 - i} w{i} w{65536 + i} w7"} for i in range(20)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    r = _prep(str(tmp_path / "c.jsonl"), d, tmp_path / "out", seq_len=8)
    assert r.index["dtype"] == "uint32" and r.index["max_token_id"] == 70001  # eos
    got = _all(TokenDataset(tmp_path / "out"))["input_ids"]
    assert int((got > 65535).sum()) > 20 and np.array_equal(got, pack_cpt(big, records, seq_len=8).numpy())


def test_another_tokenizer_is_refused_by_fingerprint(tok, tokdir, tmp_path):
    _prep(str(CPT), tokdir, tmp_path / "out")
    ds = TokenDataset(tmp_path / "out")
    check_fits_model(ds.index, tmp_path / "out", tokdir, "cpt", vocab_size=len(tok))
    other = tmp_path / "other"
    shutil.copytree(tokdir, other)
    if (other / "chat_template.jinja").is_file():  # transformers >= 4.52's layout
        (other / "chat_template.jinja").write_text((other / "chat_template.jinja").read_text() + " ")
    else:
        cfg = json.loads((other / "tokenizer_config.json").read_text())
        cfg["chat_template"] = cfg["chat_template"] + " "
        (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tokdir)
    with pytest.raises(
        ValueError, match=rf"sha256 {tokenizer_fingerprint(other)[:16]}.*sha256 {tokenizer_fingerprint(tokdir)[:16]}"
    ):
        check_fits_model(ds.index, tmp_path / "out", other, "cpt", vocab_size=len(tok))
    top = ds.index["max_token_id"]
    with pytest.raises(
        ValueError,
        match=rf"token id {top} in .* does not fit the vocab_size {top} of .*tokenizer and model do not belong together",
    ):
        check_fits_model(ds.index, tmp_path / "out", tokdir, "cpt", vocab_size=top, fingerprint=False)


# --------------------------------------------------------------------------------------------
# The frozen CPT encoder: pool workers tokenize without transformers or torch


def test_pool_workers_encode_added_tokens_like_the_tokenizer(tmp_path):
    """Two pool workers, each with the frozen encoder only, give pack_cpt's blocks over text
    holding tokens added after training (they live in the backend transformers builds)."""
    tok = build_tokenizer(DEFAULT_CORPUS, vocab_size=512)
    tok.add_tokens(["ZZQ", "<tool>"])
    tok.add_special_tokens({"additional_special_tokens": ["<|sep|>"]})
    tokdir = tmp_path / "tok"
    tok.save_pretrained(tokdir)
    records = [{"text": f"{r['text']} ZZQ<tool> and <|sep|>{i}"} for i, r in enumerate(read_records(str(CPT)))]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    half = len(records) // 2
    _write(corpus / "a.jsonl", records[:half])
    _write(corpus / "b.jsonl", records[half:])
    assert tok("ZZQ<tool><|sep|>", add_special_tokens=False)["input_ids"] == [len(tok) - 3, len(tok) - 2, len(tok) - 1]
    out = tmp_path / "prep"
    r = _prep(str(corpus), tokdir, out, workers=2)
    assert len(r.tokenized) == 2 and (out / "encoders" / f"{tokenizer_fingerprint(tokdir)}.json").is_file()
    assert r.index["vocab_size"] == len(tok)
    blocks = pack_cpt(tok, records, seq_len=64).numpy()
    assert np.array_equal(_all(TokenDataset(out))["input_ids"], blocks)


def test_a_cpt_worker_imports_neither_transformers_nor_torch(tokdir, tmp_path):
    import subprocess
    import sys

    from tasks.core.data.prepare import PrepareSpec, plan

    p = plan(PrepareSpec.of(str(CPT), kind="cpt", field="text", seq_len=64), tokdir, tmp_path)
    code = (
        "import pickle, sys\n"
        "from tasks.core.data.shard import tokenize_file\n"
        "inp, spec, tokdir, out = pickle.load(sys.stdin.buffer)\n"
        "s = tokenize_file(inp, spec, tokdir, out)\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'})\n"
        "print(s['train']['tokens'], heavy)\n"
    )
    import pickle

    res = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps((p.inputs[0], p.spec, str(tokdir), str(tmp_path))),
        capture_output=True,
        check=True,
    )
    tokens, heavy = res.stdout.decode().split(" ", 1)
    assert int(tokens) > 0 and heavy.strip() == "[]", res.stdout
