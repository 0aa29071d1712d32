"""The stage protocol every stage task follows, written once: skip -> build -> manifest -> publish -> event.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # every stage goes through here

The skip rule (README, "Re-runs and retries"): a stage is skipped when its artifact's manifest
verifies AND records the config digest the stage would produce now. `Stage` computes that digest
one way for every stage (tasks/core/run/digest.py) from the config fields its StageSpec declares
and its parents' content digests (their files and config digests, not their manifests' bytes), so
changing a stage's config re-runs that stage and, through the chain of parents, everything downstream.

A stage task body is its real work:

    @stage_task(ROWS.unshard)                     # the row: the task's name, what it reads
    def unshard(cfg, cpt):
        st = Stage(ROWS.unshard.name, cfg, cpt)   # the declared parents' results
        if st.skipped:
            return st.result
        with st.build() as out:                   # <artifact>.tmp-build, swapped in on success
            ...write files into out.dir...
            out.manifest(kind="hf-model", meta=..., parent=cpt)   # written last
        return st.done(detail=...)                # publish, log, completed event, StageResult

A skipped stage ends its task run in a Completed state named "Skipped", so the Prefect UI shows
what happened; the manifest stays the source of truth. The flow calls stage tasks with
`return_state=True` and reads the StageResult with `outcome()`.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import wraps
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.states import Completed, Failed, State

from tasks.core.config.paths import resolve_local
from tasks.core.config.schema import RunConfig
from tasks.core.errors import ArtifactMissing, ManifestError, Preempted
from tasks.core.hub.repo import SECRET_BLOCK, hub_token
from tasks.core.run.digest import config_digest, content_digest
from tasks.core.run.manifest import MANIFEST, list_files, read_manifest, verify_artifact, write_manifest
from tasks.core.run.stages import BUILD_SUFFIX, ROWS, STAGE, SUPERSEDED, StageSpec, Status, run_stage
from tasks.core.storage.fs import RunStore
from tasks.core.storage.oserrors import note_free
from tasks.core.storage.publisher import RETRIES, publish_retrying
from tasks.flowkit import automation
from tasks.flowkit.notices import critical, stop_on_notice
from tasks.flowkit.pipeline import bind

__all__ = [
    "PREEMPTED_STATE",
    "Stage",
    "StageResult",
    "completed",
    "disk_cause",
    "fresh_dir",
    "outcome",
    "recorded_metrics",
    "resolve_local",
    "secret_token",
    "stage_task",
    "store_for",
    "token",
    "write_record",
]


PREEMPTED_STATE = "Preempted"  # the Prefect state (task run, and a flow run past its preemption bound)


@dataclass
class StageResult:
    stage: str
    status: Status
    rel: str | None = None
    uri: str | None = None
    digest: str | None = None
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)
    # CPU seconds of the stage: the flow process's own (all its threads) plus its waited-for child processes'
    # (the launcher and the ranks it reaped), and that second part alone (tasks/core/run/cputime.py); None: not measured
    cpu_seconds: float | None = None
    cpu_children_seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = str(self.status)
        return d


def recorded_metrics(results: dict[str, StageResult]) -> dict[str, dict[str, Any] | None]:
    """{"cpt": metrics | None, "sft": metrics | None, "benchmark": metrics | None} from this run's
    stage results (skipped evaluations carry the metrics recorded in their manifests): run.json's
    "evaluation" and the input of the card's model-index (`tasks.core.evaluation.verdict.eval_results_for_card`)."""
    out: dict[str, dict[str, Any] | None] = {}
    for key, row in (("cpt", ROWS.evaluate_cpt), ("sft", ROWS.evaluate_sft), ("benchmark", ROWS.benchmark)):
        r = results.get(row.name)
        out[key] = r.detail.get("metrics") if r is not None else None
    if (
        r := results.get(ROWS.evaluate_dpo.name)
    ) is not None:  # a row of the dpo phase: a run without it records what it did
        out["dpo"] = r.detail.get("metrics")
    return out


def store_for(cfg: RunConfig) -> RunStore:
    return RunStore(cfg.run_uri, staging_dir=cfg.staging_dir)


