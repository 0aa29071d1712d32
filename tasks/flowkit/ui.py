"""What the Prefect UI shows for a run: progress during training, loss curves, the stage table,
the export verification and the Hub commit link (each stage's automation event: tasks/flowkit/automation.py).

Artifact keys must be lowercase letters, digits and dashes; each run's artifacts are attached to
its flow/task runs, so the keys are stable names (the UI's Artifacts page shows the latest per key,
a run's Artifacts tab shows that run's). Everything here is a view: a failure to publish it is a
warning in the log, never a failed stage.
"""

from __future__ import annotations

import base64
import io
import logging
import math
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tasks.core.config.kernels import describe
from tasks.core.evaluation import benchmark as bench
from tasks.core.run import meter, preemptions
from tasks.core.run.events import CONSOLE_OFF
from tasks.core.run.segments import summary as segments_summary
from tasks.core.run.trainlog import duration

STAGES_KEY = "cpt-to-sft-stages"
BENCHMARK_TABLE_KEY = "cpt-to-sft-benchmark"


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:100]


def _log_warning(msg: str, *args: Any) -> None:
    try:
        get_run_logger().warning(msg, *args)
    except Exception:  # outside a flow/task run there is no run logger
        logging.getLogger(__name__).warning(msg, *args)


def warn_view_failure(what: str, exc: BaseException) -> None:
    try:
        get_run_logger().warning("%s unavailable: %s", what, exc)
    except Exception:  # outside a flow/task run there is no run logger, and a view must never fail the stage
        pass


