"""Streaming conversion of a sharded model checkpoint to an HF-standard safetensors directory.

Input: a ColossalAI 0.5.0 checkpoint written by
`booster.save_model(model, dir, shard=True, use_safetensors=True)` (any plugin), or a plain HF
directory (`model.safetensors`, or shards plus `model.safetensors.index.json`); pickled `.bin`
checkpoints only with `allow_pickle=True`. Output: `model-0000K-of-0000N.safetensors` shards
planned by a byte budget and a byte-correct `model.safetensors.index.json` (or a single
`model.safetensors`), plus `config.json`, optionally cast to one dtype.

What ColossalAI 0.5.0 writes (read from colossalai/checkpoint_io/*.py, and what this module relies on):
- Keys are the unwrapped HF model's parameter names and tensors are full: HybridParallel
  gathers tp shards (`gather_distributed_param`) and strips the vocabulary padding it added for
  tp (`to_unpadded_tensor`) before saving. A half-size or padded tensor therefore means a save
  that bypassed that code, and is reported as such.
- pp == 1: `model-00001.safetensors`, `model-00002.safetensors`, ... (no "-of-"), always with an
  index, even for one shard. pp > 1: every stage writes `model-stage-0000S-shard-0000K.safetensors`
  (S and K from 1) and rank 0 merges the per-stage indexes (from `tmp_index_files/`) into one.
- The index's `metadata.total_size` is a float in MiB (`numel * element_size / 1024 / 1024`),
  not bytes as in transformers; this module never trusts it and recomputes from the headers.
- Tied embeddings: HybridParallel saves `named_parameters()`, which yields a tied weight once
  (no `lm_head.weight`) when pp == 1; with pp > 1 the first stage saves
  `model.embed_tokens.weight` and the last stage saves `lm_head.weight`, kept equal by the
  shared-parameter sync. DDP/LowLevelZero save `model.state_dict()`, which lists both names; on
  GPU `.cpu()` copies them so both are written (on CPU safetensors refuses the shared storage).
  A duplicated `lm_head.weight` is dropped only if it is bitwise equal to the embeddings.

Memory stays bounded by a few fixed 16 MiB buffers per shard writer whatever the tensor or model
size: tensors are copied (or cast) chunk by chunk with `pread`, not through a memory map, because
pages touched through a map count in the process RSS for as long as the file stays mapped. sha256
of every output file is computed on the bytes as they are written, in a helper thread so hashing
overlaps disk I/O. One sha256 stream runs at about 1.4 GB/s a core (SHA-NI), slower than a fast
disk, so up to `workers` output shards (one per CPU, at most 4) are written at once, each with its
own hasher. `safetensors.safe_open` validates every input header with the reference parser.

    python -m tasks.core.convert SRC_DIR DST_DIR [--dtype bf16] [--max-shard-size 5GB] [--config FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import mmap
import os
import queue
import re
import struct
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Mapping

import torch

from tasks.core.errors import ConversionError

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"

_CHUNK = 16 << 20  # I/O unit: large enough for disk speed, small enough to keep RSS flat
_RING = 4  # write buffers in flight while the hasher thread catches up
_MAX_WORKERS = 4  # output shards written at once by default (memory: 64 MiB of ring each)
_MAX_HEADER = 100 << 20  # the safetensors reference parser refuses larger headers too
_MAX_PROBLEMS_SHOWN = 25

# ---------------------------------------------------------------------------------------------
# dtypes and sizes (tables, so adding one is a line)
# ---------------------------------------------------------------------------------------------

# safetensors dtype code -> torch dtype
ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}
_FLOATING = frozenset(code for code, dt in ST_TO_TORCH.items() if dt.is_floating_point)

# user-facing dtype names -> safetensors code; the label is what reports and config.json show
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "F32", "float32": "F32",
    "bf16": "BF16", "bfloat16": "BF16",
    "fp16": "F16", "float16": "F16", "half": "F16",
}  # fmt: skip
_ST_LABEL = {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "F64": "fp64"}
_ST_CONFIG_DTYPE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}

# transformers' convention: decimal units are powers of 10, binary ones powers of 2
_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or "5GB" (10**9), "500MB", "1GiB" (2**30), "1024"."""
    if isinstance(size, bool):
        raise ConversionError(f"max_shard_size={size!r}: expected bytes or a string like '5GB'")
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE_RE.match(str(size))
        unit = (m.group(2) or "").upper() if m else None
        if not m or unit not in _SIZE_UNITS:
            raise ConversionError(f"max_shard_size={size!r}: expected bytes or a string like '5GB', '500MB', '1GiB'")
        value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ConversionError(f"max_shard_size={size!r}: must be positive")
    return value


def _st_dtype(dtype: str | torch.dtype | None) -> str | None:
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_TO_ST:
            raise ConversionError(f"dtype={dtype}: unsupported; use one of {sorted(DTYPE_ALIASES)}")
        return TORCH_TO_ST[dtype]
    code = DTYPE_ALIASES.get(str(dtype).lower())
    if code is None:
        raise ConversionError(f"dtype={dtype!r}: unsupported; use one of {sorted(DTYPE_ALIASES)}")
    return code


