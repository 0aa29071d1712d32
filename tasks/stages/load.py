"""Stage 1, load_from_hf: the base model into `runs/<run>/base/` as a verified HF artifact.

Accepts a Hub repo id or a local/fsspec path to an HF directory. A Hub revision (branch, tag or
sha) is first resolved to its commit sha, and `snapshot_download` fetches exactly that commit, so
the files cannot change under us mid-download; every LFS file is then checked against the sha256
the Hub lists for it. The manifest records the repo, the requested revision and the commit sha.
HF_ENDPOINT selects the Hub; the token is the same as push_to_hub's (HF_TOKEN, the Prefect
Secret block `hf-token`, or the saved `hf auth login` token, in that order). Only safetensors
weights are taken unless `base_model.allow_pickle`; then pickle-only weights are converted here,
once, to safetensors (`convert_pickle`), so every later stage reads safetensors; the manifest's
meta `converted_from_pickle` records the source files and their sha256. A model folder's code never
comes along: no `.py` file is copied (meta `left_out` names it) and every `auto_map` of its configs,
nested sections included, is removed with a logged line (meta `removed_auto_map`), so nothing later
(cpt/hf/, the export, the Hub) carries it and the model loads as transformers' own class. The files
are judged before anything loads them (`shapes.folder_refusals`: config.json's sizes against the
safetensors headers, the weights' dtypes and keys); a load that still fails on the model itself is a
ConfigError, so the retry condition fails it at once, while a download's network error is retried.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # runs this first
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from prefect import get_run_logger

from tasks.core.config.paths import resolve_local
from tasks.core.config.schema import RunConfig
from tasks.core.errors import ConfigError, ConversionError, ManifestError, StageFailed
from tasks.core.hub.repo import is_hub_id
from tasks.core.models.fingerprint import hf_dir_logits, save_fingerprint
from tasks.core.models.folder import (
    JSON_FILES,
    config_dtype,
    is_code,
    json_file_problem,
    misnamed,
    safetensors_problems,
    strip_auto_map,
)
from tasks.core.models.shapes import folder_refusals
from tasks.core.run.manifest import sha256_file
from tasks.core.run.stages import ROWS
from tasks.core.storage.fs import fetch_tree, filesystem, is_local
from tasks.flowkit.retry import transient
from tasks.flowkit.stage import Stage, StageResult, stage_task, token

CODE_LEFT_OUT = "the model folder's own Python code: no model code runs here, and none is carried on"
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
PICKLE_PATTERNS = ["*.bin", "*.bin.index.json", "*.pt", "*.pth"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")
SIDE_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "*.model",
    "vocab.*",
    "merges.txt",
    "chat_template*",
    "added_tokens.json",
]


def _download_hub(cfg: RunConfig, dest: Path) -> dict:
    from huggingface_hub import HfApi, constants, snapshot_download

    b = cfg.base_model
    hf_token = token()
    info = HfApi(token=hf_token).model_info(b.uri, revision=b.revision, files_metadata=True)
    patterns = WEIGHT_PATTERNS + SIDE_FILES + (PICKLE_PATTERNS if b.allow_pickle else [])
    snapshot_download(repo_id=b.uri, revision=info.sha, local_dir=str(dest), allow_patterns=patterns, token=hf_token)
    shutil.rmtree(dest / ".cache", ignore_errors=True)
    lfs = {s.rfilename: s.lfs.sha256 for s in (info.siblings or []) if s.lfs is not None}
    for path in sorted(p for p in dest.rglob("*") if p.is_file()):
        rel = path.relative_to(dest).as_posix()
        if rel in lfs and sha256_file(path) != lfs[rel]:
            raise ManifestError(
                f"{b.uri}@{info.sha}: downloaded {rel} does not match the sha256 the Hub lists for it (a retry "
                "downloads it again)"
            )
    return {
        "source": "hub",
        "repo_id": b.uri,
        "revision": b.revision,
        "commit_sha": info.sha,
        "endpoint": constants.ENDPOINT,
    }


def _copy_path(cfg: RunConfig, dest: Path) -> dict:
    uri = resolve_local(cfg.base_model.uri)
    if is_local(uri):
        src = Path(filesystem(uri)[1])
        if not (src / "config.json").is_file():
            raise ConfigError(
                [
                    (
                        "base_model.uri",
                        (
                            f"{src} is not an HF model directory (no config.json); for the demo run `python -m "
                            f"tasks.core.models.demo --out {cfg.base_model.uri}` first"
                        ),
                    )
                ]
            )
        left_out = misnamed(src)  # not what their name says: never copied (load_from_hf names them)
        for path in sorted(src.rglob("*")):
            if path.is_file() and is_code(path.name):  # a model folder's own code: never copied, never run
                left_out[path.relative_to(src).as_posix()] = CODE_LEFT_OUT
            elif path.is_file() and not path.name.startswith(".") and path.relative_to(src).as_posix() not in left_out:
                target = dest / path.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    else:
        fs, root = filesystem(uri)
        if not fs.exists(f"{root.rstrip('/')}/config.json"):
            raise ConfigError([("base_model.uri", f"{uri} has no config.json")])
        fetch_tree(uri, dest, skip=lambda rel: any(part.startswith(".") for part in rel.split("/")))
        left_out = {}
    return {"source": "path", "uri": cfg.base_model.uri, **({"left_out": left_out} if left_out else {})}


def check_weight_files(model_dir: Path, allow_pickle: bool) -> list[str]:
    names = [p.name for p in model_dir.iterdir()]
    safetensors = [n for n in names if n.endswith(".safetensors")]
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if not safetensors:
        if pickles and not allow_pickle:
            raise ConfigError(
                [
                    (
                        "base_model.allow_pickle",
                        (
                            f"{model_dir} has only pickle weights ({', '.join(sorted(pickles)[:3])}); pickle files "
                            "can run code when loaded. "
                            "Convert them to safetensors, or set base_model.allow_pickle: true if you trust the source"
                        ),
                    )
                ]
            )
        if not pickles:
            raise ConfigError([("base_model.uri", f"{model_dir} has no weight files (*.safetensors)")])
    return sorted(safetensors or pickles)


def convert_pickle(model_dir: Path, model_cfg: dict, uri: str) -> dict:
    """Replace the pickle weights in `model_dir` by safetensors, once, for every later stage.

    The pickles (and any other pickle file, e.g. training_args.bin) move out of the artifact into
    a sibling directory that is deleted afterwards; the converter unpickles only
    pytorch_model.bin or the shards its index names, with torch.load(weights_only=True), which
    refuses every object but tensors and containers (a `__reduce__` payload never runs). Tied
    weights are stored once, as save_pretrained does; many shards keep an index.
    """
    from tasks.core.models.convert import PICKLE_INDEX_NAME, convert_checkpoint  # here: the converter imports torch

    src = model_dir.with_name(model_dir.name + ".pickle")
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    try:
        sources = {}
        for path in sorted(model_dir.iterdir()):
            if path.is_file() and (path.name.endswith(PICKLE_SUFFIXES) or path.name == PICKLE_INDEX_NAME):
                sources[path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
                shutil.move(str(path), src / path.name)
        try:
            report = convert_checkpoint(src, model_dir, model_config=model_cfg, allow_pickle=True, write_config=False)
        except ConversionError as exc:
            why = (
                f"{uri}: its pickle weights cannot be converted: {exc}. torch.load(weights_only=True) loads tensors "
                "only, so a pickle that "
                "would run code is refused here; get safetensors weights from the model's source"
            )
            raise ConfigError([("base_model.uri", why)], header="load_from_hf refused the base model") from None
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return {"loader": "torch.load(weights_only=True)", "files": sources, **report.summary()}


def _verified_logits(cfg: RunConfig, model_dir: Path):
    """The logits of base/ through plain transformers. base/ is on the local disk by now, so a failure
    here other than the disk's (an OSError) is the model's own (a dtype, a shape, a config.json
    transformers cannot build) and the same on every try: a ConfigError, which is not retried."""
    try:
        return hf_dir_logits(
            model_dir, trust_remote_code=cfg.base_model.trust_remote_code, verify_memory_gb=cfg.verify_memory_gb
        )
    except (OSError, StageFailed):
        # the disk (a full one is judged by the retry condition), a file that vanished, or a preemption
        # notice raised at a safe point inside the check (Preempted): none of them is the model's
        raise
    except Exception as exc:  # the model's own: transformers' and torch's errors have no common type
        said = " ".join(str(exc).split())  # torch puts the cause on its second line
        said = said if len(said) <= 600 else said[:600] + "..."
        raise ConfigError(
            [
                (
                    "base_model.uri",
                    (
                        f"{cfg.base_model.uri}: transformers cannot load the model from {model_dir} ({type(exc).__name__}: "
                        f"{said}); the same on every try, so not retried: restore the weights and config.json from the "
                        "model's source"
                    ),
                )
            ],
            header="load_from_hf refused the base model",
        ) from exc


@stage_task(
    ROWS.load_from_hf,
    retries=2,
    retry_delay_seconds=15,
    retry_condition_fn=transient,
    task_run_name=ROWS.load_from_hf.name,
)
def load_from_hf(cfg: RunConfig) -> StageResult:
    logger = get_run_logger()
    stage = Stage(ROWS.load_from_hf.name, cfg)
    if stage.skipped:
        return stage.result
    with stage.build() as out:
        if is_hub_id(cfg.base_model.uri):
            logger.info("downloading %s@%s from the Hub", cfg.base_model.uri, cfg.base_model.revision)
            meta = _download_hub(cfg, out.dir)
        else:
            logger.info("copying base model from %s", cfg.base_model.uri)
            meta = _copy_path(cfg, out.dir)
        # Files that are not what their name says (a GGUF file named tokenizer.model, a stray shard)
        # and the folder's code stay out of base/, so no later folder copies them and nothing pushes them.
        stray = misnamed(out.dir)
        for name in stray:
            (out.dir / name).unlink()
        for path in sorted(p for p in out.dir.rglob("*") if p.is_file() and is_code(p.name)):  # a Hub snapshot's
            stray[path.relative_to(out.dir).as_posix()] = CODE_LEFT_OUT
            path.unlink()
        if left_out := {**meta.pop("left_out", {}), **stray}:
            meta["left_out"] = left_out
            logger.warning(
                "left out of %s: %s",
                stage.uri,
                "; ".join(f"{n}: {why}" for n, why in left_out.items()),
            )
        broken = [(n, why) for n in JSON_FILES if (out.dir / n).is_file() and (why := json_file_problem(out.dir / n))]
        broken += list(safetensors_problems(out.dir).items())
        if broken:  # a Hub model's files are first read here; pre-flight read a local one's
            raise ConfigError(
                [
                    ("base_model.uri", f"{cfg.base_model.uri}: {n} {why}; restore it from the model's source")
                    for n, why in broken
                ],
                header="load_from_hf refused the base model",
            )
        if removed := strip_auto_map(out.dir):
            meta["removed_auto_map"] = removed
            logger.warning(
                "removed %s from %s: it names the model's own Python code, which this project never runs nor "
                "carries into cpt/hf/, the export or the Hub; the model loads as transformers' own %r class",
                ", ".join(removed),
                stage.uri,
                json.loads((out.dir / "config.json").read_text()).get("model_type"),
            )
        weights = check_weight_files(out.dir, cfg.base_model.allow_pickle)
        model_cfg = json.loads((out.dir / "config.json").read_text())
        if shape := folder_refusals(out.dir, model_cfg):  # a Hub model's index and generation config: first read here
            raise ConfigError([("base_model.uri", m) for m in shape], header="load_from_hf refused the base model")
        if not any(w.endswith(".safetensors") for w in weights):
            meta["converted_from_pickle"] = convert_pickle(out.dir, model_cfg, cfg.base_model.uri)
            logger.info("converted pickle weights %s to safetensors", ", ".join(meta["converted_from_pickle"]["files"]))
            weights = check_weight_files(out.dir, allow_pickle=False)
        meta.update(model_type=model_cfg.get("model_type"), vocab_size=model_cfg.get("vocab_size"), weights=weights)
        logits = _verified_logits(cfg, out.dir)
        fingerprint = save_fingerprint(logits, out.dir, config_dtype(model_cfg))
        out.manifest(kind="hf-model", meta=meta, fingerprint=fingerprint)
    return stage.done({k: v for k, v in meta.items() if k != "weights"})