class Progress:
    """The `<stage>-progress` artifact: percent of steps done, description `step k / N, loss x`.

    Called with every @@progress record of rank 0 (the description gains `ETA 3h12m`, the record's
    `eta_s`, until the last step); sends at most one update per `min_interval`
    seconds and always the last step; `flush()` (when the launch ends, failed or not) sends the
    last record seen, so a failed stage shows the step it reached. `links` ({text: url}, e.g. the
    stage's MLflow run) are appended to the description, which the UI renders as markdown.
    `backpressure(record)` (an @@backpressure record) logs a warning and, while the engine waits
    for uploads, appends `waiting for N upload(s)` to the description, so the UI says why the bar
    stopped. `kernels(record)` (the launch's @@kernels record) adds what it runs with, e.g.
    `kernels: flash attention: off: no CUDA; …; activation checkpointing: on`.
    """

    def __init__(self, phase: str, total: int, min_interval: float = 2.0, links: dict[str, str] | None = None):
        self.phase, self.total, self.min_interval = phase, max(total, 1), min_interval
        self.links = "".join(f" · [{text}]({url})" for text, url in (links or {}).items())
        self._last = float("-inf")  # the first record always goes out
        self._id = None
        self._pending: dict[str, Any] | None = None
        self._last_record: dict[str, Any] = {"step": 0}
        self._waiting = ""
        self._kernels = ""
        try:
            self._id = create_progress_artifact(
                0.0, key=_key(f"{phase}-progress"), description=f"{phase.upper()}: step 0 / {self.total}"
            )
        except Exception as exc:
            warn_view_failure("progress artifact", exc)

    def __call__(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        self._pending = self._last_record = record
        if self._id is not None and (time.monotonic() - self._last >= self.min_interval or step >= self.total):
            self._send(record)

    def backpressure(self, record: dict[str, Any]) -> None:
        step, cap = record.get("step"), record.get("max_pending_publishes")
        if record.get("state") == "waiting":
            n = len(record.get("pending", []))
            self._waiting = (
                f" — waiting for {n} checkpoint upload(s) before saving step {step} (max_pending_publishes={cap})"
            )
            _log_warning(
                "%s training waits before saving step %s: %d checkpoint(s) still uploading (max_pending_publishes=%s)",
                self.phase.upper(),
                step,
                n,
                cap,
            )
        else:
            self._waiting = ""
            _log_warning(
                "%s training resumed after waiting %.1fs for checkpoint uploads before step %s",
                self.phase.upper(),
                float(record.get("waited_s", 0)),
                step,
            )
        if self._id is not None:
            self._send(self._pending or self._last_record)

    def kernels(self, record: dict[str, Any]) -> None:
        self._kernels = f" — kernels: {describe(record.get('kernels') or {})}; activation checkpointing: {'on' if record.get('activation_checkpointing') else 'off'}"
        if self._id is not None:
            self._send(self._pending or self._last_record)

    def flush(self) -> None:
        if self._id is not None and self._pending is not None:
            self._send(self._pending)

    def _send(self, record: dict[str, Any]) -> None:
        self._last, self._pending = time.monotonic(), None
        step = int(record.get("step", 0))
        loss = record.get("loss")
        text = f"{self.phase.upper()}: step {step} / {self.total}"
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            text += f", loss {loss:.4f}"
        pad = record.get("padding_frac")
        if isinstance(pad, (int, float)):
            text += f", padding {100 * pad:.1f}% of computed tokens"
        eta = record.get("eta_s")
        if isinstance(eta, (int, float)) and step < self.total:
            text += f", ETA {duration(eta)}"
        text += self._waiting + self._kernels + self.links
        try:
            update_progress_artifact(self._id, min(100.0, 100.0 * step / self.total), description=text)
        except Exception as exc:
            warn_view_failure("progress update", exc)


class DataProgress:
    """The `data-<phase>-progress` artifact of prepare_data: files, records, tokens and MB/s so far.

    Called with each tokenized file's or chunk's summary as it finishes (the units of work of the
    task runner); a chunk's counts its bytes, and its file once it completed it (`file_done`).
    """

    def __init__(self, phase: str, files: int, total_bytes: int):
        self.phase, self.files, self.total_bytes = phase, files, max(total_bytes, 1)
        self.done = {"files": 0, "bytes": 0, "records": 0, "tokens": 0, "skipped": 0}
        self.t0 = time.monotonic()
        self._id = None
        try:
            self._id = create_progress_artifact(
                0.0, key=_key(f"data-{phase}-progress"), description=f"{phase.upper()} data: 0 / {files} files"
            )
        except Exception as exc:
            warn_view_failure("data progress artifact", exc)

    def __call__(self, summary: dict[str, Any]) -> None:
        d = self.done
        chunk = summary.get("chunk")
        d["files"] += 1 if chunk is None or summary.get("file_done") else 0
        d["bytes"] += summary["input"]["size"] if chunk is None else chunk["bytes"]
        d["records"] += summary["records"]
        d["tokens"] += summary["train"]["tokens"] + summary["heldout"]["tokens"]
        d["skipped"] += summary["skipped"]
        mbs = d["bytes"] / 1e6 / max(time.monotonic() - self.t0, 1e-9)
        text = (
            f"{self.phase.upper()} data: {d['files']} / {self.files} files, {d['records']:,} records, {d['tokens']:,} "
            "tokens, "
            f"{mbs:.1f} MB/s" + (f", {d['skipped']} bad records skipped" if d["skipped"] else "")
        )
        try:
            get_run_logger().info(text)
            if self._id is not None:
                update_progress_artifact(self._id, 100.0 * d["bytes"] / self.total_bytes, description=text)
        except Exception as exc:
            warn_view_failure("data progress artifact", exc)


class WorkProgress:
    """The `<stage>-progress` artifact and console lines of a stage that is not training
    (tasks/core/run/meter.py): each record of its meters is a log line (`benchmark: export
    loglikelihood: 1,200 / 4,000 requests (30%), 1m10s elapsed, ETA 2m43s`) and the bar's percent and
    description. `reporting()` is the block the stage runs its work in."""

    def __init__(self, phase: str):
        self.phase = phase
        self._id = None
        self._said: set[str] = set()
        # taken here, in the task's thread: a converter's shard threads report through it too
        try:
            self._logger: Any = get_run_logger()
        except Exception:  # outside a flow/task run there is no run logger
            self._logger = logging.getLogger(__name__)
        try:
            self._id = create_progress_artifact(0.0, key=_key(f"{phase}-progress"), description=f"{phase}: starting")
        except Exception as exc:
            warn_view_failure("progress artifact", exc)

    def __call__(self, record: dict[str, Any]) -> None:
        text = f"{self.phase}: {meter.line(record)}"
        # The console gets a part's lines once it has run an interval (then its end too), so a short
        # stage adds none to the run's console; the run's log in the UI gets every record.
        going = not record["finished"] and record["done"] > 0
        said = going or (record["finished"] and record["what"] in self._said)
        if going:
            self._said.add(record["what"])
        try:
            self._logger.info(text, **({} if said else {"extra": CONSOLE_OFF}))
            if self._id is not None:
                pct = 100.0 * record["done"] / record["total"] if record["total"] else 100.0
                update_progress_artifact(self._id, min(100.0, pct), description=text)
        except Exception as exc:
            warn_view_failure("progress update", exc)

    def reporting(self, interval_s: float = meter.INTERVAL_S):
        return meter.reporting(self, interval_s)


def token_table(phase: str, totals: dict[str, Any]) -> None:
    """The `data-<phase>-tokens` table: records and tokens per split, and the bad records skipped."""
    rows = [
        {"split": "train", "records": totals["train_records"], "tokens": totals["train_tokens"]},
        {"split": "held-out", "records": totals["heldout_records"], "tokens": totals["heldout_tokens"]},
        {"split": "skipped (bad records)", "records": totals["skipped"], "tokens": 0},
    ]
    if totals.get("empty_files"):
        rows.append({"split": "empty input files (no record)", "records": totals["empty_files"], "tokens": 0})
    if totals.get("cpt_blocks") is not None:
        rows.append({"split": "train blocks (seq_len)", "records": totals["cpt_blocks"], "tokens": None})
    try:
        create_table_artifact(
            rows,
            key=_key(f"data-{phase}-tokens"),
            description=f"{phase.upper()} data: {totals['files']} files, {totals['bytes'] / 1e6:.1f} MB",
        )
    except Exception as exc:
        warn_view_failure("token table artifact", exc)


def mixture_rows(
    sources: list[dict[str, Any]], blend: dict[str, Any] | None, heldout_only: list[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """One row per source: its weight, what it holds, and (a mixture) what the planned steps take of
    it; then one per held-out-only source (weight 0: evaluated, never trained on)."""
    rows = []
    for src in sources:
        row = {
            "source": src["name"],
            "weight": src.get("weight", 1.0),
            "files": src["files"][1] - src["files"][0],
            "samples available": src["samples_available"],
            "tokens available": src["tokens_available"],
        }
        if blend:
            row.update({"token share": src["token_share"], "samples planned": src["samples"], "epochs": src["epochs"]})
        rows.append(row)
    for src in heldout_only:
        rows.append(
            {
                "source": f"{src['name']} (held out only)",
                "weight": 0.0,
                "files": len(src["inputs"]),
                "samples available": 0,
                "tokens available": 0,
                **({"token share": 0.0, "samples planned": 0, "epochs": 0.0} if blend else {}),
                "held-out tokens": src["tokens"],
            }
        )
    return rows


def mixture_table(
    phase: str, sources: list[dict[str, Any]], blend: dict[str, Any] | None, heldout_only: list[dict[str, Any]] = ()
) -> None:
    """The `data-<phase>-mixture` table: each source's weight, size, realized token share and epochs,
    and the held-out-only sources beside them."""
    if blend:
        plan = blend["plan"]
        what = (
            f"{phase.upper()} mixture over {plan['max_steps']} steps of {plan['global_batch']} "
            f"({blend['positions']:,} {blend['unit']})"
        )
    else:
        what = f"{phase.upper()} data: one source"
    try:
        create_table_artifact(
            mixture_rows(sources, blend, heldout_only), key=_key(f"data-{phase}-mixture"), description=what
        )
    except Exception as exc:
        warn_view_failure("mixture table artifact", exc)


def benchmark_table(metrics: dict[str, Any] | None, verdict: dict[str, Any] | None = None) -> None:
    """The UI's table artifact: task, metric, base, export, change (and the gate's word)."""
    rows = bench.table_rows(metrics, verdict)
    if not rows:
        return
    try:
        from prefect.artifacts import create_table_artifact

        s = (metrics or {}).get("settings") or {}
        create_table_artifact(
            rows,
            key=BENCHMARK_TABLE_KEY,
            description=f"lm-eval {s.get('lm_eval')} scores, base vs export ({s.get('num_fewshot')}-shot, "
            f"{s.get('dtype')})",
        )
    except Exception as exc:
        get_run_logger().warning("benchmark table artifact unavailable: %s", exc)


def render_loss_png(phase: str, losses: list[float], first_step: int = 1) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.plot(
        range(first_step, first_step + len(losses)), losses, lw=1.5, marker="o" if len(losses) <= 30 else None, ms=3
    )
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{phase.upper()} loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def loss_curve(phase: str, losses: list[float], png: str | Path) -> bytes:
    """Render the PNG, save it at `png` (a local path or fsspec URI beside the stage's artifact,
    e.g. `<run_root>/cpt/loss-curve.png`) and show it inline in the `<stage>-loss-curve` artifact."""
    from tasks.core.storage.fs import open_uri

    data = render_loss_png(phase, losses)
    try:
        if isinstance(png, Path) or "://" not in str(png):
            Path(png).parent.mkdir(parents=True, exist_ok=True)
        with open_uri(str(png), "wb") as f:
            f.write(data)
    except Exception as exc:
        warn_view_failure(f"loss-curve PNG at {png}", exc)
    b64 = base64.b64encode(data).decode()
    first, last = (losses[0], losses[-1]) if losses else (float("nan"), float("nan"))
    md = (
        f"### {phase.upper()} loss\n\nsteps: {len(losses)}, first {first:.4f} → last {last:.4f}\n\n"
        f"![{phase} loss](data:image/png;base64,{b64})\n\nPNG: `{png}`\n"
    )
    try:
        create_markdown_artifact(
            md, key=_key(f"{phase}-loss-curve"), description=f"{phase.upper()} training loss per step"
        )
    except Exception as exc:
        warn_view_failure("loss-curve artifact", exc)
    return data


def stage_table(results: Iterable[dict[str, Any]]) -> None:
    rows = [
        {
            "stage": r["stage"],
            "status": r["status"],
            "artifact": r.get("uri") or "",
            "manifest digest": (r.get("digest") or "")[:16],
            "duration": _duration(r.get("seconds") or 0.0),
            # the flow process's and its waited-for child processes' (the ranks') CPU time (tasks/core/run/cputime.py)
            "CPU": _duration(r["cpu_seconds"]) if r.get("cpu_seconds") is not None else "",
            # A failed stage's cause (a launch: the failing rank's first error line), else empty.
            "cause": (r.get("detail") or {}).get("error", "") if r["status"] in ("failed", "preempted") else "",
            # what the stage wants read beside its status (prepare: the records longer than seq_len and what became of
            # them; a training stage continued under another layout: each segment's layout)
            "note": "; ".join(
                x
                for x in (
                    (r.get("detail") or {}).get("note", ""),
                    segments_summary(_segments(r)),
                    preemptions.short((r.get("detail") or {}).get("preemptions") or []),
                )
                if x
            ),
        }
        for r in results
    ]
    create_table_artifact(
        rows,
        key=STAGES_KEY,
        description="Stages of this run: status, artifact URI, manifest digest, duration, CPU time, the cause of a "
        "failure, a note (records longer than seq_len, the layout of each segment of a training stage that changed "
        "layout, its preemptions: how many, steps lost, notice to commit, restart to first step)",
    )


def _segments(r: dict[str, Any]) -> list[dict[str, Any]]:
    return (r.get("detail") or {}).get("segments") or []


def _duration(seconds: float) -> str:
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def markdown(key: str, text: str, description: str) -> None:
    try:
        create_markdown_artifact(text, key=_key(key), description=description)
    except Exception as exc:
        warn_view_failure(f"{key} artifact", exc)


def link(key: str, url: str, text: str) -> None:
    try:
        create_link_artifact(url, link_text=text, key=_key(key), description=text)
    except Exception as exc:
        warn_view_failure(f"{key} artifact", exc)
