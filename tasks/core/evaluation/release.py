"""One model at a time in the flow process: a model read without a second copy, and its memory
given back before the next one loads.

    python -m tasks.core.evaluation.release      # whether this C library has malloc_trim (glibc)

`load_on_cpu` builds a CPU model holding one copy of its weights: `read_state_dict` reads each
safetensors tensor with plain reads into a tensor of the evaluation dtype, and the module tree,
built on the meta device, is assigned them. transformers' own loader maps each shard: a tensor
already in the evaluation dtype is used in place (its file pages become resident as it is read),
but one in another dtype (a bf16 export scored in fp32 on CPU) is copied out while the mapped
shard's pages stay resident until it closes. Measured on a 159M-parameter Llama (0.64 GB in fp32)
stored in bf16, loaded in fp32 and run once: 0.95 GB over the process's resident set that way,
0.66-0.69 GB this way (tests/test_eval_memory.py holds every evaluation to the model + 0.5 GB).

`release`, once the caller dropped a model, collects only if something still holds it (accelerate's
dispatch hooks and lm-eval's wrapper form reference cycles; a full pass costs seconds in a
long-lived process) and asks glibc to hand the freed heap back (`malloc_trim`), so the next model
is not counted on top of the last one's pages.
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


_ST_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def read_state_dict(model_dir: str | Path, dtype) -> dict:
    """Every tensor of the folder's safetensors files, floating ones cast to `dtype` (a torch dtype),
    each read alone from its file (no mapping): a tensor already in `dtype` is read straight into
    its own storage, one to convert through a single scratch buffer, so nothing but the results is
    allocated and freed holes do not grow the heap. The peak is the result plus the scratch."""
    import torch

    out, scratch = {}, torch.empty(0, dtype=torch.uint8)
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb", buffering=0) as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
            header.pop("__metadata__", None)
            for name, info in header.items():
                start, end = info["data_offsets"]
                stored = getattr(torch, _ST_DTYPES[info["dtype"]])
                fh.seek(8 + size + start)
                if not stored.is_floating_point or stored == dtype:
                    t = torch.empty(info["shape"], dtype=stored)
                    fh.readinto(memoryview(t.view(-1).view(torch.uint8).numpy()))
                else:
                    if scratch.numel() < end - start:
                        scratch = torch.empty(end - start, dtype=torch.uint8)
                    fh.readinto(memoryview(scratch[: end - start].numpy()))
                    t = scratch[: end - start].view(stored).reshape(info["shape"]).to(dtype)
                out[name] = t
    return out


def load_on_cpu(model_dir: str | Path, dtype, trust_remote_code: bool = False):
    """The HF folder's causal LM on the CPU in `dtype` holding one copy of its weights: the module
    tree built with its parameters on the meta device (accelerate's init_empty_weights; buffers
    real), then each parameter assigned the tensor `read_state_dict` read, tied ones tied."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
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
    print(
        f"malloc_trim: {'available (glibc)' if trim() or ctypes.util.find_library('c') else 'not available'}; rss "
        f"{rss_bytes() / 1e6:.0f} MB"
    )
