"""The benchmark stage's pure parts: local tasks only (pre-flight), the scores as lm-eval itself
gives them, and the gate's limits on them. The flow-level tests are in tests/test_benchmark_flow.py.

    PYTHONPATH=$PWD python -m pytest -q tests/test_benchmark.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.core.config.outputs import GateConfig
from tasks.core.evaluation import benchmark as bench
from tasks.core.evaluation.verdict import gate_verdict
from tasks.core.preflight.benchmark import check_benchmark
from tasks.core.preflight.report import CheckContext, PreflightReport
from tasks.core.run import meter
from tests.conftest import REPO, tiny_config_raw

SHIPPED = [REPO / "data" / "sample" / "benchmarks" / f"{t}.yaml" for t in ("veyra_facts", "general_text")]


def _check(tmp_path: Path, tasks: list, gate: dict | None = None) -> PreflightReport:
    from tasks.core.config.load import parse_config

    raw = tiny_config_raw(Path("/nonexistent-model"), tmp_path / "run")
    raw["benchmark"] = {"tasks": [str(t) for t in tasks]}
    if gate:
        raw["gate"]["benchmarks"] = gate
    report = PreflightReport()
    check_benchmark(CheckContext(parse_config(raw), None, None, None, report, None))
    return report


def test_shipped_tasks_load_and_a_task_that_would_download_is_refused_naming_it(tmp_path):
    clean = _check(tmp_path, SHIPPED, gate={"veyra_facts": {"metric": "acc", "max_drop": 2.0}})
    assert clean.problems == [] and any("veyra_facts, general_text" in line for line in clean.checked)

    hub = tmp_path / "hub.yaml"
    hub.write_text("task: mmlu_hub\ndataset_path: cais/mmlu\ntest_split: test\noutput_type: multiple_choice\n")
    web = tmp_path / "web.yaml"
    web.write_text(
        "task: web_facts\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        "https://example.com/facts.jsonl\ntest_split: test\n"
        "output_type: multiple_choice\n"
    )
    report = _check(
        tmp_path, [SHIPPED[0], hub, web], gate={"general_text": {"metric": "bits_per_byte", "max_drop": 5.0}}
    )
    text = "\n".join(f"{w}: {m}" for w, m in report.problems)
    assert (
        f"benchmark.tasks[1] ({hub})" in text and "'mmlu_hub' is refused" in text and "dataset_path 'cais/mmlu'" in text
    )
    assert f"benchmark.tasks[2] ({web})" in text and "https://example.com/facts.jsonl would be downloaded" in text
    assert "gate.benchmarks.general_text: no task 'general_text' in benchmark.tasks" in text


def test_a_missing_data_file_and_a_broken_yaml_are_named(tmp_path):
    gone = tmp_path / "gone.yaml"
    gone.write_text(
        "task: gone\ndataset_path: json\ndataset_kwargs: {data_files: {test: nowhere.jsonl}}\ntest_split: test\n"
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text("task: [unclosed\n")
    text = "\n".join(f"{w}: {m}" for w, m in _check(tmp_path, [gone, broken]).problems)
    assert (
        f"data file {tmp_path / 'nowhere.jsonl'} does not exist" in text
        and f"benchmark.tasks[1] ({broken}): cannot read the task YAML" in text
    )


def test_stage_scores_equal_a_direct_simple_evaluate_on_the_same_folder(tiny_model_dir, tmp_path, monkeypatch):
    """The stage's path (copies, rewritten YAMLs, our model load and HFLM) against lm-eval's own
    CLI-equivalent call: model="hf" on the folder, the original YAMLs, the same settings."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tasks.core.config.benchmark import BenchmarkConfig

    tasks = [bench.read_task(str(p)) for p in SHIPPED]
    cfg = BenchmarkConfig(tasks=tuple(str(p) for p in SHIPPED), num_fewshot=1, batch_size=4, limit=12)
    fetched = bench.fetch(tasks, tmp_path / "copies")
    assert all(f["sha256"] == bench.sha256_uri(f["uri"]) for rec in fetched for f in rec["files"])
    include = bench.runnable(tasks, fetched, tmp_path / "copies", tmp_path / "run", tmp_path / "cache")
    records: list[dict] = []
    with meter.reporting(records.append, interval_s=0):  # every request a record: the stage's lines, with an ETA
        ours = bench.score(tiny_model_dir, include, ["veyra_facts", "general_text"], cfg, "fp32", label="export")
    parts = {r["what"]: r for r in records if r["finished"]}
    assert set(parts) == {"export loglikelihood", "export loglikelihood_rolling"}, records
    assert all(r["done"] == r["total"] > 0 for r in parts.values())  # multiple choice: requests; perplexity: windows
    going = [r for r in records if not r["finished"] and 0 < r["done"] < r["total"]]
    assert going and all(r["eta_s"] is not None for r in going)
    assert meter.line(going[0]).startswith(f"{going[0]['what']}: {going[0]['done']:,} / {going[0]['total']:,} ")
    assert ", ETA " in meter.line(going[0])

    monkeypatch.chdir(SHIPPED[0].parent)  # the YAMLs' relative data_files, as lm-eval reads them
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "direct-cache"))
    direct = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(tiny_model_dir), "dtype": "float32"},
        device="cpu",
        tasks=["veyra_facts", "general_text"],
        task_manager=TaskManager(include_path=str(SHIPPED[0].parent), include_defaults=False),
        num_fewshot=1,
        batch_size=4,
        limit=12,
        apply_chat_template=False,
        fewshot_as_multiturn=False,
        log_samples=False,
        bootstrap_iters=0,
    )
    assert ours["scores"] == bench.flatten(direct)["scores"]
    assert set(ours["scores"]) == {"veyra_facts", "general_text"} and ours["n_shot"] == {
        "veyra_facts": 1,
        "general_text": 1,
    }


