"""One model at a time in the flow process: a model read without a second copy, and its memory
given back before the next one loads.

    python -m tasks.core.evaluation.release      # whether this C library has malloc_trim (glibc)

`read_state_dict` reads an HF folder's safetensors tensors one at a time with plain reads into
tensors of the evaluation dtype, for `from_pretrained(None, config=..., state_dict=...)`:
transformers' own loader maps a whole shard and copies each tensor out of it, so until the shard
closes the file's pages and the copies are both resident (measured: a 0.64 GB fp32 Llama peaked
0.97 GB over the process's start while loading and scoring two such models one after the other).

Every evaluation (held-out loss, the generation check, the benchmark) loads one model, scores it
and drops it before the next: `release` runs the collector only when something still holds the
model (accelerate's dispatch hooks and lm-eval's wrapper form reference cycles), then asks glibc to
hand the freed heap back to the OS (`malloc_trim`): a model's tensors under glibc's mmap threshold
(32 MiB once a mapped block has been freed) come from the heap, which is otherwise kept by the
process after they are freed, and the next model's RSS is counted on top of it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import struct
import weakref
from pathlib import Path


def trim() -> bool:
    """glibc's malloc_trim(0): freed heap pages back to the OS; False where the C library lacks it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def release(gone: weakref.ref | None = None) -> None:
    """After the caller dropped its last name for a model (`gone`: a weak reference to it): collect
    if it is still alive (a full pass costs seconds in a long-lived process, so only then), give the
    heap back, and empty the CUDA cache."""
    if gone is None or gone() is not None:
        gc.collect()
    trim()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64", "I32": "int32", "I16": "int16",
              "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def read_state_dict(model_dir: str | Path, dtype) -> dict:
    """Every tensor of the folder's safetensors files, floating ones cast to `dtype` (a torch dtype),
    each read alone from its file (no mapping), so the peak is the result plus one tensor."""
    import torch

    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb", buffering=0) as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                raw = torch.empty(end - start, dtype=torch.uint8)
                fh.seek(8 + size + start)
                fh.readinto(memoryview(raw.numpy()))
                t = raw.view(getattr(torch, _ST_DTYPES[info["dtype"]])).reshape(info["shape"])
                out[name] = t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
                del raw, t
    return out


def load_on_cpu(model_dir: str | Path, dtype, trust_remote_code: bool = False):
    """The HF folder's causal LM on the CPU in `dtype` holding one copy of its weights: the module
    tree built with its parameters on the meta device (accelerate's init_empty_weights; buffers
    real), then each parameter assigned the tensor `read_state_dict` read, tied ones tied."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, trust_remote_code=trust_remote_code)
    model.load_state_dict(read_state_dict(model_dir, dtype), strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{model_dir}: no tensor for {missing[:5]} in its safetensors files")
    model.config._name_or_path = model.name_or_path = str(model_dir)
    return model


def rss_bytes() -> int:
    """This process's resident set now (Linux /proc), 0 elsewhere."""
    try:
        with open("/proc/self/statm") as fh:
            import os

            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


if __name__ == "__main__":
    print(f"malloc_trim: {'available (glibc)' if trim() or ctypes.util.find_library('c') else 'not available'}; rss {rss_bytes() / 1e6:.0f} MB")
