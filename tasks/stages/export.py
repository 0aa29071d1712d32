"""Stage export: the final SFT checkpoint (plugin B; DPO's in a run with `dpo:`) -> `export/`, a clean HF model folder.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # export runs as one stage of it

Shards to `export.max_shard_size`, casts to `export.dtype`, proves every tensor bitwise the
checkpoint's cast to that dtype, aligns the stop tokens with the chat template
(`export.align_stop_tokens`), and checks the folder the way a user will load it: plain
`transformers` logits against the SFT fingerprint, relative to their magnitude. The model folder
holds only model files (config, generation config, weights, tokenizer); the provenance
(manifest, `verification.json`, fingerprint) is under `.cpt-to-sft/`, shown in the UI too.

With `sft.lora` (`dpo.lora` in a run with `dpo:`), `export/` is cpt/hf (sft/hf) with the adapter
merged (tasks/core/models/merge.py), and the stage also writes `export-adapter/`
(stages.EXPORT_ADAPTER), the adapter alone in peft's layout, an artifact of its own with its
manifest last, proven to give the merged export's logits (tasks/core/models/adapter.py). The stage
is skipped only when both verify with its digest.

The model card, `export/README.md`, is written by every run that has an export (`write_card`,
called by the flow after the gate, and at the end of a run stopped or failed after the export),
from the run's records: training, evaluation, the export's proof and the base model. It is a
view of the artifact (`manifest.amend_views`): listed with its sha256, outside the content digest,
so rendering it again re-runs nothing. The push uploads this file; `cpt-to-sft card RUN_ROOT`
renders it again.
"""

from __future__ import annotations

import json
from importlib import metadata

from prefect import get_run_logger

from tasks.core.config.schema import RunConfig
from tasks.core.data.stage_data import recorded_split
from tasks.core.errors import ConversionError
from tasks.core.models.stop_tokens import describe
from tasks.core.run.manifest import VERIFICATION, amend_views, read_manifest, write_manifest
from tasks.core.run.stages import EXPORT, EXPORT_ADAPTER, ROWS, TRAINING, exported_phase
from tasks.core.storage.publisher import RETRIES, publish_retrying
from tasks.flowkit import ui
from tasks.flowkit.stage import Stage, StageResult, completed, fresh_dir, recorded_metrics, stage_task, store_for

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
        *(
            [
                (
                    f"| LoRA merge | in fp32 onto cpt/hf; {v['lora']['untouched_bitwise']} untouched tensors bitwise "
                    "the base's, "
                    f"{v['lora']['touched']} merged; head untied: {v['lora']['untied_head']} |"
                )
            ]
            if v.get("lora")
            else []
        ),
        *(
            [
                (
                    "| export-adapter/ | peft on cpt/hf vs this export: relative "
                    f"{v['adapter']['fingerprint_rel_diff']:.3g}, top-1 "
                    f"{v['adapter']['top1_agreement']:.3f}; base_model_name_or_path "
                    f"{v['adapter']['base_model_name_or_path']} (local) |"
                )
            ]
            if v.get("adapter")
            else []
        ),
        f"| bytes | {v['bytes']:,} |",
        f"| dtype | {v['dtype']} |",
        (
            f"| logits max abs diff / max abs logit | {v['fingerprint_max_abs_diff']:.3g} / "
            f"{v['fingerprint_max_abs_logit']:.3g} = "
            f"{v['fingerprint_rel_diff']:.3g} (tolerance {v['fingerprint_rtol']:g}) {ok} |"
        ),
        f"| top-1 agreement | {v['top1_agreement']:.3f} ({v['top1_disagreements_beyond_tolerance']} beyond tolerance) |",
        (
            f"| eos_token_id | {stop.get('eos_token_id')} (added: {', '.join(a['token'] for a in stop.get('added', [])) or 'none'}) "
            "|"
        ),
        f"| tokenizer files | {', '.join(v['tokenizer_files'])} |",
        "",
        "| key | shape |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {tuple(s)} |" for k, s in list(v.get("shapes", {}).items())[:64]]
    return "\n".join(lines) + "\n"


