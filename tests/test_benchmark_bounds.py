"""What a benchmark task's data and templates cost is bounded before they are read: pre-flight reads a
head sample of each data file and its sizes from the file system (its time does not grow with the
data), refuses a split over benchmark.max_split_mb and a num_fewshot its few-shot split cannot
give, and every way a template could build a large string in one step is refused before it runs.

    PYTHONPATH=$PWD python -m pytest -q tests/test_benchmark_bounds.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tasks.core.evaluation import benchmark as bench
from tasks.core.evaluation import task_data as data
from tasks.core.evaluation import task_rules as rules
from tasks.core.preflight.benchmark import check_benchmark
from tasks.core.preflight.report import CheckContext, PreflightReport
from tests._task_yaml import mc_task_lines
from tests.conftest import tiny_config_raw

DOC = json.dumps({"question": "q", "choices": ["a", "b"], "answer": 0}).encode() + b"\n"


def _yaml(root: Path, name: str, splits: dict[str, str], **top) -> Path:
    lines = mc_task_lines(name, **top)
    lines += ["dataset_kwargs:\n  data_files:"] + [f"    {s}: {f}" for s, f in splits.items()]
    path = root / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _check(tmp_path: Path, tasks: list[Path], **benchmark) -> tuple[str, float]:
    """Pre-flight's benchmark check: its problems as text, and its seconds."""
    from tasks.core.config.load import parse_config

    raw = tiny_config_raw(Path("/nonexistent-model"), tmp_path / "run")
    raw["benchmark"] = {"tasks": [str(t) for t in tasks], **benchmark}
    report = PreflightReport()
    started = time.monotonic()
    check_benchmark(CheckContext(parse_config(raw), None, None, None, report, None))
    return "\n".join(f"{w}: {m}" for w, m in report.problems), time.monotonic() - started


def test_preflight_time_does_not_grow_with_the_data_and_a_split_over_the_limit_is_refused(tmp_path):
    """Bad: on main check_benchmark copied every data file and lm-eval built every document, so a
    55 MB JSONL of 10^6 documents kept `check` silent for minutes and a 1 GB file longer."""
    _check(tmp_path, [_yaml(tmp_path, "warm", {"test": "warm.jsonl"})])  # lm-eval's imports, once
    (tmp_path / "warm.jsonl").write_bytes(DOC * 10)
    seconds = {}
    for n in (10**3, 10**5, 10**6):
        (tmp_path / f"d{n}.jsonl").write_bytes(DOC * n)
        text, seconds[n] = _check(tmp_path, [_yaml(tmp_path, f"d{n}", {"test": f"d{n}.jsonl"})])
        assert text == "", text
    # 54 MB answered as fast as 54 KB (measured: 0.1 s each; main: minutes for 10^6)
    assert seconds[10**6] < 10 and seconds[10**6] < 5 * seconds[10**3] + 2, seconds

    huge = tmp_path / "huge.jsonl"
    with open(huge, "wb") as fh:  # 1 GB, sparse: nothing of it is written, nor read by pre-flight
        fh.truncate(10**9)
    task = _yaml(tmp_path, "huge", {"test": "huge.jsonl"})
    text, took = _check(tmp_path, [task])
    assert (
        f"task 'huge': its 'test' split is 1000.0 MB on disk ({huge} (1000.0 MB)), over benchmark.max_split_mb "
        "(256 MB): the stage reads a split whole and lm-eval builds every document; score a subset (a smaller "
        "file), or raise benchmark.max_split_mb" in text
    ), text
    assert took < 10
    with pytest.raises(ValueError, match="over benchmark.max_split_mb"):  # the stage's own check
        bench.require_runnable([bench.read_task(str(task))], 256)
    # the limit raised, pre-flight still reads only its sample: 4 MiB of one unending line
    text, took = _check(tmp_path, [task], max_split_mb=2000)
    assert f"data file {huge}: its first document is longer than the 4 MiB pre-flight reads" in text, text
    assert took < 10


def test_a_split_of_many_files_is_sampled_from_its_first_files(tmp_path, monkeypatch):
    names = [f"part{i}.jsonl" for i in range(40)]
    for name in names:
        (tmp_path / name).write_bytes(DOC * 2)
    read: list[str] = []
    real = data.head_sample
    monkeypatch.setattr(data, "head_sample", lambda uri, *a, **k: read.append(uri) or real(uri, *a, **k))
    text, _ = _check(tmp_path, [_yaml(tmp_path, "parts", {"test": json.dumps(names)})])
    assert text == "" and read == [str(tmp_path / n) for n in names[: data.SAMPLE_FILES]], (text, read)


