"""Training checkpoints: atomic directories, complete state, newest-complete-first resume.

Layout of `<stage_dir>/step-NNNNNN/` (written as `<stage_dir>/.step-NNNNNN.tmp/`, renamed after
rank 0 wrote the manifest LAST):

    model/                    booster.save_model(shard=True, use_safetensors=True): HF key names,
                              full tensors, model.safetensors.index.json, config.json
    optimizer/                booster.save_optimizer(shard=True): ColossalAI's pickled .bin shards
                              (full, gathered states keyed by parameter index) + index + param groups
                              (both in files of at most `save_shard_mib`, or one larger tensor)
    masters/                  tasks/engine/masters.py: rank-NNNNN.safetensors, each rank's fp32 master
                              pieces (bf16/fp16), and rank-NNNNN.json, where each piece of each
                              parameter sits (read by tasks/core/models/convert/state_view.py)
    lr_scheduler.pt           booster.save_lr_scheduler (a plain dict of numbers)
    rng/rank-NNNNN.json       python `random` and numpy states of every rank, as JSON
    rng/rank-NNNNN.safetensors  torch CPU generator state (and CUDA's where present) of every rank
    train_state.json          step, tokens_seen, sampler position (epoch, offset, seed), per-step
                              losses and learning rates so far (full precision), phase
    .cpt-to-sft/fingerprint.npy  logits on the fixed probe batch (tasks.core.models.fingerprint)
    .cpt-to-sft/manifest.json    tasks.core.run.manifest.write_manifest: every file with size + sha256

Pickles: the optimizer files and lr_scheduler.pt are torch pickles written by us into our own
storage; ColossalAI reads them with a bare `torch.load`, which defaults to `weights_only=True` in
torch >= 2.6, and the engine additionally sets TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 so no code path
can unpickle arbitrary objects. They are only ever read after the manifest's sha256 checks pass.
RNG states are JSON and safetensors, never pickle.

Inspect the newest complete checkpoint of a stage by hand:

    python -m tasks.engine.checkpoint runs/demo/cpt
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tasks.core.config.phases import PHASES, phase_of
from tasks.core.errors import ConversionError, ManifestError
from tasks.core.models.families import largest_tensor
from tasks.core.run.manifest import MANIFEST, fsync_dir, verify_artifact
from tasks.core.run.stages import BASE, STEP_PREFIX, STEP_RE, TRAIN_STATE, TRAINING, step_name, tmp_step_name
from tasks.core.storage.handshake import is_published

# step_name and TRAIN_STATE are re-exported: the engine names its checkpoints through this module.
__all__ = [
    "KIND",
    "TRAIN_STATE",
    "ResumePoint",
    "capture_rng",
    "check_checkpoint",
    "commit",
    "find_resume",
    "list_steps",
    "read_train_state",
    "remove_leftovers",
    "restore_rng",
    "retain",
    "save_shard_mib",
    "step_name",
    "tmp_name",
    "write_json",
    "write_rng",
]

KIND = "colossalai-checkpoint"
tmp_name = tmp_step_name  # the engine's name for it

# ColossalAI 0.5.0's sharded saves (the model and the optimizer, every plugin) gather whole tensors
# (tensor-parallel pieces, ZeRO shards) into a block of up to `size_per_shard` MiB on every rank that
# takes part, the writing one and the others alike, and write a block as one file. At its default,
# 1024, a model under 1 GB is one block, held whole on every such rank. A block never splits a
# tensor, so the largest tensor is the least a save holds; blocks no larger than it bound a save to
# about two of them (the block being written and the tensor that closed it), and never more than
# the default did. Below the floor a split only adds files: a rank holds ~0.45 GB of imports anyway.
SAVE_SHARD_FLOOR_MIB = 64
COLOSSALAI_SHARD_MIB = 1024


def save_shard_mib(model_config: dict[str, Any], element_bytes: int) -> int:
    """`size_per_shard` (MiB) of this model's checkpoint saves: its largest tensor in the saved dtype,
    within [SAVE_SHARD_FLOOR_MIB, ColossalAI's default]; the default for a family without a tensor table."""
    try:
        largest = largest_tensor(model_config) * element_bytes
    except ConversionError:
        return COLOSSALAI_SHARD_MIB
    return min(COLOSSALAI_SHARD_MIB, max(SAVE_SHARD_FLOOR_MIB, -(-largest // 2**20)))


def list_steps(stage_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step-NNNNNN` directory, newest first (complete or not)."""
    if not stage_dir.is_dir():
        return []
    out = []
    for p in stage_dir.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


@dataclass
class ResumePoint:
    step: int | None  # None: no usable checkpoint
    path: Path | None
    manifest: dict[str, Any] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (newer directory, why not used)

    def announce(self, phase: str) -> str:
        """The log line of where training begins: step 0 is the sharded base (a fresh start), any other
        step a resume."""
        assert self.path is not None
        newer = f", skipping {len(self.skipped)} newer unusable one(s) listed above" if self.skipped else ""
        if not self.step:
            return f"starting {phase} from {self.path.name}: {step_zero(phase)}{newer}"
        return f"resuming {phase} from {self.path.name}: the newest checkpoint whose manifest verifies{newer}"


def step_zero(phase: str) -> str:
    """What a training stage's step 0 holds: the base model, or the model an earlier stage made (cpt/hf for SFT),
    sharded for this stage's plugin."""
    source = TRAINING[phase].source if phase in TRAINING else BASE
    if source == BASE:
        return "the sharded base model"
    made_by = next((PHASES[p].title for p, t in TRAINING.items() if t.hf == source), None)
    return f"the {made_by + ' model' if made_by else 'model'} ({source}), sharded for {phase}"


def check_checkpoint(path: Path, step: int, phase: str, config_digest: str | None) -> dict[str, Any]:
    """The manifest of a usable checkpoint, or ManifestError saying why it is not usable."""
    manifest = verify_artifact(path, deep=True)
    meta = manifest.get("meta") or {}
    if manifest.get("kind") != KIND:
        raise ManifestError(f"{path}: manifest kind is {manifest.get('kind')!r}, not {KIND!r}")
    if meta.get("step") != step:
        raise ManifestError(f"{path}: manifest says step {meta.get('step')!r} but the directory is {path.name}")
    if phase_of(meta) != phase:
        raise ManifestError(f"{path}: checkpoint of phase {phase_of(meta)!r}, this job trains {phase!r}")
    if config_digest is not None and manifest.get("config_digest") != config_digest:
        raise ManifestError(
            f"{path}: made from config digest {str(manifest.get('config_digest'))[:12]}, this job has "
            f"{config_digest[:12]} "
            "(another configuration or parent)"
        )
    # A LoRA checkpoint holds the adapter; its base is the stage's model_dir (tasks/engine/lora.py).
    weights = "adapter/adapter_model.safetensors" if meta.get("lora") else "model/model.safetensors.index.json"
    for rel in (weights, TRAIN_STATE, "lr_scheduler.pt"):
        if rel not in manifest["files"]:
            raise ManifestError(f"{path}: manifest lists no {rel}; not a complete training checkpoint")
    return manifest


def find_resume(stage_dir: Path, phase: str, config_digest: str | None) -> ResumePoint:
    """The newest checkpoint whose manifest verifies (sha256 of every file), and why newer ones
    were skipped. Older checkpoints are not verified once a usable one is found."""
    skipped: list[tuple[str, str]] = []
    for step, path in list_steps(stage_dir):
        try:
            manifest = check_checkpoint(path, step, phase, config_digest)
        except ManifestError as exc:
            skipped.append((path.name, str(exc)))
            continue
        return ResumePoint(step, path, manifest, skipped)
    return ResumePoint(None, None, {}, skipped)


def remove_leftovers(stage_dir: Path) -> list[str]:
    """Delete temporary directories of saves that never committed (a killed rank, a crash)."""
    removed = []
    if stage_dir.is_dir():
        for p in stage_dir.iterdir():
            if p.name.startswith(f".{STEP_PREFIX}") and (p.name.endswith(".tmp") or ".old" in p.name):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
    return removed


def unpublished(stage_dir: Path) -> list[str]:
    """Complete checkpoints (steps > 0) the task has not yet marked as committed remotely."""
    return [p.name for s, p in list_steps(stage_dir) if s > 0 and (p / MANIFEST).is_file() and not is_published(p)]


def retain(stage_dir: Path, keep_last: int, require_published: bool = False) -> list[str]:
    """Keep the newest `keep_last` complete training checkpoints; step-000000 is always kept.

    step-000000 is the artifact of the shard/reboost stage (the flow's skip rule looks for it), so
    retention applies to steps > 0 only. Directories older than the keep_last-th newest complete
    checkpoint are deleted (complete or not); newer incomplete ones are left for the next resume to
    report. Called only after the newest manifest is committed. `require_published` (a remote run
    root, where this directory is only staging): a complete checkpoint without the task's
    `.published` marker is never deleted, whatever keep_last says: its remote copy may not exist yet.
    """
    complete = [(s, p) for s, p in list_steps(stage_dir) if s > 0 and (p / MANIFEST).is_file()]
    if len(complete) <= keep_last:
        return []
    oldest_kept = complete[keep_last - 1][0]
    removed = []
    for s, p in list_steps(stage_dir):
        if require_published and (p / MANIFEST).is_file() and not is_published(p):
            continue
        if 0 < s < oldest_kept:
            # Rename first: a half-deleted directory must never look like a checkpoint.
            doomed = p.with_name(f".{p.name}.old-{os.getpid()}")
            os.replace(p, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(p.name)
    return removed


def commit(tmp: Path, final: Path) -> None:
    """Rename the finished temporary directory into place (replacing a stale/corrupt one)."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


# ------------------------------------------------------------------------------------------------
# RNG: JSON + safetensors per rank


def capture_rng() -> dict[str, Any]:
    """This rank's generator states, in plain types (each rank writes its own)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    tensors = {"torch_cpu": torch.get_rng_state().clone()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state().clone()
    return {
        "json": {
            "python": {"version": version, "state": list(mt), "gauss_next": gauss},
            "numpy": {
                "kind": kind,
                "keys": keys.tolist(),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
        },
        "tensors": tensors,
    }


def write_rng(rng_dir: Path, rank: int, state: dict[str, Any]) -> None:
    rng_dir.mkdir(parents=True, exist_ok=True)
    (rng_dir / f"rank-{rank:05d}.json").write_text(json.dumps({"rank": rank, **state["json"]}))
    save_file({k: v.contiguous() for k, v in state["tensors"].items()}, str(rng_dir / f"rank-{rank:05d}.safetensors"))


def restore_rng(rng_dir: Path, rank: int) -> bool:
    """Set this rank's generators from the checkpoint; False if the checkpoint has no state for it."""
    js, st = rng_dir / f"rank-{rank:05d}.json", rng_dir / f"rank-{rank:05d}.safetensors"
    if not (js.is_file() and st.is_file()):
        return False
    d = json.loads(js.read_text())
    py = d["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    n = d["numpy"]
    np.random.set_state(
        (n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    tensors = load_file(str(st))
    torch.set_rng_state(tensors["torch_cpu"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    return True


# ------------------------------------------------------------------------------------------------


def read_train_state(path: Path) -> dict[str, Any]:
    return json.loads((path / TRAIN_STATE).read_text())


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tasks.engine.checkpoint STAGE_DIR", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    stage_dir = Path(argv[0])
    steps = list_steps(stage_dir)
    if not steps:
        print(f"{stage_dir}: no step-NNNNNN directories")
        return 1
    for step, path in steps:
        try:
            m = verify_artifact(path)
            st = read_train_state(path)
            loss = st["losses"][-1] if st.get("losses") else None
            print(
                f"{path.name}: complete ({len(m['files'])} files), phase={phase_of(m['meta'])} "
                f"tokens={st.get('tokens_seen')} loss={loss}"
            )
        except (ManifestError, OSError, KeyError, json.JSONDecodeError) as exc:
            print(f"{path.name}: NOT usable: {exc}")
    print(f"({time.monotonic() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
