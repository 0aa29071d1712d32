"""The lines of a local multiple-choice lm-eval task YAML over question/choices/answer records, shared by the
benchmark tests that write their own tasks (test_benchmark_tasks, test_benchmark_bounds)."""

from __future__ import annotations

import json


def mc_task_lines(name: str, **top) -> list[str]:
    """`task: name` and the multiple-choice fields (each overridable by `top`), one `key: value` line each."""
    fields = {
        "task": name,
        "dataset_path": "json",
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        **top,
    }
    return [f"{k}: {json.dumps(v)}" for k, v in fields.items()]
