"""Held-out-only sources (`cpt.eval.heldout_sources`): text evaluated base vs CPT, never trained on.

    python -m tasks.core.data.heldout_only --tokenizer build/demo-inputs/tiny-llama --uri data/sample/general.jsonl --seq-len 64

The way to measure forgetting without replaying general text: prepare_cpt resolves each source
(`resolve`, refusing a file that is also a trained source's: that text would not be held out),
reads every record once, refuses a bad one or a source shorter than one `seq_len` block naming the
source's field and file:line, and writes its records into `HELDOUT_ONLY_DIR/<name>.jsonl` of the
prepared data (`write`), beside the trained sources' held-out split and outside the blend, so the
training shards, the index's `sources` and `blend.items` are the bytes they would be without it.
evaluate_cpt reads them through `tasks.core.data.stage_data.heldout_by_source`. Records identical to
a training record are not dropped from training (unlike eval.heldout_uri): a held-out-only source
is meant to be other text, and checking that would read every training record again.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tasks.core.data.blend import Source
from tasks.core.data.index import PrepareError
from tasks.core.data.inputs import InputError, InputFile, resolve_inputs
from tasks.core.data.records import FOLDER_FORMATS, BadRecord, iter_file_records

HELDOUT_ONLY_DIR = "heldout-sources"  # data/<phase>/heldout-sources/<name>.jsonl


def label(i: int, name: str) -> str:
    """The config field a message names (prepare does not know the stage: `cpt.` is the caller's)."""
    return f"eval.heldout_sources[{i}] ({name}).uri"


def resolve(
    sources: Sequence[Source], owner_of: dict[str, str], formats: Sequence[str] = FOLDER_FORMATS
) -> list[list[InputFile]]:
    """Each held-out-only source's files (a directory: the stage's data.formats); a file that a trained source
    (`owner_of`: uri -> name) also reads is refused."""
    out = []
    for i, src in enumerate(sources):
        files = resolve_inputs(src.uri, label=label(i, src.name), formats=formats)
        for f in files:
            if f.uri in owner_of:
                raise InputError(
                    f"{label(i, src.name)}: {f.uri!r} is also a file of trained source {owner_of[f.uri]!r}; "
                    "a held-out-only source must be text the stage never trains on: point it at other files"
                )
        out.append(files)
    return out


def _records(i: int, src: Source, files: list[InputFile], field: str, max_record_chars: int) -> list[dict]:
    records = []
    for f in files:
        for lineno, rec in iter_file_records(f.uri, f.fmt, max_record_chars):
            if isinstance(rec, BadRecord):
                raise PrepareError(f"{label(i, src.name)}: {rec}; a held-out set must be clean")
            if not isinstance(rec.get(field), str):
                raise PrepareError(
                    f"{label(i, src.name)}: {f.uri}:{lineno}: no string field {field!r} (fields: {sorted(rec)}); "
                    "its records need data.text_field like the trained sources'"
                )
            records.append(rec)
    return records


def write(
    out_dir: Path,
    sources: Sequence[Source],
    inputs: Sequence[list[InputFile]],
    tokenizer: Any,
    field: str,
    seq_len: int,
    max_record_chars: int,
) -> list[dict[str, Any]]:
    """Check each source, write its records under out_dir/HELDOUT_ONLY_DIR, and return index.json's `heldout_sources`."""
    table = []
    for i, (src, files) in enumerate(zip(sources, inputs)):
        records = _records(i, src, files, field, max_record_chars)
        texts = [r[field] for r in records]
        tokens = (
            sum(len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else 0
        )  # + eos per document, as pack_cpt
        if tokens < seq_len:
            raise PrepareError(
                f"{label(i, src.name)}: {len(records)} records, {tokens} tokens, fewer than one block of "
                f"seq_len={seq_len}; "
                "give it more text or remove it from cpt.eval.heldout_sources"
            )
        rel = f"{HELDOUT_ONLY_DIR}/{src.name}.jsonl"
        path = Path(out_dir) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(rec, ensure_ascii=False, default=str) + "\n" for rec in records)
        os.replace(tmp, path)
        table.append(
            {
                "name": src.name,
                "file": rel,
                "inputs": [f.to_json() for f in files],
                "records": len(records),
                "tokens": tokens,
                "blocks": tokens // seq_len,
            }
        )
    return table


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m tasks.core.data.heldout_only",
        description="Check one held-out-only source: records, tokens, blocks.",
    )
    ap.add_argument("--uri", required=True, nargs="+")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--field", default="text")
    ap.add_argument(
        "--out", default=None, help="write heldout-sources/<name>.jsonl here (default: a temporary directory)"
    )
    a = ap.parse_args(argv)
    import tempfile

    from tasks.core.data.shard import load_tokenizer

    src = Source("source", a.uri if len(a.uri) > 1 else a.uri[0])
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rows = write(
                Path(a.out or tmp), [src], resolve([src], {}), load_tokenizer(a.tokenizer), a.field, a.seq_len, 1 << 24
            )
        except (InputError, PrepareError) as e:
            raise SystemExit(f"heldout_only: {e}") from None
    print(json.dumps({k: v for k, v in rows[0].items() if k != "inputs"}, indent=1))


if __name__ == "__main__":
    main()
