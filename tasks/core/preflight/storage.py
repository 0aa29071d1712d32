"""Pre-flight checks of paths: the run root is reachable and writable, the artifacts already
under it are trustworthy by name and keep the model-folder rule, there is local space for the
checkpoints, the run never reads what it writes (run root, staging dir and data sources apart),
and a local base model's files all resolve inside its directory.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check

Staging space is an estimate (parameter count from the model family's tensor table): a training
checkpoint is weights in the dtype the plugin trains + fp32 Adam moments (8 B/param) + the fp32 master
weights where the plugin keeps them apart (bf16/fp16 under every plugin but torch_ddp: 4 B/param,
`PluginSpec.saves_masters`; tasks/engine/masters.py saves them and a resume restores them); a local run root keeps `keep_last + 1` of them per
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

from tasks.core.config.plugins import spec_of
from tasks.core.config.schema import PhaseConfig, RunConfig
from tasks.core.errors import ConversionError, ManifestError
from tasks.core.models.folder import config_dtype, folder_problems
from tasks.core.preflight.model_info import DTYPE_BYTES, estimate_parameters
from tasks.core.preflight.report import CheckContext
from tasks.core.run.manifest import MANIFEST, artifact_of, inside_artifact, safe_relpath
from tasks.core.run.stages import SUPERSEDED
from tasks.core.storage.fs import is_local, local_path_of
from tasks.core.storage.oserrors import human_bytes

ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master weights, saved where the plugin keeps them (PluginSpec.saves_masters)


def check_run_root(ctx: CheckContext) -> None:
    """The run root is reachable and writable: write, read back and delete a probe object."""
    from tasks.core.storage.fs import RunStore

    uri = ctx.cfg.run_uri
    probe = f".preflight-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        store = RunStore(uri, staging_dir=ctx.cfg.staging_dir)
    except (ValueError, ImportError) as exc:
        ctx.problem(
            "run_root",
            f"{uri}: not reachable ({type(exc).__name__}: {exc}); use a local path or an fsspec URI whose filesystem "
            "is installed (s3:// needs s3fs)",
        )
        return
    if store.local and not _own_root(ctx, Path(store.root)):
        return
    try:
        if store.local:
            _probe_local(Path(store.root), probe)
        else:
            store.write_text(probe, "cpt-to-sft pre-flight probe\n")
            if store.read_text(probe) != "cpt-to-sft pre-flight probe\n":
                raise OSError("the probe read back differently")
            store.remove(probe)
    except Exception as exc:
        ctx.problem(
            "run_root",
            f"{uri}: not writable ({type(exc).__name__}: {exc}); point run_root at a directory this worker can create "
            "files in",
        )
        return
    ctx.ok(f"run root {uri}: reachable, probe object written, read back and deleted")
    _check_existing_manifests(ctx, store)


def _probe_local(root: Path, probe: str) -> None:
    """Write, read back and delete a probe inside the run root. A root that does not exist yet is
    created for it, with its missing parents, and removed again with them: the probe is never
    written beside the run root, and a check leaves nothing behind, not even the run root."""
    made = [p for p in (root, *root.parents) if not p.exists() and not p.is_symlink()]  # deepest first
    root.mkdir(parents=True, exist_ok=True)
    path = root / probe
    try:
        if not root.is_dir():
            raise NotADirectoryError(f"{root} is not a directory")
        path.write_text("cpt-to-sft pre-flight probe\n")
        if path.read_text() != "cpt-to-sft pre-flight probe\n":
            raise OSError("the probe read back differently")
    finally:
        path.unlink(missing_ok=True)
        for p in made:  # one that something else filled meanwhile stays, and so do its parents
            try:
                p.rmdir()
            except OSError:
                break


RUN_JSON_MAX_BYTES = 16 << 20  # a run.json is tens of KB; a bigger one is not read to tell whose it is


def _link_of(root: Path) -> str | None:
    """How `root` goes through a symbolic link ("a symbolic link to X", "under the symbolic link L -> X"), or None."""
    try:
        if root.is_symlink():
            return f"a symbolic link to {os.readlink(root)} ({root.resolve()})"
        for p in root.absolute().parents:
            if p.is_symlink():
                return f"under the symbolic link {p} -> {os.readlink(p)} ({root.resolve()})"
    except (OSError, RuntimeError):  # a link loop: said as such
        return "a symbolic link that does not resolve (a loop)"
    return None


def _own_root(ctx: CheckContext, root: Path) -> bool:
    """False (with the problem said) when the local run root is reached through a symbolic link and its
    run.json is another run's: this run would overwrite that run's records and leave its export's card
    stale. A dangling link is refused too. A root named directly whose run.json is another run's is a
    warning: the config names that directory itself."""
    from tasks.core.run.stages import RUN_JSON

    link = _link_of(root)
    if root.is_symlink() and not root.exists():
        ctx.problem(
            "run_root",
            f"{root} is {link}, which does not exist; point run_root at a directory, or create the link's target",
        )
        return False
    record = root / RUN_JSON
    try:
        if not record.is_file() or record.stat().st_size > RUN_JSON_MAX_BYTES:
            return True
        other = json.loads(record.read_bytes())
    except (OSError, ValueError):  # unreadable: the flow's own record rewrites it; nothing says whose it was
        return True
    name = other.get("run") if isinstance(other, dict) else None
    if not isinstance(name, str) or name == ctx.cfg.name:
        return True
    whose = f"its {RUN_JSON} is run {name[:100]!r}'s (run_root {str(other.get('run_root'))[:300]})"
    if link is None:
        ctx.warn(f"run root {root}: {whose}; this run ({ctx.cfg.name}) takes that record over")
        return True
    ctx.problem(
        "run_root",
        f"{root} is {link}, and {whose}: this run ({ctx.cfg.name}) would overwrite that run's records and leave "
        f"its export's card stale; point run_root at a directory of this run's own, or set name: {name[:100]} to "
        "continue that run",
    )
    return False


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
    # Work moved aside (<dir>.superseded-<time>) is kept for the user, never read by the run.
    found = [m for m in found if SUPERSEDED not in m[len(root) :]]
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
                ctx.problem(
                    where,
                    f"{str(exc).removeprefix(where + ': ')}. Refusing to trust this artifact: move it aside or delete "
                    f"{store.uri(rel_art)}",
                )
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
        ctx.ok(
            f"existing artifacts under the run root: {len(found)} manifest(s), every listed path stays inside its "
            "artifact, no stray weight file"
        )


def estimate_local_bytes(cfg: RunConfig, mc: dict[str, Any], local_run_root: bool) -> tuple[int, str] | None:
    """(bytes of local disk the run needs, how it was computed), or None without model dims."""
    n = estimate_parameters(mc)
    if n is None:
        return None
    base_bytes = DTYPE_BYTES.get(config_dtype(mc), 4)

    def ckpt(phase_cfg: PhaseConfig) -> int:
        p = phase_cfg.plugin
        spec = spec_of(p.name)
        w = DTYPE_BYTES[spec.weights_dtype(p.precision)]
        return n * (w + ADAM_BYTES + (MASTER_BYTES if spec.saves_masters(p.precision, p.zero_stage) else 0))

    hf = n * (base_bytes + DTYPE_BYTES[cfg.cpt.plugin.precision] + DTYPE_BYTES[cfg.export.dtype])
    if local_run_root:
        kept = sum((cfg.phase(s).keep_last + 1) * ckpt(cfg.phase(s)) for s in cfg.phases)
        how = (
            f"{n / 1e6:.1f}M params: (keep_last+1) checkpoints per stage at (weights + 8 B Adam + 4 B fp32 "
            "master where the plugin keeps one) per param, plus 3 HF copies"
        )
    else:
        staged = {s: cfg.phase(s).keep_last + cfg.phase(s).max_pending_publishes + 1 for s in cfg.phases}
        kept = max(staged[s] * ckpt(cfg.phase(s)) for s in staged)
        how = (
            f"{n / 1e6:.1f}M params: (keep_last + max_pending_publishes + 1) staged checkpoints of the larger stage "
            f"(cpt {staged['cpt']}, sft {staged['sft']}) plus 3 HF copies"
        )
    return kept + hf, how


def unestimated(mc: dict[str, Any]) -> str:
    """Why config.json gives no parameter count: its family is not known (the family registry's own
    words, naming the known ones and where to add it), or a dimension is missing."""
    from tasks.core.models.families import family_config

    try:
        family_config(mc)
    except ConversionError as exc:
        return str(exc)
    return "config.json lacks the dimensions to estimate the parameter count"


def check_staging_space(ctx: CheckContext) -> None:
    """Enough local disk for the estimated checkpoints (run root if local, else the staging dir)."""
    if ctx.model is None:
        return

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
        ctx.warn(f"staging space not checked: {unestimated(ctx.model.config)}")
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
        ctx.problem(
            field_,
            f"{where}: {human_bytes(free)} free, the run needs about {human_bytes(need)} ({how}); free space, lower "
            f"keep_last, or point {field_} at a larger disk",
        )
    else:
        ctx.ok(f"local space at {where}: {human_bytes(free)} free >= about {human_bytes(need)} needed ({how})")


def _location(uri: str) -> str | None:
    """A comparable form of a path or URI: the real local path, else the URI without a trailing
    slash; for a glob, the directory above its first wildcard. None when it cannot be told."""
    from tasks.core.config.paths import resolve_local

    target = resolve_local(str(uri))
    if any(c in target for c in "*?["):
        target = target[: min(target.find(c) for c in "*?[" if c in target)].rsplit("/", 1)[0] or "/"
    try:
        return os.path.realpath(local_path_of(target)) if is_local(target) else target.rstrip("/")
    except (ValueError, ImportError):
        return None


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def check_paths(ctx: CheckContext) -> None:
    """The run never reads its own output as input: no run_root or staging_dir inside a data
    source, and no data source inside the run root (a second run would read the first one's
    held-out JSONL and generations.jsonl as corpus)."""
    cfg = ctx.cfg
    writes = [("run_root", cfg.run_uri)] + ([("staging_dir", str(cfg.staging_dir))] if cfg.staging_dir else [])
    sources = [(f"{s}.data.uri", u) for s in cfg.phases for u in cfg.phase(s).data.uris]
    sources += [
        (f"{s}.eval.heldout_uri", cfg.phase(s).eval.heldout_uri) for s in cfg.phases if cfg.phase(s).eval.heldout_uri
    ]
    bad = 0
    for wfield, wuri in writes:
        w = _location(wuri)
        for sfield, suri in sources:
            s = _location(suri)
            if w is None or s is None:
                continue
            source_is_dir = not is_local(s) or os.path.isdir(s) or any(c in str(suri) for c in "*?[")
            if source_is_dir and _within(w, s):
                bad += 1
                ctx.problem(
                    wfield,
                    f"{wfield} {w} is inside the data source {sfield} = {s}: the run's own files (held-out JSONL, "
                    "generations.jsonl, "
                    f"checkpoints) would be read as data by the next run; point {wfield} outside {s}",
                )
            elif _within(s, w):
                bad += 1
                ctx.problem(
                    sfield,
                    f"{sfield} {s} is inside {wfield} = {w}, which the run writes and deletes in; "
                    f"move the data out of {w}, or point {wfield} elsewhere",
                )
    if not bad:
        ctx.ok(
            f"paths: {' and '.join(f for f, _ in writes)} and the {len(sources)} data source(s) do not contain one "
            "another"
        )


def check_base_model_links(ctx: CheckContext) -> None:
    """Every file of a local base model is its own: a link resolving outside the model directory
    (or to nothing) is refused, since load_from_hf copies through links. The Hub cache's layout
    (snapshots/<sha>/ linking into the repo's blobs/) is the one accepted exception."""
    if ctx.model is None or ctx.model.source != "local":
        return
    root = Path(ctx.model.where)
    real_root = root.resolve()
    allowed = [real_root] + ([real_root.parent.parent / "blobs"] if real_root.parent.name == "snapshots" else [])
    bad = 0
    for path in sorted(root.rglob("*")):
        if not path.is_symlink():
            continue
        target = Path(os.path.realpath(path))
        if not target.exists():
            why = f"a link to {target}, which does not exist"
        elif not any(_within(str(target), str(a)) for a in allowed):
            why = f"a link to {target}, outside the model directory {real_root}"
        else:
            continue
        bad += 1
        ctx.problem(
            "base_model.uri",
            f"{path} is {why}: load_from_hf would copy whatever the link points at as the model's file; "
            f"copy the real file into {root} (or point base_model.uri at the directory that holds it)",
        )
    if not bad:
        ctx.ok(f"base model {root}: every file resolves inside its directory")
