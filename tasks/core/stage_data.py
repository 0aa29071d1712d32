"""The data a training stage trains on and the held-out part it is evaluated on, as files.

    python -m flows.cpt_to_sft --config deployments/configs/tiny-cpu.yaml   # train and evaluate call this

Used before the engine runs (tasks/train.py: the engine trains on every record of the file it is
given, so it gets the training part only) and by evaluation (the same deterministic split,
recomputed). Which record goes where is decided by `tasks.core.split`; this module stages the
data in, writes the two parts and keeps the split record beside the stage's checkpoints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tasks.core.config import RunConfig
from tasks.core.manifest import sha256_file
from tasks.core.paths import resolve_local
from tasks.core.split import split_by_fraction, split_by_heldout
from tasks.core.storage import RunStore, fetch_to_local

SPLIT_FILE = "data-split.json"  # beside the stage's checkpoints: <run_root>/<stage>/data-split.json


def write_jsonl(path: Path, records: list[Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(rec, ensure_ascii=False, default=str) + "\n" for rec in records)
    os.replace(tmp, path)


def heldout_split(cfg: RunConfig, store: RunStore, stage: str) -> tuple[Path, Path | None, dict[str, Any]]:
    """(training file, held-out file or None, split record) for `stage`.

    Writes `<staging>/data/<stage>/split/{train,heldout}.jsonl` and the split record; without a
    held-out set (fraction 0, no URI) the training file is the data file itself, unchanged.
    """
    from tasks.core.data import read_records

    st = getattr(cfg, stage)
    dest = store.staging / "data" / stage
    data = fetch_to_local(resolve_local(st.data.uri), dest)
    base = {"data_uri": st.data.uri, "data_sha256": sha256_file(data)}
    if not st.eval.enabled:
        return data, None, {"method": "none", **base}
    records = read_records(str(data))
    if st.eval.heldout_uri:
        held_file = fetch_to_local(resolve_local(st.eval.heldout_uri), dest / "heldout-source")
        split = split_by_heldout(records, read_records(str(held_file)), st.eval.heldout_uri)
        base["heldout_sha256"] = sha256_file(held_file)
    else:
        split = split_by_fraction(records, st.eval.heldout_fraction)
    out = dest / "split"
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", split.train)
    write_jsonl(out / "heldout.jsonl", split.heldout)
    info = {**base, **split.info}
    (out / SPLIT_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out / "train.jsonl", out / "heldout.jsonl", info


def record_split(store: RunStore, stage: str, info: dict[str, Any]) -> None:
    """Keep the split record in the run root beside the stage's checkpoints (S3 included)."""
    store.write_text(f"{stage}/{SPLIT_FILE}", json.dumps(info, indent=2, sort_keys=True) + "\n")


def recorded_split(store: RunStore, stage: str) -> dict[str, Any] | None:
    """The split the stage trained with, for the manifests of the artifacts made from it."""
    try:
        return json.loads(store.read_text(f"{stage}/{SPLIT_FILE}"))
    except Exception:  # no readable split record: the artifact's manifest says data_split null rather than failing
        return None
