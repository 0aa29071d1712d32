"""LoRA vs full fine-tuning, side by side in one run: SFT of the same model under LowLevelZero.

    python benchmarks/lora.py            # ~1 min on 2 CPU cores: a 4-layer hidden-512 Llama (13M parameters), ZeRO-2 bf16, r=8
    python benchmarks/lora.py --smoke    # the demo's tiny model, 2 steps on one rank: checks the script runs

Each mode is the engine's own shard and train verbs under torchrun (2 ranks; --smoke: 1), on the sample chats:
- optimizer-state bytes: the files of the final checkpoint's optimizer/ (Adam moments and fp32
  masters of what trains; under LoRA the frozen base has none);
- peak memory: rank 0's `peak_mem_bytes` of the last step (the @@progress record: VmHWM on CPU);
- step time: the median `step_s` of the train launch;
- checkpoint size: every file of the final checkpoint (LoRA: adapter/, never the base);
- merged export time: tasks.core.models.merge.build_merged_dir (fp32 merge, bf16 export, proofs).
Targets: LoRA checkpoint <= 5 % of the full one at r=8; peak rank memory below full
fine-tuning by at least the optimizer state of the frozen weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support.bench import workdir
from support.tiny import tiny_model

LLZ2 = {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}


def _bytes(root: Path, prefix: str = "") -> int:
    manifest = json.loads((root / ".cpt-to-sft" / "manifest.json").read_text())
    return sum(e["size"] for f, e in manifest["files"].items() if f.startswith(prefix))


def run_mode(work: Path, base: Path, lora: dict | None, steps: int, nproc: int) -> dict:
    from support.engine import engine, phase_raw, write_job

    name = "lora" if lora else "full"
    extra = {"lora": lora} if lora else {}
    section = phase_raw("sft", LLZ2, max_steps=steps, checkpoint_every=steps, keep_last=1, micro_batch_size=2, **extra)
    section["launch"] = {"nproc_per_node": nproc}
    common = dict(phase="sft", phase_cfg=section, model_dir=base, tokenizer_dir=base, stage_dir=work / name / "sft")
    engine("shard", write_job(work / name / "shard.json", verb="shard", **common), nproc=nproc)
    run = engine("train", write_job(work / name / "train.json", verb="train", **common), nproc=nproc)
    last = run.progress[-1]
    ckpt = work / name / "sft" / f"step-{steps:06d}"
    out = {
        "mode": name,
        "optimizer_state_bytes": _bytes(ckpt, "optimizer/"),
        "checkpoint_bytes": _bytes(ckpt),
        "peak_rank_bytes": last.get("peak_mem_bytes"),
        "median_step_s": statistics.median(p["step_s"] for p in run.progress),
        "final_loss": last["loss"],
        "trainable_params": last.get("trainable_params"),
        "total_params": last.get("total_params"),
    }
    if lora:
        from tasks.core.config.outputs import ExportConfig
        from tasks.core.models.merge import build_merged_dir

        t0 = time.monotonic()
        built = build_merged_dir(ckpt, work / "export", base, ExportConfig(dtype="bf16"))
        out["merged_export_s"] = round(time.monotonic() - t0, 2)
        out["export_rel_diff"] = built["verification"]["fingerprint_rel_diff"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the demo's tiny model, 2 steps on one rank")
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", type=Path, help="also write the JSON result here")
    args = p.parse_args(argv)
    from tasks.core.run.manifest import write_manifest

    size = (
        {}
        if args.smoke
        else {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536}
    )
    steps, nproc = (2, 1) if args.smoke else (args.steps, 2)
    work = workdir(None, "bench-lora-")
    try:
        base = tiny_model(work / "base", **size)
        write_manifest(base, kind="hf-model")
        full = run_mode(work, base, None, steps, nproc)
        lora = run_mode(work, base, {"r": args.r, "alpha": 2 * args.r}, steps, nproc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    frozen = lora["total_params"] - lora["trainable_params"]
    result = {
        "full": full,
        "lora": lora,
        "checkpoint_share": round(lora["checkpoint_bytes"] / full["checkpoint_bytes"], 4),
        "peak_saving_bytes": full["peak_rank_bytes"] - lora["peak_rank_bytes"],
        # ZeRO-2: fp32 master + two fp32 moments of the frozen weights, shared by the ranks
        "frozen_optimizer_bytes_per_rank": frozen * 12 // nproc,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
