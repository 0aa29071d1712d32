"""Stage push_to_hub: ONE commit of the verified export plus a model card.

The export is staged in (sha256-verified) from the run root; its model files (config, generation
config, weights, tokenizer), its provenance subfolder `.cpt-to-sft/` (manifest, verification record,
fingerprint; `hub.push_provenance`, default on) and a `README.md` written with huggingface_hub's
`ModelCard` (`tasks.core.hub.card`) go up in a single `create_commit` on the
configured branch (the card is the export's own `README.md`, written by the run), with `parent_commit` pinned to the branch head read just before. LFS objects
the Hub already holds are not sent again (the LFS batch API answers that they exist), and a push
of an unchanged export makes no commit at all. Uploads are retried (transient I/O); the Hub only
moves the branch when the commit lands, so a push that cannot finish leaves the repo as it was.
A token the Hub refuses (401/403) is not retried, and the error names where it came from; nor
is any other refusal (no token, a folder breaking the model-folder rule).

A `.safetensors` file that is not a weight shard of the model, or an adapter beside the merged
weights, is refused (the folder rule verify and pre-flight apply too: `tasks.core.models.folder`),
and a `.safetensors` an earlier push left in the repo is deleted in the same commit, so no serving
engine meets a tensor that is no parameter.

With `hub.push_adapter` (a LoRA run) the adapter alone (`export-adapter/`, peft's layout) goes too:
to `hub.adapter_repo_id` in a commit of its own (with a card saying what base it needs), or, when
that is unset, to the subfolder `adapter/` of the model repo in the same commit as the merged
model. Never beside the merged shards: the folder rule refuses adapter files at the top level.
A push without the adapter deletes an `adapter/` an earlier push left, since it no longer
matches the merged weights.

The token comes from HF_TOKEN in the worker's environment, the Prefect Secret block `hf-token`, or
the token `hf auth login` saved (in that order, `tasks.core.hub.repo.hub_token`) — never from
parameters — and is never logged or written into the card. HF_ENDPOINT selects
another Hub (the tests run their own). Without `hub:` in the config the stage is skipped.

    python -c "from tasks.flowkit.stage import token; print(bool(token()))"   # is a token reachable?
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from tasks.core.config.outputs import HubConfig
from tasks.core.config.schema import RunConfig
from tasks.core.hub.card import CARD, adapter_card, base_facts, model_card, train_facts
from tasks.core.hub.repo import (
    REFUSED_STATUS,
    SECRET_BLOCK,
    HubRefusal,
    HubTokenRefused,
    find_hub_token,
    refused_token_message,
)
from tasks.core.models.folder import folder_problems
from tasks.core.run.manifest import MANIFEST, PROVENANCE_DIR, read_manifest
from tasks.core.run.stages import EXPORT, EXPORT_ADAPTER, ROWS, Status
from tasks.flowkit import automation, ui
from tasks.flowkit.pipeline import bind
from tasks.flowkit.retry import transient
from tasks.flowkit.stage import StageResult, recorded_metrics, secret_token, store_for

ADAPTER_SUBFOLDER = "adapter"  # the adapter's folder in the model repo when hub.adapter_repo_id is unset


def files_to_push(export_dir: Path, manifest: dict[str, Any], provenance: bool = True) -> list[str]:
    """The model files of the export (plus its provenance subfolder when asked), never a stray
    `*.safetensors` nor an adapter: the model-folder rule of `tasks.core.models.folder`."""
    names = sorted(manifest["files"])
    problems = folder_problems(export_dir, names)
    if problems:
        raise HubRefusal("push_to_hub: " + "; ".join(problems))
    model = [n for n in names if not n.startswith(PROVENANCE_DIR + "/") and n != CARD]
    return model + ([n for n in names if n.startswith(PROVENANCE_DIR + "/")] + [MANIFEST] if provenance else [])


def adapter_files(adapter_dir: Path, provenance: bool = True) -> dict[str, Path]:
    """What goes up of export-adapter/ (the name in the adapter's folder -> the local file): peft's
    two files, plus its provenance when asked."""
    names = sorted(read_manifest(adapter_dir)["files"])
    keep = [n for n in names if not n.startswith(PROVENANCE_DIR + "/")] + (
        [n for n in names if n.startswith(PROVENANCE_DIR + "/")] + [MANIFEST] if provenance else []
    )
    return {n: adapter_dir / n for n in keep}


def push_export(
    export_dir: Path,
    files: list[str],
    card: str,
    hub: HubConfig,
    token: str,
    log: Callable[[str], None] = print,
    extra: dict[str, Path] | None = None,
) -> dict[str, Any]:
    """One commit of `files` (relative to export_dir) + README.md + `extra` (path in the repo ->
    local file) to hub.repo_id@hub.revision.

    Returns repo_id, revision, commit_url, commit_oid, parent_commit and `changed` (False when the
    Hub already held exactly this export, in which case no commit was made).
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    api = HfApi(token=token)
    repo_url = api.create_repo(hub.repo_id, private=hub.private, exist_ok=True, repo_type="model")
    if hub.revision != "main":
        api.create_branch(hub.repo_id, branch=hub.revision, exist_ok=True)
    head = api.repo_info(hub.repo_id, revision=hub.revision, repo_type="model").sha
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(export_dir / name))
        for name in sorted(files)
        if name != CARD
    ]
    operations += [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)) for name, path in sorted((extra or {}).items())
    ]
    operations.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.encode()))
    # A *.safetensors an earlier push left (an old layout's fingerprint, shards of a run with more
    # of them) would be loaded as weights by every consumer, and an adapter/ it left no longer fits
    # these merged weights: removed in the same commit.
    pushed = set(files) | set(extra or {})
    stale = [
        p
        for p in api.list_repo_files(hub.repo_id, revision=head, repo_type="model")
        if (p.endswith(".safetensors") or p.startswith(ADAPTER_SUBFOLDER + "/")) and p not in pushed
    ]
    operations += [CommitOperationDelete(path_in_repo=p) for p in stale]
    # One commit; parent pinned so a concurrent writer makes this attempt fail (and retry) instead
    # of being overwritten. Unchanged files are dropped by the client, and an all-unchanged push
    # returns the current head without committing.
    commit = api.create_commit(
        repo_id=hub.repo_id,
        operations=operations,
        revision=hub.revision,
        commit_message=hub.commit_message,
        parent_commit=head,
        repo_type="model",
    )
    changed = commit.oid != head
    log(
        f"push_to_hub: {'committed' if changed else 'unchanged, no new commit:'} {commit.commit_url} "
        f"({len(operations)} files) to {hub.repo_id}@{hub.revision}"
    )
    return {
        "repo_id": hub.repo_id,
        "revision": hub.revision,
        "repo_url": str(repo_url),
        "commit_url": commit.commit_url,
        "commit_oid": commit.oid,
        "parent_commit": head,
        "changed": changed,
        "files": len(operations),
    }


