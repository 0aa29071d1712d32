"""The exact weight proof: every exported tensor is the checkpoint's tensor cast to the export dtype, bitwise.

    python -m tasks.core.models.convert.proof CHECKPOINT_MODEL_DIR EXPORT_DIR bf16   # prints the proof or the failure

Both sides are read with the `safetensors` library itself, not with the converter's own header
parser and writer, so a bug in the converter (a mis-mapped key, a wrong offset, a bad cast) cannot
hide behind the code that made it. The checkpoint side is cast with `torch.Tensor.to` (round to
nearest even), which is what `save_pretrained` of a model loaded in that dtype would write. Each
side is reduced to one sha256 per tensor, streamed one tensor at a time, so memory stays at one
tensor; a mismatch is then explained: the checkpoint tensor the exported bytes really are (a
swapped pair of layers), or how many elements differ and where (a flipped bit).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasks.core.errors import ConversionError
from tasks.core.run import meter

_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SHOWN = 10


def tensor_files(directory: Path) -> dict[str, str]:
    """key -> file of a safetensors directory: the index's files when there is one, else every shard."""
    index = sorted(directory.glob("*.safetensors.index.json"))
    if index:
        return dict(json.loads(index[0].read_text())["weight_map"])
    from safetensors import safe_open

    out: dict[str, str] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update((k, path.name) for k in f.keys())  # noqa: SIM118 (safe_open has keys(), no __iter__)
    return out


def _tensors(directory: Path, files: dict[str, str], keys: Iterable[str]):
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for k in keys:
        by_file.setdefault(files[k], []).append(k)
    for name, ks in sorted(by_file.items()):
        for k in ks:
            # Opened per tensor: a mapped file's pages stay resident until it is closed, so one
            # `safe_open` over a whole file would hold every tensor read from it.
            with safe_open(str(directory / name), framework="pt") as f:
                yield k, f.get_tensor(k)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _digest(t: torch.Tensor) -> tuple[str, str, tuple[int, ...]]:
    return hashlib.sha256(_bytes(t)).hexdigest(), str(t.dtype).removeprefix("torch."), tuple(t.shape)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def prove_weights(
    checkpoint_dir: str | Path, export_dir: str | Path, dtype: str | None, dropped: Iterable[str] = ()
) -> dict[str, Any]:
    """Raise ConversionError naming every tensor that is not bitwise the cast checkpoint tensor.

    `dropped` are checkpoint keys the converter left out as bitwise copies of a tied weight.
    Returns {"tensors", "bytes", "dtype", "method"} for the verification record.
    """
    ckpt, export = Path(checkpoint_dir), Path(export_dir)
    torch_dtype = _TORCH.get(dtype) if dtype else None
    ckpt_files, export_files = tensor_files(ckpt), tensor_files(export)
    dropped = set(dropped)
    problems = [
        f"{k!r} is in the checkpoint but not in the export"
        for k in sorted(set(ckpt_files) - set(export_files) - dropped)
    ]
    problems += [
        f"{k!r} is in the export but not in the checkpoint" for k in sorted(set(export_files) - set(ckpt_files))
    ]
    progress = meter.meter(f"bitwise proof of {export.name}", len(ckpt_files) + len(export_files), "tensors read")
    tensors = progress.counted(_tensors(ckpt, ckpt_files, sorted(ckpt_files)))
    expected = {k: _digest(_cast(t, torch_dtype)) for k, t in tensors}
    got: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    total = 0
    for k, t in progress.counted(_tensors(export, export_files, sorted(export_files))):
        got[k] = _digest(t)
        total += t.numel() * t.element_size()
    progress.finish()
    owner = {v[0]: k for k, v in expected.items()}
    bad = [k for k in sorted(got) if k in expected and got[k] != expected[k]]
    for k in bad:
        problems.append(
            _explain(
                k, got[k], expected[k], owner, _Folder(ckpt, ckpt_files), _Folder(export, export_files), torch_dtype
            )
        )
    if problems:
        shown = problems[:_SHOWN] + ([f"... and {len(problems) - _SHOWN} more"] if len(problems) > _SHOWN else [])
        raise ConversionError(
            f"{export}: the exported weights are not the checkpoint's ({ckpt}) cast to {dtype or 'their own dtype'}, "
            "bitwise "
            f"({len(problems)} problem{'s' if len(problems) != 1 else ''}):\n"
            + "\n".join(f"  - {p}" for p in shown)
            + "\nthe export is corrupt or the conversion mis-mapped tensors: re-run the export stage and do not "
            "publish this folder"
        )
    return {
        "tensors": len(got),
        "bytes": total,
        "dtype": dtype,
        "method": "sha256 per tensor: export bytes == checkpoint tensor .to(dtype) bytes",
    }


@dataclass(frozen=True)
class _Folder:
    """A weights folder and its tensor files (key -> file), as `tensor_files` lists them."""

    directory: Path
    files: dict[str, str]

    def tensor(self, key: str) -> torch.Tensor:
        ((_, t),) = _tensors(self.directory, self.files, [key])
        return t


def _explain(key, got, want, owner, ckpt: _Folder, export: _Folder, torch_dtype) -> str:
    if got[1:] != want[1:]:
        return f"{key!r}: exported as {got[1]} {list(got[2])}, the checkpoint cast gives {want[1]} {list(want[2])}"
    if got[0] in owner:
        return f"{key!r} holds the checkpoint's {owner[got[0]]!r} (mis-mapped or swapped tensors)"
    a, b = export.tensor(key), _cast(ckpt.tensor(key), torch_dtype)
    differ = (
        a.reshape(-1).view(torch.uint8).reshape(a.numel(), -1) != b.reshape(-1).view(torch.uint8).reshape(b.numel(), -1)
    ).any(-1)
    where = differ.nonzero().flatten()
    first = int(where[0])
    return (
        f"{key!r}: {len(where)} of {a.numel()} elements differ from the checkpoint's bits, first at flat index {first} "
        f"(exported {a.reshape(-1)[first].item()!r}, checkpoint {b.reshape(-1)[first].item()!r})"
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print(
            "usage: python -m tasks.core.models.convert.proof CHECKPOINT_MODEL_DIR EXPORT_DIR [fp32|bf16|fp16]",
            file=sys.stderr,
        )
        return 2
    try:
        print(json.dumps(prove_weights(args[0], args[1], args[2] if len(args) == 3 else None)))
    except ConversionError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
