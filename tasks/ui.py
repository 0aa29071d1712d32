"""What the Prefect UI shows: progress during training, loss curves, the stage table, events.

Artifact keys must be lowercase letters, digits and dashes; each run's artifacts are attached to
its flow/task runs, so the keys are stable names (the UI shows the latest per key).
"""

from __future__ import annotations

import base64
import io
import re
import time
from pathlib import Path
from typing import Any, Iterable

from prefect import get_run_logger
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.events import emit_event


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:100]


class Progress:
    """A progress artifact updated at most every `min_interval` seconds (and at the end)."""

    def __init__(self, stage: str, total: int, min_interval: float = 2.0):
        self.stage, self.total, self.min_interval = stage, max(total, 1), min_interval
        self._last = 0.0
        self._id = None
        try:
            self._id = create_progress_artifact(0.0, key=_key(f"{stage}-progress"), description=f"{stage}: step / {total}")
        except Exception as exc:  # the UI is a view; never fail training because of it
            get_run_logger().warning("progress artifact unavailable: %s", exc)

    def __call__(self, record: dict[str, Any]) -> None:
        now = time.monotonic()
        step = int(record.get("step", 0))
        if self._id is None or (now - self._last < self.min_interval and step < self.total):
            return
        self._last = now
        try:
            update_progress_artifact(self._id, 100.0 * step / self.total)
        except Exception:
            pass


def loss_curve(stage: str, losses: list[float], png_path: Path) -> None:
    """Render a PNG beside the stage's artifact and show it in a markdown artifact."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.plot(range(1, len(losses) + 1), losses, lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{stage.upper()} loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    png_path.write_bytes(buf.getvalue())
    b64 = base64.b64encode(buf.getvalue()).decode()
    first, last = (losses[0], losses[-1]) if losses else (float("nan"), float("nan"))
    md = f"### {stage.upper()} loss\n\nsteps: {len(losses)}, first {first:.4f} → last {last:.4f}\n\n![{stage} loss](data:image/png;base64,{b64})\n\nPNG: `{png_path}`\n"
    try:
        create_markdown_artifact(md, key=_key(f"{stage}-loss-curve"), description=f"{stage} loss curve")
    except Exception as exc:
        get_run_logger().warning("loss-curve artifact unavailable: %s", exc)


def stage_table(results: Iterable[dict[str, Any]]) -> None:
    rows = [
        {
            "stage": r["stage"],
            "status": r["status"],
            "artifact": r.get("uri") or "",
            "manifest digest": (r.get("digest") or "")[:16],
            "seconds": round(r.get("seconds", 0.0), 1),
        }
        for r in results
    ]
    create_table_artifact(rows, key="cpt-to-sft-stages", description="Stages of this run")


def markdown(key: str, text: str, description: str) -> None:
    create_markdown_artifact(text, key=_key(key), description=description)


def link(key: str, url: str, text: str) -> None:
    create_link_artifact(url, link_text=text, key=_key(key))


def stage_event(stage: str, status: str, run_name: str, uri: str | None, **payload: Any) -> None:
    emit_event(
        event=f"cpt-to-sft.stage.{status}",
        resource={"prefect.resource.id": f"cpt-to-sft.run.{run_name}.{stage}", "prefect.resource.name": stage},
        payload={"stage": stage, "status": status, "artifact_uri": uri, **payload},
    )
