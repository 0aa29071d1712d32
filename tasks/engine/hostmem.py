"""While a rank builds its model, glibc hands large freed blocks back to the OS at once.

    python -m tasks.engine.hostmem        # whether this C library takes mallopt (glibc), and the thresholds set

Building a sharded model allocates and frees whole tensors one after another: shardformer
materializes each lazily built weight whole and keeps its slice, and the weight loader
(tasks/engine/weights.py) reads each tensor whole and keeps its slice. glibc serves a block under
its mmap threshold from the heap and raises that threshold (up to 32 MiB) whenever a mapped block
is freed, so after the first freed tensor the next whole tensors come from the heap, and the holes
they leave are reused only in part: measured on a 102M Llama at tp=2 (fp32, 0.20 GB share, largest
tensor 16 MiB), the rank's construction peak was 0.25-0.28 GB over its start with the default
behaviour and 0.23-0.25 GB with every block over 1 MiB mapped on its own (the peak then is the
share plus the tensor in hand). On CUDA the weights materialize on the device; the host side is the
loader's one tensor at a time, which this keeps from piling up in the heap either.

`large_blocks_mapped()` sets M_MMAP_THRESHOLD to 1 MiB for the span, then to 32 MiB, the ceiling
glibc's own adjustment would reach (setting it once turns that adjustment off), with the trim
threshold at twice that, as glibc pairs them. Without glibc (mallopt missing) it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
DURING = 1 << 20
AFTER = 32 << 20


def _mallopt():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.mallopt
    except (OSError, AttributeError):
        return None


def _set(mmap_threshold: int) -> bool:
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, 2 * mmap_threshold))


@contextlib.contextmanager
def large_blocks_mapped() -> Iterator[bool]:
    """Blocks of 1 MiB and more mapped on their own (and unmapped when freed) for the span;
    yields whether the C library took the setting."""
    took = _set(DURING)
    try:
        yield took
    finally:
        if took:
            _set(AFTER)


if __name__ == "__main__":
    with large_blocks_mapped() as took:
        print(
            f"mallopt: {'glibc took M_MMAP_THRESHOLD' if took else 'not available: nothing changes'}; "
            f"{DURING >> 20} MiB during the span, {AFTER >> 20} MiB after"
        )