def _bench(base: float, export: float, metric: str = "acc", up: bool = True) -> dict:
    b = {"scores": {"veyra_facts": {metric: base}}, "higher_is_better": {"veyra_facts": {metric: up}}}
    e = {"scores": {"veyra_facts": {metric: export}}, "higher_is_better": {"veyra_facts": {metric: up}}}
    return {"tasks": bench.compare(b, e)}


def test_gate_holds_the_push_on_a_failing_max_drop_naming_task_and_figures_and_passes_one_that_holds():
    off = GateConfig(
        cpt_max_ppl_increase_pct=None,
        sft_loss_must_improve=False,
        generation_must_stop=False,
        benchmarks={"veyra_facts": {"metric": "acc", "max_drop": 2.0}},
    )
    failed = gate_verdict(off, None, None, _bench(0.60, 0.57))  # 5 % worse
    assert not failed["passed"]
    assert failed["reasons"] == [
        (
            "benchmark 'veyra_facts' acc: export 0.57 vs base 0.6; 5.00% worse (allowed at most 2% by "
            "gate.benchmarks.veyra_facts.max_drop)"
        )
    ]
    assert gate_verdict(off, None, None, _bench(0.60, 0.59))["passed"]  # 1.67 % worse: within 2 %
    better = gate_verdict(off, None, None, _bench(0.56, 0.60))  # an improvement reads as one
    assert better["passed"] and better["checks"][0]["message"] == (
        "benchmark 'veyra_facts' acc: export 0.6 vs base 0.56; 7.14% better (allowed at most 2% by "
        "gate.benchmarks.veyra_facts.max_drop)"
    )
    # a lower-is-better metric drops when it rises
    ppl = GateConfig.model_validate(
        {**off.model_dump(), "benchmarks": {"veyra_facts": {"metric": "word_perplexity", "max_drop": 2.0}}}
    )
    assert not gate_verdict(ppl, None, None, _bench(10.0, 10.5, "word_perplexity", up=False))["passed"]
    assert gate_verdict(ppl, None, None, _bench(10.0, 9.0, "word_perplexity", up=False))["passed"]
    # a bound, and a task the benchmark did not score
    floor = GateConfig.model_validate(
        {
            **off.model_dump(),
            "benchmarks": {"veyra_facts": {"metric": "acc", "min": 0.7}, "other": {"metric": "acc", "max_drop": 1}},
        }
    )
    reasons = gate_verdict(floor, None, None, _bench(0.60, 0.65))["reasons"]
    assert "at least 0.7 by gate.benchmarks.veyra_facts.min" in reasons[0] and "no score for metric 'acc'" in reasons[1]


def test_card_lists_each_tasks_scores_with_the_settings():
    from huggingface_hub import ModelCardData

    m = {
        **_bench(0.25, 0.5),
        "settings": {"lm_eval": "0.4.13", "num_fewshot": 0, "apply_chat_template": False, "dtype": "fp32"},
        "n_shot": {"veyra_facts": 0},
    }
    results = bench.card_results(m)
    data = ModelCardData(model_name="x", eval_results=results).to_dict()
    text = json.dumps(data["model-index"])
    assert (
        "veyra_facts" in text
        and "0.5" in text
        and "lm-eval 0.4.13, 0-shot, chat template off, fp32" in text
        and "veyra_facts, 0-shot" in text
    )
    rows = bench.table_rows(m)
    assert rows == [
        {
            "task": "veyra_facts",
            "metric": "acc",
            "base": "0.25",
            "export": "0.5",
            "change": "+0.25 (+100.00%)",
            "gate": "",
        }
    ]


@pytest.mark.parametrize("limit", [{}, {"metric": "acc"}])
def test_a_limit_needs_a_figure(limit):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="needs max_drop, min or max"):
        GateConfig(benchmarks={"t": limit})
