"""Stage push_to_hub: ONE commit of the verified export plus a model card.

The export is staged in (sha256-verified) from the run root; every file its manifest lists and a
`README.md` written with huggingface_hub's `ModelCard` go up in a single `create_commit` on the
configured branch, with `parent_commit` pinned to the branch head read just before. LFS objects
the Hub already holds are not sent again (the LFS batch API answers that they exist), and a push
of an unchanged export makes no commit at all. Uploads are retried (transient I/O); the Hub only
moves the branch when the commit lands, so a push that cannot finish leaves the repo as it was.

The token comes from HF_TOKEN in the worker's environment or the Prefect Secret block `hf-token`
— never from parameters — and is never logged or written into the card. HF_ENDPOINT selects
another Hub (the tests run their own). Without `hub:` in the config the stage is skipped.

    python -c "from tasks.stage import token; print(bool(token()))"   # is a token reachable?
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from tasks import ui
from tasks.core.config import HubConfig, RunConfig
from tasks.core.hub import SECRET_BLOCK, hub_dataset_id, is_hub_id
from tasks.core.manifest import MANIFEST, read_manifest
from tasks.core.runlayout import EXPORT, TRAINING, Status
from tasks.stage import StageResult, store_for, token

CARD = "README.md"


def train_facts(cfg: RunConfig, results: dict[str, StageResult], read_text: Callable[[str], str] | None = None) -> dict[str, dict]:
    """Steps and final loss per training stage: from this run's results, or (stages skipped on a
    re-run) from the final checkpoint's train_state.json, so a re-push renders the same card."""
    facts = {}
    for stage in ("cpt", "sft"):
        steps = getattr(cfg, stage).max_steps
        loss = None
        r = results.get(f"train_{stage}")
        if r is not None and r.detail.get("final_loss") is not None:
            loss = float(r.detail["final_loss"])
        elif read_text is not None:
            try:
                losses = json.loads(read_text(f"{TRAINING[stage].step(steps)}/train_state.json")).get("losses") or []
                loss = float(losses[-1]) if losses else None
            except Exception:  # the card then shows the loss as n/a; it must not block the push
                loss = None
        facts[stage] = {"steps": steps, "final_loss": loss}
    return facts