def test_a_data_file_the_sampler_cannot_read_is_named(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    text, _ = _check(tmp_path, [_yaml(tmp_path, "bad", {"test": "bad.parquet"}, dataset_path="parquet")])
    assert "task 'bad': cannot read a sample of its data: ArrowInvalid" in text, text


def test_a_sample_keeps_whole_records_of_each_format(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"q": i, "t": "x" * 50} for i in range(100)]))
    (tmp_path / "c.csv").write_text('q,t\n1,"two\nlines"\n' + "".join(f"{i},x\n" for i in range(200)))
    (tmp_path / "l.jsonl").write_bytes(DOC * 3)
    arr, csv_, lines = (
        data.head_sample(str(tmp_path / f), b) for f, b in (("a.json", "json"), ("c.csv", "csv"), ("l.jsonl", "json"))
    )
    assert (arr.count, arr.complete, len(arr.docs)) == (100, True, data.SAMPLE_DOCS)
    assert json.loads(arr.docs[1]) == {"q": 1, "t": "x" * 50}
    assert (csv_.count, csv_.header, csv_.docs[0]) == (201, b"q,t\n", b'1,"two\nlines"')
    assert (lines.count, lines.complete, lines.docs) == (3, True, [DOC.strip()] * 3)


def test_num_fewshot_larger_than_the_fewshot_split_is_refused_before_launch(tmp_path):
    """Poor: on main it passed pre-flight and the stage failed after training with "Sample larger
    than population"."""
    (tmp_path / "three.jsonl").write_bytes(DOC * 3)
    (tmp_path / "two.jsonl").write_bytes(DOC * 2)
    scored_only = _yaml(tmp_path, "scored_only", {"test": "three.jsonl"})
    text, _ = _check(tmp_path, [scored_only], num_fewshot=5)
    assert (
        f"task 'scored_only': benchmark.num_fewshot is 5, but its few-shot split 'test' ({tmp_path / 'three.jsonl'}) "
        "holds 3 document(s) and lm-eval needs 5; set benchmark.num_fewshot to at most 3, or give the task a "
        "few-shot split with more documents (fewshot_split)" in text
    ), text
    same = _yaml(tmp_path, "same", {"test": "three.jsonl"}, fewshot_split="test")
    text, _ = _check(tmp_path, [same], num_fewshot=3)  # drawn from the scored split: n + 1 needed
    assert "holds 3 document(s) and lm-eval needs 4 (lm-eval draws one more" in text and "at most 2" in text, text
    own = _yaml(tmp_path, "own", {"test": "three.jsonl", "train": "two.jsonl"}, training_split="train", num_fewshot=4)
    text, _ = _check(tmp_path, [own])
    assert f"num_fewshot in {own} is 4, but its few-shot split 'train'" in text and "at most 2" in text, text
    assert _check(tmp_path, [own], num_fewshot=2)[0] == ""  # the config's value wins, and fits
    zero = _yaml(tmp_path, "zero", {"test": "three.jsonl"}, num_fewshot=0)
    assert _check(tmp_path, [zero], num_fewshot=50)[0] == ""  # a task that says 0 keeps 0 (lm-eval's rule)


