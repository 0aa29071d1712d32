"""Prepared data from an `s3://` corpus on the real SeaweedFS S3 server (integration tier).

python -m pytest -m integration tests/test_dataprep_s3.py -q
"""

from __future__ import annotations

import gzip
import json

import fsspec
import numpy as np
import pytest

from tasks.core.data.dataset import TokenDataset
from tasks.core.data.inputs import InputError, resolve_inputs
from tasks.core.data.prepare import prepare
from tasks.core.data.records import read_records
from tasks.core.data.samples import pack_cpt
from tasks.core.data.split import split_by_fraction
from tasks.core.models.demo import DEFAULT_CORPUS, build_tokenizer

pytest_plugins = ["tests.conftest_servers"]
pytestmark = pytest.mark.integration


def test_s3_directory_corpus_streams_and_reuses_by_etag(s3_root, tmp_path):
    tok = build_tokenizer(DEFAULT_CORPUS, vocab_size=512)
    tok.save_pretrained(tmp_path / "tok")
    records = read_records(str(DEFAULT_CORPUS[0]))
    half = len(records) // 2
    fs = fsspec.filesystem("s3")
    corpus = f"{s3_root}/corpus"
    fs.pipe(f"{corpus}/a.jsonl", "".join(json.dumps(r) + "\n" for r in records[:half]).encode())
    fs.pipe(f"{corpus}/b.jsonl.gz", gzip.compress("".join(json.dumps(r) + "\n" for r in records[half:]).encode()))

    inputs = resolve_inputs(corpus)
    assert [f.uri.rsplit("/", 1)[-1] for f in inputs] == ["a.jsonl", "b.jsonl.gz"]
    assert all(f.uri.startswith("s3://") and f.checksum.startswith("etag:") for f in inputs)
    out = tmp_path / "prep"
    kw = dict(kind="cpt", field="text", seq_len=64, heldout_fraction=0.05)
    r1 = prepare(corpus, tmp_path / "tok", out, **kw)
    split = split_by_fraction(records, 0.05)
    assert np.array_equal(
        TokenDataset(out).batch(range(TokenDataset(out).num_items))["input_ids"],
        pack_cpt(tok, split.train, seq_len=64).numpy(),
    )
    assert len(r1.tokenized) == 2 and prepare(corpus, tmp_path / "tok", out, **kw).tokenized == []

    # Rewriting one object changes its ETag: that file alone is tokenized again.
    fs.pipe(f"{corpus}/a.jsonl", "".join(json.dumps(r) + "\n" for r in records[: half - 1]).encode())
    r3 = prepare(corpus, tmp_path / "tok", out, **kw)
    assert [u.rsplit("/", 1)[-1] for u in r3.tokenized] == ["a.jsonl"] and len(r3.reused) == 1

    with pytest.raises(InputError, match="matches no file"):
        resolve_inputs(f"{corpus}/*.parquet")