def completed(store: RunStore, rel: str, config_digest: str) -> dict[str, Any] | None:
    """The manifest if `rel` exists, verifies and was made from this exact config; else None."""
    logger = get_run_logger()
    if not store.exists(f"{rel}/{MANIFEST}"):
        return None
    try:
        # A current verification stamp stands for the hashes (tasks/core/run/stamp.py): a finished
        # stage is skipped without reading its artifact again; where it is read, it is hashed.
        manifest = store.verify(rel, trust_stamp=True)
    except ManifestError as exc:
        logger.warning("%s exists but does not verify, so it is rebuilt: %s", store.uri(rel), exc)
        return None
    if store.local:
        logger.info("%s verifies (%s)", store.uri(rel), store.last_verify)
    if manifest.get("config_digest") != config_digest:
        logger.info(
            "%s was made from another config or parent (digest %s, now %s): re-running",
            store.uri(rel),
            str(manifest.get("config_digest"))[:12],
            config_digest[:12],
        )
        return None
    return manifest


def not_ours(path: Path) -> str | None:
    """Why `path` is not wholly an artifact this flow wrote (so it must not be deleted), or None:
    no manifest, an unreadable or foreign one, a listed file missing or resized, a file it does not list."""
    try:
        manifest = read_manifest(path)
    except ArtifactMissing:
        return f"it has no {MANIFEST}"
    except (ManifestError, OSError) as exc:
        return f"its manifest is not this flow's ({exc})"
    listed = set(manifest["files"])
    extra = [rel for rel in list_files(path) if rel not in listed]
    if extra:
        return f"it holds {len(extra)} file(s) its manifest does not list ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})"
    try:
        verify_artifact(path, deep=False)
    except ManifestError as exc:
        return f"it was changed after its manifest was written ({exc})"
    return None


def set_aside(path: Path) -> Path | None:
    """Move what sits at `path` aside as `<path>.superseded-<UTC time>` unless it is wholly this
    flow's artifact (`not_ours`), saying so; None when there was nothing to keep."""
    why = not_ours(path) if path.exists() else None
    if why is None:
        return None
    stamp_ = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = next(
        d
        for i in range(1000)
        if not (d := path.with_name(f"{path.name}{SUPERSEDED}{stamp_}{f'-{i}' if i else ''}")).exists()
    )
    path.rename(dest)
    get_run_logger().warning(
        "%s was not written by this flow (%s): kept as %s, never deleted; delete it yourself when it is not needed",
        path,
        why,
        dest,
    )
    return dest


@contextmanager
def fresh_dir(path: Path, keep_foreign: bool = True) -> Iterator[Path]:
    """Build an artifact in `path.tmp-build`, then swap it into place; a failure leaves the old one.
    What the place held is deleted only if it was this flow's own artifact (`keep_foreign`: else moved aside)."""
    tmp = path.with_name(path.name + BUILD_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException as exc:
        note_free(exc, tmp)  # a full disk: its free space now, before the partial output below is removed
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with critical():  # a notice now is raised once the new artifact is in place
        if keep_foreign:
            set_aside(path)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)


class _Output:
    """What a stage writes while it builds: files in `dir`, then one manifest call."""

    def __init__(self, directory: Path, config_digest: str):
        self.dir, self._digest, self.wrote_manifest = directory, config_digest, False

    def manifest(self, *, kind: str, meta: dict[str, Any], parent: StageResult | None = None, **kwargs: Any) -> None:
        """The manifest, last: every file already in `dir` is listed with its sha256."""
        link = {"uri": parent.uri, "digest": parent.digest} if parent is not None else None
        write_manifest(self.dir, kind=kind, meta=meta, parent=link, config_digest=self._digest, **kwargs)
        self.wrote_manifest = True


