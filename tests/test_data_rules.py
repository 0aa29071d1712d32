"""What is data is said once, and mixture weights that do not sum to 1 are said (or refused).

python -m pytest -q tests/test_data_rules.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tasks.core.data.inputs import InputError, resolve_inputs
from tasks.core.preflight.checks import Machine, load_for_check, preflight_report
from tests.conftest import REPO, tiny_config_raw, write_config

CPU = Machine(cuda_devices=0, cpu_count=2, free_bytes=10**13)


def _folder(d: Path) -> Path:
    d.mkdir(parents=True)
    shutil.copy(REPO / "data/sample/cpt.jsonl", d / "cpt.jsonl")
    (d / "NOTES.txt").write_text("remember to ask about the licence\n")
    (d / "README.md").write_text("# corpus\n")
    (d / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    return d


def _report(tmp_path: Path, raw: dict):
    return preflight_report(load_for_check(write_config(tmp_path / "c.yaml", raw)), machine=CPU)


def test_a_folder_is_read_by_its_formats_and_the_rest_is_named_in_one_preflight_line(tiny_model_dir, tmp_path):
    from tasks.core.data.prepare import prepare

    corpus = _folder(tmp_path / "corpus")
    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["cpt"]["data"] = {"uri": str(corpus)}
    report = _report(tmp_path, raw)
    assert report.ok, report.text()
    lines = [w for w in report.warnings if "not data" in w]
    assert lines == [
        (
            "cpt.data.uri: skipped 3 files that are not data (cpt.data.formats: jsonl, parquet): .DS_Store, "
            "NOTES.txt, README.md "
            "(1 .txt: plain text is read from a folder only when cpt.data.formats lists txt)"
        )
    ], report.warnings
    # prepare reads the rule's files only: NOTES.txt is not training text.
    r = prepare(str(corpus), tiny_model_dir, tmp_path / "prep", kind="cpt", field="text", seq_len=64)
    assert [Path(f["input"]["uri"]).name for f in r.index["files"]] == ["cpt.jsonl"]
    # Named by the user, plain text is read: data.formats lists txt, or a file or glob names it.
    raw["cpt"]["data"] = {"uri": str(corpus), "formats": ["jsonl", "txt"]}
    assert not [w for w in _report(tmp_path, raw).warnings if "NOTES.txt" in w]
    r = prepare(
        str(corpus),
        tiny_model_dir,
        tmp_path / "prep2",
        kind="cpt",
        field="text",
        seq_len=64,
        formats=(".jsonl", ".txt"),
    )
    assert [Path(f["input"]["uri"]).name for f in r.index["files"]] == ["NOTES.txt", "cpt.jsonl"]
    assert [Path(f.uri).name for f in resolve_inputs(str(corpus / "*.txt"))] == ["NOTES.txt"]
    only_txt = tmp_path / "only-txt"
    only_txt.mkdir()
    (only_txt / "a.txt").write_text("some text\n")
    with pytest.raises(
        InputError,
        match=r"holds no .jsonl, .parquet file .*its 1 .txt file\(s\) are read from a folder only when data.formats "
        r"lists txt",
    ):
        resolve_inputs(str(only_txt))


def _mixture(tiny_model_dir: Path, tmp_path: Path, weights: tuple[float, float], strict: bool = False) -> dict:
    raw = tiny_config_raw(tiny_model_dir, tmp_path / "run")
    raw["cpt"]["data"] = {
        "sources": [
            {"name": "domain", "uri": str(REPO / "data/sample/cpt.jsonl"), "weight": weights[0]},
            {"name": "general", "uri": str(REPO / "data/sample/general.jsonl"), "weight": weights[1]},
        ],
        "strict_weights": strict,
    }
    return raw


def test_mixture_weights_that_do_not_sum_to_one_are_normalized_and_said_or_refused(tiny_model_dir, tmp_path):
    report = _report(tmp_path, _mixture(tiny_model_dir, tmp_path, (0.7, 0.2)))
    assert report.ok, report.text()
    assert (
        "cpt.data.sources: weights 0.7, 0.2 (domain, general) sum to 0.9: normalized to 0.778, 0.222 "
        "(set cpt.data.strict_weights: true to refuse weights that do not sum to 1)"
    ) in report.warnings, report.warnings
    strict = _report(tmp_path, _mixture(tiny_model_dir, tmp_path, (0.7, 0.2), strict=True))
    assert [
        (w, m) for w, m in strict.problems if w == "cpt.data.sources" and "sum to 0.9" in m and "0.778, 0.222" in m
    ], strict.problems
    exact = _report(tmp_path, _mixture(tiny_model_dir, tmp_path, (0.7, 0.3), strict=True))
    assert (
        exact.ok
        and "cpt mixture weights 0.7, 0.3 sum to 1" in exact.checked
        and not [w for w in exact.warnings if "normalized" in w]
    )
    assert json.dumps(exact.problems) == "[]"
