"""Helpers for the engine tests: write a job file, run `torchrun -m tasks.engine`, read results."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

STAGE = {
    "seq_len": 32,
    "micro_batch_size": 2,
    "grad_accum_steps": 1,
    "lr": 3e-3,
    "warmup_steps": 1,
    "lr_schedule": "cosine",
    "max_steps": 6,
    "checkpoint_every": 3,
    "keep_last": 2,
}


def phase_raw(phase: str, plugin: dict[str, Any], **phase_kw) -> dict[str, Any]:
    """One phase section (a PhaseConfig dict) of the sample data under `plugin`: what a job carries."""
    data = {"uri": str(REPO / "data" / "sample" / f"{phase}.jsonl")}
    seq = {"seq_len": 64} if phase in ("sft", "dpo") else {}  # chats and pairs are longer than 32 tokens
    return {"data": data, "plugin": plugin, "launch": {"nproc_per_node": 2}, **STAGE, **seq, "seed": 1234, **phase_kw}


def run_raw(model_dir: Path, run_root: Path, phase: str, plugin: dict[str, Any], **phase_kw) -> dict[str, Any]:
    """A RunConfig dict whose `stage` section uses `plugin`; the other stage is a valid filler."""
    filler = {"name": "torch_ddp", "precision": "fp32"}
    return {
        "name": "engine-test",
        "run_root": str(run_root),
        "base_model": {"uri": str(model_dir)},
        **{s: phase_raw(s, plugin, **phase_kw) if s == phase else phase_raw(s, filler) for s in ("cpt", "sft")},
    }


def prepare_spec(phase_cfg: dict[str, Any], phase: str):
    """The stage's PrepareSpec as prepare_data builds it (`prepare.prepare_spec`), with no held-out part:
    the engine tests train on every record."""
    from dataclasses import replace

    from tasks.core.config.phases import PHASES
    from tasks.core.config.schema import DpoConfig, PhaseConfig
    from tasks.core.data.spec import prepare_spec

    section = DpoConfig if PHASES[phase].record == "pair" else PhaseConfig  # a pair phase reads its own fields
    spec = prepare_spec(section.model_validate(phase_cfg), phase)
    return replace(spec, heldout_fraction=0.0, heldout_uri=None, heldout_sources=())


def prepared_data(phase_cfg: dict[str, Any], phase: str, tokenizer_dir: Path, out: Path) -> Path:
    """The stage's corpus tokenized as prepare_data does (`prepare_spec`); a mixture blended for the
    stage's steps, as prepare_data blends it."""
    from tasks.core.data.prepare import prepare_spec_into

    if not (out / "index.json").is_file():
        prepare_spec_into(prepare_spec(phase_cfg, phase), tokenizer_dir, out)
    return out


def write_job(
    path: Path,
    *,
    verb: str,
    phase: str,
    phase_cfg: dict[str, Any],
    model_dir: Path,
    stage_dir: Path,
    tokenizer_dir: Path | None = None,
    config_digest: str = "0" * 64,
    **optional: Any,
) -> Path:
    """`optional`: the job's optional fields (verify_memory_gb, reference_dir), written where not None."""
    # One prepared directory per prepare spec (corpus, seq_len, split, a mixture's blend plan) and tokenizer,
    # keyed by the product's digest of that spec.
    from tasks.core.run.digest import digest

    spec = prepare_spec(phase_cfg, phase)
    tag = f"{phase}-{phase_cfg['seq_len']}-{Path(tokenizer_dir or model_dir).name}-{digest(spec.to_json())[:12]}"
    data_dir = prepared_data(phase_cfg, phase, tokenizer_dir or model_dir, path.parent / f"data-{tag}")
    job = {
        "verb": verb,
        "phase": phase,
        "phase_cfg": phase_cfg,
        "trust_remote_code": False,
        "model_dir": str(model_dir),
        "tokenizer_dir": str(tokenizer_dir or model_dir),
        "data_dir": str(data_dir),
        "stage_dir": str(stage_dir),
        "parent": {"uri": str(model_dir), "digest": "parent-digest"},
        "config_digest": config_digest,
    }
    job.update({k: str(v) if isinstance(v, Path) else v for k, v in optional.items() if v is not None})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job, indent=2))
    return path


class EngineRun:
    def __init__(self, rc: int, output: str, seconds: float):
        self.rc, self.output, self.seconds = rc, output, seconds

    @property
    def progress(self) -> list[dict[str, Any]]:
        return [json.loads(m) for m in re.findall(r"^\[rank 0\] @@progress (.*)$", self.output, re.MULTILINE)]

    @property
    def checkpoints(self) -> list[dict[str, Any]]:
        return [json.loads(m) for m in re.findall(r"^\[rank 0\] @@checkpoint (.*)$", self.output, re.MULTILINE)]


def engine(
    verb: str, job: Path, nproc: int = 2, env: dict[str, str] | None = None, expect_ok: bool = True, timeout: int = 300
) -> EngineRun:
    argv = [
        sys.executable,
        "-m",
        "tasks.engine.agent",  # the launcher's torchrun (tasks/core/launch/torchrun.py): ranks forked or fresh
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "tasks.engine",
        verb,
        "--config",
        str(job),
    ]
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), e.get("PYTHONPATH")) if p)
    e.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    e.pop("CPT_TO_SFT_FAULT", None)
    e.update(env or {})
    t0 = time.monotonic()
    proc = subprocess.run(
        argv, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False
    )
    run = EngineRun(proc.returncode, proc.stdout, time.monotonic() - t0)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"engine {verb} exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return run


def shard_train(shard_job: Path, train_job: Path, fault: str = "", **kw) -> EngineRun:
    """The shard job, then the train job in the same ranks: the verb shard-train with its hand-off file
    written first, as the flow's shared launch runs a phase's shard and train stages
    (tasks/core/launch/shared.py). One launch's imports (~13 CPU-s on 2 ranks) where two launches pay
    them twice; `fault` is the train part's CPT_TO_SFT_FAULT, as the hand-off file carries it. The run's
    output and records are the shard's, then the train's."""
    from tasks.core.run import handoff

    handoff.write_go(shard_job, train_job, fault)
    try:
        return engine("shard-train", shard_job, **kw)
    finally:
        handoff.clear(shard_job)


def reference_for(job: Path, out: Path) -> Path:
    """The reference log-probabilities of a pair job's data, by the real code (`write_reference`) on the
    job's model_dir (the model the phase starts from), as the flow's reference stage computes them."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.core.evaluation.reference import write_reference
    from tasks.core.run.manifest import MANIFEST

    raw = json.loads(job.read_text())
    if not (out / MANIFEST).is_file():
        model = AutoModelForCausalLM.from_pretrained(raw["model_dir"], torch_dtype=torch.float32).eval()
        write_reference(model, raw["data_dir"], out)
    return out


def train_state(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / "train_state.json").read_text())


def read_model_dir(model_dir: Path):
    """Every tensor of a saved `model/` directory (all shards, HF keys)."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            assert k not in tensors, f"{k} appears in two shards"
            tensors[k] = v
    return tensors
