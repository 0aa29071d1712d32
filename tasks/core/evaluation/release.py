"""Giving a model's memory back before the next one loads: one model at a time in the flow process.

    python -m tasks.core.evaluation.release      # whether this C library has malloc_trim (glibc)

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
import weakref


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
