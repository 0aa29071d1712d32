"""Pre-flight of the preemption notices: what a polled source's endpoint is on this machine now.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check

The endpoint's form (an http(s) URL, an absolute file path) is the config's own rule
(tasks/core/config/elastic.py); here the file system is asked, with lstat only (nothing is opened,
so a FIFO or a device cannot hang the check): a `file` endpoint must name a path where nothing is
yet. A notice file already there would preempt the run at once, and any other file there (a key, a
device such as /dev/zero) would be read as a notice.
"""

from __future__ import annotations

from tasks.core.config.notices import NOTICES, file_endpoint_problem
from tasks.core.preflight.report import CheckContext


def check_notices(ctx: CheckContext) -> None:
    polled = 0
    for phase in ctx.cfg.phases:
        for i, n in enumerate(ctx.cfg.phase(phase).elastic.notices):
            row = NOTICES[n.source]
            if row.poll is None:
                continue
            polled += 1
            if row.endpoint_kind == "path" and n.where:
                problem = file_endpoint_problem(n.where)
                if problem:
                    ctx.problem(f"{phase}.elastic.notices.{i}.endpoint", problem)
    if polled:
        ctx.ok(
            f"preemption notices: {polled} polled source(s), each endpoint an http(s) URL or a path with no file yet"
        )
