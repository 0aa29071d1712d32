"""What pre-flight reads of a benchmark task's data, bounded: sizes from the file system, a head
sample of each data file, and from those the counts its checks need (tasks/core/preflight/benchmark.py).

    python -c "from tasks.core.evaluation.task_data import head_sample; print(head_sample('data/sample/benchmarks/veyra_facts.jsonl', 'json').count)"

lm-eval builds every document of every split when it loads a task, so pre-flight loads it from a
sample of each data file (SAMPLE_DOCS documents from the first SAMPLE_BYTES; parquet: its footer's
row count and first rows; arrow: its first record batches) and takes sizes from the file system:
its cost does not grow with the data. A split larger than benchmark.max_split_mb is refused
(`size_problems`, by pre-flight and again by the stage, which reads the data whole as it runs).
`num_fewshot` and `fewshot_pool` say how many documents lm-eval 0.4.13 will draw few-shot examples
from, and from which split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TaskFile = Any  # tasks.core.evaluation.benchmark.TaskFile, which imports this module

SAMPLE_FILES = 8  # data files per split pre-flight samples (a split of 10^4 files: its first 8)
SAMPLE_DOCS = 32  # documents per data file pre-flight hands lm-eval: document 0 renders, splits exist
SAMPLE_BYTES = 4 << 20  # the most pre-flight reads of one data file (a document is a few KB)
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")


@dataclass
class Sample:
    """The head of one data file: its first documents (`docs`, as the lines or rows to write), how
    many documents the head holds (`count`), and whether that head is the whole file (`complete`)."""

    docs: list[Any]
    count: int
    complete: bool
    header: bytes = b""
    note: str | None = None  # why no document could be read from the head


def data_bytes(uri: str) -> int:
    """A data file's size on disk, from the file system (nothing of it read)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    return int(fs.size(path))


def split_bytes(task: TaskFile) -> dict[str, int]:
    """{split: bytes on disk of its data files}."""
    return {split: sum(data_bytes(f) for f in files) for split, files in task.data.items()}


def size_problems(task: TaskFile, max_mb: float) -> list[str]:
    """A split whose files hold more than `max_mb` MB (benchmark.max_split_mb): datasets and
    lm-eval read each split whole when the stage loads the task."""
    out = []
    for split, size in split_bytes(task).items():
        if size > max_mb * 1e6:
            files = ", ".join(f"{f} ({data_bytes(f) / 1e6:.1f} MB)" for f in task.data[split])
            out.append(
                f"its {split!r} split is {size / 1e6:.1f} MB on disk ({files}), over benchmark.max_split_mb "
                f"({max_mb:g} MB): the stage reads a split whole and lm-eval builds every document; score a "
                f"subset (a smaller file), or raise benchmark.max_split_mb"
            )
    return out


def _compression(uri: str) -> str | None:
    return "infer" if uri.lower().endswith(COMPRESSED) else None


def _read_head(uri: str, limit: int) -> tuple[bytes, bool]:
    """The first `limit` bytes of a data file (decompressed), and whether that is all of it."""
    import fsspec

    with fsspec.open(uri, "rb", compression=_compression(uri)) as fh:
        raw = fh.read(limit + 1)
    return raw[:limit], len(raw) <= limit


def _lines_sample(raw: bytes, complete: bool, keep: int, header: bool) -> Sample:
    lines = raw.split(b"\n")
    if not complete:
        lines = lines[:-1]  # the last line may be cut
    head = b""
    if header:
        if not lines:
            return Sample([], 0, complete, note=None if complete else "its header line is longer than the sample")
        head, lines = lines[0] + b"\n", lines[1:]
        rows: list[bytes] = []
        quotes = 0
        for line in lines:  # a quoted field may hold a newline: a record ends where its quotes balance
            if rows and quotes % 2:
                rows[-1] += b"\n" + line
            else:
                rows.append(line)
            quotes += line.count(b'"')
        if quotes % 2 and rows and not complete:
            rows.pop()
        lines = rows
    docs = [line for line in lines if line.strip()]
    note = (
        None if docs or complete else f"its first document is longer than the {SAMPLE_BYTES >> 20} MiB pre-flight reads"
    )
    return Sample(docs[:keep], len(docs), complete, head, note)