def _itemsize(code: str) -> int:
    return ST_TO_TORCH[code].itemsize


# ---------------------------------------------------------------------------------------------
# key -> shape registry by model family (data, like torchtitan's from_hf_map)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRule:
    """One tensor of a model: key (with `{i}` for the layer index), symbolic shape, presence."""

    key: str
    shape: tuple[str, ...]  # names from _DIMS
    when: str | None = None  # present only if this config flag is true
    unless: str | None = None  # absent if this config flag is true


@dataclass(frozen=True)
class ModelFamily:
    """How a decoder-only family lays out its state dict, in module (= save) order."""

    head: tuple[TensorRule, ...]
    layer: tuple[TensorRule, ...]
    tail: tuple[TensorRule, ...]
    config_defaults: Mapping[str, Any]  # the family's config class defaults for omitted fields
    # key -> the key it is a copy of when tie_word_embeddings is true
    tied: Mapping[str, str] = field(default_factory=lambda: {"lm_head.weight": "model.embed_tokens.weight"})
    # key -> dim that indexes the vocabulary (to tell padded vocab rows from other mismatches)
    vocab_dims: Mapping[str, int] = field(
        default_factory=lambda: {"model.embed_tokens.weight": 0, "lm_head.weight": 0}
    )


def _head_dim(c: Mapping[str, Any]) -> int:
    head_dim = c.get("head_dim")
    if head_dim:
        return int(head_dim)
    if c["hidden_size"] % c["num_attention_heads"]:
        raise ConversionError(
            f"config: hidden_size={c['hidden_size']} is not divisible by num_attention_heads="
            f"{c['num_attention_heads']} and head_dim is not set"
        )
    return c["hidden_size"] // c["num_attention_heads"]


def _kv_heads(c: Mapping[str, Any]) -> int:
    return c.get("num_key_value_heads") or c["num_attention_heads"]


_DIMS: dict[str, Callable[[Mapping[str, Any]], int]] = {
    "vocab": lambda c: c["vocab_size"],
    "hidden": lambda c: c["hidden_size"],
    "inter": lambda c: c["intermediate_size"],
    "head_dim": _head_dim,
    "q": lambda c: c["num_attention_heads"] * _head_dim(c),
    "kv": lambda c: _kv_heads(c) * _head_dim(c),
}
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")


def _attn(q_bias: str | None, o_bias: str | None, qk_norm: bool = False) -> tuple[TensorRule, ...]:
    """Attention projections; `*_bias` is the flag that enables the bias ("always" = always)."""

    def bias(name: str, dim: str, flag: str | None) -> tuple[TensorRule, ...]:
        if flag is None:
            return ()
        return (TensorRule(f"self_attn.{name}.bias", (dim,), when=None if flag == "always" else flag),)

    rules = (
        TensorRule("self_attn.q_proj.weight", ("q", "hidden")), *bias("q_proj", "q", q_bias),
        TensorRule("self_attn.k_proj.weight", ("kv", "hidden")), *bias("k_proj", "kv", q_bias),
        TensorRule("self_attn.v_proj.weight", ("kv", "hidden")), *bias("v_proj", "kv", q_bias),
        TensorRule("self_attn.o_proj.weight", ("hidden", "q")), *bias("o_proj", "hidden", o_bias),
    )  # fmt: skip
    if qk_norm:
        rules += (TensorRule("self_attn.q_norm.weight", ("head_dim",)), TensorRule("self_attn.k_norm.weight", ("head_dim",)))
    return rules


def _mlp(flag: str | None) -> tuple[TensorRule, ...]:
    out: list[TensorRule] = []
    for name, shape, bias_dim in (("gate_proj", ("inter", "hidden"), "inter"),
                                  ("up_proj", ("inter", "hidden"), "inter"),
                                  ("down_proj", ("hidden", "inter"), "hidden")):  # fmt: skip
        out.append(TensorRule(f"mlp.{name}.weight", shape))
        if flag:
            out.append(TensorRule(f"mlp.{name}.bias", (bias_dim,), when=flag))
    return tuple(out)


_NORMS = (TensorRule("input_layernorm.weight", ("hidden",)), TensorRule("post_attention_layernorm.weight", ("hidden",)))
_HEAD = (TensorRule("model.embed_tokens.weight", ("vocab", "hidden")),)
_TAIL = (
    TensorRule("model.norm.weight", ("hidden",)),
    TensorRule("lm_head.weight", ("vocab", "hidden"), unless="tie_word_embeddings"),
)
_LLAMA_DEFAULTS = {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}

