"""A process's host-memory peak over a span, from Linux /proc: what the engine logs for building a
rank's model and what the benchmarks report for the work they time.

    python -c "from tasks.core.run.hostpeak import HostPeak; p = HostPeak(); b = bytearray(1 << 28); print(p.added())"

Torch-free on purpose: a benchmark's worker imports it before its RSS baseline without the import
itself weighing on what is measured.
"""

from __future__ import annotations

from pathlib import Path


def status_bytes(field: str) -> int | None:
    """This process's /proc/self/status `field` (VmRSS, VmHWM) in bytes; None where /proc lacks it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class HostPeak:
    """This rank's host-memory peak over a span: VmHWM reset to the current RSS at the start
    (/proc/self/clear_refs 5), read at the end; `added` is None where /proc has neither."""

    def __init__(self):
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.start = status_bytes("VmRSS")
        except OSError:
            self.start = None

    def added(self) -> tuple[int, int] | None:
        """(peak - start, start) in bytes."""
        peak = status_bytes("VmHWM")
        return None if peak is None or self.start is None else (peak - self.start, self.start)
