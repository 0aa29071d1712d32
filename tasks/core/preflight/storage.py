"""Pre-flight checks of where the run writes: the run root is reachable and writable, the
artifacts already under it are trustworthy by name, and there is local space for the checkpoints.

    python -m flows.cpt_to_sft --config deployments/configs/tiny-cpu.yaml --check

Staging space is an estimate (parameter count from the model family's tensor table): a training
checkpoint is weights in the training precision + fp32 Adam moments (8 B/param) + fp32 master
weights when training in bf16/fp16 (4 B/param); a local run root keeps `keep_last + 1` of them per
stage at once (the new one is committed before the oldest is deleted), plus the three HF copies
(base, cpt/hf, export). A remote run root stages, per stage, the `keep_last` newest published
checkpoints plus up to `max_pending_publishes` still uploading (the engine waits at a save beyond
that; tasks/engine/backpressure.py), plus the one being written: keep_last + max_pending_publishes + 1.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from tasks.core.config.schema import RunConfig, StageConfig
from tasks.core.errors import ManifestError
from tasks.core.models.folder import folder_problems
from tasks.core.preflight.model_info import DTYPE_BYTES, estimate_parameters
from tasks.core.preflight.report import CheckContext
from tasks.core.run.manifest import MANIFEST, artifact_of, inside_artifact, safe_relpath
from tasks.core.storage.fs import is_local

ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master weights kept by mixed-precision optimizers


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"


def check_run_root(ctx: CheckContext) -> None:
    """The run root is reachable and writable: write, read back and delete a probe object."""
    from tasks.core.storage.fs import RunStore

    uri = ctx.cfg.run_uri
    probe = f".preflight-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        store = RunStore(uri, staging_dir=ctx.cfg.staging_dir)
    except (ValueError, ImportError) as exc:
        ctx.problem("run_root", f"{uri}: not reachable ({type(exc).__name__}: {exc}); use a local path or an fsspec URI whose filesystem is installed (s3:// needs s3fs)")
        return
    try:
        store.write_text(probe, "cpt-to-sft pre-flight probe\n")
        if store.read_text(probe) != "cpt-to-sft pre-flight probe\n":
            raise OSError("the probe read back differently")
        store.remove(probe)
    except Exception as exc:
        ctx.problem("run_root", f"{uri}: not writable ({type(exc).__name__}: {exc}); point run_root at a directory this worker can create files in")
        return
    ctx.ok(f"run root {uri}: reachable, probe object written, read back and deleted")
    _check_existing_manifests(ctx, store)


def _check_existing_manifests(ctx: CheckContext, store: Any) -> None:
    """Artifacts already under the run root (a resume) are untrusted: every manifest path must
    stay inside its artifact, and a model folder keeps the folder rule (`tasks.core.models.folder`).
    Only names, link targets and a weight index are read here, never weights."""
    fs, root = store.fs, store.root.rstrip("/")
    found = []
    for depth in ("*", "*/*"):
        try:
            found += fs.glob(f"{root}/{depth}/{MANIFEST}")
        except Exception:  # a fresh run root may not exist yet (some stores raise): nothing to check at this depth
            pass
    bad = 0
    for mpath in sorted(set(found)):
        art = artifact_of(mpath)
        rel_art = art[len(root) + 1 :]
        where = f"{store.uri(rel_art)}/{MANIFEST}"
        try:
            with fs.open(mpath, "rb") as f:
                manifest = json.loads(f.read())
        except Exception as exc:
            ctx.warn(f"{where}: unreadable manifest ({type(exc).__name__}); that stage will be rebuilt")
            continue
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict):
            ctx.warn(f"{where}: manifest has no files table; that stage will be rebuilt")
            continue
        for rel in files:
            try:
                safe_relpath(rel, where)
                if store.local:
                    inside_artifact(Path(art), rel, where)
            except ManifestError as exc:
                bad += 1
                ctx.problem(where, f"{str(exc).removeprefix(where + ': ')}. Refusing to trust this artifact: move it aside or delete {store.uri(rel_art)}")
                break
        else:
            # The model-folder rule verify and push apply: a stray *.safetensors (listed or not) would be served as weights.
            try:
                strays = folder_problems(Path(art), require_weights=False) if store.local else []
            except ValueError as exc:  # an unreadable weight index
                strays = [str(exc)]
            bad += bool(strays)
            for msg in strays:
                ctx.problem(where, msg)
    if found and not bad:
        ctx.ok(f"existing artifacts under the run root: {len(found)} manifest(s), every listed path stays inside its artifact, no stray weight file")


def estimate_local_bytes(cfg: RunConfig, mc: dict[str, Any], local_run_root: bool) -> tuple[int, str] | None:
    """(bytes of local disk the run needs, how it was computed), or None without model dims."""
    n = estimate_parameters(mc)
    if n is None:
        return None
    base_bytes = DTYPE_BYTES.get(str(mc.get("torch_dtype", "float32")), 4)

    def ckpt(stage: StageConfig) -> int:
        w = DTYPE_BYTES[stage.plugin.precision]
        return n * (w + ADAM_BYTES + (MASTER_BYTES if w < 4 else 0))

    hf = n * (base_bytes + DTYPE_BYTES[cfg.cpt.plugin.precision] + DTYPE_BYTES[cfg.export.dtype])
    if local_run_root:
        kept = sum((getattr(cfg, s).keep_last + 1) * ckpt(getattr(cfg, s)) for s in ("cpt", "sft"))
        how = f"{n / 1e6:.1f}M params: (keep_last+1) checkpoints per stage at (weights + 8 B Adam + 4 B master if mixed) per param, plus 3 HF copies"
    else:
        staged = {s: getattr(cfg, s).keep_last + getattr(cfg, s).max_pending_publishes + 1 for s in ("cpt", "sft")}
        kept = max(staged[s] * ckpt(getattr(cfg, s)) for s in staged)
        how = (f"{n / 1e6:.1f}M params: (keep_last + max_pending_publishes + 1) staged checkpoints of the larger stage "
               f"(cpt {staged['cpt']}, sft {staged['sft']}) plus 3 HF copies")
    return kept + hf, how


def check_staging_space(ctx: CheckContext) -> None:
    """Enough local disk for the estimated checkpoints (run root if local, else the staging dir)."""
    if ctx.model is None:
        return
    from tasks.core.storage.fs import local_path_of

    uri = ctx.cfg.run_uri
    try:
        local = is_local(uri)
    except (ValueError, ImportError):
        return  # reported by check_run_root
    if local:
        where = local_path_of(uri)
    else:
        import tempfile

        where = Path(ctx.cfg.staging_dir) if ctx.cfg.staging_dir else Path(tempfile.gettempdir())
    est = estimate_local_bytes(ctx.cfg, ctx.model.config, local)
    if est is None:
        ctx.warn("staging space not checked: config.json lacks the dimensions to estimate the parameter count")
        return
    need, how = est
    free = ctx.machine.free_bytes
    if free is None:
        probe = where
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            free = shutil.disk_usage(probe).free
        except OSError:
            ctx.warn(f"staging space not checked: cannot stat {probe}")
            return
    field_ = "run_root" if local else "staging_dir"
    if free < need:
        ctx.problem(field_, f"{where}: {_human(free)} free, the run needs about {_human(need)} ({how}); free space, lower keep_last, or point {field_} at a larger disk")
    else:
        ctx.ok(f"local space at {where}: {_human(free)} free >= about {_human(need)} needed ({how})")