@stage_task(ROWS.export, task_run_name="export HF safetensors [{cfg.export.dtype}]")
def export_hf(cfg: RunConfig, sft: StageResult) -> StageResult:
    """`sft`: the final training stage's result (train_sft, or train_dpo in a run with dpo: the export row's read)."""
    stage = Stage(ROWS.export.name, cfg, sft)
    phase = exported_phase(cfg.phases)
    section, source_rel = cfg.phase(phase), TRAINING[phase].source
    lora = section.lora is not None
    if stage.skipped and (not lora or completed(stage.store, EXPORT_ADAPTER, stage.digest)):
        return stage.result
    if not lora and stage.store.exists(
        EXPORT_ADAPTER
    ):  # an earlier LoRA run's adapter: it does not describe this export
        get_run_logger().info(
            "export: removing %s, the adapter of an earlier LoRA export (%s.lora is not set now)",
            stage.store.uri(EXPORT_ADAPTER),
            phase,
        )
        stage.store.remove(EXPORT_ADAPTER)
    # Imported when the stage runs: the converter, the merge and the folder rules import torch (~2.5 s
    # of CPU), and the flow process, which imports every task module at start, may skip them all.
    from tasks.core.models.folder import folder_problems
    from tasks.core.models.hf_artifact import build_hf_dir
    from tasks.core.models.merge import build_merged_dir

    ckpt, source = stage.store.stage_in(sft.rel), stage.store.stage_in(source_rel)
    with stage.build() as out, ui.WorkProgress(ROWS.export.name).reporting():  # shards, the proof: lines with an ETA
        if lora:  # the adapter merged onto the phase's source (cpt/hf; sft/hf for dpo) in fp32, proven against peft (tasks/core/models/merge.py)
            built = build_merged_dir(
                ckpt, out.dir, source, cfg.export, work_dir=cfg.staging_dir, verify_memory_gb=cfg.verify_memory_gb
            )
        else:
            built = build_hf_dir(
                ckpt,
                out.dir,
                source,
                cfg.export,
                weights_dtype=section.plugin.precision,
                verify_memory_gb=cfg.verify_memory_gb,
            )
        v = built["verification"]
        problems = folder_problems(out.dir)  # the rule verify, push and pre-flight apply to this folder later
        if problems:
            raise ConversionError("export: " + "; ".join(problems))
        get_run_logger().info("export: %s", describe(v["stop_tokens"]))
        if lora:
            v["adapter"] = _export_adapter(stage, sft, ckpt, source, out.dir, v["fingerprint_rtol"], source_rel)
        (out.dir / VERIFICATION).write_text(json.dumps(v, indent=2, sort_keys=True) + "\n")
        out.manifest(
            kind="hf-export",
            parent=sft,
            fingerprint=built["fingerprint"],
            known_hashes=built["known_hashes"],
            meta={
                "from_checkpoint": sft.uri,
                "dtype": cfg.export.dtype,
                "verification": {k: x for k, x in v.items() if k != "shapes"},
                "data_split": recorded_split(stage.store, phase),  # what the phase trained on and what it held out
                "versions": framework_versions(),  # of the process that built the export, for the model card
            },
        )
    if lora:  # the adapter first: export/'s manifest, published last, is what marks the stage done
        publish_retrying(
            stage.store,
            EXPORT_ADAPTER,
            retries=0 if stage.store.local else RETRIES,
            log=get_run_logger(),
            what="the export-adapter artifact",
        )
    ui.markdown(
        "export-verification",
        _verification_markdown(v),
        "Export verification: keys, shapes, dtype, fingerprint, stop tokens",
    )
    return stage.done({k: x for k, x in v.items() if k != "shapes"})


def _export_adapter(
    stage: Stage,
    sft: StageResult,
    ckpt,
    base,
    export_dir,
    rtol: float,
    base_rel: str = TRAINING["sft"].source,
) -> dict:
    """export-adapter/: the checkpoint's adapter in peft's layout, proven against `export_dir`
    (before its manifest); returns the verification the export's record also carries."""
    from tasks.core.models.adapter import build_adapter_dir
    from tasks.core.models.merge import ADAPTER

    base_ref = {
        "name_or_path": stage.store.uri(base_rel),
        "digest": stage.store.manifest_digest(base_rel),
    }
    with fresh_dir(stage.store.local_path(EXPORT_ADAPTER), keep_foreign=stage.store.local) as tmp:
        a = build_adapter_dir(
            ckpt / ADAPTER,
            tmp,
            base,
            export_dir,
            base_ref=base_ref,
            rtol=rtol,
            verify_memory_gb=stage.cfg.verify_memory_gb,
        )
        (tmp / VERIFICATION).parent.mkdir(parents=True, exist_ok=True)
        (tmp / VERIFICATION).write_text(json.dumps(a, indent=2, sort_keys=True) + "\n")
        write_manifest(
            tmp,
            kind="lora-adapter",
            meta={"from_checkpoint": sft.uri, "base": base_ref, "verification": a},
            parent={"uri": sft.uri, "digest": sft.digest},
            config_digest=stage.digest,
        )
    get_run_logger().info(
        "export: %s holds the adapter alone (base %s, a local reference); peft on %s matches the merged export "
        "(logits relative diff %.3g <= %g, top-1 %.3f)",
        stage.store.uri(EXPORT_ADAPTER),
        base_ref["name_or_path"],
        base_rel,
        a["fingerprint_rel_diff"],
        rtol,
        a["top1_agreement"],
    )
    return {
        k: a[k]
        for k in ("base_model_name_or_path", "base_is", "fingerprint_rel_diff", "fingerprint_match", "top1_agreement")
    }


def write_card(cfg: RunConfig, results: dict[str, StageResult], metrics: dict | None = None) -> tuple[str, bool]:
    """Render the model card from the run's records into `export/README.md` (published like the
    artifact, manifest last); returns (its URI, whether it changed). `metrics`: the evaluation,
    by default this run's results' (`recorded_metrics`)."""
    from tasks.core.hub.card import CARD, base_facts, model_card, train_facts

    store = store_for(cfg)
    local = store.stage_in(EXPORT) if not store.local else store.local_path(EXPORT)
    if metrics is None:
        metrics = recorded_metrics(results)
    # As every record holds them (manifests and run.json sort their keys): the same card from a
    # first run, a re-run whose evaluations were skipped, and `cpt-to-sft card`.
    metrics = json.loads(json.dumps(metrics, sort_keys=True))
    card = model_card(
        cfg,
        read_manifest(local),
        train_facts(cfg, results, store.read_text),
        metrics,
        base=base_facts(cfg, store.read_text),
        results=results,  # the gate's verdict and the evaluations that did not run
    )
    changed = amend_views(local, {CARD: card.encode()})
    if changed:
        store.publish(EXPORT)
    return store.uri(f"{EXPORT}/{CARD}"), changed
