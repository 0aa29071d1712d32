"""dtypes, sizes and file names (spelled in tasks.core.models.folder) of the formats the converter reads and writes (tables, so adding one is a line).

python -c "from tasks.core.models.convert.dtypes import parse_size; print(parse_size('5GB'))"
"""

from __future__ import annotations

import re

import torch

from tasks.core.errors import ConversionError
from tasks.core.models.folder import (  # noqa: F401 (the converter's modules read the file names from here)
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    PICKLE_INDEX_NAME,
    PICKLE_WEIGHTS_NAME,
    SAFE_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
)

# I/O unit: large enough for disk speed, small enough to keep RSS flat. Readers and writers look
# it up here at call time (`dtypes.CHUNK`), so one setting governs every copy and comparison.
CHUNK = 16 << 20

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
FLOATING = frozenset(code for code, dt in ST_TO_TORCH.items() if dt.is_floating_point)

# user-facing dtype names -> safetensors code; the label is what reports and config.json show
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "F32", "float32": "F32",
    "bf16": "BF16", "bfloat16": "BF16",
    "fp16": "F16", "float16": "F16", "half": "F16",
}  # fmt: skip
ST_LABEL = {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "F64": "fp64"}
ST_CONFIG_DTYPE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}

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


def st_dtype(dtype: str | torch.dtype | None) -> str | None:
    """The safetensors code of a user-facing dtype name or torch dtype (None stays None)."""
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


def itemsize(code: str) -> int:
    """Bytes per element of a safetensors dtype code."""
    return ST_TO_TORCH[code].itemsize
