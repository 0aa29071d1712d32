"""Stage push_to_hub: one commit of the verified export plus a model card.

The token comes from the Prefect Secret block `hf-token` or HF_TOKEN in the worker's
environment — never from parameters, and it is never logged. Without `hub:` in the config the
stage is skipped with a log line and the run summary says so.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from tasks import ui
from tasks.common import StageResult, store_for
from tasks.core.config import RunConfig

SECRET_BLOCK = "hf-token"


def hub_token() -> str | None:
    token = os.environ.get("HF_TOKEN")
    if token:
        return token
    try:
        from prefect.blocks.system import Secret

        return Secret.load(SECRET_BLOCK).get()
    except Exception:
        return None


def model_card(cfg: RunConfig, results: dict[str, StageResult], export_dir: Path) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    cpt, sft = results.get("train_cpt"), results.get("train_sft")
    data = ModelCardData(
        base_model=cfg.base_model.uri if "/" in cfg.base_model.uri and "://" not in cfg.base_model.uri else None,
        datasets=None,
        library_name="transformers",
        license=cfg.hub.license if cfg.hub else None,
        tags=["cpt-to-sft", "colossalai", *((cfg.hub.tags if cfg.hub else ()))],
    )

    def layout(stage: str) -> str:
        p = getattr(cfg, stage).plugin
        return f"{p.name} (tp={p.tp_size}, pp={p.pp_size}, zero={p.zero_stage}, {p.precision})"

    def loss(r: StageResult | None) -> str:
        return f"{r.detail.get('final_loss'):.4f}" if r and r.detail.get("final_loss") is not None else "n/a"

    verification = results.get("export").detail if results.get("export") else {}
    body = f"""
# {cfg.hub.repo_id if cfg.hub else cfg.name}

Continued pre-training then supervised fine-tuning of `{cfg.base_model.uri}` with
[cpt-to-sft](https://github.com/) on ColossalAI.

| stage | plugin and layout | steps | final loss | data |
|---|---|---|---|---|
| CPT | {layout('cpt')} | {cfg.cpt.max_steps} | {loss(cpt)} | `{Path(cfg.cpt.data.uri).name}` |
| SFT | {layout('sft')} | {cfg.sft.max_steps} | {loss(sft)} | `{Path(cfg.sft.data.uri).name}` |

Export: `{cfg.export.dtype}` safetensors; verification: logits on the probe batch match the SFT
checkpoint within {verification.get('fingerprint_atol')} (max abs diff {verification.get('fingerprint_max_abs_diff')}).
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}").content


@task(name="push_to_hub", retries=3, retry_delay_seconds=20, task_run_name="push_to_hub")
def push_to_hub(cfg: RunConfig, results: dict[str, StageResult]) -> StageResult:
    logger = get_run_logger()
    started = time.monotonic()
    if cfg.hub is None:
        logger.info("push_to_hub: skipped, no `hub:` section in the config (nothing is published)")
        return StageResult("push_to_hub", "not-configured", detail={"reason": "no hub configured"})
    from huggingface_hub import CommitOperationAdd, HfApi

    token = hub_token()
    if not token:
        raise RuntimeError(f"push_to_hub: no Hub token; set HF_TOKEN in the worker's environment or create the Prefect Secret block '{SECRET_BLOCK}'")
    store = store_for(cfg)
    export_dir = store.stage_in("export")
    manifest = store.read_manifest("export")
    card = model_card(cfg, results, export_dir)
    api = HfApi(token=token)
    repo = api.create_repo(cfg.hub.repo_id, private=cfg.hub.private, exist_ok=True, repo_type="model")
    if cfg.hub.revision != "main":
        api.create_branch(cfg.hub.repo_id, branch=cfg.hub.revision, exist_ok=True)
    # Exactly the verified files plus the card, in one commit; the artifact itself is not touched.
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(export_dir / name)) for name in sorted(manifest["files"])]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode()))
    commit = api.create_commit(
        repo_id=cfg.hub.repo_id, operations=operations, revision=cfg.hub.revision, commit_message=cfg.hub.commit_message,
    )
    url = getattr(commit, "commit_url", None) or str(commit)
    logger.info("push_to_hub: committed %s to %s@%s", url, cfg.hub.repo_id, cfg.hub.revision)
    ui.link("hub-commit", url, f"{cfg.hub.repo_id}@{cfg.hub.revision}")
    return StageResult("push_to_hub", "completed", uri=str(repo), seconds=time.monotonic() - started, detail={"commit_url": url, "repo_id": cfg.hub.repo_id})
