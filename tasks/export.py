"""Stage export: the final SFT checkpoint (plugin B) -> `export/`, HF safetensors + tokenizer.

Shards to `export.max_shard_size`, casts to `export.dtype`, and verifies the result the way a
user will load it: `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(export)`, logits equal
to the SFT stage's fingerprint within the dtype's tolerance. The verification is written to
`export/verification.json` and shown in the UI.
"""

from __future__ import annotations

import json

from tasks import ui
from tasks.core.config import RunConfig
from tasks.core.runlayout import TRAINING
from tasks.core.stage_data import recorded_split
from tasks.hf_artifact import build_hf_dir
from tasks.stage import Stage, StageResult, stage_digest, stage_task


def _verification_markdown(v: dict) -> str:
    ok = "✅ match" if v["fingerprint_match"] else "❌ MISMATCH"
    lines = [
        "### Export verification",
        "",
        "| check | value |",
        "|---|---|",
        f"| tensors | {v['tensors']} |",
        f"| bytes | {v['bytes']:,} |",
        f"| dtype | {v['dtype']} |",
        f"| fingerprint max abs diff | {v['fingerprint_max_abs_diff']:.3g} (tolerance {v['fingerprint_atol']:g}) {ok} |",
        f"| tokenizer files | {', '.join(v['tokenizer_files'])} |",
        "",
        "| key | shape |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {tuple(s)} |" for k, s in list(v.get("shapes", {}).items())[:64]]
    return "\n".join(lines) + "\n"


@stage_task(name="export", task_run_name="export HF safetensors [{cfg.export.dtype}]")
def export_hf(cfg: RunConfig, sft: StageResult) -> StageResult:
    stage = Stage("export", cfg, stage_digest("export", cfg.export, sft.digest))
    if stage.skipped:
        return stage.result
    ckpt, source = stage.store.stage_in(sft.rel), stage.store.stage_in(TRAINING["sft"].source)
    with stage.build() as out:
        built = build_hf_dir(
            ckpt, out.dir, source, dtype=cfg.export.dtype, max_shard_size=cfg.export.max_shard_size,
            weights_dtype=cfg.sft.plugin.precision, atol=cfg.export.fingerprint_atol,
        )
        v = built["verification"]
        (out.dir / "verification.json").write_text(json.dumps(v, indent=2, sort_keys=True) + "\n")
        out.manifest(
            kind="hf-export", parent=sft, fingerprint=built["fingerprint"], known_hashes=built["known_hashes"],
            meta={
                "from_checkpoint": sft.uri, "dtype": cfg.export.dtype, "verification": {k: x for k, x in v.items() if k != "shapes"},
                "data_split": recorded_split(stage.store, "sft"),  # what SFT trained on and what it held out
            },
        )
    ui.markdown("export-verification", _verification_markdown(v), "Export verification: keys, shapes, dtype, fingerprint")
    return stage.done({k: x for k, x in v.items() if k != "shapes"})
