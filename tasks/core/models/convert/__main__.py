"""Streaming conversion of a sharded model checkpoint to an HF-standard safetensors directory.

    python -m tasks.core.models.convert SRC_DIR DST_DIR [--dtype bf16] [--max-shard-size 5GB] [--config FILE]

Prints the conversion summary as JSON on stdout and the throughput on stderr; exit status 1 with
the reason on stderr when the checkpoint cannot be converted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tasks.core.errors import ConversionError
from tasks.core.models.convert.api import convert_checkpoint
from tasks.core.models.convert.dtypes import CONFIG_NAME, DTYPE_ALIASES


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.core.models.convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("src_dir")
    ap.add_argument("dst_dir")
    ap.add_argument("--config", help="config.json to validate against (default: SRC_DIR/config.json)")
    ap.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), default=None)
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--allow-pickle", action="store_true")
    ap.add_argument("--no-fsync", action="store_true")
    ap.add_argument(
        "--workers", type=int, default=None, help="output shards written at once (default: one per CPU, at most 4)"
    )
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
    print(
        f"{report.total_bytes / 1e9:.3f} GB in {report.seconds:.2f} s = {report.throughput_gbps:.2f} GB/s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
