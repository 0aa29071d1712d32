"""The converter's API: `convert_checkpoint`, its `ConversionReport`, and `load_state_dict_from_dir`.

    python -m tasks.core.models.convert SRC_DIR DST_DIR [--dtype bf16] [--max-shard-size 5GB] [--config FILE]

Scan the source (`source`), validate it against the model family and plan the shards (`plan`),
then write them (`write`); the index and config.json follow the shards. What the input layouts
are and why memory stays bounded is in the package docstring (`tasks.core.models.convert`).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasks.core.errors import ConversionError
from tasks.core.models.convert.dtypes import (
    CONFIG_NAME,
    FLOATING,
    GENERATION_CONFIG_NAME,
    SAFE_INDEX_NAME,
    ST_CONFIG_DTYPE,
    ST_LABEL,
    parse_size,
    st_dtype,
)
from tasks.core.models.convert.plan import plan_shards, shard_name, validate_and_order
from tasks.core.models.convert.source import Reader, scan_source
from tasks.core.models.convert.write import MAX_WORKERS, shard_workers, write_shards, write_small
from tasks.core.models.folder import set_config_dtype


@dataclass
class ConversionReport:
    """What a conversion wrote; `files` feeds `manifest.write_manifest(known_hashes=...)`."""

    src_dir: str
    dst_dir: str
    source_layout: str
    files: dict[str, dict[str, Any]]  # relpath -> {"size": int, "sha256": str}, every file written
    num_tensors: int
    num_params: int
    total_bytes: int  # tensor bytes, = index metadata.total_size
    dtype: str  # output floating dtype label ("bf16", ...)
    keys: list[str]
    shapes: dict[str, list[int]]
    dropped: list[str]  # tied duplicates left out of the output
    seconds: float

    @property
    def throughput_gbps(self) -> float:
        return self.total_bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")

    def summary(self) -> dict[str, Any]:
        """Compact form for a manifest's meta (the shapes of all keys are in the index anyway)."""
        return {
            "source_layout": self.source_layout,
            "num_tensors": self.num_tensors,
            "num_params": self.num_params,
            "total_bytes": self.total_bytes,
            "dtype": self.dtype,
            "shards": sum(1 for f in self.files if f.endswith(".safetensors")),
            "dropped": self.dropped,
            "seconds": round(self.seconds, 3),
        }


def _remove_stale_outputs(dst: Path, keep: set[str]) -> None:
    # a previous conversion with a different shard count would leave shards the new index does
    # not name, and the manifest (which lists every file) would carry them along
    pattern = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.tmp)?|model\.safetensors\.index\.json(\.tmp)?")
    for path in dst.iterdir():
        if path.is_file() and pattern.fullmatch(path.name) and path.name not in keep:
            path.unlink()


def convert_checkpoint(
    src_dir: str | Path,
    dst_dir: str | Path,
    *,
    model_config: Mapping[str, Any],
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    allow_pickle: bool = False,
    write_config: bool = True,
    fsync: bool = True,
    workers: int | None = None,
) -> ConversionReport:
    """Convert a ColossalAI sharded (or HF) checkpoint in `src_dir` to HF safetensors in `dst_dir`.

    `model_config` is the parsed config.json; it decides which keys and shapes must be present.
    `dtype` ("fp32", "bf16", "fp16") casts floating tensors. With `write_config`, config.json
    (its dtype, under both keys, updated) and the source's generation_config.json are written too. `workers`
    output shards are written at once (default: one per CPU, at most 4); the files are the same
    byte for byte whatever the number.
    """
    started = time.perf_counter()
    src, dst = Path(src_dir), Path(dst_dir)
    out_code = st_dtype(dtype)
    budget = parse_size(max_shard_size)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ConversionError(
            f"workers={workers!r}: must be an int >= 1, or None for one per CPU (at most {MAX_WORKERS})"
        )
    if dst.exists() and src.resolve() == dst.resolve():
        raise ConversionError(f"{dst}: destination is the source directory; convert into a new directory")

    source = scan_source(src, allow_pickle)
    reader = Reader(src)
    try:
        planned, dropped = validate_and_order(source, model_config, out_code, reader)
        shards = plan_shards((p.out_nbytes for p in planned), budget)
        names = [shard_name(k + 1, len(shards)) for k in range(len(shards))]

        dst.mkdir(parents=True, exist_ok=True)
        _remove_stale_outputs(dst, keep=set(names) | ({SAFE_INDEX_NAME} if len(names) > 1 else set()))
        jobs = [(dst / name, [planned[i] for i in members]) for name, members in zip(names, shards)]
        files = write_shards(jobs, reader, fsync, shard_workers(workers, len(jobs)))
    finally:
        reader.close()

    total_bytes = sum(p.out_nbytes for p in planned)
    if len(names) > 1:
        weight_map = {p.entry.key: name for name, members in zip(names, shards) for p in (planned[i] for i in members)}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        files[SAFE_INDEX_NAME] = write_small(
            dst / SAFE_INDEX_NAME, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode(), fsync
        )

    out_codes = sorted({p.out_dtype for p in planned if p.out_dtype in FLOATING})
    assert out_code is None or out_codes == [out_code], f"planned dtypes {out_codes} != requested {out_code}"
    label = ST_LABEL.get(out_codes[0], out_codes[0]) if len(out_codes) == 1 else "none"
    if write_config:
        # "_"-prefixed entries are runtime state that `PretrainedConfig.to_dict()` leaks; written
        # back, `_attn_implementation_autoset` would pin the loader to eager attention
        config = {k: v for k, v in model_config.items() if not k.startswith("_")}
        if len(out_codes) == 1 and out_codes[0] in ST_CONFIG_DTYPE:
            set_config_dtype(config, ST_CONFIG_DTYPE[out_codes[0]])
        files[CONFIG_NAME] = write_small(
            dst / CONFIG_NAME, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(), fsync
        )
        if (src / GENERATION_CONFIG_NAME).is_file():
            blob = (src / GENERATION_CONFIG_NAME).read_bytes()
            files[GENERATION_CONFIG_NAME] = write_small(dst / GENERATION_CONFIG_NAME, blob, fsync)

    return ConversionReport(
        src_dir=str(src),
        dst_dir=str(dst),
        source_layout=source.layout,
        files=files,
        num_tensors=len(planned),
        num_params=sum(math.prod(p.entry.shape) for p in planned),
        total_bytes=total_bytes,
        dtype=label,
        keys=[p.entry.key for p in planned],
        shapes={p.entry.key: list(p.entry.shape) for p in planned},
        dropped=dropped,
        seconds=time.perf_counter() - started,
    )


def load_state_dict_from_dir(directory: str | Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory in any layout above (for tests and fingerprints).

    Loads everything into memory: for small models only. Refuses duplicated keys.
    """
    source = scan_source(Path(directory), allow_pickle)
    if source.problems:
        raise ConversionError(f"{directory}: " + "; ".join(source.problems))
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for key, entries in source.by_key.items():
        if len(entries) > 1:
            raise ConversionError(f"{directory}: duplicated key {key!r} in {' and '.join(e.file for e in entries)}")
    for name in source.files:
        if source.layout == "pickle":
            out.update({k: es[0].tensor for k, es in source.by_key.items() if es[0].file == name})  # type: ignore[misc]
            continue
        with safe_open(str(source.root / name), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping: it has keys() but no __iter__
                out[key] = f.get_tensor(key)
    return out