def _json_array_sample(raw: bytes, complete: bool, keep: int) -> Sample:
    import json

    text = raw.decode("utf-8", errors="replace")
    dec, docs, i = json.JSONDecoder(), [], text.index("[") + 1
    ended = False
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i < len(text) and text[i] == "]":
            ended = True
            break
        try:
            doc, i = dec.raw_decode(text, i)
        except ValueError:
            break  # cut at the sample's end (or not JSON: lm-eval's load names that)
        docs.append(json.dumps(doc).encode())
    note = None if docs or ended else f"its first document is longer than the {SAMPLE_BYTES >> 20} MiB pre-flight reads"
    return Sample(docs[:keep], len(docs), complete or ended, note=note)


def head_sample(uri: str, builder: str, keep: int = SAMPLE_DOCS) -> Sample:
    """The first documents of a data file, read from at most SAMPLE_BYTES of it (parquet: its
    footer's row count and first rows; arrow: its first record batches)."""
    import fsspec

    if builder in ("parquet", "arrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        with fsspec.open(uri, "rb") as fh:
            if builder == "parquet":
                pf = pq.ParquetFile(fh)
                rows = pf.metadata.num_rows
                first = next(pf.iter_batches(batch_size=max(keep, 1)), None)
                return Sample([pa.Table.from_batches([first])] if first is not None else [], rows, True)
            try:
                batches = iter(pa.ipc.open_stream(fh))
            except (OSError, pa.lib.ArrowInvalid):
                reader = pa.ipc.open_file(fh)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            got, count = [], 0
            for batch in batches:
                got.append(batch)
                count += batch.num_rows
                if count >= keep:
                    return Sample([pa.Table.from_batches(got).slice(0, keep)], count, False)
            return Sample([pa.Table.from_batches(got)] if got else [], count, True)
    raw, complete = _read_head(uri, SAMPLE_BYTES)
    if builder == "json" and raw.lstrip()[:1] == b"[":
        return _json_array_sample(raw, complete, keep)
    return _lines_sample(raw, complete, keep, header=builder == "csv")


def write_sample(sample: Sample, builder: str, dest: Path) -> None:
    """The sample as a data file of the same builder (a JSON array is written as JSON lines)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if builder in ("parquet", "arrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = sample.docs[0] if sample.docs else None
        if builder == "parquet" and table is not None:
            pq.write_table(table, dest)
        elif table is not None:
            with pa.OSFile(str(dest), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
        else:
            dest.write_bytes(b"")
        return
    dest.write_bytes(sample.header + b"".join(d + b"\n" for d in sample.docs))


def samples(
    tasks: Sequence[TaskFile], dest: Path, heads: dict[str, dict[str, Sample]] | None = None
) -> list[dict[str, Any]]:
    """Each task's head samples (`heads`: {task: {data file: Sample}} already read, else read now)
    written under `dest/<task>/data/` as `fetch` lays out its copies, so `runnable` reads either."""
    out = []
    for t in tasks:
        builder, files = t.config.get("dataset_path"), []
        for split, uris in sorted(t.data.items()):
            for i, uri in enumerate(uris[:SAMPLE_FILES]):
                sample = (heads or {}).get(t.name, {}).get(uri) or head_sample(uri, builder)
                rel = f"{t.name}/data/{split}-{i}-sample"
                write_sample(sample, builder, dest / rel)
                files.append({"split": split, "uri": uri, "path": rel})
        out.append({"task": t.name, "uri": t.uri, "files": files})
    return out


def num_fewshot(task: TaskFile, configured: int | None) -> int:
    """The shots lm-eval will use: benchmark.num_fewshot, except where the task's YAML says 0
    (lm-eval keeps it); unset: the task's own, else 0 (lm_eval.evaluator.simple_evaluate)."""
    own = task.config.get("num_fewshot")
    if configured is not None:
        return 0 if own == 0 else configured
    return own if isinstance(own, int) and not isinstance(own, bool) else 0


def fewshot_pool(task: TaskFile) -> tuple[str | None, int | None, int]:
    """Where lm-eval 0.4.13 draws few-shot examples from (ConfigurableTask.fewshot_docs and the
    sampler): (split or None, the number of `fewshot_config.samples` or None, and how many more
    documents than the shots it needs: 1 when the document scored is drawn from the same pool)."""
    c = task.config
    few = c.get("fewshot_config") if isinstance(c.get("fewshot_config"), dict) else {}
    split = few["split"] if "split" in few else c.get("fewshot_split")
    extra = 1 if split == c.get("test_split") else 0  # lm-eval then draws n + 1 and drops the scored one
    if split:
        return split, None, extra
    if isinstance(few.get("samples"), list):
        return None, len(few["samples"]), extra
    for key in ("training_split", "validation_split", "test_split"):
        if c.get(key):
            return c[key], None, extra
    return None, None, extra
