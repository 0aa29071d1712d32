"""Stage export: the final SFT checkpoint (plugin B) -> `export/`, a clean HF model folder.

    python -m flows.cpt_to_sft --config deployments/configs/tiny-cpu.yaml   # export runs as one stage of it

Shards to `export.max_shard_size`, casts to `export.dtype`, proves every tensor bitwise the
checkpoint's cast to that dtype, aligns the stop tokens with the chat template
(`export.align_stop_tokens`), and checks the folder the way a user will load it: plain
`transformers` logits against the SFT fingerprint, relative to their magnitude. The model folder
holds only model files (config, generation config, weights, tokenizer); the provenance
(manifest, `verification.json`, fingerprint) is under `.cpt-to-sft/`, shown in the UI too.
"""

from __future__ import annotations

import json
from importlib import metadata

from prefect import get_run_logger

from tasks import ui
from tasks.core.config.schema import RunConfig
from tasks.core.data.prepared import recorded_split
from tasks.core.errors import ConversionError
from tasks.core.models.folder import folder_problems
from tasks.core.models.hf_artifact import VERIFICATION, build_hf_dir
from tasks.core.models.merge import build_merged_dir
from tasks.core.models.stop_tokens import describe
from tasks.core.run.stages import TRAINING
from tasks.stage import Stage, StageResult, stage_task

VERSIONED = ("torch", "colossalai", "transformers", "safetensors", "huggingface_hub")


def framework_versions() -> dict[str, str | None]:
    """Installed versions, read from package metadata (importing colossalai here would be slow)."""
    out: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _verification_markdown(v: dict) -> str:
    ok = "✅ match" if v["fingerprint_match"] else "❌ MISMATCH"
    stop = v.get("stop_tokens") or {}
    lines = [
        "### Export verification",
        "",
        "| check | value |",
        "|---|---|",
        f"| tensors | {v['tensors']} (each bitwise the checkpoint's, cast to {v['dtype']}) |",
        *([(f"| LoRA merge | in fp32 onto cpt/hf; {v['lora']['untouched_bitwise']} untouched tensors bitwise the base's, "
            f"{v['lora']['touched']} merged; head untied: {v['lora']['untied_head']} |")] if v.get("lora") else []),
        f"| bytes | {v['bytes']:,} |",
        f"| dtype | {v['dtype']} |",
        (f"| logits max abs diff / max abs logit | {v['fingerprint_max_abs_diff']:.3g} / {v['fingerprint_max_abs_logit']:.3g} = "
         f"{v['fingerprint_rel_diff']:.3g} (tolerance {v['fingerprint_rtol']:g}) {ok} |"),
        f"| top-1 agreement | {v['top1_agreement']:.3f} ({v['top1_disagreements_beyond_tolerance']} beyond tolerance) |",
        f"| eos_token_id | {stop.get('eos_token_id')} (added: {', '.join(a['token'] for a in stop.get('added', [])) or 'none'}) |",
        f"| tokenizer files | {', '.join(v['tokenizer_files'])} |",
        "",
        "| key | shape |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {tuple(s)} |" for k, s in list(v.get("shapes", {}).items())[:64]]
    return "\n".join(lines) + "\n"


@stage_task(name="export", task_run_name="export HF safetensors [{cfg.export.dtype}]")
def export_hf(cfg: RunConfig, sft: StageResult) -> StageResult:
    stage = Stage("export", cfg, sft)
    if stage.skipped:
        return stage.result
    ckpt, source = stage.store.stage_in(sft.rel), stage.store.stage_in(TRAINING["sft"].source)
    with stage.build() as out:
        if cfg.sft.lora is not None:  # the adapter merged onto cpt/hf in fp32, proven against peft (tasks/core/models/merge.py)
            built = build_merged_dir(ckpt, out.dir, source, dtype=cfg.export.dtype, max_shard_size=cfg.export.max_shard_size,
                                     rtol=cfg.export.fingerprint_rtol, align_stop_tokens=cfg.export.align_stop_tokens, work_dir=cfg.staging_dir)
        else:
            built = build_hf_dir(
                ckpt, out.dir, source, dtype=cfg.export.dtype, max_shard_size=cfg.export.max_shard_size,
                weights_dtype=cfg.sft.plugin.precision, rtol=cfg.export.fingerprint_rtol, align_stop_tokens=cfg.export.align_stop_tokens,
            )
        v = built["verification"]
        problems = folder_problems(out.dir)  # the rule verify, push and pre-flight apply to this folder later
        if problems:
            raise ConversionError("export: " + "; ".join(problems))
        get_run_logger().info("export: %s", describe(v["stop_tokens"]))
        (out.dir / VERIFICATION).write_text(json.dumps(v, indent=2, sort_keys=True) + "\n")
        out.manifest(
            kind="hf-export", parent=sft, fingerprint=built["fingerprint"], known_hashes=built["known_hashes"],
            meta={
                "from_checkpoint": sft.uri, "dtype": cfg.export.dtype, "verification": {k: x for k, x in v.items() if k != "shapes"},
                "data_split": recorded_split(stage.store, "sft"),  # what SFT trained on and what it held out
                "versions": framework_versions(),  # of the process that built the export, for the model card
            },
        )
    ui.markdown("export-verification", _verification_markdown(v), "Export verification: keys, shapes, dtype, fingerprint, stop tokens")
    return stage.done({k: x for k, x in v.items() if k != "shapes"})