# model_type -> layout; transformers 4.51's module definitions are the source of truth (the tests
# compare this table with the state dict of a tiny model of every family)
FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily(_HEAD, _attn("attention_bias", "attention_bias") + _mlp("mlp_bias") + _NORMS, _TAIL, _LLAMA_DEFAULTS),
    "mistral": ModelFamily(_HEAD, _attn(None, None) + _mlp(None) + _NORMS, _TAIL, {"tie_word_embeddings": False}),
    "qwen2": ModelFamily(_HEAD, _attn("always", None) + _mlp(None) + _NORMS, _TAIL, {"tie_word_embeddings": False}),
    "qwen3": ModelFamily(
        _HEAD,
        _attn("attention_bias", "attention_bias", qk_norm=True) + _mlp(None) + _NORMS,
        _TAIL,
        {"tie_word_embeddings": False, "attention_bias": False, "head_dim": 128},
    ),
}
LAYER_PREFIX = "model.layers.{i}."


def _family(model_config: Mapping[str, Any]) -> tuple[ModelFamily, dict[str, Any]]:
    model_type = model_config.get("model_type")
    family = FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        raise ConversionError(
            f"config.json model_type={model_type!r} is not supported by the converter; "
            f"supported: {', '.join(sorted(FAMILIES))} (add its layout to FAMILIES in tasks/core/convert.py)"
        )
    config = {**family.config_defaults, **{k: v for k, v in model_config.items() if v is not None}}
    missing = [f for f in _REQUIRED_FIELDS if not isinstance(config.get(f), int)]
    if missing:
        raise ConversionError(f"config.json ({model_type}) lacks integer field(s) {missing}: cannot derive tensor shapes")
    return family, config


