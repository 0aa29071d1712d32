"""A benchmark task file is untrusted input (tasks/core/evaluation/task_rules.py): each attack is
refused in pre-flight naming the key and the fix, and the payload it carries does not run there nor
where the stage loads the task (the stage's own check, and lm-eval's load under the sandbox).

    PYTHONPATH=$PWD python -m pytest -q tests/test_benchmark_tasks.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from jinja2.exceptions import SecurityError

from tasks.core.evaluation import benchmark as bench
from tasks.core.evaluation import task_rules as rules
from tests._task_yaml import mc_task_lines
from tests.test_benchmark import _check

# A payload that writes {marker} when Python runs it (the id > marker of the report, in Python).
WRITE = "open({marker!r}, 'w').write('ran')"


def _task(tmp_path: Path, name: str = "evil", body: str = "", records: int = 2, data: str | None = None, **top) -> Path:
    """A multiple-choice task over `records` documents beside it; `body` adds raw YAML lines."""
    if data is None:
        data = "".join(
            json.dumps({"question": f"q{i}", "choices": ["a", "b"], "answer": i % 2}) + "\n" for i in range(records)
        )
    (tmp_path / f"{name}.jsonl").write_text(data)
    lines = mc_task_lines(name, **top)
    lines += [f"dataset_kwargs:\n  data_files:\n    test: {name}.jsonl"]
    lines += [body or "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}"]
    path = tmp_path / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _problems(report) -> str:
    return "\n".join(f"{w}: {m}" for w, m in report.problems)


def _stage_load(tmp_path: Path, task: Path, *, checked: bool = True):
    """What the benchmark stage does with a task before any model: read it, its own check of the
    rules (`checked`), copy it, and lm-eval's load of the copy (bench.score's first step)."""
    tasks = [bench.read_task(str(task))]
    if checked:
        bench.require_runnable(tasks)
    fetched = bench.fetch(tasks, tmp_path / "copies")
    include = bench.runnable(tasks, fetched, tmp_path / "copies", tmp_path / "run", tmp_path / "cache")
    return bench.score(tmp_path / "no-model", include, [t.name for t in tasks], None, "fp32")


def test_jinja_in_a_task_is_refused_and_renders_in_the_sandbox_where_the_stage_loads_it(tmp_path):
    """Bad 1: on main `{{ lipsum.__globals__['os'].popen('id > marker') }}` passed `check` and wrote the marker."""
    marker = tmp_path / "marker"
    direct = _task(
        tmp_path, doc_to_text=f"{{{{ lipsum.__globals__['os'].popen('id > {marker}').read() }}}}{{{{question}}}}"
    )
    report = _check(tmp_path, [direct])
    assert f"benchmark.tasks[0] ({direct}): task 'evil' is refused" in _problems(report)
    assert "doc_to_text: the template reaches '__globals__'" in _problems(report) and not marker.exists()
    with pytest.raises(ValueError, match="doc_to_text: the template reaches '__globals__'"):
        _stage_load(tmp_path / "stage", direct)
    # the same reach through the attr filter passes the text of the template: the sandbox stops it
    # when lm-eval renders document 0, in pre-flight and where the stage loads the task
    sneaky = _task(
        tmp_path,
        name="sneaky",
        doc_to_text="{{ (lipsum|attr('__glo' ~ 'bals__'))['os'].popen('id > "
        + str(marker)
        + "').read() }}{{question}}",
    )
    report = _check(tmp_path, [sneaky])
    assert "lm-eval cannot load task 'sneaky'" in _problems(report) and not marker.exists()
    assert f"benchmark.tasks[0] ({sneaky})" in _problems(report) and "SecurityError" in _problems(report)
    with pytest.raises(SecurityError, match="__globals__"):
        _stage_load(tmp_path / "stage2", sneaky)
    assert not marker.exists()
    import lm_eval.utils

    assert isinstance(lm_eval.utils.env, rules.BoundedSandbox)  # installed for the whole process


def test_a_template_that_would_loop_for_hours_is_refused_in_seconds(tmp_path):
    """10^10 loop steps on main (jinja2's sandbox caps one range, not their product)."""
    loops = _task(
        tmp_path,
        name="loops",
        doc_to_text="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{question}}",
    )
    started = time.monotonic()
    text = _problems(_check(tmp_path, [loops]))
    assert "SecurityError: a task template took more than 1000000 loop steps and calls" in text, text
    assert time.monotonic() - started < 120  # ~1 s; hours without the bound
    sandbox = rules.BoundedSandbox()
    with pytest.raises(SecurityError, match="builds a sequence of 1000000000 items"):
        sandbox.from_string("{{ 'x' * 10 ** 9 }}").render()
    with pytest.raises(SecurityError, match="loop steps"):
        sandbox.from_string("{% for c in 'ab' * 999999 %}{% endfor %}").render()


def test_a_metric_that_is_a_path_is_refused_and_never_imported(tmp_path, monkeypatch):
    """Bad 2: on main lm-eval fell back to evaluate.load('./evilmetric/evilmetric.py'), which ran the
    file; its SystemExit ended `check` with no report."""
    marker = tmp_path / "marker"
    (tmp_path / "evilmetric").mkdir()
    (tmp_path / "evilmetric" / "evilmetric.py").write_text(WRITE.format(marker=str(marker)) + "\nraise SystemExit(7)\n")
    monkeypatch.chdir(tmp_path)  # where evaluate.load would find the relative path
    task = _task(tmp_path, body="metric_list:\n  - metric: ./evilmetric/evilmetric.py\n    aggregation: mean")
    text = _problems(_check(tmp_path, [task]))
    assert (
        "metric_list[0].metric: './evilmetric/evilmetric.py' is not one of lm-eval's registered metrics" in text
        and "evaluate.load" in text
    ), text
    assert not marker.exists()
    with pytest.raises(ValueError, match="metric_list\\[0\\].metric"):
        _stage_load(tmp_path / "stage", task)
    # past the stage's check, lm-eval's own get_metric is the registry's alone
    with pytest.raises(ValueError, match="not one of lm-eval's registered metrics; evaluate.load is not used"):
        _stage_load(tmp_path / "stage2", task, checked=False)
    assert not marker.exists()


def test_a_metric_lm_eval_does_not_have_or_does_not_score_is_refused(tmp_path):
    """Bad 3: on main `accuracy_typo` passed pre-flight, the stage completed with no score and the gate passed."""
    typo = _task(tmp_path, name="typo", body="metric_list:\n  - {metric: accuracy_typo, aggregation: mean}")
    unscored = _task(tmp_path, name="unscored", body="metric_list:\n  - {metric: word_perplexity}")
    agg = _task(tmp_path, name="agg", body="metric_list:\n  - {metric: acc, aggregation: ./x.py}")
    text = _problems(_check(tmp_path, [typo, unscored, agg]))
    assert "metric_list[0].metric: 'accuracy_typo' is not one of lm-eval's registered metrics (acc, acc_bytes" in text
    assert (
        "metric_list[0].metric: 'word_perplexity' is never scored for output_type multiple_choice (it scores acc, "
        in text
        and "the task would score nothing" in text
    )
    assert "metric_list[0].aggregation: './x.py' is not one of lm-eval's aggregations" in text


def test_a_task_that_scores_nothing_fails_the_stage(tiny_model_dir, tmp_path):
    """Bad 3, the stage: a task past pre-flight that lm-eval scores no metric for is an error, not `{}`."""
    from tasks.core.config.benchmark import BenchmarkConfig

    task = _task(tmp_path, name="silent", body="metric_list:\n  - {metric: acc, aggregation: mean}")
    t = bench.read_task(str(task))
    fetched = bench.fetch([t], tmp_path / "copies")
    include = bench.runnable([t], fetched, tmp_path / "copies", tmp_path / "run", tmp_path / "cache")
    cfg = BenchmarkConfig(tasks=(str(task),), limit=2, batch_size=2)
    assert bench.score(tiny_model_dir, include, ["silent"], cfg, "fp32")["scores"]["silent"]["acc"] >= 0
    # what accuracy_typo did on main, past every check: lm-eval drops the unscored metric's results
    rewritten = include / "silent.yaml"
    rewritten.write_text(rewritten.read_text().replace("metric: acc", "metric: word_perplexity"))
    with pytest.raises(ValueError, match=r"lm-eval scored no metric for task\(s\) \['silent'\]"):
        bench.score(tiny_model_dir, include, ["silent"], cfg, "fp32")


def test_a_task_name_that_is_a_path_is_refused_before_anything_is_written(tmp_path):
    """Bad 4: on main `task: /some/dir` made `check` write the YAML and data under /some/dir/."""
    outside = tmp_path / "outside"
    task = _task(tmp_path, name="abs")
    task.write_text(task.read_text().replace('task: "abs"', f"task: {json.dumps(str(outside))}"))
    text = _problems(_check(tmp_path, [task]))
    assert (
        f"benchmark.tasks[0] ({task}): cannot read the task YAML: {task}: task: {str(outside)!r} is not a plain name"
        in text
    )
    assert "name the task e.g. my_task" in text and not outside.exists()
    with pytest.raises(ValueError, match="is not a plain name"):
        _stage_load(tmp_path / "stage", task)
    assert not outside.exists()
    # a split name is a path segment of the copies too; and fetch guards its own join
    split = _task(tmp_path, name="split")
    split.write_text(split.read_text().replace("    test: split.jsonl", "    ../../../escape: split.jsonl"))
    assert "dataset_kwargs.data_files: '../../../escape' is not a plain name" in _problems(_check(tmp_path, [split]))
    forged = bench.TaskFile(str(task), str(outside), "", {}, {})
    with pytest.raises(ValueError, match="not a plain name"):
        bench.fetch([forged], tmp_path / "copies")
    assert not outside.exists()


def test_a_task_with_no_documents_is_refused_naming_the_data_file(tmp_path):
    """Poor: on main, refused with only `StopIteration: `."""
    for name, data in (("blank", "\n\n"), ("array", "[]\n")):
        task = _task(tmp_path, name=name, data=data)
        text = _problems(_check(tmp_path, [task]))
        assert (
            f"task {name!r}: its 'test' split has no record (data file(s) {tmp_path / f'{name}.jsonl'}); "
            "put the documents to score there" in text
        ), text


def test_a_gate_limit_on_a_metric_the_task_does_not_score_is_refused_in_preflight(tmp_path):
    """Poor: on main refused only by the gate, after all training."""
    task = _task(tmp_path, name="facts")
    text = _problems(_check(tmp_path, [task], gate={"facts": {"metric": "acc_norm", "max_drop": 2.0}}))
    assert (
        "gate.benchmarks.facts.metric: 'acc_norm' is not scored by task 'facts': it scores ['acc'] under the "
        "filter(s) ['none']"
        in text
        and f"use one of those, or add it to the task's metric_list in {task}" in text
    ), text
    filtered = _check(tmp_path, [task], gate={"facts": {"metric": "acc,strict", "max_drop": 2.0}})
    assert "'acc,strict' is not scored by task 'facts'" in _problems(filtered)
    ok = _check(tmp_path, [task], gate={"facts": {"metric": "acc", "max_drop": 2.0}})
    assert ok.problems == []


def test_every_custom_tag_however_spelled_and_every_alias_is_refused(tmp_path):
    """Poor: on main `!functio%6E` passed the text search for `!function` (the task then ran
    without its process_results); the loader now refuses the tag itself, and the Python never runs."""
    marker = tmp_path / "marker"
    (tmp_path / "utils.py").write_text(WRITE.format(marker=str(marker)) + "\ndef docs(d):\n    return d\n")
    cases = {
        "escaped": ("process_results: !functio%6E utils.docs", "line 11: the tag !function is refused"),
        "plain": ("process_docs: !function utils.docs", "line 11: the tag !function is refused"),
        "python": (
            "metadata: !!python/object/apply:os.system ['true']",
            "line 11: the tag tag:yaml.org,2002:python/object",
        ),
        "aliases": ("metadata: {a: &a [x, x], b: [*a, *a]}", "line 11: the YAML alias *a is refused in a task file"),
    }
    for name, (line, said) in cases.items():
        task = _task(tmp_path, name=name, body=line + "\nmetric_list:\n  - {metric: acc}")
        text = _problems(_check(tmp_path, [task]))
        assert f"cannot read the task YAML: {task}, {said}" in text, (name, text)
        with pytest.raises(ValueError, match="refused"):
            _stage_load(tmp_path / name, task)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("class: utils.Evil", "class: names a Python task class"),
        ("process_docs: utils.docs", "process_docs: is Python lm-eval would run"),
        ("include: other.yaml", "include: pulls in another YAML"),
        ("use_prompt: promptsource:x", "use_prompt: loads a promptsource template"),
        ("tag: [mmlu]", "tag: makes a tag"),
        ("unsafe_code: true", "unsafe_code: true lets lm-eval run model-written code"),
        ("frobnicate: 1", "frobnicate: not a field of an lm-eval task"),
        ("dataset_kwargs2: {}", "dataset_kwargs2: not a field"),
        ("fewshot_config: {process_docs: utils.docs}", "fewshot_config.process_docs: is Python"),
        ("generation_kwargs: {until: [x], custom_generate: org/repo}", "generation_kwargs.custom_generate: not taken"),
        ("filter_list: [{name: f, filter: [{function: custom}]}]", "filter_list[0].filter[0].function: 'custom'"),
    ],
)
def test_every_key_lm_eval_would_resolve_to_code_or_a_download_is_refused(tmp_path, line, said):
    task = _task(tmp_path, body=line + "\nmetric_list:\n  - {metric: acc}")
    text = _problems(_check(tmp_path, [task]))
    assert f"benchmark.tasks[0] ({task}): task 'evil' is refused" in text and said in text, text


