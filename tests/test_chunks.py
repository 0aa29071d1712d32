"""One file tokenized in chunks at record boundaries: the same bytes, the same lines named, resumable.

    python -m pytest tests/test_chunks.py -q

The oracle is the whole-file pass (`chunk_mb` larger than the file, one worker): every prepared
file (shards, summary, index.json, held-out records) must be the same bytes whatever the chunk
size and the number of workers, for JSONL, gzip'd JSONL and parquet with several row groups.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.core.data import chunks as ck
from tasks.core.data.inputs import resolve_inputs
from tasks.core.data.prepare import prepare
from tasks.core.data.records import iter_records, read_records
from tasks.core.data.shard import BadRecordError
from tasks.core.models.demo import DEFAULT_CORPUS, build_tokenizer

CPT, SFT = DEFAULT_CORPUS
SMALL = 0.01  # MB: ~10 KB chunks, a dozen or more per test file
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(DEFAULT_CORPUS, vocab_size=512).save_pretrained(d)
    return d


def _records(kind: str) -> list[dict]:
    return read_records(str(CPT if kind == "cpt" else SFT))


def _write(path: Path, records: list[dict], bad: dict[int, bytes] | None = None) -> Path:
    lines = [json.dumps(r).encode() for r in records]
    for line, text in (bad or {}).items():
        lines[line - 1] = text
    data = b"\n".join(lines) + b"\n"
    if path.name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=max(1, len(records) // 9))
    else:
        path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def _prep(path: Path, tokdir, out: Path, kind: str = "cpt", **kw):
    field = "text" if kind == "cpt" else "messages"
    return prepare(
        str(path), tokdir, out, kind=kind, field=field, seq_len=64 if kind == "cpt" else 96, heldout_fraction=0.05, **kw
    )


def _artifact(out: Path, index: dict) -> dict[str, bytes]:
    """index.json and every file of every shard the index names: what the artifact copies."""
    files = {"index.json": (out / "index.json").read_bytes()}
    for f in index["files"]:
        for p in sorted((out / f["shard"]).iterdir()):
            files[f"{f['shard']}/{p.name}"] = p.read_bytes()
    return files


def _chunked(path: Path, mb: float = SMALL) -> list[ck.Chunk]:
    inp = resolve_inputs(str(path))[0]
    return list(ck.split(0, inp, int(mb * 2**20), path.parent / "spill") or [])


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz", "c.parquet"])
def test_chunks_give_the_whole_file_bytes_whatever_the_workers(tokdir, tmp_path, name):
    path = _write(tmp_path / name, _records("cpt") * 2)
    assert len(_chunked(path)) >= 4
    whole = _prep(path, tokdir, tmp_path / "whole")
    want = _artifact(tmp_path / "whole", whole.index)
    assert whole.index["totals"]["heldout_records"] > 0 and not (tmp_path / "whole" / ck.CHUNKS).exists()
    for out, kw in (("one", {"workers": 1}), ("two", {"workers": 2})):
        r = _prep(path, tokdir, tmp_path / out, chunk_mb=SMALL, **kw)
        assert _artifact(tmp_path / out, r.index) == want, (name, out)
        assert len(list((tmp_path / out / ck.CHUNKS).glob("*/summary.json"))) >= 4
    for p in tmp_path.glob("*/chunks/.tmp-spill-*"):
        assert not any(p.iterdir()), "a spilled chunk outlived its tokenizing"


def test_sft_chunks_give_the_whole_file_bytes(tokdir, tmp_path):
    path = _write(tmp_path / "s.jsonl", _records("sft"))
    assert len(_chunked(path)) >= 3
    whole = _prep(path, tokdir, tmp_path / "whole", kind="sft")
    r = _prep(path, tokdir, tmp_path / "one", kind="sft", chunk_mb=SMALL)
    assert _artifact(tmp_path / "one", r.index) == _artifact(tmp_path / "whole", whole.index)


BAD = {
    "c.jsonl": (b'{"text": "cut off', r"c\.jsonl:{line}: malformed JSON"),
    "c.jsonl.gz": (b'{"text": "caf\xe9"}', r"c\.jsonl\.gz:{line}: bytes that are not UTF-8"),
    "c.parquet": (None, r"c\.parquet row {line}: field 'text' is empty"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_record_in_the_second_chunk_is_named_by_its_line_in_the_file(tokdir, tmp_path, name):
    records = _records("cpt")
    (tmp_path / "probe").mkdir()
    probe = _chunked(_write(tmp_path / "probe" / name, records))
    second = probe[1]
    line = second.first_line + 3  # a line well inside the second chunk
    assert second.first_line > 1 and line < probe[2].first_line
    text, match = BAD[name]
    if text is None:
        records = [*records[: line - 1], {"text": ""}, *records[line:]]
    path = _write(tmp_path / name, records, {line: text} if text else None)
    with pytest.raises(BadRecordError, match=match.format(line=line)):
        _prep(path, tokdir, tmp_path / "out", chunk_mb=SMALL, workers=2 if name == "c.jsonl" else 1)
    # skip: counted, and named the same in the index
    r = _prep(path, tokdir, tmp_path / "skip", chunk_mb=SMALL, on_bad_record="skip", max_bad_records=1)
    f = r.index["files"][0]
    assert f["skipped"] == 1 and __import__("re").search(match.format(line=line), f["bad_records"][0])


def test_a_prepare_killed_after_some_chunks_reruns_only_the_missing_ones(tokdir, tmp_path):
    path = _write(tmp_path / "c.jsonl", _records("cpt") * 2)
    total = len(_chunked(path))
    out = tmp_path / "out"
    # Killed (SIGKILL: no clean-up runs) as the third chunk's summary lands.
    code = (
        "import os, signal, sys\n"
        "from tasks.core.data.prepare import prepare\n"
        "seen = []\n"
        "def progress(s):\n"
        "    seen.append(s)\n"
        "    if len(seen) == 3: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"prepare({str(path)!r}, {str(tokdir)!r}, {str(out)!r}, kind='cpt', field='text', seq_len=64, "
        f"heldout_fraction=0.05, chunk_mb={SMALL}, progress=progress)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, check=False
    )
    assert p.returncode == -9, p.stderr.decode()[-2000:]
    assert len(list((out / ck.CHUNKS).glob("*/summary.json"))) == 3 and not (out / "index.json").exists()
    again: list[dict] = []
    r = _prep(path, tokdir, out, chunk_mb=SMALL, progress=again.append)
    assert sum(1 for s in again if "n" in s.get("chunk", {})) == total - 3
    whole = _prep(path, tokdir, tmp_path / "whole")
    assert _artifact(out, r.index) == _artifact(tmp_path / "whole", whole.index)

    # Records appended to the file: the chunks before its old last one are reused.
    (tmp_path / "before.jsonl").write_bytes(path.read_bytes())
    records = _records("cpt") * 2 + [{"text": f"appended record {i}: the moons of Zorvath"} for i in range(200)]
    _write(path, records)
    old, grown = {(c.start, c.end) for c in _chunked(tmp_path / "before.jsonl")}, _chunked(path)
    again.clear()
    r = _prep(path, tokdir, out, chunk_mb=SMALL, progress=again.append, prune_unused=True)
    redone = sum(1 for s in again if "n" in s.get("chunk", {}))
    assert len(grown) > total and redone == sum((c.start, c.end) not in old for c in grown) <= len(grown) - total + 1, (
        redone,
        len(grown),
        total,
    )
    fresh = _prep(path, tokdir, tmp_path / "fresh")
    assert _artifact(out, r.index) == _artifact(tmp_path / "fresh", fresh.index)
    # Pruned with the index: the old version's last chunk and its chunk list are gone.
    assert (
        len(list((out / ck.CHUNKS).glob("*/summary.json"))) == len(grown)
        and len(list((out / ck.CHUNKS).glob("*.json"))) == 1
    )


def test_chunk_size_gives_every_worker_work_and_keeps_the_grid_for_large_corpora():
    mib = 2**20
    assert ck.chunk_size([200 * mib], 2, 64 * mib) == 16 * mib  # 13 chunks for 2 workers
    assert ck.chunk_size([12 * mib] * 8, 2, 64 * mib) == 64 * mib  # 8 files are work enough: none is split
    assert ck.chunk_size([100 * 2**30], 64, 64 * mib) == 64 * mib
    assert ck.chunk_size([3 * mib], 8, 64 * mib) == mib  # not below 1 MiB unless asked
    assert ck.chunk_size([3 * mib], 1, 64 * mib) == 64 * mib


def test_text_chunks_cut_after_a_newline_and_count_every_line_end(tmp_path):
    # CRLF, a lone CR (universal newlines: a line end too) and a line longer than a chunk.
    body = (
        b"".join(b'{"text": "r%d"}\r\n' % i for i in range(50))
        + b'{"text": "cr"}\r'
        + b'{"text": "'
        + b"x" * 300
        + b'"}\n'
        + b"".join(b'{"text": "s%d"}\n' % i for i in range(50))
    )
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(body)
    pieces = _chunked(path, mb=100 / 2**20)
    assert len(pieces) > 5 and b"".join(body[c.start : c.end] for c in pieces) == body
    lines = dict(iter_records(str(path)))
    for c in pieces:
        assert c.start == 0 or body[c.start - 1 : c.start] == b"\n"
        first, rec = next(iter(c.records(1 << 20)))
        assert first == c.first_line and rec == lines[first], c


@pytest.mark.parametrize("name", ["c.jsonl.gz", "c.parquet"])
def test_a_compressed_or_parquet_prepare_killed_after_some_chunks_reruns_only_the_missing_ones(tokdir, tmp_path, name):
    path = _write(tmp_path / name, _records("cpt") * 2)
    total = len(_chunked(path))
    out = tmp_path / "out"
    # Killed (SIGKILL: no clean-up runs) as the second chunk's summary lands; a gzip stream leaves its spill behind.
    code = (
        "import os, signal\n"
        "from tasks.core.data.prepare import prepare\n"
        "seen = []\n"
        "def progress(s):\n"
        "    seen.append(s)\n"
        "    if len(seen) == 2: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"prepare({str(path)!r}, {str(tokdir)!r}, {str(out)!r}, kind='cpt', field='text', seq_len=64, "
        f"heldout_fraction=0.05, chunk_mb={SMALL}, progress=progress)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, check=False
    )
    assert p.returncode == -9, p.stderr.decode()[-2000:]
    done = {d.name for d in (out / ck.CHUNKS).iterdir() if (d / "summary.json").is_file()}
    assert len(done) == 2 and total > 3 and not (out / "index.json").exists()
    before = {k: (out / ck.CHUNKS / k / "summary.json").stat().st_mtime_ns for k in done}
    again: list[dict] = []
    r = _prep(path, tokdir, out, chunk_mb=SMALL, progress=again.append)
    redone = [s["chunk"]["n"] for s in again if "n" in s.get("chunk", {})]
    assert sorted(redone) == list(range(2, total)), redone  # chunks 0 and 1 were done: only the others ran
    assert {k: (out / ck.CHUNKS / k / "summary.json").stat().st_mtime_ns for k in done} == before
    assert not list((out / ck.CHUNKS).glob(".tmp-*")), (
        "the killed run's spill and half-written chunks, and this run's spill"
    )
    whole = _prep(path, tokdir, tmp_path / "whole")
    assert _artifact(out, r.index) == _artifact(tmp_path / "whole", whole.index)
