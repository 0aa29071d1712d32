"""Pre-flight's benchmark check against the size of a task's data: its time must not grow with it.

    .venv/bin/python benchmarks/benchmark_preflight.py                     # 10^3, 10^5, 10^6 documents and a 1 GB file
    .venv/bin/python benchmarks/benchmark_preflight.py --docs 1000 --smoke  # one size: checks the script runs

Writes a multiple-choice task over a JSONL of N tiny documents (about 54 bytes each) in a temporary
folder and times `check_benchmark` (tasks/core/preflight/benchmark.py) on it, lm-eval's imports
done once before the first timed run; then a sparse 1 GB data file, refused from its size alone
(benchmark.max_split_mb), and the same file with the limit raised, refused after the 4 MiB head
pre-flight reads. Prints one line per case: documents, MB on disk, seconds, and what pre-flight said.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401  (the checkout on sys.path)

DOC = json.dumps({"question": "q", "choices": ["a", "b"], "answer": 0}).encode() + b"\n"
YAML = (
    "task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {name}.jsonl\ntest_split: test\n"
    "output_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\ndoc_to_choice: '{{{{choices}}}}'\n"
    "doc_to_target: '{{{{answer}}}}'\n"
)


def check(root: Path, name: str, **benchmark) -> tuple[float, list]:
    from support.tiny import tiny_config_raw
    from tasks.core.config.load import parse_config
    from tasks.core.preflight.benchmark import check_benchmark
    from tasks.core.preflight.report import CheckContext, PreflightReport

    (root / f"{name}.yaml").write_text(YAML.format(name=name))
    raw = tiny_config_raw(Path("/nonexistent-model"), root / "run")
    raw["benchmark"] = {"tasks": [str(root / f"{name}.yaml")], **benchmark}
    report = PreflightReport()
    started = time.monotonic()
    check_benchmark(CheckContext(parse_config(raw), None, None, None, report, None))
    return time.monotonic() - started, report.problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    ap.add_argument("--smoke", action="store_true", help="no 1 GB file")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="benchmark-preflight-") as tmp:
        root = Path(tmp)
        (root / "warm.jsonl").write_bytes(DOC * 10)
        check(root, "warm")  # lm-eval's and datasets' imports, once
        for n in args.docs:
            (root / f"d{n}.jsonl").write_bytes(DOC * n)
            seconds, problems = check(root, f"d{n}")
            size = (root / f"d{n}.jsonl").stat().st_size / 1e6
            print(f"{n:>9,} documents  {size:8.1f} MB  {seconds:6.2f} s  {'refused' if problems else 'passed'}")
        if not args.smoke:
            with open(root / "huge.jsonl", "wb") as fh:
                fh.truncate(10**9)
            for label, extra in (("limit 256 MB", {}), ("limit raised", {"max_split_mb": 2000})):
                seconds, problems = check(root, "huge", **extra)
                said = problems[0][1][:100] if problems else "passed"
                print(f"1 GB sparse, {label}: {seconds:.2f} s: {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
