"""The Slurm runner of `tasks.core.launch.torchrun.RUNNERS` (`launch.backend: slurm`): one engine verb is one
Slurm job, one torchrun agent per node (the batch script of `tasks.core.launch.slurm_batch`).

    python -m pytest -m "" tests/test_slurm_launch.py      # runs it on the real two-node test cluster

- **Record, then wait.** The job id is written to `<stage_dir>/.launch/<verb>.slurm.json` right
  after `sbatch` returns, before anything waits on the job.
- **Never double-submit.** A later call for the same verb and the same job file (a Prefect retry,
  or a re-run after the flow-run process died) finds the recorded job and, while Slurm still runs
  it, follows its output and waits instead of submitting a second job. A process killed between
  `sbatch` returning and the record being written leaves no record: the job is submitted under a
  deterministic name (`<run>-<phase>-<verb>`) with the job file's digest as its comment, so the
  next call finds it with `squeue` (`SlurmCli.find`) before it submits anything. A job that has
  ended is not re-attached: a new one is submitted, and the engine resumes from the newest
  verified checkpoint as for any retry.
- **Output.** Every node's file (`.launch/logs/job-<id>.<node>.log`) is followed; each line goes
  through `tasks.core.launch.torchrun.Router` as `[<node> rank N] ...`, so `@@progress` / `@@checkpoint` are
  handled exactly as for the local backend. How far each file was read is saved to
  `<verb>.slurm.seen.json` at most every `SEEN_EVERY_S`; a re-attach goes on from there and says
  so, replaying at most the last few seconds of output.
- **Cancel.** Any exception while waiting (Prefect's cancellation of the flow run arrives in the
  task process as one: SIGTERM -> `TerminationSignal`) scancels the job and waits, bounded, for
  Slurm to report it ended; `ProctrackType=proctrack/pgid` or cgroup on the cluster ends every
  engine process of it. Unless the exception is a preemption notice to this process, it writes
  `<verb>.teardown` beside the record first, the file the ranks know by TEARDOWN_ENV: scancel's SIGTERM
  then ends a rank at once instead of being a preemption notice.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tasks.core.config.notices import TEARDOWN_ENV
from tasks.core.config.schema import LaunchConfig
from tasks.core.errors import Preempted, StageFailed
from tasks.core.launch import slurm, slurm_batch
from tasks.core.run.job import Job

REPO = Path(__file__).resolve().parents[3]
CANCEL_WAIT_S = 60.0
SEEN_EVERY_S = 2.0
COMMENT_PREFIX = "cpt-to-sft:"


def record_path(job: Job, verb: str) -> Path:
    return job.stage_dir / ".launch" / f"{verb}.slurm.json"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def attachable(cli: slurm.SlurmCli, record: Path, job_digest: str) -> str | None:
    """The recorded job id when that job still runs the same job file; None otherwise."""
    rec = _read_json(record)
    if rec.get("job_digest") != job_digest:
        return None
    info = cli.job(str(rec.get("job_id", "")))
    return info.job_id if info is not None and info.active else None


def run_slurm(
    verb: str,
    job: Job,
    job_path: Path,
    launch: LaunchConfig,
    rdzv_id: str,
    router,
    env: dict[str, str],
    cli: slurm.SlurmCli | None = None,
) -> None:
    cli = cli or slurm.SlurmCli()
    logger = router.logger
    record = record_path(job, verb)
    seen = record.with_name(f"{verb}.slurm.seen.json")
    logs_dir = record.parent / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    marker = record.with_name(f"{verb}.teardown")  # on the run root, which every node sees
    env = {**env, TEARDOWN_ENV: str(marker)}
    job_digest = hashlib.sha256(job_path.read_bytes()).hexdigest()
    name = launch.rdzv_id or rdzv_id
    comment = COMMENT_PREFIX + job_digest[:32]

    job_id = attachable(cli, record, job_digest)
    how = "recorded in " + str(record)
    if not job_id:
        found = cli.find(name, comment)
        if found:
            job_id, how = found[0], f"found by name {name} and comment {comment} (its id was never recorded)"
            _write_json(
                record,
                {
                    "job_id": job_id,
                    "verb": verb,
                    "name": name,
                    "job_digest": job_digest,
                    "logs": str(logs_dir),
                    "submitted_at": None,
                },
            )
    start: dict[str, int] = {}
    if job_id:
        start = _read_json(seen).get(job_id, {}) if seen.exists() else {}
        logger.warning(
            "re-attaching to Slurm job %s (%s), still running from an earlier attempt, %s; not submitting another. %s",
            job_id,
            name,
            how,
            "Output already logged by the earlier attempt is skipped (up to its last few seconds may repeat)"
            if start
            else "Its output is replayed from the start",
        )
    else:
        marker.unlink(missing_ok=True)  # a cancelled attempt's: this job is no teardown
        script = record.parent / f"{verb}.sbatch"
        script.write_text(
            slurm_batch.render_batch_script(
                slurm_batch.engine_program(verb, job_path),
                launch,
                name,
                logs_dir,
                REPO,
                python=sys.executable,
                comment=comment,
            )
        )
        job_id = cli.sbatch(script, env=env)
        _write_json(
            record,
            {
                "job_id": job_id,
                "verb": verb,
                "name": name,
                "job_digest": job_digest,
                "script": str(script),
                "logs": str(logs_dir),
                "submitted_at": time.time(),
            },
        )
        logger.info(
            "submitted Slurm job %s (%s): %d node(s) x %d process(es); record %s",
            job_id,
            name,
            launch.nnodes,
            launch.nproc_per_node,
            record,
        )

    logs = slurm_batch.NodeLogs(logs_dir, job_id, start=start)
    batch: list[str] = []
    by_node: dict[str, list[str]] = {}
    last_saved = [0.0]

    def on_line(node: str, line: str) -> None:
        if node == "batch":
            batch.append(line)
            logger.info("[slurm %s] %s", job_id, line)
            return
        by_node.setdefault(node, []).append(line)
        del by_node[node][:-200]
        router.line(line, node=node)

    def save_positions() -> None:
        if time.monotonic() - last_saved[0] >= SEEN_EVERY_S:
            _write_json(seen, {job_id: logs.positions()})
            last_saved[0] = time.monotonic()

    try:
        info = slurm_batch.wait_for_job(cli, job_id, logs, on_line, on_poll=save_positions)
    except BaseException as exc:
        # A notice to this process (Preempted) leaves scancel's SIGTERM a notice to the ranks too, so they
        # may still commit the step in flight; anything else (a cancel, a failure) ends them at once.
        if not isinstance(exc, Preempted):
            marker.touch()
        cancel(cli, job_id, logger)
        raise
    if not info.ok and router.preempted is not None:
        raise router.failure(verb, 1)  # Preempted: the ranks stopped on a notice (tasks/core/launch/notice_watch.py)
    if not info.ok:
        # The cause, as on the local backend: the first error line a rank (else torchrun) wrote.
        cause = f"{router.cause[0]}: {router.cause[1]}" if router.cause else None
        message = slurm_batch.failure_message(info, batch, by_node, what=f"engine verb '{verb}'")
        raise StageFailed(f"engine verb '{verb}' failed on {cause}\n{message}" if cause else message, cause=cause)
    logger.info("Slurm job %s COMPLETED on %s", job_id, info.nodes)


def cancel(cli: slurm.SlurmCli, job_id: str, logger) -> None:
    try:
        cli.cancel(job_id)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            info = cli.job(job_id)
            if info is None or not info.active:
                break
            time.sleep(0.5)
        logger.warning("cancelled Slurm job %s", job_id)
    except slurm.SlurmError as exc:
        logger.error("could not cancel Slurm job %s: %s; cancel it by hand: scancel %s", job_id, exc, job_id)
