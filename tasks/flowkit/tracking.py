"""MLflow, written by the Prefect task side only, from the `@@progress` records it already receives.

    python -m tasks.core.config.tracking http://127.0.0.1:5000   # pre-flight check of a tracking URI

One MLflow run per flow run (params: the flattened config, secrets left out; tags: the Prefect
flow run id and URL, later the manifest digests and the export URI / Hub link) and one nested run
per training stage, whose metrics are the per-step fields of the engine's records
(tasks/engine/metrics.py). The training ranks never import a tracking client.

The flow opens the parent run and hands the stages that report to it a `TrackerHandle` (the
tracking URI and the run's ids) as a task parameter: plain data, so a task reaches the run from
whatever process its task runner put it in.

Failure handling: an unreachable server is a pre-flight problem naming `tracking.mlflow.uri`
(`check_tracking` in tasks/core/preflight/checks.py).
Mid-run, a stage's records go through a queue to one writer thread, so a slow or dead server
never stalls the launch's output pipe (and with it the ranks). While the server does not answer,
records are dropped (retrying every `retry_s`), the first failure is a warning in the run's log
(the Prefect UI), and when the stage ends every gap is logged as `steps a..b not recorded`.
MLflow's own HTTP retries (7 with backoff, minutes) are lowered for this process to 0 and a
5 s timeout unless set in the environment.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from tasks.core.config.tracking import FIELD, check_uri, flatten, redact
from tasks.core.run.events import METRICS
from tasks.core.run.stages import TENSORBOARD

# MLflow writes two link lines to stdout whenever a run ends (three runs a flow): the console is
# a short training log, and the runs are found from the parent run named in the flow's log.
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

__all__ = [
    "FIELD",
    "RunTracker",
    "StageTracker",
    "TrackerHandle",
    "check_uri",
    "eval_scalars",
    "fan_out",
    "flatten",
    "log_evaluation",
    "redact",
    "stage_tracker",
]


def _client(uri: str):
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


class TrackerHandle(BaseModel):
    """The flow run's MLflow run as a task parameter: enough to log to it or open a nested run
    under it from any process (a client object is neither hashable nor serializable)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uri: str
    experiment_id: str
    run_id: str


class RunTracker:
    """The flow run's MLflow run. `None`-safe use: `RunTracker.start(...)` returns None without a URI."""

    def __init__(self, client, uri: str, experiment_id: str, run_id: str, warn: Callable[[str], None]):
        self.client, self.uri, self.experiment_id, self.run_id, self.warn = client, uri, experiment_id, run_id, warn
        self.stages: dict[str, StageTracker] = {}

    @classmethod
    def start(
        cls,
        cfg,
        *,
        flow_run_id: str | None = None,
        flow_run_url: str | None = None,
        warn: Callable[[str], None] = print,
    ) -> RunTracker | None:
        m = cfg.tracking.mlflow
        if not m.uri:
            return None
        client = _client(m.uri)
        exp = client.get_experiment_by_name(m.experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(m.experiment)
        tags = {"mlflow.runName": cfg.name, "cpt-to-sft.run": cfg.name}
        if flow_run_id:
            tags["prefect.flow_run_id"] = flow_run_id
        if flow_run_url:
            tags["prefect.flow_run_url"] = flow_run_url
        run = client.create_run(exp_id, tags=tags, run_name=cfg.name)
        self = cls(client, m.uri, exp_id, run.info.run_id, warn)
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flatten(cfg.model_dump(mode="json")).items()]
        for i in range(0, len(params), 100):  # MLflow's log_batch takes at most 100 params
            client.log_batch(self.run_id, params=params[i : i + 100])
        return self

    @classmethod
    def attach(cls, handle: TrackerHandle, warn: Callable[[str], None] = print) -> RunTracker:
        """The run `handle` names, in this process (a task's), with its own client."""
        return cls(_client(handle.uri), handle.uri, handle.experiment_id, handle.run_id, warn)

    @property
    def handle(self) -> TrackerHandle:
        return TrackerHandle(uri=self.uri, experiment_id=self.experiment_id, run_id=self.run_id)

    @property
    def url(self) -> str:
        return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def stage(self, stage: str, retry_s: float = 10.0) -> StageTracker:
        run = self.client.create_run(
            self.experiment_id, run_name=stage, tags={"mlflow.parentRunId": self.run_id, "cpt-to-sft.stage": stage}
        )
        self.stages[stage] = StageTracker(self, stage, run.info.run_id, retry_s)
        return self.stages[stage]

    def tag(self, **tags: Any) -> None:
        """Tags of the parent run (manifest digests, export URI, Hub link); a failure is a warning."""
        for k, v in tags.items():
            if v is None:
                continue
            try:
                self.client.set_tag(self.run_id, k, redact(str(v)))
            except Exception as exc:
                self.warn(f"MLflow tag {k} not recorded ({redact(self.uri)}): {exc}")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Metrics of the parent run (the evaluation stages'); a failure is a warning."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        try:
            self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, step) for k, v in metrics.items()])
        except Exception as exc:
            self.warn(f"MLflow metrics {sorted(metrics)} not recorded ({redact(self.uri)}): {exc}")

    def finish(self, status: str = "FINISHED") -> None:
        for st in self.stages.values():
            st.close()
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as exc:
            self.warn(f"MLflow run {self.run_id} not marked {status} ({redact(self.uri)}): {exc}")


