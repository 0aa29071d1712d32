"""Read TensorBoard event files back: {tag: [(step, value), ...]} from every file under a logdir.

    python -m tasks.core.run.tbevents runs/tiny-cpu/cpt/tensorboard      # prints points per tag

The event format is TFRecord framing (length, masked CRC32C of the length, the `Event` protobuf,
masked CRC32C of the data) around tensorboardX's own `event_pb2`, so no TensorFlow and no
`tensorboard` package is needed to check what the training ranks wrote. A record whose CRC does not
match is an error naming the file and offset, not a silently skipped point.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

from tasks.core.errors import ManifestError


def _crc32c(data: bytes) -> int:
    from tensorboardX.crc32c import crc32c

    return crc32c(data)


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path: Path):
    data = Path(path).read_bytes()
    pos = 0
    while pos < len(data):
        if pos + 12 > len(data):
            raise ManifestError(f"{path}: truncated record header at byte {pos}")
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        if _masked(_crc32c(header)) != hcrc:
            raise ManifestError(f"{path}: length CRC mismatch at byte {pos}")
        body = data[pos + 12 : pos + 12 + length]
        (bcrc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        if _masked(_crc32c(body)) != bcrc:
            raise ManifestError(f"{path}: data CRC mismatch at byte {pos}")
        yield body
        pos += 16 + length


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of every event file under `logdir`, per tag sorted by step. A resumed stage opens its
    file with a SessionLog START at the first step it trains again (tensorboardX `purge_step`):
    as in TensorBoard, every earlier point at or after that step is dropped."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    out: dict[str, dict[int, float]] = {}
    for path in sorted(Path(logdir).rglob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime, p.name)):
        for body in records(path):
            ev = Event.FromString(body)
            if ev.HasField("session_log") and ev.session_log.status == SessionLog.START:
                for points in out.values():
                    for step in [s for s in points if s >= ev.step]:
                        del points[step]
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, {})[int(ev.step)] = float(v.simple_value)
    return {tag: sorted(points.items()) for tag, points in sorted(out.items())}


if __name__ == "__main__":
    for tag, points in read_scalars(sys.argv[1]).items():
        print(f"{tag}: {len(points)} points, steps {points[0][0]}..{points[-1][0]}, last {points[-1][1]:.6g}")