@bind
@task(
    name=ROWS.push_to_hub.name,
    retries=3,
    retry_delay_seconds=20,
    retry_condition_fn=transient,
    task_run_name=ROWS.push_to_hub.name,
)
def push_to_hub(cfg: RunConfig, results: dict[str, StageResult]) -> StageResult:
    logger = get_run_logger()
    started = time.monotonic()
    if cfg.hub is None:
        logger.info("push_to_hub: skipped, no `hub:` section in the config (nothing is published)")
        return StageResult(ROWS.push_to_hub.name, Status.NOT_CONFIGURED, detail={"reason": "no hub configured"})
    found = find_hub_token(secret_token)
    if found is None:
        raise HubRefusal(
            "push_to_hub: no Hub token; set HF_TOKEN in the worker's environment, create the Prefect Secret block "
            f"'{SECRET_BLOCK}', "
            "or log the worker in with `hf auth login`"
        )
    store = store_for(cfg)
    export_dir = store.stage_in(EXPORT)  # sha256-verified against the export manifest
    manifest = read_manifest(export_dir)
    # The card the run wrote into the export (tasks/stages/export.py write_card), byte for byte; rendered
    # here only for an export that has none listed (made before cards were part of it).
    card = (
        (export_dir / CARD).read_text()
        if CARD in manifest["files"]
        else model_card(
            cfg,
            manifest,
            train_facts(cfg, results, store.read_text),
            recorded_metrics(results),
            base=base_facts(cfg, store.read_text),
            results=results,
        )
    )
    files = files_to_push(export_dir, manifest, cfg.hub.push_provenance)
    adapter_dir = store.stage_in(EXPORT_ADAPTER) if cfg.hub.push_adapter else None  # sha256-verified, like the export
    adapter = adapter_files(adapter_dir, cfg.hub.push_provenance) if adapter_dir else {}
    sent = {
        "repo_id": cfg.hub.repo_id,
        "subfolder": ADAPTER_SUBFOLDER,
    }  # where the adapter goes without a repo of its own
    try:
        if adapter and cfg.hub.adapter_repo_id:  # its own repo, its own commit, first: the model card points at it
            where = cfg.hub.model_copy(update={"repo_id": cfg.hub.adapter_repo_id})
            sent = push_export(
                export_dir,
                [],
                adapter_card(cfg, read_manifest(adapter_dir)),
                where,
                found.value,
                log=logger.info,
                extra=adapter,
            )
            adapter = {}
        outcome = push_export(
            export_dir,
            files,
            card,
            cfg.hub,
            found.value,
            log=logger.info,
            extra={f"{ADAPTER_SUBFOLDER}/{name}": path for name, path in adapter.items()},
        )
        if cfg.hub.push_adapter:
            outcome["adapter"] = sent
    except Exception as exc:
        from huggingface_hub import constants
        from huggingface_hub.errors import HfHubHTTPError

        status = getattr(getattr(exc, "response", None), "status_code", None)
        if not isinstance(exc, HfHubHTTPError) or status not in REFUSED_STATUS:
            raise

        raise HubTokenRefused(f"push_to_hub: {refused_token_message(found, constants.ENDPOINT, status)}") from None
    ui.link("hub-commit", outcome["commit_url"], f"{cfg.hub.repo_id}@{cfg.hub.revision}")
    automation.stage_event(
        ROWS.push_to_hub.name, "completed", cfg.name, outcome["commit_url"], changed=outcome.get("changed")
    )
    return StageResult(
        ROWS.push_to_hub.name,
        Status.COMPLETED,
        uri=outcome["repo_url"],
        seconds=time.monotonic() - started,
        detail=outcome,
    )