class StageTracker:
    """Callable with each @@progress record of one stage; writes on its own thread."""

    def __init__(self, parent: RunTracker, stage: str, run_id: str, retry_s: float):
        self.parent, self.stage, self.run_id, self.retry_s = parent, stage, run_id, retry_s
        self.gaps: list[list[int]] = []  # [first, last] steps not recorded
        self.recorded = 0
        self._q: queue.Queue = queue.Queue()
        self._down_since: float | None = None
        self._last_try = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"mlflow-{stage}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"{self.parent.uri.rstrip('/')}/#/experiments/{self.parent.experiment_id}/runs/{self.run_id}"

    def __call__(self, record: dict[str, Any]) -> None:
        if not self._closed:
            self._q.put(dict(record))

    def _loop(self) -> None:
        from mlflow.entities import Metric

        while True:
            rec = self._q.get()
            if rec is None:
                return
            step = int(rec.get("step", 0))
            now = time.monotonic()
            if self._down_since is not None and now - self._last_try < self.retry_s:
                self._missed(step)
                continue
            ts = int(time.time() * 1000)
            metrics = [Metric(k, float(rec[k]), ts, step) for k in METRICS if isinstance(rec.get(k), (int, float))]
            try:
                self.parent.client.log_batch(self.run_id, metrics=metrics)
            except Exception as exc:
                self._last_try = time.monotonic()
                if self._down_since is None:
                    self._down_since = self._last_try
                    self.parent.warn(
                        f"MLflow at {redact(self.parent.uri)} stopped answering at {self.stage} step {step} "
                        f"({type(exc).__name__}: "
                        f"{str(exc)[:300]}); training continues, steps are not recorded in MLflow until it answers "
                        "again"
                    )
                self._missed(step)
                continue
            if self._down_since is not None:
                self._down_since = None
                self.parent.warn(f"MLflow at {redact(self.parent.uri)} answers again from {self.stage} step {step}")
            self.recorded += 1

    def _missed(self, step: int) -> None:
        if self.gaps and self.gaps[-1][1] == step - 1:
            self.gaps[-1][1] = step
        else:
            self.gaps.append([step, step])

    def close(self, timeout: float = 60.0, status: str = "FINISHED") -> list[list[int]]:
        """Drain the queue, end the nested run, log every gap; returns the gaps."""
        if self._closed:
            return self.gaps
        self._closed = True
        self._q.put(None)
        self._thread.join(timeout)
        for first, last in self.gaps:
            self.parent.warn(
                f"MLflow gap in {self.stage}: steps {first}..{last} not recorded ({redact(self.parent.uri)} did not "
                "answer)"
            )
        try:
            self.parent.client.set_terminated(self.run_id, status=status)
        except Exception as exc:
            self.parent.warn(f"MLflow stage run {self.stage} not marked {status}: {exc}")
        return self.gaps


def stage_tracker(handle: TrackerHandle | None, stage: str, warn: Callable[[str], None]) -> StageTracker | None:
    """The nested MLflow run of `stage` under the run `handle` names, or None without MLflow; a
    server that does not answer when the stage starts is a warning, never a failed stage. `warn`
    is called from the writer thread too: pass a logger bound in the task (its run's log)."""
    if handle is None:
        return None
    try:
        return RunTracker.attach(handle, warn).stage(stage)
    except Exception as exc:
        warn(f"MLflow run for {stage} not created ({redact(handle.uri)}): {exc}; training continues without it")
        return None


def fan_out(*callbacks: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
    live = [c for c in callbacks if c is not None]

    def call(record: dict[str, Any]) -> None:
        for c in live:
            c(record)

    return call


def eval_scalars(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of an evaluation's metrics.json as dotted names (timings, the split
    description and booleans left out): base.perplexity, cpt.loss, perplexity_change_pct, ..."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if k in ("split", "seconds", "problems", "file"):
            continue
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(eval_scalars(v, f"{key}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def _warn(message: str) -> None:
    try:
        from prefect import get_run_logger

        get_run_logger().warning("%s", message)
    except Exception:  # outside a flow/task run: stderr
        print(message, file=sys.stderr)


def log_evaluation(
    which: str, metrics: dict[str, Any], out_dir, step: int, tracker: TrackerHandle | None = None
) -> dict[str, float]:
    """An evaluation stage's metrics as TensorBoard scalars `eval/<name>` at the training stage's
    last step, under `<out_dir>/tensorboard/` (inside the evaluation artifact, so its manifest
    covers them and `tensorboard --logdir <run_root>` shows them), and as `eval.<which>.<name>`
    metrics of the flow's MLflow run (`tracker`, None without MLflow). Both are views: a failure is a warning."""
    from pathlib import Path

    scalars = eval_scalars(metrics)
    try:
        from tensorboardX import SummaryWriter

        with SummaryWriter(logdir=str(Path(out_dir) / TENSORBOARD)) as writer:
            for name, value in scalars.items():
                writer.add_scalar(f"eval/{name}", value, step)
    except Exception as exc:
        _warn(f"TensorBoard evaluation scalars not written under {out_dir}: {exc}")
    if tracker is not None:
        try:
            RunTracker.attach(tracker, _warn).log_metrics({f"eval.{which}.{k}": v for k, v in scalars.items()}, step)
        except Exception as exc:  # the client itself (an unusable URI): a view, never a failed stage
            _warn(f"MLflow evaluation metrics not recorded ({redact(tracker.uri)}): {exc}")
    return scalars