def expected_tensors(model_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every key the HF model built from `model_config` has, with its shape, in module order."""
    family, config = _family(model_config)
    dims = {name: fn(config) for name, fn in _DIMS.items()}

    def present(rule: TensorRule) -> bool:
        return (rule.when is None or bool(config.get(rule.when))) and not (rule.unless and config.get(rule.unless))

    out: dict[str, tuple[int, ...]] = {}
    for rule in family.head:
        if present(rule):
            out[rule.key] = tuple(dims[d] for d in rule.shape)
    for i in range(config["num_hidden_layers"]):
        prefix = LAYER_PREFIX.format(i=i)
        for rule in family.layer:
            if present(rule):
                out[prefix + rule.key] = tuple(dims[d] for d in rule.shape)
    for rule in family.tail:
        if present(rule):
            out[rule.key] = tuple(dims[d] for d in rule.shape)
    return out


def tied_keys(model_config: Mapping[str, Any]) -> dict[str, str]:
    """{dropped key: key it duplicates} when the config ties embeddings, else {}."""
    family, config = _family(model_config)
    return dict(family.tied) if config.get("tie_word_embeddings") else {}


def _shape_cause(key: str, got: tuple[int, ...], want: tuple[int, ...], family: ModelFamily) -> str:
    """Most likely reason a saved shape differs from the config's, for the error message."""
    if len(got) != len(want):
        return "a different architecture, or a fused/flattened tensor"
    dim = next(d for d in range(len(want)) if got[d] != want[d])
    if family.vocab_dims.get(key) == dim and got[dim] > want[dim]:
        return (
            f"padded vocabulary rows: {got[dim] - want[dim]} rows beyond vocab_size={want[dim]} (the saver did not "
            f"strip the padding ColossalAI adds for tensor parallelism, or config.json's vocab_size is stale)"
        )
    if got[dim] < want[dim] and want[dim] % got[dim] == 0:
        return (
            f"ungathered tensor-parallel shard: holds 1/{want[dim] // got[dim]} of dim {dim} "
            f"(saved from one tp rank without gathering)"
        )
    return "the checkpoint belongs to a model with a different config.json (size, heads or vocabulary)"


# ---------------------------------------------------------------------------------------------
# reading sources: header validation and layout discovery
# ---------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    """One tensor as stored in one input file."""

    key: str
    file: str  # relative to the source directory
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file (safetensors); unused for pickles
    nbytes: int
    tensor: torch.Tensor | None = None  # pickled inputs only


def read_safetensors_header(path: str | Path, name: str | None = None) -> tuple[int, dict[str, _Entry], dict]:
    """(data start, {key: entry}, __metadata__) of a safetensors file, validated strictly.

    Catches what a truncated copy or a flipped byte does to a file: a header length past the
    end, a header that is not JSON, offsets that do not tile the data, data shorter than the
    header says. Every error names the file.
    """
    path = Path(path)
    name = name or path.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ConversionError(f"{name}: file is missing") from None
    if size < 8:
        raise ConversionError(f"{name}: {size} bytes, too short for a safetensors header (truncated)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(size - 8, _MAX_HEADER):
            raise ConversionError(
                f"{name}: header length field says {header_len} bytes but the file has {size} (truncated or corrupted header)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{name}: safetensors header is not valid JSON ({exc}): corrupted file") from None
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    entries: dict[str, _Entry] = {}
    for key, info in header.items():
        try:
            code, shape = info["dtype"], tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
            if not isinstance(code, str):
                raise TypeError(code)
        except (KeyError, TypeError, ValueError):
            raise ConversionError(f"{name}: header entry for {key!r} is malformed (corrupted header)") from None
        if code not in ST_TO_TORCH:
            raise ConversionError(f"{name}: tensor {key!r} has dtype {code!r}, which the converter does not handle")
        nbytes = math.prod(shape) * _itemsize(code)
        if end - begin != nbytes or begin < 0:
            raise ConversionError(
                f"{name}: tensor {key!r} spans bytes [{begin}, {end}) but shape {list(shape)} {code} needs {nbytes} (corrupted header)"
            )
        entries[key] = _Entry(key, name, code, shape, data_start + begin, nbytes)
    cursor = 0
    for e in sorted(entries.values(), key=lambda e: e.offset):
        if e.offset - data_start != cursor:
            raise ConversionError(f"{name}: tensor {e.key!r} does not start where the previous one ends (corrupted header)")
        cursor += e.nbytes
    if data_start + cursor != size:
        raise ConversionError(
            f"{name}: header describes {cursor} data bytes but the file holds {size - data_start} "
            f"({'truncated' if data_start + cursor > size else 'trailing garbage'})"
        )
    return data_start, entries, metadata


def _check_with_reference(path: Path, name: str) -> None:
    """Second opinion from the reference parser (it only reads the header; tensors stay unmapped)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            f.keys()
    except Exception as exc:  # SafetensorError is not importable in a stable place across versions
        raise ConversionError(f"{name}: safetensors refuses the file ({exc}): corrupted or truncated") from None


def _checked_relpath(rel: Any, index_name: str) -> str:
    """Index entries are untrusted: a shard name must stay inside the checkpoint directory."""
    if not isinstance(rel, str) or not rel or "\\" in rel or rel.startswith("/"):
        raise ConversionError(f"{index_name}: weight_map names file {rel!r}, which is not a relative path")
    parts = PurePosixPath(rel).parts
    if any(p in ("..", ".") for p in parts):
        raise ConversionError(f"{index_name}: weight_map names file {rel!r}, which leaves the checkpoint directory")
    return rel


@dataclass
class _Source:
    """Everything known about the input before a byte of tensor data is read."""

    root: Path
    layout: str  # colossalai-sharded | colossalai-pipeline | hf-sharded | hf-single | pickle
    files: list[str]
    by_key: dict[str, list[_Entry]]  # key -> every file that holds it (more than one = duplicate)
    problems: list[str]


def _layout_name(files: list[str], index: dict | None) -> str:
    if index is None:
        return "hf-single"
    if any(re.fullmatch(r".*-stage-\d{5}-shard-\d{5}\.safetensors", f) for f in files):
        return "colossalai-pipeline"
    if all(re.fullmatch(r".*-\d{5}\.safetensors", f) and "-of-" not in f for f in files):
        return "colossalai-sharded"
    return "hf-sharded"


def _scan_source(src: Path, allow_pickle: bool) -> _Source:
    if not src.is_dir():
        raise ConversionError(f"{src}: checkpoint directory does not exist")
    index_path = src / SAFE_INDEX_NAME
    if index_path.is_file() and (src / SAFE_WEIGHTS_NAME).is_file():
        # transformers would load model.safetensors and ignore the index: one of them is stale
        raise ConversionError(f"{src}: both {SAFE_WEIGHTS_NAME} and {SAFE_INDEX_NAME}; remove the stale one")
    if index_path.is_file():
        return _scan_safetensors(src, index_path)
    if (src / SAFE_WEIGHTS_NAME).is_file():
        return _scan_safetensors(src, None)
    pickles = [PICKLE_INDEX_NAME, PICKLE_WEIGHTS_NAME]
    if any((src / p).is_file() for p in pickles):
        if not allow_pickle:
            found = next(p for p in pickles if (src / p).is_file())
            raise ConversionError(
                f"{src / found}: refusing a pickled checkpoint (unpickling can run arbitrary code); save it with "
                f"use_safetensors=True, or pass allow_pickle=True for a checkpoint from your own storage"
            )
        return _scan_pickle(src)
    stray = sorted(p.name for p in src.glob("*.safetensors"))
    if (src / "tmp_index_files").is_dir():
        raise ConversionError(
            f"{src}: no {SAFE_INDEX_NAME} but a tmp_index_files/ folder: a pipeline-parallel save stopped before "
            f"rank 0 merged the per-stage indexes (incomplete checkpoint)"
        )
    if stray:
        raise ConversionError(
            f"{src}: shards {stray[:3]} but no {SAFE_INDEX_NAME} (ColossalAI writes the index after the "
            f"shards: the save is incomplete)"
        )
    raise ConversionError(f"{src}: no {SAFE_INDEX_NAME}, {SAFE_WEIGHTS_NAME} or {PICKLE_WEIGHTS_NAME}: not a checkpoint")


def _read_index(index_path: Path) -> dict:
    try:
        index = json.loads(index_path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{index_path.name}: not valid JSON ({exc})") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict) or not index["weight_map"]:
        raise ConversionError(f"{index_path.name}: has no weight_map (not a sharded checkpoint index)")
    return index


def _scan_safetensors(src: Path, index_path: Path | None) -> _Source:
    problems: list[str] = []
    index = _read_index(index_path) if index_path else None
    if index is not None:
        weight_map = {k: _checked_relpath(v, index_path.name) for k, v in index["weight_map"].items()}
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (src / f).is_file()]
        if missing:
            keys = {f: next(k for k, v in weight_map.items() if v == f) for f in missing}
            raise ConversionError(
                "; ".join(f"{index_path.name} names {f} (e.g. for {keys[f]!r}) but the file is missing" for f in missing)
                + " (incomplete copy or an interrupted save)"
            )
    else:
        weight_map, files = None, [SAFE_WEIGHTS_NAME]

    by_key: dict[str, list[_Entry]] = {}
    for name in files:
        _, entries, _ = read_safetensors_header(src / name, name)
        _check_with_reference(src / name, name)
        for key, entry in entries.items():
            by_key.setdefault(key, []).append(entry)
    if weight_map is not None:
        # the index and the headers must agree: a disagreement is a stale index or a rewritten shard
        for key, name in weight_map.items():
            if not any(e.file == name for e in by_key.get(key, ())):
                problems.append(f"{index_path.name} maps {key!r} to {name}, but {name} does not contain it (stale index)")
        for key, entries in by_key.items():
            if key not in weight_map:
                problems.append(f"{entries[0].file} holds {key!r}, which {index_path.name} does not list (stale index)")
    return _Source(src, _layout_name(files, index), files, by_key, problems)


def _scan_pickle(src: Path) -> _Source:
    index_path = src / PICKLE_INDEX_NAME
    if index_path.is_file():
        files = sorted({_checked_relpath(v, PICKLE_INDEX_NAME) for v in _read_index(index_path)["weight_map"].values()})
    else:
        files = [PICKLE_WEIGHTS_NAME]
    by_key: dict[str, list[_Entry]] = {}
    for name in files:
        path = src / name
        if not path.is_file():
            raise ConversionError(f"{PICKLE_INDEX_NAME} names {name} but the file is missing")
        try:
            try:  # mmap keeps the loaded file out of anonymous memory (zip format only)
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ConversionError(f"{name}: cannot load with torch.load(weights_only=True) ({exc}): corrupted or not a state dict") from None
        for key, t in state.items():
            if not isinstance(t, torch.Tensor) or t.dtype not in TORCH_TO_ST:
                raise ConversionError(f"{name}: entry {key!r} is not a supported tensor ({type(t).__name__})")
            t = t.detach().contiguous()
            by_key.setdefault(key, []).append(
                _Entry(key, name, TORCH_TO_ST[t.dtype], tuple(t.shape), 0, t.numel() * t.element_size(), tensor=t)
            )
    return _Source(src, "pickle", files, by_key, [])


class _Reader:
    """Reads an entry's bytes, chunk by chunk, into caller-owned buffers (no mmap: see module doc)."""

    def __init__(self, root: Path):
        self.root = root
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()  # shard writers share one reader (pread itself is thread-safe)

    def readinto(self, entry: _Entry, pos: int, out: memoryview) -> None:
        """Fill `out` with entry bytes [pos, pos + len(out))."""
        if entry.tensor is not None:
            flat = entry.tensor.reshape(-1).view(torch.uint8).numpy()
            out[:] = memoryview(flat)[pos : pos + len(out)]
            return
        fd = self._fds.get(entry.file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(entry.file)
                if fd is None:
                    fd = self._fds[entry.file] = os.open(self.root / entry.file, os.O_RDONLY)
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], entry.offset + pos + done)
            if n == 0:
                raise ConversionError(f"{entry.file}: ended while reading {entry.key!r} (file shrank during conversion)")
            done += n

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _bitwise_equal(reader: _Reader, a: _Entry, b: _Entry) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    buf_a, buf_b = memoryview(bytearray(_CHUNK)), memoryview(bytearray(_CHUNK))
    for pos in range(0, a.nbytes, _CHUNK):
        n = min(_CHUNK, a.nbytes - pos)
        reader.readinto(a, pos, buf_a[:n])
        reader.readinto(b, pos, buf_b[:n])
        if buf_a[:n] != buf_b[:n]:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# planning: validate everything, then lay out output shards
# ---------------------------------------------------------------------------------------------


@dataclass
class _Planned:
    entry: _Entry
    out_dtype: str
    out_nbytes: int


def _validate_and_order(
    source: _Source, model_config: Mapping[str, Any], out_code: str | None, reader: _Reader
) -> tuple[list[_Planned], list[str]]:
    """Output tensors in model order plus the keys dropped as tied duplicates.

    Collects every problem before raising so one run reports them all; nothing is written until
    the whole plan is valid.
    """
    family, config = _family(model_config)
    expected = expected_tensors(model_config)
    tied = tied_keys(model_config)
    problems = list(source.problems)
    dropped: list[str] = []

    for key, entries in source.by_key.items():
        if len(entries) > 1:
            problems.append(f"duplicated key {key!r} in {' and '.join(e.file for e in entries)} (overlapping shards or stages)")
    for key in source.by_key:
        if key in expected:
            continue
        if key in tied:
            original = source.by_key.get(tied[key])
            if original and len(original) == 1 and len(source.by_key[key]) == 1:
                if _bitwise_equal(reader, source.by_key[key][0], original[0]):
                    dropped.append(key)  # the pp > 1 (or DDP-on-GPU) copy of a tied weight
                else:
                    problems.append(
                        f"{key!r} in {source.by_key[key][0].file} differs from {tied[key]!r} but config.json ties them "
                        f"(tie_word_embeddings=true): the tie was broken in training, or the config is wrong"
                    )
            continue
        hint = " (config.json has tie_word_embeddings=true, so no separate lm_head is expected)" if key in tied else ""
        problems.append(f"unexpected key {key!r} in {source.by_key[key][0].file}: not in the {config['model_type']} model config.json describes{hint}")
    for key in expected:
        if key not in source.by_key:
            hint = ""
            if key in family.tied and not config.get("tie_word_embeddings"):
                hint = " (config.json has tie_word_embeddings=false; was the model trained with tied embeddings?)"
            problems.append(f"missing key {key!r}: no input file holds it{hint}")

    planned: list[_Planned] = []
    floating: dict[str, list[str]] = {}
    for key, want in expected.items():
        entries = source.by_key.get(key)
        if not entries:
            continue
        e = entries[0]
        if e.shape != want:
            cause = _shape_cause(key, e.shape, want, family)
            problems.append(f"{key!r} in {e.file} has shape {list(e.shape)}, config.json implies {list(want)}: {cause}")
            continue
        code = e.dtype
        if e.dtype in _FLOATING:
            floating.setdefault(e.dtype, []).append(key)
            code = out_code or e.dtype
        planned.append(_Planned(e, code, math.prod(e.shape) * _itemsize(code)))
    if out_code is None and len(floating) > 1:
        mix = "; ".join(f"{c}: {len(ks)} tensors, e.g. {ks[0]!r}" for c, ks in sorted(floating.items()))
        problems.append(f"mixed floating dtypes ({mix}): pass dtype= to cast them to one")

    if problems:
        shown = problems[:_MAX_PROBLEMS_SHOWN]
        more = len(problems) - len(shown)
        lines = [f"cannot convert {source.root} ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"]
        lines += [f"  - {p}" for p in shown] + ([f"  ... and {more} more"] if more else [])
        raise ConversionError("\n".join(lines))
    return planned, dropped


def plan_shards(sizes: Iterable[int], budget: int) -> list[list[int]]:
    """Group consecutive item indexes into shards of at most `budget` bytes (a bigger item alone)."""
    shards: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        if current and used + size > budget:
            shards.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        shards.append(current)
    return shards


def shard_name(k: int, n: int) -> str:
    """transformers' naming: one shard is `model.safetensors`, else `model-0000K-of-0000N.safetensors`."""
    return SAFE_WEIGHTS_NAME if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"


# ---------------------------------------------------------------------------------------------
# writing: each file once, hashed on the way out
# ---------------------------------------------------------------------------------------------


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # Linux (glibc, musl)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait
_WRITEBACK_STEP = 64 << 20


class _HashingWriter:
    """Writes one file under a temporary name, hashing the same bytes in a helper thread.

    hashlib releases the GIL on large updates, so with a ring of buffers the hash of chunk i
    runs while chunk i+1 is read and written. A buffer is reused only after its hash finished.
    With `fsync`, writeback of every 64 MiB written is started at once (sync_file_range), so the
    disk writes while the rest is converted and the final fsync waits only for the tail, instead
    of the whole file sitting dirty in the page cache until then.
    """

    def __init__(self, path: Path, hasher: ThreadPoolExecutor, ring: list[memoryview], fsync: bool):
        self.path = path
        self._tmp = path.with_name(path.name + ".tmp")
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._hash = hashlib.sha256()
        self._hasher = hasher
        self._ring = ring
        self._pending: list[Future | None] = [None] * len(ring)
        self._slot = 0
        self._fsync = fsync
        self._writeback = _SYNC_FILE_RANGE if fsync else None
        self._written_back = 0
        self.size = 0

    def buffer(self) -> memoryview:
        """The next ring buffer, once the hasher is done with its previous contents."""
        self._slot = (self._slot + 1) % len(self._ring)
        fut = self._pending[self._slot]
        if fut is not None:
            fut.result()
        return self._ring[self._slot]

    def write(self, data: memoryview | bytes, slot: bool = True) -> None:
        """Write `data` (a slice of the last `buffer()` if `slot`, else immutable bytes)."""
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])
        fut = self._hasher.submit(self._hash.update, view)  # one worker: updates stay in order
        if slot:
            self._pending[self._slot] = fut
        self.size += len(view)
        if self._writeback is not None and self.size - self._written_back >= _WRITEBACK_STEP:
            if self._writeback(self._fd, self._written_back, self.size - self._written_back, _SYNC_FILE_RANGE_WRITE) != 0:
                self._writeback = None  # not supported here (some FUSE/network filesystems): fsync alone
            self._written_back = self.size

    def close(self) -> str:
        """Finish the hash, make the file durable and give it its final name; returns sha256."""
        self._hasher.submit(lambda: None).result()
        self._pending = [None] * len(self._ring)
        if self._fsync:
            os.fsync(self._fd)
        os.close(self._fd)
        os.replace(self._tmp, self.path)
        return self._hash.hexdigest()

    def abort(self) -> None:
        self._hasher.submit(lambda: None).result()
        os.close(self._fd)
        self._tmp.unlink(missing_ok=True)


