"""gpu_check's internal subcommands, each run in its own process by benchmarks/gpu_check.py.

    python benchmarks/gpu_check.py _env     # the versions and imports, as one @@env record

`_env` (versions, imports), `_kernels` (HybridAdam's JIT kernels built and stepped), `_build-model`
(the Llama-shaped random model), `_flow` (the flow in-process, every engine launch's records kept in
a JSONL file), `_logits` (the export's logits on this device against the checkpoint's fingerprint).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpucheck.steps import (
    DRY_MODEL,
    FULL_MODEL,
    TOKENIZER_VOCAB,
)
from support.tiny import tiny_tokenizer

# ------------------------------------------------------------------------------------------------
# internal subcommands (each runs in its own process)


def cmd_env() -> int:
    import importlib.metadata as md

    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if info["cuda_available"]:
        info.update(
            gpu=torch.cuda.get_device_name(0),
            gpus=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        )
    for name in (
        "transformers",
        "tokenizers",
        "huggingface-hub",
        "colossalai",
        "prefect",
        "pydantic",
        "safetensors",
        "numpy",
        "peft",
        "bitsandbytes",
        "galore-torch",
    ):
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            info[name] = None
    from torch.utils.cpp_extension import CUDA_HOME

    info["nvcc"], info["cuda_home"] = shutil.which("nvcc"), CUDA_HOME
    import colossalai  # noqa: F401
    import prefect  # noqa: F401
    from colossalai.booster.plugin import GeminiPlugin, HybridParallelPlugin  # noqa: F401
    from colossalai.nn.optimizer import HybridAdam  # noqa: F401

    import flows.cpt_to_sft  # noqa: F401
    import tasks.engine.loop  # noqa: F401

    info["imports"] = "ok"
    print("@@env " + json.dumps(info, sort_keys=True), flush=True)
    return 0


def cmd_kernels() -> int:
    """Build (JIT) and smoke-test the kernels HybridAdam needs; later processes load them from
    ~/.cache/colossalai/torch_extensions."""
    import torch
    from colossalai.kernel.kernel_loader import CPUAdamLoader, FusedOptimizerLoader

    times = {}
    for loader in (CPUAdamLoader, FusedOptimizerLoader):
        t0 = time.monotonic()
        loader().load()
        times[loader.__name__] = round(time.monotonic() - t0, 1)
    from colossalai.nn.optimizer import HybridAdam

    p = torch.nn.Parameter(torch.ones(1024, device="cuda"))
    opt = HybridAdam([p], lr=0.1, adamw_mode=True)
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    moved = float((1.0 - p.detach()).abs().max())
    if not 0.05 < moved < 0.2:  # AdamW's first step moves each weight by ~lr
        raise SystemExit(f"HybridAdam step moved weights by {moved}, expected ~0.1")
    print("@@kernels " + json.dumps({"seconds": times, "first_step_delta": moved}), flush=True)
    return 0


def cmd_build_model(out: str, size: str) -> int:
    from tasks.core.models.demo import build_tiny_model
    from tasks.core.preflight.checks import estimate_parameters

    shape = dict(FULL_MODEL if size == "full" else DRY_MODEL)
    vocab = shape.pop("vocab_size")
    dest = Path(out)
    tmp = dest.with_name(dest.name + ".tmp-build")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.monotonic()
    build_tiny_model(tmp, tiny_tokenizer(TOKENIZER_VOCAB), vocab_size=vocab, seed=0, **shape)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    mc = json.loads((dest / "config.json").read_text())
    info = {
        "path": str(dest),
        "params": estimate_parameters(mc),
        "vocab_size": mc["vocab_size"],
        "hidden_size": mc["hidden_size"],
        "layers": mc["num_hidden_layers"],
        "seconds": round(time.monotonic() - t0, 1),
    }
    print("@@model " + json.dumps(info), flush=True)
    return 0


def cmd_flow(config: str, run_root: str, records_path: str) -> int:
    """The flow in this process, every engine launch's records appended to a JSONL file as they come
    (a killed stage keeps what it printed)."""
    import tasks.stages.train
    from flows.cli import flow_main

    real = tasks.stages.train.run_engine
    with open(records_path, "a") as sink:

        def write(obj: dict[str, Any]) -> None:
            sink.write(json.dumps(obj, sort_keys=True) + "\n")
            sink.flush()

        def recording(verb, job, *args, **kwargs):
            phase, t0 = job.phase, time.monotonic()
            write({"event": "launch", "verb": verb, "phase": phase})
            inner_progress, inner_event = kwargs.get("on_progress"), kwargs.get("on_event")

            def on_progress(rec):
                write({**rec, "event": "progress", "verb": verb, "phase": phase})
                if inner_progress:
                    inner_progress(rec)

            def on_event(kind, rec):
                write({**rec, "event": kind, "verb": verb, "phase": phase})
                if inner_event:
                    inner_event(kind, rec)

            kwargs.update(on_progress=on_progress, on_event=on_event)
            try:
                result = real(verb, job, *args, **kwargs)
            except BaseException as exc:
                write(
                    {
                        "event": "end",
                        "verb": verb,
                        "phase": phase,
                        "ok": False,
                        "seconds": round(time.monotonic() - t0, 2),
                        "error": str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__,
                    }
                )
                raise
            write(
                {"event": "end", "verb": verb, "phase": phase, "ok": True, "seconds": round(time.monotonic() - t0, 2)}
            )
            return result

        tasks.stages.train.run_engine = recording
        try:
            return flow_main(["--config", config, "--run-root", run_root])
        except Exception as exc:  # the flow re-raises the failed stage's error
            print(f"flow failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
            return 4  # 1 and 3 are the flow's own (a stage failed / the gate failed)


def cmd_logits(export_dir: str, checkpoint_dir: str) -> int:
    """The export's logits by plain transformers on this machine's device vs the checkpoint's fingerprint."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.core.models.fingerprint import load_fingerprint, max_abs_diff, model_logits

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.bfloat16, use_safetensors=True).to(device)
    logits = model_logits(model, model.config.vocab_size)
    ref = load_fingerprint(checkpoint_dir)
    info = {
        "device": device,
        "max_abs_diff": max_abs_diff(logits, ref),
        "bitwise": bool(torch.equal(logits, ref)),
        "ref_mean_abs": float(ref.abs().mean()),
    }
    print("@@logits " + json.dumps(info), flush=True)
    return 0
