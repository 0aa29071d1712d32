"""What a training or evaluation stage reads from its prepared data (data/<phase>/, made by prepare_data).

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # train and evaluate call this

- `blend_plan`: the steps a mixture is blended for, from the stage's config (prepare_data plans
  with it, the ranks check it).
- `prepared_dir`: the local data/<phase>/ (staged in and verified from a remote run root).
- `check_against_model`: before any launch, the shards' tokenizer fingerprint must be the model's
  (a different tokenizer is refused naming both) and every token id must fit its vocabulary.
- `heldout_records`: the held-out records evaluation runs on, as prepare_data decided them in its
  one streaming pass (no second read of the corpus, no second split); `heldout_by_source`: the
  same, per source of a mixture, and the held-out-only sources' records (eval.heldout_sources).
- `split_info` / `record_split` / `recorded_split`: the split record kept beside the stage's
  checkpoints (`<run_root>/<phase>/data-split.json`) and copied into the manifests made from it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.core.config.batching import BATCHING
from tasks.core.config.layout import global_batch
from tasks.core.config.phases import PHASES, Phase
from tasks.core.data.blend import BlendPlan
from tasks.core.data.index import INDEX, check_fits_model
from tasks.core.run.stages import PREPARE, STAGE, split_rel
from tasks.core.storage.fs import RunStore

HELDOUT_SET = "heldout.jsonl"  # eval.heldout_uri's records, at the root of data/<phase>/


def write_jsonl(path: Path, records: list[Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(rec, ensure_ascii=False, default=str) + "\n" for rec in records)
    os.replace(tmp, path)


def read_index(data_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(data_dir) / INDEX).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{data_dir}: no {INDEX}; the data was not prepared (the prepare_data stage makes it)"
        ) from None


def blend_plan(phase_cfg: Any, phase: Phase) -> BlendPlan | None:
    """The steps a stage's mixture is blended for (None: one source, no blend): its max_steps of
    global batches, its seed, and under SFT packing the rows' seq_len."""
    if not phase_cfg.data.mixture:
        return None
    packed = PHASES[phase].rows and BATCHING[phase_cfg.batching].packs
    return BlendPlan(
        phase_cfg.max_steps, global_batch(phase_cfg), phase_cfg.seed, phase_cfg.seq_len if packed else None
    )


def prepared_dir(store: RunStore, phase: Phase) -> Path:
    """The local data/<phase>/ a training or evaluation stage reads (staged in, sha256-verified, for remote run
    roots)."""
    rel = STAGE[PREPARE[phase]].artifact
    return store.local_path(rel) if store.local else store.stage_in(rel)


def check_against_model(data_dir: Path, model_dir: Path, phase: Phase) -> dict[str, Any]:
    """Refuse shards made with another tokenizer than model_dir's, or holding ids beyond its vocabulary."""
    index = read_index(data_dir)
    check_fits_model(index, data_dir, model_dir, phase)
    return index


def corpus_of(data_cfg: Any) -> str | list[str] | dict[str, str | list[str]]:
    """What a split record names as the corpus: data.uri, or a mixture's {source: uri}."""
    return data_cfg.uri if data_cfg.sources is None else {s.name: s.uri for s in data_cfg.sources}


def split_info(data_dir: Path, data_uri: str | list[str] | dict[str, Any]) -> dict[str, Any]:
    """The split record of a prepared stage: method, counts, the corpus it was made from (`corpus_of`)
    and, per source, its weight, what the planned steps take of it and its held-out records; the
    held-out-only sources with their records, tokens and files."""
    index = read_index(data_dir)
    t = index["totals"]
    keep = ("name", "weight", "token_share", "epochs", "tokens_available", "heldout_records", "truncation")
    only = [
        {
            "name": s["name"],
            "records": s["records"],
            "tokens": s["tokens"],
            "inputs": [{k: f[k] for k in ("uri", "size", "checksum")} for f in s["inputs"]],
        }
        for s in index.get("heldout_sources") or []
    ]
    return {
        "sources": [{k: s[k] for k in keep if k in s} for s in index.get("sources") or []],
        **({"heldout_sources": only} if only else {}),
        "data_uri": data_uri,
        "files": t["files"],
        "prepared": str(data_dir),
        "tokenizer_sha256": index["tokenizer_sha256"],
        **index["split"],
        "train_records": t["train_records"],
        "heldout_records": t["heldout_records"],
        "dropped_no_labels": t["dropped_no_labels"],
        "skipped": t["skipped"],
        # records longer than seq_len: the rule and what it did (tasks/core/data/truncation.py)
        **({"truncation": {**index["truncation"], **t["truncation"]}} if "truncation" in index else {}),
        # every input file with its size and checksum (sha256, or the object store's etag): the
        # model card lists them as the datasets the model was trained on
        "inputs": [{k: f["input"][k] for k in ("uri", "size", "checksum")} for f in index["files"]],
    }


def iter_heldout(data_dir: Path) -> Iterator[dict]:
    """Held-out records in corpus order (fraction split), or eval.heldout_uri's records."""
    data_dir = Path(data_dir)
    index = read_index(data_dir)
    files = (
        [data_dir / HELDOUT_SET]
        if index["split"]["method"] == "heldout-uri"
        else [data_dir / f["shard"] / HELDOUT_SET for f in index["files"]]
    )
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def heldout_records(data_dir: Path) -> list[dict]:
    return list(iter_heldout(data_dir))


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def heldout_by_source(data_dir: Path) -> dict[str, list[dict]] | None:
    """Each source's held-out records: a trained source's split off its own files by the hash split,
    then each held-out-only source's (eval.heldout_sources), in that order. None when there is no
    more than the pooled set: one trained source and no held-out-only one. Under eval.heldout_uri a
    mixture's trained sources have no records of their own (only held-out-only ones are listed);
    one trained source's are that file's."""
    data_dir = Path(data_dir)
    index = read_index(data_dir)
    sources, only = index.get("sources") or [], index.get("heldout_sources") or []
    by_file = index["split"]["method"] == "heldout-uri"
    if not only and (len(sources) < 2 or by_file):
        return None
    out: dict[str, list[dict]] = {}
    if by_file and len(sources) == 1:
        out[sources[0]["name"]] = _read_jsonl(data_dir / HELDOUT_SET)
    for src in [] if by_file else sources:
        a, b = src["files"]
        out[src["name"]] = [
            rec for f in index["files"][a:b] for rec in _read_jsonl(data_dir / f["shard"] / HELDOUT_SET)
        ]
    for src in only:
        out[src["name"]] = _read_jsonl(data_dir / src["file"])
    return out


def heldout_only_names(data_dir: Path) -> list[str]:
    """The held-out-only sources of a prepared stage (never trained on), in config order."""
    return [s["name"] for s in read_index(Path(data_dir)).get("heldout_sources") or []]


def record_split(store: RunStore, phase: str, info: dict[str, Any]) -> None:
    """Keep the split record in the run root beside the stage's checkpoints (S3 included)."""
    store.write_text(split_rel(phase), json.dumps(info, indent=2, sort_keys=True) + "\n")


def recorded_split(store: RunStore, phase: str) -> dict[str, Any] | None:
    """The split the stage trained with, for the manifests of the artifacts made from it."""
    try:
        return json.loads(store.read_text(split_rel(phase)))
    except Exception:  # no readable split record: the artifact's manifest says data_split null rather than failing
        return None