def test_dataset_kwargs_that_choose_where_data_come_from_are_refused(tmp_path):
    task = _task(tmp_path)
    task.write_text(
        task.read_text().replace(
            "dataset_kwargs:\n", "dataset_kwargs:\n  data_dir: hf://datasets/x\n  revision: main\n"
        )
    )
    text = _problems(_check(tmp_path, [task]))
    assert "dataset_kwargs.data_dir: chooses where datasets reads or caches data" in text
    assert "dataset_kwargs.revision" in text


def test_an_oversized_task_file_is_refused_unread(tmp_path):
    task = _task(tmp_path, name="big")
    task.write_text(task.read_text() + "#" * rules.MAX_BYTES)
    assert "over the 1048576-byte limit of a task YAML" in _problems(_check(tmp_path, [task]))


def test_cpt_to_sft_check_refuses_the_payloads_and_runs_none(tmp_path, monkeypatch, capsys):
    """The command the report ran: `cpt-to-sft check` with the Jinja and the metric-path tasks; one
    report naming both, no marker, nothing under the run root."""
    from flows.cli import main
    from tests.test_cli import TINY

    marker = tmp_path / "marker"
    (tmp_path / "evilmetric").mkdir()
    (tmp_path / "evilmetric" / "evilmetric.py").write_text(WRITE.format(marker=str(marker)) + "\nraise SystemExit(7)\n")
    monkeypatch.chdir(tmp_path)
    jinja = _task(tmp_path, doc_to_text=f"{{{{ lipsum.__globals__['os'].popen('id > {marker}').read() }}}}")
    metric = _task(tmp_path, name="metric", body="metric_list:\n  - metric: ./evilmetric/evilmetric.py")
    run_root = tmp_path / "run"
    sets = [f"benchmark.tasks=[{jinja}, {metric}]", f"run_root={run_root}"]
    assert main(["check", "--config", TINY, *[a for s in sets for a in ("--set", s)]]) == 1
    said = capsys.readouterr()
    out = said.out + said.err
    assert f"benchmark.tasks[0] ({jinja}): task 'evil' is refused" in out and "reaches '__globals__'" in out, out
    assert f"benchmark.tasks[1] ({metric}): task 'metric' is refused" in out and "metric_list[0].metric" in out
    assert not marker.exists() and not run_root.exists()