class Stage:
    """One run of one stage: its artifact under the run root, its digest, its timing.

    `parents` are the results of the stages its StageSpec names in `parents` (or, for a stage that
    `continues` another, that stage's result); `inputs` the run-time facts its digest also covers.
    """

    def __init__(self, name: str, cfg: RunConfig, *parents: StageResult, inputs: Any = None, rel: str | None = None):
        spec = run_stage(cfg.phases, name)
        self.name, self.cfg = name, cfg
        self.rel = rel or spec.artifact
        self.store = store_for(cfg)
        self.started = time.monotonic()
        self.digest = self._config_digest(parents, inputs)
        self.result: StageResult | None = None
        self._skip_checked = False

    def _config_digest(self, parents: tuple[StageResult, ...], inputs: Any) -> str:
        spec = run_stage(self.cfg.phases, self.name)
        for p in parents:
            if p.rel is None:
                raise ValueError(
                    f"{self.name}: parent {p.stage} has no artifact ({p.status}); a stage digest is made from its "
                    "parents' artifacts"
                )
        if spec.continues:
            # Training continues the digest its starting checkpoint was made with (config + parents).
            (start,) = parents
            if start.stage != spec.continues:
                raise ValueError(f"{self.name} continues {spec.continues}, not {start.stage}")
            return self.store.read_manifest(start.rel)["config_digest"]
        return config_digest(
            self.cfg, self.name, {p.stage: content_digest(self.store.read_manifest(p.rel)) for p in parents}, inputs
        )

    @property
    def uri(self) -> str:
        return self.store.uri(self.rel)

    @property
    def skipped(self) -> bool:
        """Whether the artifact already verifies with this digest; `result` is then the skip."""
        if not self._skip_checked:
            self._skip_checked = True
            if completed(self.store, self.rel, self.digest):
                get_run_logger().info("%s: skipped, %s verifies and its config digest matches", self.name, self.uri)
                self.result = StageResult(
                    self.name, Status.SKIPPED, self.rel, self.uri, self.store.manifest_digest(self.rel), self.elapsed
                )
        return self.result is not None and self.result.status == Status.SKIPPED

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @contextmanager
    def build(self) -> Iterator[_Output]:
        """Build the artifact locally; the manifest must be the last thing written."""
        # A remote run root's local copy is staging, the flow's own cache: replaced, not kept.
        with fresh_dir(self.store.local_path(self.rel), keep_foreign=self.store.local) as tmp:
            out = _Output(tmp, self.digest)
            yield out
            if not out.wrote_manifest:
                raise AssertionError(f"stage {self.name} built {self.rel} without a manifest")

    def done(self, detail: dict[str, Any] | None = None, event: dict[str, Any] | None = None) -> StageResult:
        """Publish the artifact (manifest last), log it, send the completed event."""
        # A transient store error must not throw away the stage's work (a boost & shard of a large
        # model, say): the same bounded backoff as checkpoint uploads, then a failure naming it.
        # A local run root is not retried: a full disk does not heal in a minute.
        published, attempts = publish_retrying(
            self.store,
            self.rel,
            retries=0 if self.store.local else RETRIES,
            log=get_run_logger(),
            what=f"the {self.name} artifact",
        )
        get_run_logger().info(
            "%s: completed, %s (manifest %s%s)",
            self.name,
            self.uri,
            published[:12],
            f", published at attempt {attempts}" if attempts > 1 else "",
        )
        self.result = StageResult(
            self.name, Status.COMPLETED, self.rel, self.uri, published, self.elapsed, dict(detail or {})
        )
        automation.stage_event(self.name, "completed", self.cfg.name, self.uri, **(event or {}))
        return self.result


