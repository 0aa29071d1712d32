"""The `benchmark:` section (lm-evaluation-harness on local tasks) and the gate's limits on its scores.

    benchmark:
      tasks: [data/sample/benchmarks/veyra_facts.yaml, data/sample/benchmarks/general_text.yaml]
      num_fewshot: 0
    gate:
      benchmarks: {veyra_facts: {metric: acc, max_drop: 2.0}}

    python -c "from tasks.core.config.benchmark import BenchmarkConfig; print(BenchmarkConfig(tasks=('a.yaml',)).enabled)"

A task is lm-eval's own YAML plus local data files (tasks/core/evaluation/benchmark.py reads,
checks and copies them); no field here reaches the network.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.core.config.base import Frozen


class BenchmarkConfig(Frozen):
    tasks: tuple[str, ...] = Field(
        default=(),
        description=(
            "lm-evaluation-harness task YAMLs (local paths or any fsspec URI), one task each, with `dataset_path: "
            "json`, `parquet`, `csv` or "
            "`text` and `dataset_kwargs.data_files` naming local or fsspec data files (relative paths: beside the "
            "YAML). Empty: no benchmark "
            "stage. The YAMLs and data are copied into eval/benchmark/ with their sha256; a task that would download "
            "anything is refused in pre-flight."
        ),
    )
    num_fewshot: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Few-shot examples per prompt, for every task (lm-eval's --num_fewshot; a task whose YAML sets 0 keeps "
            "0); null: each task's own, else 0."
        ),
    )
    apply_chat_template: bool = Field(
        default=False,
        description=(
            "Render prompts through the model's chat template (lm-eval's --apply_chat_template); both the base and "
            "the export use their own."
        ),
    )
    fewshot_as_multiturn: bool = Field(
        default=False,
        description=(
            "With apply_chat_template: give the few-shot examples as turns of a conversation. Set explicitly because "
            "lm-eval's default changed between "
            "0.4.9 and 0.4.12, and scores are comparable only with it fixed."
        ),
    )
    batch_size: int = Field(
        default=8,
        ge=1,
        description="Requests per forward pass (lm-eval's --batch_size); changes speed and memory, not the scores.",
    )
    dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        default=None,
        description=(
            "Dtype both models are scored in; unset: the export's dtype on a GPU, fp32 on CPU (as the held-out "
            "evaluation)."
        ),
    )
    limit: int | None = Field(
        default=None,
        ge=1,
        description="Score only the first N documents of each task (a smoke run); null: all of them.",
    )

    max_split_mb: float = Field(
        default=256.0,
        gt=0,
        description=(
            "The largest split a task's data_files may name, in MB (10^6 bytes) on disk summed over the split's "
            "files: the stage reads every split whole and lm-eval builds every document, while pre-flight reads "
            "only a sample of each file. A larger split is refused before launch."
        ),
    )

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)

    @model_validator(mode="after")
    def _multiturn_needs_template(self) -> BenchmarkConfig:
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ValueError(
                "benchmark.fewshot_as_multiturn needs benchmark.apply_chat_template: true (few-shot turns exist only "
                "in a chat)"
            )
        return self


class BenchmarkLimit(Frozen):
    metric: str = Field(
        default="acc",
        min_length=1,
        description="The task's metric as lm-eval names it (acc, acc_norm, word_perplexity, ...; the 'none' filter "
        "implied).",
    )
    max_drop: float | None = Field(
        default=None,
        ge=0,
        description=(
            "Fail when the export scores more than this many percent worse than the base model, relative to the "
            "base's score, in the metric's "
            "own direction (acc 0.60 -> 0.588 is a 2.0 % drop; a perplexity 10 -> 10.2 also); null: not checked."
        ),
    )
    min: float | None = Field(
        default=None,
        description="Fail when the export's score is below this (a higher-is-better metric); null: not checked.",
    )
    max: float | None = Field(
        default=None,
        description="Fail when the export's score is above this (a lower-is-better metric such as a perplexity); "
        "null: not checked.",
    )

    @model_validator(mode="after")
    def _something(self) -> BenchmarkLimit:
        if self.max_drop is None and self.min is None and self.max is None:
            raise ValueError("a benchmark limit needs max_drop, min or max")
        return self


class GateBenchmarkFields(Frozen):
    """The gate's field for the benchmark (GateConfig derives from this, beside its other thresholds)."""

    benchmarks: dict[str, BenchmarkLimit] = Field(
        default_factory=dict,
        description=(
            "Limits on the benchmark stage's scores, {task: {metric, max_drop, min, max}}, e.g. {veyra_facts: "
            "{metric: acc, max_drop: 2.0}}: "
            "every task named must be in benchmark.tasks."
        ),
    )
