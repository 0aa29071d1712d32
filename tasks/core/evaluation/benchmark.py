"""Benchmark scores with EleutherAI's lm-evaluation-harness on local tasks: read and check a task,
copy it with its data, score one HF folder, compare base and export, the gate's checks, the card.

    python -m tasks.core.evaluation.benchmark runs/tiny-demo/export data/sample/benchmarks/veyra_facts.yaml data/sample/benchmarks/general_text.yaml

A task is lm-eval's own YAML (one `task:`) whose data are local: `dataset_path` is one of datasets'
packaged file builders (json, parquet, csv, text, arrow) and `dataset_kwargs.data_files` names the
files (local paths, relative ones beside the YAML, or any fsspec URI the run reads; never http or
the Hub). `task_problems` says why a task would reach the network or run code (task_rules.py: the
file read as data, every key that would resolve to code, metrics from lm-eval's registry), naming
it; pre-flight and the stage (`require_runnable`) both apply it; the stage copies the
YAML and its data into its artifact with their sha256 (`fetch`), writes a copy of the YAML pointing
at those copies (`runnable`), and lm-eval loads it through `TaskManager(include_path=...)` without
its built-in tasks, offline (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE). Each model is loaded as the
held-out evaluation loads it (`tasks.core.evaluation.heldout.load_model`: its placement and dtype),
handed to lm-eval's `HFLM`, scored by `lm_eval.simple_evaluate`, and released before the next;
a task with no score is an error. Every load renders the task templates in `task_rules.BoundedSandbox`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import posixpath
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tasks.core.config.benchmark import BenchmarkConfig, BenchmarkLimit
from tasks.core.evaluation import placement as where
from tasks.core.evaluation import task_rules as rules
from tasks.core.evaluation.lm_eval_progress import bars_to_meter, metered_hflm
from tasks.core.evaluation.release import release
from tasks.core.evaluation.task_data import size_problems

LOCAL_BUILDERS = ("json", "parquet", "csv", "text", "arrow")
REMOTE_SCHEMES = ("http", "https", "hf", "ftp", "github", "git")
INSTALL_HINT = (
    "install lm-evaluation-harness as the project does: bash scripts/install.sh (or pip install -e '.[benchmark]', "
    "then "
    "pip install --no-deps 'lm-eval==0.4.13' 'datasets==4.8.5' 'evaluate==0.4.6')"
)


@dataclass(frozen=True)
class TaskFile:
    """One task YAML as configured: its name, text, and data files per split (resolved URIs)."""

    uri: str
    name: str
    text: str
    config: dict[str, Any]
    data: dict[str, list[str]] = field(default_factory=dict)


def _open(uri: str, mode: str = "rb"):
    import fsspec

    return fsspec.open(uri, mode)


def _beside(yaml_uri: str, rel: str) -> str:
    if "://" in rel or rel.startswith("/"):
        return rel
    if "://" in yaml_uri:
        return posixpath.join(posixpath.dirname(yaml_uri), rel)
    return str(Path(yaml_uri).resolve().parent / rel)


def read_task(uri: str) -> TaskFile:
    """Parse one task YAML as data (`task_rules.parse`: no custom tag, no alias, bounded size);
    ValueError naming the file when it is no task or its task or split names are no plain names.
    A relative path is relative to the project root, like every path of the config."""
    from tasks.core.config.paths import resolve_local

    uri = resolve_local(uri)
    with _open(uri, "rb") as fh:
        raw = fh.read(rules.MAX_BYTES + 1)
    config = rules.parse(raw, uri)
    text = raw.decode("utf-8", errors="replace")
    if not isinstance(config, dict) or not isinstance(config.get("task"), str):
        raise ValueError(
            f"{uri}: an lm-eval task YAML needs a `task:` name (groups and tags are not supported; name each task's "
            "YAML)"
        )
    if bad := rules.check_name(config["task"], "task"):
        raise ValueError(f"{uri}: {bad}")
    files = (
        (config.get("dataset_kwargs") or {}).get("data_files")
        if isinstance(config.get("dataset_kwargs"), dict)
        else None
    )
    if isinstance(files, (str, list)):
        files = {"train": files}
    if files is not None and not isinstance(files, dict):
        raise ValueError(f"{uri}: dataset_kwargs.data_files must be a file, a list or {{split: files}}")
    for split in files or {}:
        if bad := rules.check_name(split, "dataset_kwargs.data_files"):
            raise ValueError(f"{uri}: {bad}")
    data = {
        split: [_beside(uri, f) for f in ([fs] if isinstance(fs, str) else list(fs or [])) if isinstance(f, str)]
        for split, fs in (files or {}).items()
    }
    return TaskFile(uri, config["task"], text, config, data)


def task_problems(task: TaskFile) -> list[str]:
    """Why this task cannot run offline from local files as data (empty: it can): a download, and
    every key `task_rules` refuses (code, another file, a name outside lm-eval's registries)."""
    c, out = task.config, []
    path = c.get("dataset_path")
    if path not in LOCAL_BUILDERS:
        out.append(
            f"dataset_path {path!r} is a dataset lm-eval would download from the Hub; use dataset_path: json (or {', '.join(LOCAL_BUILDERS[1:])}) "
            "with dataset_kwargs.data_files naming local files"
        )
    if not task.data:
        out.append("dataset_kwargs.data_files names no data file")
    for files in task.data.values():
        for f in files:
            scheme = f.split("://", 1)[0].split("::")[-1].lower() if "://" in f else ""
            if scheme in REMOTE_SCHEMES:
                out.append(
                    f"data file {f} would be downloaded ({scheme}://); copy it to local storage or s3:// and name that"
                )
    return out + rules.key_problems(c)


def eval_split(task: TaskFile) -> str | None:
    """The split lm-eval scores: test_split, else validation_split."""
    return task.config.get("test_split") or task.config.get("validation_split")


def require_runnable(tasks: Sequence[TaskFile], max_split_mb: float | None = None) -> None:
    """The stage's own check of the rules pre-flight applies (and of the splits' sizes, with
    `max_split_mb`): ValueError naming each task's problems."""
    problems = [f"{t.uri}: {p}" for t in tasks for p in task_problems(t)]
    if not problems and max_split_mb is not None:
        problems = [f"{t.uri}: {p}" for t in tasks for p in size_problems(t, max_split_mb)]
    if problems:
        raise ValueError("benchmark tasks refused (pre-flight names the fix):\n  " + "\n  ".join(problems))


def sha256_uri(uri: str) -> str:
    h = hashlib.sha256()
    with _open(uri) as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(tasks: Sequence[TaskFile]) -> list[dict[str, Any]]:
    """What the stage's digest covers of its tasks: each YAML's and data file's sha256."""
    return [
        {
            "task": t.name,
            "yaml": hashlib.sha256(t.text.encode()).hexdigest(),
            "data": {split: [sha256_uri(f) for f in files] for split, files in sorted(t.data.items())},
        }
        for t in tasks
    ]


def fetch(tasks: Sequence[TaskFile], dest: Path) -> list[dict[str, Any]]:
    """Copy each task's YAML and data files under `dest/<task>/`; one record per task (files, sha256)."""
    out = []
    for t in tasks:
        if bad := rules.check_name(t.name, "task"):  # read_task refused it; a name is a path segment here
            raise ValueError(f"{t.uri}: {bad}")
        root = dest / t.name
        (root / "data").mkdir(parents=True, exist_ok=True)
        yaml_name = posixpath.basename(t.uri.rstrip("/"))
        yaml_name = yaml_name if rules.NAME.fullmatch(yaml_name) else f"{t.name}.yaml"
        (root / yaml_name).write_text(t.text)
        files = []
        for split, uris in sorted(t.data.items()):
            for i, uri in enumerate(uris):
                base = posixpath.basename(uri)
                local = root / "data" / (f"{split}-{i}-{base}" if rules.NAME.fullmatch(base) else f"{split}-{i}")
                with _open(uri) as src, open(local, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                files.append(
                    {
                        "split": split,
                        "uri": uri,
                        "path": str(local.relative_to(dest)),
                        "sha256": sha256_uri(str(local)),
                        "bytes": local.stat().st_size,
                    }
                )
        out.append(
            {
                "task": t.name,
                "uri": t.uri,
                "yaml": f"{t.name}/{yaml_name}",
                "yaml_sha256": hashlib.sha256(t.text.encode()).hexdigest(),
                "files": files,
            }
        )
    return out


def runnable(tasks: Sequence[TaskFile], fetched: Sequence[dict], copies: Path, run_dir: Path, cache_dir: Path) -> Path:
    """Write each task's YAML into `run_dir` with its data_files pointing at the copies under
    `copies` and datasets' cache under `cache_dir` (nothing written outside the run); returns `run_dir`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for t, rec in zip(tasks, fetched):
        files: dict[str, list[str]] = {}
        for f in rec["files"]:
            files.setdefault(f["split"], []).append(str(copies / f["path"]))
        cfg = dict(t.config)
        cfg["dataset_kwargs"] = {**(cfg.get("dataset_kwargs") or {}), "data_files": files, "cache_dir": str(cache_dir)}
        (run_dir / f"{t.name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run_dir


def settings(cfg: BenchmarkConfig, dtype: str) -> dict[str, Any]:
    """The settings the scores were made with: config fields and lm-eval's version."""
    return {
        "num_fewshot": cfg.num_fewshot,
        "apply_chat_template": cfg.apply_chat_template,
        "fewshot_as_multiturn": cfg.fewshot_as_multiturn,
        "batch_size": cfg.batch_size,
        "dtype": dtype,
        "limit": cfg.limit,
        "lm_eval": lm_eval_version(),
    }


def lm_eval_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        return None


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """datasets and the Hub client refuse the network for the span (their import reads these)."""
    keys = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    before = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    # lm-eval's and datasets' progress bars (tqdm on stderr) and their warnings stay off the run's
    # console: the stage logs the scores. Errors still raise.
    loggers = [logging.getLogger(name) for name in ("lm_eval", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def load_tasks(include_dir: Path, names: Sequence[str]):
    """lm-eval's TaskManager over `include_dir` alone, its templates in the sandbox; the loaded
    tasks (their data read, document 0 rendered)."""
    with offline():
        from lm_eval.tasks import TaskManager

        rules.sandbox_lm_eval()

        tm = TaskManager(include_path=str(include_dir), include_defaults=False)
        missing = [n for n in names if n not in tm.all_tasks]
        if missing:
            raise ValueError(f"lm-eval found no task {missing} under {include_dir} (it found {tm.all_tasks})")
        return tm, tm.load(list(names))


def flatten(results: dict[str, Any]) -> dict[str, Any]:
    """simple_evaluate's results -> {scores: {task: {metric: value}}, higher_is_better, samples, n_shot, versions}."""
    scores: dict[str, dict[str, float]] = {}
    for task, row in (results.get("results") or {}).items():
        for key, value in row.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            scores.setdefault(task, {})[metric if filt == "none" else f"{metric},{filt}"] = float(value)
    return {
        "scores": scores,
        "higher_is_better": results.get("higher_is_better") or {},
        "samples": {t: (n or {}).get("effective") for t, n in (results.get("n-samples") or {}).items()},
        "n_shot": dict(results.get("n-shot") or {}),
        "versions": {t: str(v) for t, v in (results.get("versions") or {}).items()},
    }


def score(
    model_dir: Path,
    include_dir: Path,
    names: Sequence[str],
    cfg: BenchmarkConfig,
    dtype: str,
    trust_remote_code: bool = False,
    label: str = "model",
) -> dict[str, Any]:
    """lm_eval.simple_evaluate of one HF folder on the tasks under `include_dir`, the model placed as
    the held-out evaluation places it; the model is released before this returns. Its progress goes
    to the `reporting` block open around it (tasks/core/run/meter.py), each part named `label`."""
    from tasks.core.evaluation.heldout import eval_device, load_model, load_tokenizer

    started = time.monotonic()
    with offline(), bars_to_meter():
        import lm_eval
        from lm_eval.models.huggingface import HFLM

        tm, _ = load_tasks(include_dir, names)  # refuses a missing task before a model is loaded
        placed = where.place(model_dir, dtype, cfg.batch_size * 2048)
        model = load_model(model_dir, dtype, eval_device(), trust_remote_code, placed)
        lm = metered_hflm(HFLM, label)(
            pretrained=model,
            tokenizer=load_tokenizer(model_dir, trust_remote_code),
            backend="causal",
            batch_size=cfg.batch_size,
            trust_remote_code=trust_remote_code,
        )
        gone = weakref.ref(model)
        del model
        try:
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=list(names),
                task_manager=tm,
                num_fewshot=cfg.num_fewshot,
                batch_size=cfg.batch_size,
                limit=cfg.limit,
                apply_chat_template=cfg.apply_chat_template,
                fewshot_as_multiturn=cfg.fewshot_as_multiturn,
                log_samples=False,
                bootstrap_iters=0,
            )
        finally:
            del lm
            release(gone)
    flat = flatten(results)
    unscored = [n for n in names if not flat["scores"].get(n)]
    if unscored:
        raise ValueError(
            f"lm-eval scored no metric for task(s) {unscored} of {model_dir} (scored: {sorted(flat['scores'])}); "
            "check each task's metric_list against its output_type"
        )
    return {**flat, "device": placed.describe(), "seconds": round(time.monotonic() - started, 3)}


def _better(hib: dict, task: str, metric: str) -> bool:
    return bool((hib.get(task) or {}).get(metric.split(",")[0], True))


def compare(base: dict[str, Any], export: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """{task: {metric: {base, export, change, drop_pct, higher_is_better}}}: drop_pct is how much
    worse the export is, in percent of the base's score, in the metric's own direction."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for task, metrics in export["scores"].items():
        for metric, after in metrics.items():
            before = (base["scores"].get(task) or {}).get(metric)
            up = _better(export.get("higher_is_better") or {}, task, metric)
            drop = None
            if before is not None and before != 0:
                drop = 100.0 * ((before - after) if up else (after - before)) / abs(before)
            out.setdefault(task, {})[metric] = {
                "base": before,
                "export": after,
                "change": None if before is None else after - before,
                "drop_pct": drop,
                "higher_is_better": up,
            }
    return out


def change_text(drop: float | None) -> str:
    """A drop in percent as words: "5.00% worse", "7.14% better", "unchanged"."""
    if drop is None:
        return "no base score to compare"
    return f"{drop:.2f}% worse" if drop > 0 else f"{-drop:.2f}% better" if drop < 0 else "unchanged"


def gate_checks(limits: dict[str, BenchmarkLimit], bench: dict[str, Any] | None, check) -> None:
    """One check per task named in gate.benchmarks: its metric's drop against the base and its bounds."""
    tasks = (bench or {}).get("tasks") or {}
    for task, lim in limits.items():
        name, field_ = f"benchmark:{task}", f"gate.benchmarks.{task}"
        m = (tasks.get(task) or {}).get(lim.metric)
        if m is None:
            have = (
                f"it has {sorted(tasks.get(task) or {})}"
                if task in tasks
                else f"the benchmark scored {sorted(tasks) or 'no task'}"
            )
            check(
                name,
                False,
                f"benchmark {task!r}: no score for metric {lim.metric!r} ({have}); fix {field_}",
                task=task,
                metric=lim.metric,
            )
            continue
        parts, ok = [f"benchmark {task!r} {lim.metric}: export {m['export']:.4g} vs base {_g(m['base'])}"], True
        if lim.max_drop is not None:
            drop = m["drop_pct"]
            good = drop is not None and drop <= lim.max_drop
            ok &= good
            parts.append(f"{change_text(drop)} (allowed at most {lim.max_drop:g}% by {field_}.max_drop)")
        if lim.min is not None:
            ok &= m["export"] >= lim.min
            parts.append(f"at least {lim.min:g} by {field_}.min")
        if lim.max is not None:
            ok &= m["export"] <= lim.max
            parts.append(f"at most {lim.max:g} by {field_}.max")
        check(
            name,
            ok,
            "; ".join(parts),
            task=task,
            metric=lim.metric,
            before=m["base"],
            after=m["export"],
            drop_pct=m["drop_pct"],
            max_drop=lim.max_drop,
            min=lim.min,
            max=lim.max,
        )


def _g(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"


def table_rows(bench: dict[str, Any] | None, verdict: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """The UI's benchmark table: task, metric, base, export, change, gate."""
    by_check = {c["check"]: c for c in (verdict or {}).get("checks", [])}
    rows = []
    for task, metrics in ((bench or {}).get("tasks") or {}).items():
        c = by_check.get(f"benchmark:{task}")
        for metric, m in metrics.items():
            gated = c is not None and c.get("metric") == metric
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "base": _g(m["base"]),
                    "export": _g(m["export"]),
                    "change": ""
                    if m["change"] is None
                    else f"{m['change']:+.4g}" + ("" if m["drop_pct"] is None else f" ({-m['drop_pct']:+.2f}%)"),
                    "gate": ("pass" if c["ok"] else "FAIL") if gated else "",
                }
            )
    return rows


def card_results(bench: dict[str, Any] | None) -> list:
    """huggingface_hub EvalResults for the card's model-index: each task's metrics for the export
    (and the base's, named so), with the settings in the metric's config."""
    if not bench:
        return []
    from huggingface_hub import EvalResult

    s = bench.get("settings") or {}
    how = (
        f"lm-eval {s.get('lm_eval')}, {s.get('num_fewshot') if s.get('num_fewshot') is not None else 'task default'}-shot, "
        f"chat template {'on' if s.get('apply_chat_template') else 'off'}, {s.get('dtype')}"
    )
    out = []
    for task, metrics in (bench.get("tasks") or {}).items():
        shots = (bench.get("n_shot") or {}).get(task)
        for metric, m in metrics.items():
            for who, value in (("", m["export"]), (", base model", m["base"])):
                if value is not None:
                    out.append(
                        EvalResult(
                            task_type="text-generation",
                            dataset_type=task,
                            dataset_name=f"{task} (local lm-eval task)",
                            dataset_split="test",
                            metric_type=metric,
                            metric_value=round(value, 6),
                            metric_name=f"{metric}{who}",
                            metric_config=how,
                            **({"task_name": f"{task}, {shots}-shot"} if shots is not None else {}),
                        )
                    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import tempfile

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print(__doc__)
        return 2
    tasks = [read_task(u) for u in args[1:]]
    require_runnable(tasks)
    with tempfile.TemporaryDirectory() as tmp:
        fetched = fetch(tasks, Path(tmp) / "copies")
        inc = runnable(tasks, fetched, Path(tmp) / "copies", Path(tmp) / "run", Path(tmp) / "cache")
        out = score(Path(args[0]), inc, [t.name for t in tasks], BenchmarkConfig(tasks=tuple(args[1:])), "fp32")
    for task, metrics in out["scores"].items():
        print(task, {k: round(v, 4) for k, v in metrics.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
