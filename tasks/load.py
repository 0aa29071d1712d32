"""Stage 1, load_from_hf: the base model into `runs/<run>/base/` as a verified HF artifact.

Accepts a Hub repo id or a local/fsspec path to an HF directory. A Hub revision (branch, tag or
sha) is first resolved to its commit sha, and `snapshot_download` fetches exactly that commit, so
the files cannot change under us mid-download; every LFS file is then checked against the sha256
the Hub lists for it. The manifest records the repo, the requested revision and the commit sha.
HF_ENDPOINT selects the Hub; the token is the same as push_to_hub's (HF_TOKEN or the Prefect
Secret block `hf-token`). Only safetensors weights are taken unless `base_model.allow_pickle`.

    python -m flows.cpt_to_sft --config deployments/configs/tiny-cpu.yaml   # runs this first
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from prefect import get_run_logger, task

from tasks import ui
from tasks.common import StageResult, completed, done, fresh_dir, resolve_local, skipped, stage_digest, store_for
from tasks.core.config import RunConfig
from tasks.core.errors import ConfigError, ManifestError
from tasks.core.fingerprint import hf_dir_logits, save_fingerprint
from tasks.core.manifest import sha256_file, write_manifest
from tasks.core.storage import fetch_tree, filesystem, is_local

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
PICKLE_PATTERNS = ["*.bin", "*.bin.index.json", "*.pt", "*.pth"]
SIDE_FILES = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "*.model", "vocab.*", "merges.txt", "chat_template*", "added_tokens.json"]


def is_hub_id(uri: str) -> bool:
    return bool(HUB_ID.match(uri)) and not Path(resolve_local(uri)).exists() and "://" not in uri


def _download_hub(cfg: RunConfig, dest: Path) -> dict:
    from huggingface_hub import HfApi, constants, snapshot_download

    from tasks.push import hub_token

    b = cfg.base_model
    token = hub_token()
    info = HfApi(token=token).model_info(b.uri, revision=b.revision, files_metadata=True)
    patterns = WEIGHT_PATTERNS + SIDE_FILES + (PICKLE_PATTERNS if b.allow_pickle else [])
    snapshot_download(repo_id=b.uri, revision=info.sha, local_dir=str(dest), allow_patterns=patterns, token=token)
    shutil.rmtree(dest / ".cache", ignore_errors=True)
    lfs = {s.rfilename: s.lfs.sha256 for s in (info.siblings or []) if s.lfs is not None}
    for path in sorted(p for p in dest.rglob("*") if p.is_file()):
        rel = path.relative_to(dest).as_posix()
        if rel in lfs and sha256_file(path) != lfs[rel]:
            raise ManifestError(f"{b.uri}@{info.sha}: downloaded {rel} does not match the sha256 the Hub lists for it (a retry downloads it again)")
    return {"source": "hub", "repo_id": b.uri, "revision": b.revision, "commit_sha": info.sha, "endpoint": constants.ENDPOINT}


def _copy_path(cfg: RunConfig, dest: Path) -> dict:
    uri = resolve_local(cfg.base_model.uri)
    if is_local(uri):
        src = Path(filesystem(uri)[1])
        if not (src / "config.json").is_file():
            raise ConfigError([("base_model.uri", f"{src} is not an HF model directory (no config.json); for the demo run `python -m tasks.core.demo_inputs --out {cfg.base_model.uri}` first")])
        for path in sorted(src.rglob("*")):
            if path.is_file() and not path.name.startswith("."):
                target = dest / path.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    else:
        fs, root = filesystem(uri)
        if not fs.exists(f"{root.rstrip('/')}/config.json"):
            raise ConfigError([("base_model.uri", f"{uri} has no config.json")])
        fetch_tree(uri, dest, skip=lambda rel: any(part.startswith(".") for part in rel.split("/")))
    return {"source": "path", "uri": cfg.base_model.uri}


def check_weight_files(model_dir: Path, allow_pickle: bool) -> list[str]:
    names = [p.name for p in model_dir.iterdir()]
    safetensors = [n for n in names if n.endswith(".safetensors")]
    pickles = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))]
    if not safetensors:
        if pickles and not allow_pickle:
            raise ConfigError([("base_model.allow_pickle", f"{model_dir} has only pickle weights ({', '.join(sorted(pickles)[:3])}); pickle files can run code when loaded. Convert them to safetensors, or set base_model.allow_pickle: true if you trust the source")])
        if not pickles:
            raise ConfigError([("base_model.uri", f"{model_dir} has no weight files (*.safetensors)")])
    return sorted(safetensors or pickles)


@task(name="load_from_hf", retries=2, retry_delay_seconds=15, task_run_name="load_from_hf")
def load_from_hf(cfg: RunConfig) -> StageResult:
    logger = get_run_logger()
    started = time.monotonic()
    store, rel = store_for(cfg), "base"
    cdigest = stage_digest("load", cfg.base_model, None)
    if completed(store, rel, cdigest):
        return skipped("load_from_hf", store, rel, started)
    with fresh_dir(store.local_path(rel)) as tmp:
        if is_hub_id(cfg.base_model.uri):
            logger.info("downloading %s@%s from the Hub", cfg.base_model.uri, cfg.base_model.revision)
            meta = _download_hub(cfg, tmp)
        else:
            logger.info("copying base model from %s", cfg.base_model.uri)
            meta = _copy_path(cfg, tmp)
        weights = check_weight_files(tmp, cfg.base_model.allow_pickle)
        import json

        model_cfg = json.loads((tmp / "config.json").read_text())
        meta.update(model_type=model_cfg.get("model_type"), vocab_size=model_cfg.get("vocab_size"), weights=weights)
        if all(w.endswith(".safetensors") for w in weights):
            logits = hf_dir_logits(tmp, trust_remote_code=cfg.base_model.trust_remote_code)
            fingerprint = save_fingerprint(logits, tmp, str(model_cfg.get("torch_dtype", "float32")))
        else:
            fingerprint = None  # pickle weights are converted by the shard stage, not loaded here
        write_manifest(tmp, kind="hf-model", meta=meta, config_digest=cdigest, fingerprint=fingerprint)
    result = done("load_from_hf", store, rel, started, **{k: v for k, v in meta.items() if k != "weights"})
    ui.stage_event("load_from_hf", "completed", cfg.name, result.uri)
    return result
