"""What pre-flight knows before anything is loaded: the machine, and the base model's metadata
(config.json, tokenizer_config.json and the file list; never weights), and the parameter count
the staging-space estimate is built on.

    python -c "from tasks.core.preflight.model_info import read_model_info; print(read_model_info('build/demo-inputs/tiny-llama').config['model_type'])"
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsspec.core import url_to_fs

from tasks.core.config.paths import missing_hint, resolve_local
from tasks.core.errors import ConfigError
from tasks.core.hub.repo import is_hub_id
from tasks.core.storage.fs import is_local

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class Machine:
    """Facts about this machine; `detect()` reads them, tests pass their own."""

    cuda_devices: int
    cpu_count: int
    free_bytes: int | None = None  # None: shutil.disk_usage of the staging location
    gpu_memory_bytes: int | None = None  # the smallest visible GPU's memory; None: no GPU, or NVML could not tell
    # host memory (`host_memory`): what this machine's processes can ever hold, and what is free of others' now;
    # None: not known (and not checked)
    host_memory_bytes: int | None = None
    host_available_bytes: int | None = None

    @classmethod
    def detect(cls) -> Machine:
        from tasks.core.config.kernels import cuda_available

        host, available = host_memory()
        if not cuda_available():  # decided without torch where there is no GPU device node
            return cls(
                cuda_devices=0, cpu_count=os.cpu_count() or 1, host_memory_bytes=host, host_available_bytes=available
            )
        import torch  # lazily: config-only callers should not pay for it

        n = torch.cuda.device_count()
        return cls(
            cuda_devices=n,
            cpu_count=os.cpu_count() or 1,
            gpu_memory_bytes=_nvml_memory(n) if n else None,
            host_memory_bytes=host,
            host_available_bytes=available,
        )


def _kernel_number(path: str, field: str | None = None) -> int | None:
    """A number from a small kernel file: `field`'s value in kB (/proc/meminfo), else the file's one number
    (cgroup's memory.max; "max" means no limit). None where the file or the value is missing."""
    try:
        text = Path(path).read_text()[:65536]
    except OSError:
        return None
    if field is None:
        word = text.strip()
        return int(word) if word.isdigit() else None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == field and rest.split() and rest.split()[0].isdigit():
            return int(rest.split()[0]) * 1024
    return None


def host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of host memory for this process's tree. Total: MemTotal, or the cgroup's
    limit where it is lower (a container); available: MemAvailable (free plus reclaimable cache), the cgroup's
    room where that is lower. Swap is not counted: a rank paging its optimizer state does not finish."""
    total, available = _kernel_number("/proc/meminfo", "MemTotal"), _kernel_number("/proc/meminfo", "MemAvailable")
    limit = _kernel_number("/sys/fs/cgroup/memory.max") or _kernel_number("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    used = _kernel_number("/sys/fs/cgroup/memory.current") or _kernel_number(
        "/sys/fs/cgroup/memory/memory.usage_in_bytes"
    )
    if limit and total and limit < total:
        total = limit
        if used is not None:
            available = min(available or limit, max(0, limit - used))
    return total, available


def _nvml_memory(count: int) -> int | None:
    """The smallest total memory of the visible GPUs, from NVML (the driver's library, through
    ctypes like torch's own NVML device count): no CUDA context is created in this process, which
    would hold GPU memory for as long as the worker lives. None when NVML cannot answer."""
    import ctypes

    import torch

    class _Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        totals = []
        for i in range(count):
            handle, mem = ctypes.c_void_p(), _Memory()
            index = torch.cuda._get_nvml_device_index(i)  # CUDA_VISIBLE_DEVICES order -> NVML's
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) or nvml.nvmlDeviceGetMemoryInfo(
                handle, ctypes.byref(mem)
            ):
                return None
            totals.append(int(mem.total))
        return min(totals) if totals else None
    except (
        OSError,
        AttributeError,
        RuntimeError,
        ValueError,
    ):  # no driver library, an older torch, an unparsable CUDA_VISIBLE_DEVICES
        return None


@dataclass
class ModelInfo:
    """What pre-flight reads of the base model: no weights."""

    source: str  # "local", "fsspec" or "hub"
    where: str  # the resolved path/URI or repo@revision, for messages
    config: dict[str, Any]
    files: list[str]  # top-level file names
    tokenizer_config: dict[str, Any] | None = None
    chat_template_file: bool = False  # chat_template.jinja beside the tokenizer (which reads it)


def read_model_info(uri: str, revision: str = "main") -> ModelInfo:
    """config.json, tokenizer_config.json and the file list of a local/fsspec dir or Hub repo.

    Raises ConfigError naming `base_model.uri` when there is no readable config.json.
    """
    if is_hub_id(uri):
        return _read_hub(uri, revision)
    target = resolve_local(uri)
    try:
        fs, root = url_to_fs(target)
    except (ValueError, ImportError) as exc:
        raise ConfigError(
            [
                (
                    "base_model.uri",
                    (
                        f"{uri}: cannot open ({exc}); use a local path, an fsspec URI with its filesystem installed, or a "
                        "Hub id org/name"
                    ),
                )
            ]
        ) from None
    root = root.rstrip("/")
    try:
        has_config = fs.isfile(f"{root}/config.json")
    except Exception as exc:  # network filesystems raise their own errors
        raise ConfigError([("base_model.uri", f"{uri}: not reachable ({type(exc).__name__}: {exc})")]) from None
    if not has_config:
        what = (
            f"does not exist{missing_hint(fs, root)}"
            if not fs.exists(root)
            else "is not an HF model directory (no config.json)"
        )
        if fs.exists(root) and (refusal := _gguf_only(fs, root, target)):
            raise ConfigError([("base_model.uri", refusal)])
        raise ConfigError(
            [
                (
                    "base_model.uri",
                    (
                        f"{target} {what}; point base_model.uri at an HF model directory or a Hub id org/name (for the "
                        f"demo: `python -m tasks.core.models.demo --out {uri}`)"
                    ),
                )
            ]
        )

    def read_json(name: str) -> dict | None:
        path = f"{root}/{name}"
        if not fs.isfile(path):
            return None
        try:
            with fs.open(path, "rb") as f:
                data = json.loads(f.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError([("base_model.uri", f"{target}/{name} is not valid JSON ({exc})")]) from None
        return data if isinstance(data, dict) else None

    config = read_json("config.json") or {}
    files = sorted(Path(p.rstrip("/")).name for p in fs.ls(root, detail=False))
    return ModelInfo(
        source="local" if is_local(target) else "fsspec",
        where=target,
        config=config,
        files=files,
        tokenizer_config=read_json("tokenizer_config.json"),
        chat_template_file="chat_template.jinja" in files,  # the tokenizer never reads chat_template.json
    )


def _read_hub(repo: str, revision: str) -> ModelInfo:
    from huggingface_hub import HfApi, hf_hub_download

    def fetch(name: str) -> dict | None:
        try:
            with open(hf_hub_download(repo, name, revision=revision)) as f:
                return json.load(f)
        except Exception as exc:  # network, HTTP, auth and JSON errors all mean the same here: unreadable
            if name == "config.json":
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                raise ConfigError(
                    [
                        (
                            "base_model.uri",
                            (
                                f"cannot read config.json of Hub repo {repo}@{revision} ({type(exc).__name__}: "
                                f"{first_line}); "
                                "check the id and revision, the network, and HF_TOKEN for gated repos"
                            ),
                        )
                    ]
                ) from None
            return None

    try:
        config = fetch("config.json") or {}
    except ConfigError:
        try:  # a GGUF-only repo has no config.json: say so, and the conversion that runs it
            listed = HfApi().list_repo_files(repo, revision=revision)
        except Exception:  # the config.json refusal below says what to check
            listed = []
        from tasks.core.models.shapes import gguf_files, gguf_refusal

        if gguf_files(f for f in listed if "/" not in f):
            raise ConfigError([("base_model.uri", gguf_refusal(f"{repo}@{revision}", listed))]) from None
        raise
    try:
        files = sorted(f for f in HfApi().list_repo_files(repo, revision=revision) if "/" not in f)
    except Exception as exc:  # any Hub client error becomes a problem naming base_model.uri
        raise ConfigError(
            [("base_model.uri", f"cannot list the files of Hub repo {repo}@{revision} ({type(exc).__name__})")]
        ) from None
    return ModelInfo(
        source="hub",
        where=f"{repo}@{revision}",
        config=config,
        files=files,
        tokenizer_config=fetch("tokenizer_config.json") if "tokenizer_config.json" in files else None,
        chat_template_file="chat_template.jinja" in files,  # the tokenizer never reads chat_template.json
    )


def _gguf_only(fs, root: str, target: str) -> str | None:
    """A folder with no config.json whose weights are GGUF: the refusal naming the conversion."""
    from tasks.core.models.shapes import gguf_files, gguf_refusal

    try:
        names = [Path(p.rstrip("/")).name for p in fs.ls(root, detail=False)]
    except Exception:  # a listing the filesystem refuses: the no-config.json refusal stands
        return None
    if not gguf_files(names):
        return None
    return gguf_refusal(target, names, Path(root) if is_local(target) else None)


def estimate_parameters(mc: dict[str, Any]) -> int | None:
    """Parameter count from config.json through its family's tensor table (`tasks.core.models.families`),
    the table the converter checks checkpoints against; None for an unknown family or missing dims."""
    from tasks.core.errors import ConversionError
    from tasks.core.models.families import count_parameters

    try:
        return count_parameters(mc)
    except (ConversionError, KeyError, TypeError, ValueError):
        return None