def model_card(cfg: RunConfig, export_manifest: dict[str, Any], facts: dict[str, dict], metrics: dict[str, Any] | None = None) -> str:
    """The README.md: ModelCardData metadata (with a model-index of the held-out metrics) plus
    plugins/layouts, steps, losses, verification."""
    from huggingface_hub import ModelCard, ModelCardData

    from tasks.core.evaluation import eval_results_for_card

    hub = cfg.hub
    eval_results = eval_results_for_card(metrics or {})
    datasets = sorted({d for u in (*cfg.cpt.data.uris, *cfg.sft.data.uris) if (d := hub_dataset_id(u))})
    data = ModelCardData(
        base_model=cfg.base_model.uri if is_hub_id(cfg.base_model.uri) else None,
        datasets=datasets or None,
        library_name="transformers",
        license=hub.license if hub and hub.license else None,
        tags=["cpt-to-sft", "colossalai", *(hub.tags if hub else ())],
        pipeline_tag="text-generation",
        # huggingface_hub requires model_name whenever eval_results are given.
        model_name=(hub.repo_id.split("/")[-1] if hub else cfg.name) if eval_results else None,
        eval_results=eval_results or None,
    )

    def layout(stage: str) -> str:
        st = getattr(cfg, stage)
        p = st.plugin
        return f"`{p.name}` tp={p.tp_size} pp={p.pp_size} zero={p.zero_stage} {p.precision}, {st.launch.nnodes}×{st.launch.nproc_per_node} ranks"

    def loss(stage: str) -> str:
        value = facts.get(stage, {}).get("final_loss")
        return f"{value:.4f}" if value is not None else "n/a"

    def data_name(uris: list[str]) -> str:
        return ", ".join(hub_dataset_id(u) or Path(u.rstrip("/")).name for u in uris)

    v = (export_manifest.get("meta") or {}).get("verification") or {}
    if v:
        verdict = "passed" if v.get("fingerprint_match") else "FAILED"
        verification = (
            f"{verdict}: the exported `{v.get('dtype')}` weights ({v.get('tensors')} tensors) loaded with "
            f"`transformers` give logits on the probe batch within {v.get('fingerprint_atol')} of the SFT "
            f"checkpoint's (max abs diff {v.get('fingerprint_max_abs_diff')})."
        )
    else:
        verification = "not recorded in the export manifest."
    base = f"[`{cfg.base_model.uri}`]" if is_hub_id(cfg.base_model.uri) else f"`{Path(cfg.base_model.uri.rstrip('/')).name}`"
    title = hub.repo_id if hub else cfg.name
    body = f"""
# {title}

Continued pre-training (CPT) then supervised fine-tuning (SFT) of {base} with cpt-to-sft on
ColossalAI, run `{cfg.name}`.

| stage | plugin and parallel layout | steps | final loss | data |
|---|---|---|---|---|
| CPT | {layout('cpt')} | {facts.get('cpt', {}).get('steps')} | {loss('cpt')} | `{data_name(cfg.cpt.data.uris)}` |
| SFT | {layout('sft')} | {facts.get('sft', {}).get('steps')} | {loss('sft')} | `{data_name(cfg.sft.data.uris)}` |

**Export:** `{cfg.export.dtype}` safetensors, {len(export_manifest.get('files', {}))} files, each listed with its
sha256 in the export manifest.

**Verification:** {verification}
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}").content


def push_export(export_dir: Path, files: list[str], card: str, hub: HubConfig, token: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """One commit of `files` (relative to export_dir) + README.md to hub.repo_id@hub.revision.

    Returns repo_id, revision, commit_url, commit_oid, parent_commit and `changed` (False when the
    Hub already held exactly this export, in which case no commit was made).
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    repo_url = api.create_repo(hub.repo_id, private=hub.private, exist_ok=True, repo_type="model")
    if hub.revision != "main":
        api.create_branch(hub.repo_id, branch=hub.revision, exist_ok=True)
    head = api.repo_info(hub.repo_id, revision=hub.revision, repo_type="model").sha
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(export_dir / name)) for name in sorted(files) if name != CARD
    ]
    operations.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.encode()))
    # One commit; parent pinned so a concurrent writer makes this attempt fail (and retry) instead
    # of being overwritten. Unchanged files are dropped by the client, and an all-unchanged push
    # returns the current head without committing.
    commit = api.create_commit(
        repo_id=hub.repo_id, operations=operations, revision=hub.revision, commit_message=hub.commit_message,
        parent_commit=head, repo_type="model",
    )
    changed = commit.oid != head
    log(f"push_to_hub: {'committed' if changed else 'unchanged, no new commit:'} {commit.commit_url} ({len(operations)} files) to {hub.repo_id}@{hub.revision}")
    return {
        "repo_id": hub.repo_id, "revision": hub.revision, "repo_url": str(repo_url), "commit_url": commit.commit_url,
        "commit_oid": commit.oid, "parent_commit": head, "changed": changed, "files": len(operations),
    }


@task(name="push_to_hub", retries=3, retry_delay_seconds=20, task_run_name="push_to_hub")
def push_to_hub(cfg: RunConfig, results: dict[str, StageResult]) -> StageResult:
    logger = get_run_logger()
    started = time.monotonic()
    if cfg.hub is None:
        logger.info("push_to_hub: skipped, no `hub:` section in the config (nothing is published)")
        return StageResult("push_to_hub", Status.NOT_CONFIGURED, detail={"reason": "no hub configured"})
    hf_token = token()
    if not hf_token:
        raise RuntimeError(f"push_to_hub: no Hub token; set HF_TOKEN in the worker's environment or create the Prefect Secret block '{SECRET_BLOCK}'")
    store = store_for(cfg)
    export_dir = store.stage_in(EXPORT)  # sha256-verified against the export manifest
    manifest = read_manifest(export_dir)
    from tasks.evaluate import recorded_metrics

    card = model_card(cfg, manifest, train_facts(cfg, results, store.read_text), recorded_metrics(results))
    files = [name for name in sorted(manifest["files"]) if name != MANIFEST]
    outcome = push_export(export_dir, files, card, cfg.hub, hf_token, log=logger.info)
    ui.link("hub-commit", outcome["commit_url"], f"{cfg.hub.repo_id}@{cfg.hub.revision}")
    ui.stage_event("push_to_hub", "completed", cfg.name, outcome["commit_url"], changed=outcome.get("changed"))
    return StageResult("push_to_hub", Status.COMPLETED, uri=outcome["repo_url"], seconds=time.monotonic() - started, detail=outcome)
