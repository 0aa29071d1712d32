"""Stage export: the final SFT checkpoint (plugin B) -> `export/`, HF safetensors + tokenizer.

Shards to `export.max_shard_size`, casts to `export.dtype`, and verifies the result the way a
user will load it: `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(export)`, logits equal
to the SFT stage's fingerprint within the dtype's tolerance. The verification is written to
`export/verification.json` and shown in the UI.
"""

from __future__ import annotations

import json
import time

from prefect import task

from tasks import ui
from tasks.common import StageResult, completed, done, fresh_dir, skipped, stage_digest, store_for
from tasks.core.config import RunConfig
from tasks.core.manifest import write_manifest
from tasks.evaluate import recorded_split
from tasks.hf_artifact import build_hf_dir


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


@task(name="export", task_run_name="export HF safetensors [{cfg.export.dtype}]")
def export_hf(cfg: RunConfig, sft: StageResult) -> StageResult:
    started = time.monotonic()
    store = store_for(cfg)
    rel = "export"
    cdigest = stage_digest("export", cfg.export, sft.digest)
    if completed(store, rel, cdigest):
        return skipped("export", store, rel, started)
    ckpt = store.stage_in(sft.rel)
    source = store.stage_in("cpt/hf")
    with fresh_dir(store.local_path(rel)) as tmp:
        built = build_hf_dir(
            ckpt, tmp, source, dtype=cfg.export.dtype, max_shard_size=cfg.export.max_shard_size,
            weights_dtype=cfg.sft.plugin.precision, atol=cfg.export.fingerprint_atol,
        )
        v = built["verification"]
        (tmp / "verification.json").write_text(json.dumps(v, indent=2, sort_keys=True) + "\n")
        write_manifest(
            tmp, kind="hf-export",
            meta={
                "from_checkpoint": sft.uri, "dtype": cfg.export.dtype, "verification": {k: x for k, x in v.items() if k != "shapes"},
                "data_split": recorded_split(store, "sft"),  # what SFT trained on and what it held out
            },
            parent={"uri": sft.uri, "digest": sft.digest}, config_digest=cdigest,
            fingerprint=built["fingerprint"], known_hashes=built["known_hashes"],
        )
    ui.markdown("export-verification", _verification_markdown(v), "Export verification: keys, shapes, dtype, fingerprint")
    result = done("export", store, rel, started, **{k: x for k, x in v.items() if k != "shapes"})
    ui.stage_event("export", "completed", cfg.name, result.uri)
    return result
