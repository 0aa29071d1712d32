"""A stage's config digest, computed one way for every stage from what its StageSpec declares.

    python -c "from tasks.core.run.digest import declared; print(declared())"   # what each digest covers

The skip rule (README, "Re-runs and retries"): a stage is skipped when its artifact's manifest
verifies AND records the config digest the stage would produce now. That digest is made from
  - the config fields the StageSpec declares (`digest` less `minus` and NEVER_DIGESTED),
  - the CONTENT digest of each parent artifact: its files (path, size, sha256) and the config digest
    it was made from, never the manifest's bytes, so a parent rebuilt to the same files (a new
    `created_at`) re-runs nothing below it, while a parent made from another config re-runs all of it,
  - the run-time inputs its task passes (prepare_data: the identity of every input file).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from tasks.core.config.layout import global_batch
from tasks.core.config.schema import RunConfig
from tasks.core.run.stages import GLOBAL_BATCH, NEVER_DIGESTED, STAGES, StageSpec, run_stage

__all__ = ["config_digest", "content_digest", "declared", "digest", "digest_fields"]


def digest(obj: Any) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of a pydantic model or plain data."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def content_digest(manifest: Mapping[str, Any]) -> str:
    """What an artifact is, whenever it was made: its file table (less its `views`, files rendered
    from records such as the export's model card) and the config digest it records."""
    views = set(manifest.get("views") or ())
    files = {
        rel: [entry["size"], entry["sha256"]] for rel, entry in sorted(manifest["files"].items()) if rel not in views
    }
    return digest({"config_digest": manifest.get("config_digest"), "files": files})


def _get(tree: Any, path: str) -> Any:
    node = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(
                f"digest field {path!r} is not a config field (no {part!r}); fix the stage's digest fields in "
                "tasks/core/run/stages.py"
            )
        node = node[part]
    return node


def _drop(tree: dict[str, Any], path: str) -> None:
    *parents, leaf = path.split(".")
    node: Any = tree
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:  # an optional section left out (hub: null): nothing to drop
            return
    if isinstance(node, dict):
        node.pop(leaf, None)


def _excluded(spec: StageSpec) -> tuple[str, ...]:
    return (*spec.minus, *NEVER_DIGESTED)


def digest_fields(cfg: RunConfig, stage: str) -> dict[str, Any]:
    """{config path: value} of every field `stage`'s artifact is made from."""
    spec = run_stage(cfg.phases, stage)
    dump = cfg.model_dump(mode="json")
    out: dict[str, Any] = {}
    for path in spec.digest:
        if any(path == ex or path.startswith(ex + ".") for ex in NEVER_DIGESTED):
            raise ValueError(
                f"{stage}: digest field {path!r} is in NEVER_DIGESTED (tasks/core/run/stages.py); it changes no "
                "artifact, so remove it from the stage's digest fields"
            )
        value = copy.deepcopy(_get(dump, path))
        for ex in _excluded(spec):
            if ex.startswith(path + "."):
                _drop(value, ex[len(path) + 1 :])
        out[path] = value
    if spec.global_batch:
        phase_cfg = cfg.phase(spec.global_batch)
        # keep_global_batch: the checkpoints' global batch wins on any layout (tasks/core/config/elastic.py)
        out[f"{spec.global_batch}.{GLOBAL_BATCH}"] = (
            "kept" if phase_cfg.elastic.keep_global_batch else global_batch(phase_cfg)
        )
    return out


def config_digest(
    cfg: RunConfig, stage: str, parents: Mapping[str, str], inputs: Any = None, fields: Mapping[str, Any] | None = None
) -> str:
    """The digest of `stage` from its declared config fields, its parents' content digests
    ({parent stage: content_digest}) and its run-time inputs. `fields`: values put in place of the
    config's (pre-flight asks what the digest would be at a checkpoint's global batch)."""
    spec = run_stage(cfg.phases, stage)  # the row as this run has it (the export follows the last phase)
    if spec.continues:
        raise ValueError(
            f"{stage} carries the digest of its {spec.continues} artifact; read it from that manifest instead"
        )
    if sorted(parents) != sorted(spec.parents):
        raise ValueError(
            f"{stage}: digest given parents {sorted(parents)}, its StageSpec declares {list(spec.parents)}; pass the "
            "declared parents' results"
        )
    return digest(
        {
            "stage": stage,
            "config": {**digest_fields(cfg, stage), **(fields or {})},
            "parents": dict(sorted(parents.items())),
            "inputs": inputs,
        }
    )


def declared() -> dict[str, dict[str, Any]]:
    """Each artifact stage's declared digest: fields, exclusions, parents (or the stage it continues)."""
    out: dict[str, dict[str, Any]] = {}
    for s in STAGES:
        if s.artifact is None:
            continue
        minus = [ex for ex in _excluded(s) if any(ex.startswith(f + ".") for f in s.digest)]
        out[s.name] = (
            {"continues": s.continues}
            if s.continues
            else {"fields": list(s.digest), "minus": minus, "parents": list(s.parents)}
        )
    return out