def _shard_workers(requested: int | None, shards: int) -> int:
    """Output shards written at once: each has its own sha256 stream, the one part that does
    not parallelise within a file (about 1.4 GB/s a core), and its own 4 x 16 MiB ring."""
    auto = min(_MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return max(1, min(requested or auto, shards))


def _buffer(size: int) -> memoryview:
    """A zeroed buffer the kernel backs with huge pages where it can: faulting in 4 x 16 MiB of
    4 KiB pages costs ~30 ms a ring, 2 MiB pages almost nothing."""
    buf = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return memoryview(buf)


class _ShardContext:
    """One shard writer's ring, cast scratch and sha256 thread, reused for every shard it writes."""

    def __init__(self) -> None:
        self.ring = [_buffer(_CHUNK) for _ in range(_RING)]
        self.scratch: list[memoryview] = []
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")

    def close(self) -> None:
        self.hasher.shutdown(wait=True)


def _write_shard(path: Path, items: list[_Planned], reader: _Reader, fsync: bool, cancel: threading.Event, ctx: _ShardContext) -> dict[str, Any]:
    """Write one output shard (header, then its tensors in order); returns its size and sha256."""
    out = _HashingWriter(path, ctx.hasher, ctx.ring, fsync)
    try:
        out.write(_safetensors_header(items), slot=False)
        for p in items:
            _copy_tensor(p, reader, out, ctx.scratch, cancel)
        sha = out.close()
    except BaseException:
        out.abort()
        raise
    return {"size": out.size, "sha256": sha}


def _write_shards(jobs: list[tuple[Path, list[_Planned]]], reader: _Reader, fsync: bool, workers: int) -> dict[str, dict[str, Any]]:
    """Write every shard, `workers` at a time; on the first failure the others stop and remove
    their partial files, and that failure is raised. Returns {file name: {size, sha256}}."""
    cancel = threading.Event()
    contexts: queue.SimpleQueue[_ShardContext] = queue.SimpleQueue()
    owned = [_ShardContext() for _ in range(workers)]
    for ctx in owned:
        contexts.put(ctx)

    def one(path: Path, items: list[_Planned]) -> dict[str, Any]:
        ctx = contexts.get()  # as many contexts as threads: never waits
        try:
            return _write_shard(path, items, reader, fsync, cancel, ctx)
        finally:
            contexts.put(ctx)

    try:
        if workers == 1:
            return {path.name: one(path, items) for path, items in jobs}
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard") as pool:
            futures = [pool.submit(one, path, items) for path, items in jobs]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                cancel.set()
                for f in futures:
                    f.cancel()
                wait(futures)
                raise failed.exception()
        return {path.name: f.result() for (path, _), f in zip(jobs, futures)}
    finally:
        for ctx in owned:
            ctx.close()


def _safetensors_header(items: list[_Planned]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in items:
        header[p.entry.key] = {"dtype": p.out_dtype, "shape": list(p.entry.shape), "data_offsets": [offset, offset + p.out_nbytes]}
        offset += p.out_nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the reference writer pads to 8 so tensor data stays aligned
    return struct.pack("<Q", len(blob)) + blob


class _Cancelled(Exception):
    """Another shard writer failed; this one stops and removes its partial file."""


def _copy_tensor(p: _Planned, reader: _Reader, out: _HashingWriter, scratch: list[memoryview], cancel: threading.Event) -> None:
    e = p.entry
    if p.out_dtype == e.dtype:
        for pos in range(0, e.nbytes, _CHUNK):
            if cancel.is_set():
                raise _Cancelled()
            n = min(_CHUNK, e.nbytes - pos)
            buf = out.buffer()[:n]
            reader.readinto(e, pos, buf)
            out.write(buf)
        return
    # cast chunk by chunk: read source elements into scratch, cast-copy straight into the ring buffer
    if not scratch:  # allocated on the first cast only: a plain copy never needs it
        scratch.append(_buffer(_CHUNK))
    src_dt, dst_dt = ST_TO_TORCH[e.dtype], ST_TO_TORCH[p.out_dtype]
    step = _CHUNK // max(src_dt.itemsize, dst_dt.itemsize)  # elements per chunk
    numel = math.prod(e.shape)
    for first in range(0, numel, step):
        if cancel.is_set():
            raise _Cancelled()
        count = min(step, numel - first)
        src_view = scratch[0][: count * src_dt.itemsize]
        reader.readinto(e, first * src_dt.itemsize, src_view)
        buf = out.buffer()[: count * dst_dt.itemsize]
        torch.frombuffer(buf, dtype=dst_dt).copy_(torch.frombuffer(src_view, dtype=src_dt))
        out.write(buf)


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


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
    (torch_dtype updated) and the source's generation_config.json are written too. `workers`
    output shards are written at once (default: one per CPU, at most 4); the files are the same
    byte for byte whatever the number.
    """
    started = time.perf_counter()
    src, dst = Path(src_dir), Path(dst_dir)
    out_code = _st_dtype(dtype)
    budget = parse_size(max_shard_size)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ConversionError(f"workers={workers!r}: must be an int >= 1, or None for one per CPU (at most {_MAX_WORKERS})")
    if dst.exists() and src.resolve() == dst.resolve():
        raise ConversionError(f"{dst}: destination is the source directory; convert into a new directory")

    source = _scan_source(src, allow_pickle)
    reader = _Reader(src)
    try:
        planned, dropped = _validate_and_order(source, model_config, out_code, reader)
        shards = plan_shards((p.out_nbytes for p in planned), budget)
        names = [shard_name(k + 1, len(shards)) for k in range(len(shards))]

        dst.mkdir(parents=True, exist_ok=True)
        _remove_stale_outputs(dst, keep=set(names) | ({SAFE_INDEX_NAME} if len(names) > 1 else set()))
        jobs = [(dst / name, [planned[i] for i in members]) for name, members in zip(names, shards)]
        files = _write_shards(jobs, reader, fsync, _shard_workers(workers, len(jobs)))
    finally:
        reader.close()

    total_bytes = sum(p.out_nbytes for p in planned)
    if len(names) > 1:
        weight_map = {p.entry.key: name for name, members in zip(names, shards) for p in (planned[i] for i in members)}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        files[SAFE_INDEX_NAME] = _write_small(dst / SAFE_INDEX_NAME, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode(), fsync)

    out_codes = sorted({p.out_dtype for p in planned if p.out_dtype in _FLOATING})
    assert out_code is None or out_codes == [out_code], f"planned dtypes {out_codes} != requested {out_code}"
    label = _ST_LABEL.get(out_codes[0], out_codes[0]) if len(out_codes) == 1 else "none"
    if write_config:
        # "_"-prefixed entries are runtime state that `PretrainedConfig.to_dict()` leaks; written
        # back, `_attn_implementation_autoset` would pin the loader to eager attention
        config = {k: v for k, v in model_config.items() if not k.startswith("_")}
        if len(out_codes) == 1 and out_codes[0] in _ST_CONFIG_DTYPE:
            config["torch_dtype"] = _ST_CONFIG_DTYPE[out_codes[0]]
        files[CONFIG_NAME] = _write_small(dst / CONFIG_NAME, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(), fsync)
        if (src / GENERATION_CONFIG_NAME).is_file():
            blob = (src / GENERATION_CONFIG_NAME).read_bytes()
            files[GENERATION_CONFIG_NAME] = _write_small(dst / GENERATION_CONFIG_NAME, blob, fsync)

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


def _write_small(path: Path, blob: bytes, fsync: bool) -> dict[str, Any]:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(blob)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}


def load_state_dict_from_dir(directory: str | Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory in any layout above (for tests and fingerprints).

    Loads everything into memory: for small models only. Refuses duplicated keys.
    """
    source = _scan_source(Path(directory), allow_pickle)
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
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.core.convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("src_dir")
    ap.add_argument("dst_dir")
    ap.add_argument("--config", help="config.json to validate against (default: SRC_DIR/config.json)")
    ap.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), default=None)
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--allow-pickle", action="store_true")
    ap.add_argument("--no-fsync", action="store_true")
    ap.add_argument("--workers", type=int, default=None, help="output shards written at once (default: one per CPU, at most 4)")
    args = ap.parse_args(argv)
    config_path = Path(args.config or Path(args.src_dir) / CONFIG_NAME)
    try:
        model_config = json.loads(config_path.read_text())
        report = convert_checkpoint(
            args.src_dir, args.dst_dir, model_config=model_config, dtype=args.dtype,
            max_shard_size=args.max_shard_size, allow_pickle=args.allow_pickle, fsync=not args.no_fsync,
            workers=args.workers,
        )  # fmt: skip
    except (ConversionError, OSError) as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report.summary(), indent=2))
    print(f"{report.total_bytes / 1e9:.3f} GB in {report.seconds:.2f} s = {report.throughput_gbps:.2f} GB/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
