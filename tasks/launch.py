"""Process boundary: build the torchrun command for an engine verb, run it, stream its output.

The argv builder is pure (unit-tested). `run_engine` writes the job file, starts torchrun, routes
every line into the given logger with its rank prefix (the engine prefixes its own lines with
`[rank N]`; lines without one come from torchrun itself), turns `@@progress` lines into progress
callbacks, and on failure raises `StageFailed` with the failing ranks' last lines.

Single node picks a free rendezvous port (`--standalone`); several nodes use c10d rendezvous:

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-backend c10d \
             --rdzv-endpoint head:29400 --rdzv-id run-cpt -m tasks.engine train --config job.json
"""

from __future__ import annotations

import collections
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.core.config import LaunchConfig
from tasks.core.errors import StageFailed
from tasks.core.events import PROGRESS, parse_line
from tasks.core.job import Job

_WARN = re.compile(r"\b(warn(ing)?|deprecat)", re.IGNORECASE)
_ERR = re.compile(r"(Traceback|Error|Exception|error:)")


def torchrun_argv(verb: str, job_path: str | Path, launch: LaunchConfig, rdzv_id: str, python: str = sys.executable) -> list[str]:
    argv = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(launch.nproc_per_node)]
    if launch.nnodes == 1 and not launch.rdzv_endpoint:
        argv += ["--standalone"]
    else:
        endpoint = launch.rdzv_endpoint or "127.0.0.1:29400"
        argv += [
            "--nnodes", str(launch.nnodes),
            "--node-rank", str(launch.node_rank),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint,
            "--rdzv-id", launch.rdzv_id or rdzv_id,
        ]
    argv += ["-m", "tasks.engine", verb, "--config", str(job_path)]
    return argv


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    # Keep tokenizers from forking thread pools inside every rank.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def run_engine(
    verb: str,
    job: Job,
    job_path: Path,
    launch: LaunchConfig,
    rdzv_id: str,
    logger: logging.Logger | logging.LoggerAdapter,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_event: Callable[[str, dict[str, Any]], None] | None = None,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Write `job` to `job_path`, run its engine verb under torchrun; return the parsed @@progress records."""
    job.write(job_path)
    argv = torchrun_argv(verb, job_path, launch, rdzv_id)
    logger.info("launch: %s", " ".join(argv))
    tails: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=25))
    progress: list[dict[str, Any]] = []
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=engine_env(env),
        text=True,
        bufsize=1,
        cwd=str(Path(__file__).resolve().parents[1]),
        start_new_session=True,
    )
    assert proc.stdout is not None
    try:
        for raw in proc.stdout:
            line = parse_line(raw.rstrip("\n"))
            who, body = line.who, line.body
            tails[who].append(body)
            if line.kind is not None:
                if line.kind == PROGRESS:
                    progress.append(line.record)
                    if on_progress:
                        on_progress(line.record)
                elif on_event:
                    on_event(line.kind, line.record)
                logger.info("[%s] %s %s", who, line.kind, line.payload)
                continue
            if _ERR.search(body):
                logger.error("[%s] %s", who, body)
            elif _WARN.search(body):
                logger.warning("[%s] %s", who, body)
            else:
                logger.info("[%s] %s", who, body)
        rc = proc.wait()
    except BaseException:
        _kill_group(proc)
        raise
    if rc != 0:
        raise StageFailed(_failure_message(verb, rc, tails))
    return progress


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _failure_message(verb: str, rc: int, tails: dict[str, collections.deque]) -> str:
    # Put the ranks that printed errors first: they are the ones that failed.
    def score(item):
        who, lines = item
        return (0 if any(_ERR.search(x) for x in lines) else 1, who)

    parts = [f"engine verb '{verb}' exited with status {rc}; last lines per process:"]
    for who, lines in sorted(tails.items(), key=score):
        parts.append(f"--- {who} ---")
        parts.extend(list(lines)[-15:])
    return "\n".join(parts)
