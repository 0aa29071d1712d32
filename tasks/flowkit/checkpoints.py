"""Where a training stage's checkpoints go: one sink, chosen once from where the run root is and how
many nodes run the stage (`checkpoint_sink`).

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml   # a local run root: Local

- `Local`: a local or NFS run root. The engine writes its checkpoints where they stay and keeps
  keep_last itself; nothing is published.
- `WorkerPublishes`: a remote run root (s3://) and ranks that share this worker's staging. On start
  the newest checkpoint that verifies remotely is staged in (the engine resumes from it) and a
  `Publisher` thread starts (tasks/core/storage/publisher.py): each committed checkpoint is uploaded
  beside training, the stage's TensorBoard files with it, and marked so the engine may delete it;
  `finish` waits for every upload and raises the first failure, naming the checkpoint.
- `NodesPublish`: a remote run root and a backend that runs ranks on other nodes. Those nodes see
  neither the worker's staging nor each other's, so each stages from the run root itself and
  publishes its own checkpoints (`Job.nodes`, tasks/engine/node_staging.py); the worker applies the
  remote keep_last, copies the TensorBoard files, and on `finish` stages in the final checkpoint.

The training task calls `start` (a context manager: what it started is stopped on any exit),
`on_checkpoint(step)` for each checkpoint the engine reports committed, and `finish(rel)`; on a
preemption `drain()`, so the checkpoint of the noticed step is published before the stage ends.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Self

from prefect import get_run_logger

from tasks.core.config.backends import BACKENDS
from tasks.core.config.phases import Phase
from tasks.core.config.schema import PhaseConfig
from tasks.core.run.job import NodeStaging
from tasks.core.run.stages import PREPARE, STAGE, TRAINING, is_step_name
from tasks.core.storage.fs import RunStore
from tasks.core.storage.handshake import manifest_sha256, mark_published
from tasks.core.storage.publisher import Publisher, publish_tensorboard, retain_remote, unpublished_steps


class Local:
    """A local run root: the checkpoints are written where they stay."""

    nodes: NodeStaging | None = None  # per-node staging for the job file
    remote_run_root = False  # the engine deletes only checkpoints the publisher marked, and waits when uploads lag

    def __init__(self, store: RunStore, phase: Phase, section: PhaseConfig):
        self.store, self.phase, self.section = store, phase, section

    def stage_in(self, rel: str) -> Path:
        """The local folder of an artifact the stage reads (a local run root's own, not hashed again here)."""
        return self.store.local_path(rel)

    def start(self) -> Self:
        return self

    def on_checkpoint(self, step: int) -> None:
        """The engine committed checkpoint `step`."""

    @property
    def failure(self) -> Callable[[], BaseException | None] | None:
        """What the launch polls to stop early on a failed upload (None: nothing to poll)."""
        return None

    def finish(self, rel: str) -> None:
        """The launch succeeded: every checkpoint is committed in the run root and `rel` is local."""

    def drain(self, timeout: float | None = None) -> None:
        """Wait (at most `timeout` seconds) until every checkpoint the engine committed is in the run root (a preempted launch's
        last one too, before the stage reports preempted); nothing to wait for here."""

    def close(self) -> None:
        """Stop what `start` started (also when the launch failed)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WorkerPublishes(Local):
    """A remote run root whose checkpoints this worker publishes, in order, beside training."""

    remote_run_root = True

    def __init__(self, store: RunStore, phase: Phase, section: PhaseConfig):
        super().__init__(store, phase, section)
        self.publisher: Publisher | None = None

    def stage_in(self, rel: str) -> Path:
        return self.store.stage_in(rel)

    def start(self) -> Self:
        self._stage_in_latest()
        # The log reader only enqueues; uploads run on the publisher's thread. A failed upload is
        # retried with its bounded backoff (about a minute), then the stage fails naming the checkpoint.
        self.publisher = Publisher(
            self.store,
            self.phase,
            self.section.keep_last,
            max_queue=self.section.keep_last + self.section.max_pending_publishes + 4,
            log=get_run_logger(),
            on_published=self._published,
        ).start()
        for step in unpublished_steps(self.store.local_path(self.phase)):  # left by a failed attempt
            self.publisher.submit(step)
        return self

    def _published(self, _done: object) -> None:
        publish_tensorboard(self.store, self.phase)  # beside each published checkpoint

    def _stage_in_latest(self) -> None:
        names = sorted((n for n in self.store.listdir(self.phase) if is_step_name(n)), reverse=True)
        for name in names:
            try:
                local = self.store.stage_in(f"{self.phase}/{name}")
                # Verified against its remote manifest: committed remotely, so the engine may delete it.
                mark_published(local, manifest_sha256(local))
                return
            except Exception as exc:  # a checkpoint that fails to stage in is skipped for the next older one
                get_run_logger().warning("not resuming from %s: %s", self.store.uri(f"{self.phase}/{name}"), exc)

    def on_checkpoint(self, step: int) -> None:
        if self.publisher is not None:
            self.publisher.submit(step)

    @property
    def failure(self) -> Callable[[], BaseException | None] | None:
        publisher = self.publisher
        return (lambda: publisher.failure) if publisher is not None else None

    def finish(self, rel: str) -> None:
        self.drain()

    def drain(self, timeout: float | None = None) -> None:
        if self.publisher is not None:
            self.publisher.drain(timeout)  # every checkpoint up, in order; raises PublishFailed naming one

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


class NodesPublish(Local):
    """A remote run root on nodes that publish their own checkpoints (per-node staging)."""

    def __init__(self, store: RunStore, phase: Phase, section: PhaseConfig, nodes: NodeStaging):
        super().__init__(store, phase, section)
        self.nodes = nodes

    def stage_in(self, rel: str) -> Path:
        return self.store.stage_in(rel)

    def on_checkpoint(self, step: int) -> None:
        retain_remote(self.store, self.phase, self.section.keep_last, step)
        publish_tensorboard(self.store, self.phase)

    def finish(self, rel: str) -> None:
        self.store.stage_in(rel)  # the nodes published it; run.json and the next stage read it here


CheckpointSink = Local | WorkerPublishes | NodesPublish


def checkpoint_sink(
    store: RunStore, phase: Phase, section: PhaseConfig, model_rel: str, staging_dir: str | None
) -> CheckpointSink:
    """The sink of one run of a training stage (`model_rel`: the artifact its ranks load the model from;
    `staging_dir`: the config's, under which each node stages)."""
    launch = section.launch
    if store.local:
        return Local(store, phase, section)
    if launch.nnodes == 1 or not BACKENDS[launch.backend].remote_nodes:
        return WorkerPublishes(store, phase, section)
    # Each node stages the model, the prepared data (published by prepare_data) and the newest checkpoint.
    nodes = NodeStaging(
        run_uri=store.run_uri,
        dir=f"{staging_dir or tempfile.gettempdir()}/cpt-to-sft-nodes/{{node}}",
        model_rel=model_rel,
        data_rel=STAGE[PREPARE[phase]].artifact,
        stage_rel=TRAINING[phase].checkpoints,
    )
    return NodesPublish(store, phase, section, nodes)