def stage_task(
    *rows: StageSpec, stages: tuple[str, ...] = (), **task_kwargs: Any
) -> Callable[[Callable[..., StageResult]], Any]:
    """`@task` for a stage: a skipped StageResult ends the task run in a state named "Skipped", a
    preempted stage in a Failed state named "Preempted" that carries the `Preempted` (`outcome` raises it).
    The task runs the table's `rows` (`@stage_task(ROWS.unshard)`), and is named after its row, so
    a stage's name is written in the table only; a task that runs several rows (one per phase, as
    prepare_data) takes a `name=` of its own. `stages=` names rows as strings (left for modules that
    have not moved to rows); with neither, the task runs the row of its own name, if there is one
    (tasks/flowkit/pipeline.py)."""
    if len(rows) == 1:
        task_kwargs.setdefault("name", rows[0].name)
    elif rows and "name" not in task_kwargs:
        raise TypeError("stage_task: a task that runs several rows needs a name= of its own")
    stages = (*(r.name for r in rows), *stages)

    def wrap(fn: Callable[..., StageResult]):
        @wraps(fn)
        def body(*args: Any, **kwargs: Any) -> StageResult | State:
            cfg = args[0] if args and isinstance(args[0], RunConfig) else kwargs.get("cfg")
            try:
                # a notice to this process stops the stage at a safe point (tasks/flowkit/notices.py)
                with stop_on_notice(task_kwargs.get("name") or fn.__name__, cfg):
                    result = fn(*args, **kwargs)
            except Preempted as exc:
                return Failed(name=PREEMPTED_STATE, message=exc.cause or str(exc), data=exc)
            if isinstance(result, StageResult) and result.status == Status.SKIPPED:
                return Completed(
                    name="Skipped", message=f"{result.uri} verifies and its config digest matches", data=result
                )
            return result

        made = task(**task_kwargs)(body)
        if stages or made.name in STAGE:
            bind(made, stages=stages)
        return made

    return wrap


def outcome(value: StageResult | State) -> StageResult:
    """The StageResult of a stage task call, whether it returned a state (skipped) or a value; a
    preempted stage's `Preempted` is raised."""
    if isinstance(value, State):
        if value.name == PREEMPTED_STATE:
            exc = value.result(raise_on_failure=False)
            raise exc if isinstance(exc, Preempted) else Preempted(value.message or PREEMPTED_STATE)
        return value.result()
    return value


def disk_need(cfg: RunConfig) -> int | None:
    """Pre-flight's estimate of the local disk the run needs (from base/'s or the base model's config.json), or None."""
    import json

    from tasks.core.preflight.storage import estimate_local_bytes

    store = store_for(cfg)
    for config in (store.local_path("base") / "config.json", Path(resolve_local(cfg.base_model.uri)) / "config.json"):
        try:
            est = estimate_local_bytes(cfg, json.loads(config.read_text()), store.local)
            return est[0] if est else None
        except (OSError, ValueError):
            continue
    return None


def disk_cause(cfg: RunConfig, rel: str | None, exc: BaseException) -> str | None:
    """A stage failure that is a full disk or another disk error, in one line naming the path, the
    filesystem, free and needed space and the fix (`tasks.core.storage.oserrors`); None otherwise."""
    from tasks.core.storage.oserrors import stage_cause

    store = store_for(cfg)
    place = store.local_path(rel) if rel else store.staging
    return stage_cause(exc, place, disk_need(cfg), "run_root" if store.local else "staging_dir")


def write_record(cfg: RunConfig, store: RunStore, text: str) -> None:
    """run.json, atomically; on a local disk too full for a new file, over the old run.json's own
    blocks when it fits; else the failure is logged in one line and the run's state still stands."""
    from tasks.core.run.stages import RUN_JSON
    from tasks.core.storage.oserrors import overwrite_in_place, stage_cause

    try:
        store.write_text(RUN_JSON, text)
    except OSError as exc:
        if store.local and overwrite_in_place(store.local_path(RUN_JSON), text):
            get_run_logger().warning(
                "%s written in place: the disk had no room for a new file (%s)", store.uri(RUN_JSON), exc.strerror
            )
            return
        get_run_logger().error(
            "%s not written: %s",
            store.uri(RUN_JSON),
            stage_cause(exc, store.local_path(RUN_JSON), disk_need(cfg)) or f"{type(exc).__name__}: {exc}",
        )


def secret_token() -> str | None:
    """The Prefect Secret block `hf-token`, or None."""
    from prefect.blocks.system import Secret

    return Secret.load(SECRET_BLOCK).get()


def token() -> str | None:
    """The Hub token in its one lookup order (tasks.core.hub.repo.hub_token) with the Secret block."""
    return hub_token(secret_token)