# Every way one step of a template could build a large string, each with arguments that would
# build hundreds of MB (or GB): refused before it is built.
GROWTH = {
    "format filter": "{{ '%0300000000d'|format(1) }}",
    "% operator": "{{ '%.300000000d' % 1 }}",
    "% with * width": "{{ '%*d' % (300000000, 1) }}",
    "% repeating a mapping key": "{% set s = 'x' * 4000000 %}{{ '%(a)s%(a)s%(a)s' % {'a': s} }}",
    "center filter": "{{ 'x'|center(300000000) }}",
    "str.center": "{{ 'x'.center(300000000) }}",
    "str.ljust": "{{ 'x'.ljust(300000000) }}",
    "str.rjust": "{{ 'x'.rjust(300000000) }}",
    "str.zfill": "{{ 'x'.zfill(300000000) }}",
    "str.expandtabs": "{{ '\\t'.expandtabs(300000000) }}",
    "str.format width": "{{ '{:0300000000}'.format(1) }}",
    "str.format nested width": "{{ '{:{}}'.format(1, 300000000) }}",
    "str.format repeats": "{{ '{0}{0}{0}{0}{0}{0}{0}{0}{0}{0}'.format('x' * 1000000) }}",
    "str.translate": "{{ 'xx'.translate({120: 'y' * 8000000}) }}",
    "str.replace": "{{ 'xxxxxxxx'.replace('', 'y' * 2000000) }}",
    "str.join": "{{ ('y' * 5000000).join(['a', 'b', 'c']) }}",
    "int.to_bytes": "{{ (1).to_bytes(300000000, 'big') }}",
    "indent filter": "{{ 'a\\nb'|indent(300000000) }}",
    "replace filter": "{{ ('x' * 8000000)|replace('x', 'yy') }}",
    "join filter": "{{ range(99999)|join('x' * 100000) }}",
    "wordwrap filter": "{{ ('x ' * 1000000)|wordwrap(1, wrapstring='y' * 100) }}",
    "batch filter": "{{ [1]|batch(300000000, 'x') }}",
    "slice filter": "{{ [1]|slice(300000000)|list }}",
    "tojson indent": "{{ {'a': 1}|tojson(300000000) }}",
    "sum of lists": "{{ ([[1]] * 2000000)|sum(start=[]) }}",
    "regex_replace": "{{ ('x' * 1000)|regex_replace('', 'y' * 10000) }}",
    "lipsum": "{{ lipsum(3000000) }}",
    "~ doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "+ doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "string *": "{{ 'x' * 300000000 }}",
    "list * of a big string": "{{ ['x' * 1000000] * 100 }}",
    "a list repeating one string": "{% set s = 'x' * 8000000 %}{{ [s, s, s] }}",
    "a call whose result repeats": "{{ dict.fromkeys(range(99999), 'x' * 1000) }}",
    "escape compounding": "{{ ('&' * 3000000)|forceescape|forceescape }}",
    "urlencode compounding": "{{ ('%' * 3000000)|urlencode|urlencode }}",
}


@pytest.mark.parametrize("template", GROWTH.values(), ids=GROWTH.keys())
def test_every_way_a_template_grows_its_output_is_refused_before_it_builds_it(template):
    """Poor: on main `'%0300000000d'|format(1)` built 300 MB a render (2 min 22 s for 40 documents)."""
    started = time.monotonic()
    with pytest.raises(SecurityError, match=f"over the {rules.MAX_OUTPUT}|at most 64") as got:
        rules.BoundedSandbox().from_string(template).render()
    assert "render the document's own fields" in str(got.value)
    assert time.monotonic() - started < 10  # each well under a second here


def test_templates_within_the_bounds_render_as_jinja2_renders_them():
    doc = {"question": "Who?", "choices": ["a", "b"], "answer": 1, "text": "one two three four five"}
    for template in (
        "{{ question ~ ' ' ~ answer }} {{ '%s: %05d' % (question, answer) }} {{ '{:>8}|{}'.format(question, 3) }}",
        "{{ question|center(12) }}{{ text|indent(2, true) }}{{ text|wordwrap(9) }}{{ text|truncate(12) }}",
        "{{ choices|join(', ') }} {{ [[1], [2]]|sum(start=[]) }} {{ text|replace('o', '0') }} {{ 'x' * 3 }} {{ 2 ** 8 }}",
        "{% for c in choices %}{{ loop.index }}. {{ c|upper }}\n{% endfor %}{{ choices|tojson }}{{ [1, 2] + [3] }}",
        "{{ question.ljust(6, '.') }}{{ '7'.zfill(3) }}{{ choices|batch(1, 'z')|list }}{{ choices|slice(2)|list }}",
    ):
        want = ImmutableSandboxedEnvironment(keep_trailing_newline=True).from_string(template).render(**doc)
        assert rules.BoundedSandbox().from_string(template).render(**doc) == want
    assert rules.BoundedSandbox().from_string("{{ text|regex_replace('(o)', '[\\\\1]') }}").render(**doc) == (
        "[o]ne tw[o] three f[o]ur five"
    )


def test_preflight_names_the_task_file_whose_template_grows(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(DOC * 2)
    task = _yaml(tmp_path, "wide", {"test": "d.jsonl"}, doc_to_text="{{ '%0300000000d'|format(1) }}{{question}}")
    text, took = _check(tmp_path, [task])
    assert f"benchmark.tasks[0] ({task}): lm-eval cannot load task 'wide'" in text, text
    assert "SecurityError: a task template's `format` filter would build 300000014 characters" in text, text
    assert "render the document's own fields" in text and took < 30
