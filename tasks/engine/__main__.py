"""Engine entry point, one process per torchrun rank:

    torchrun --nproc_per_node=2 -m tasks.engine shard --config JOB.json
    torchrun --nproc_per_node=2 -m tasks.engine train --config JOB.json
    torchrun --nproc_per_node=2 -m tasks.engine shard-train --config JOB.json   # a shared launch: tasks/engine/handoff.py

JOB.json is described in tasks/engine/preconditions.py. Order of work, cheapest checks first: prefix this
rank's output with `[rank N] `; read and validate the job; refuse plugins this machine cannot run
(Gemini without CUDA) before any model is loaded; parse CPT_TO_SFT_FAULT (tasks/engine/faults.py);
import ColossalAI with torch.compile deferred to first use (tasks/engine/lazy_compile.py); fit its shardformer
forwards to the installed transformers (tasks/engine/hf_compat.py); patch ColossalAI for CPU when CUDA is absent (tasks/engine/cpu_compat.py); init the process group
with `colossalai.launch_from_torch(seed=<stage seed>)`; run the verb (tasks/engine/loop.py).

Exit status 0 on success, PREEMPTED_EXIT (75, tasks/core/errors.py) on every rank after a
preemption notice stopped the stage (tasks/core/launch/notice_watch.py), 1 with a message naming the problem on failure, written at level error
(`tasks.engine.rankio.say`): the cause line first, then the traceback for anything that is not a
configuration, manifest or data error. Never imports prefect.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
import warnings

STARTED_AT = time.time()  # before torch's and ColossalAI's imports: a preemption record's `rank_start`

# Import-time notices about CUDA-only extras this engine does not use (apex fused RMSNorm,
# TensorNVMe async save) and torch deprecations of calls made inside ColossalAI 0.5.0 (its DDP
# wrapper, ZeRO's collectives): lines per rank per launch that would bury real warnings.
for _pattern in (
    r"Please install apex",
    r"Please install the latest tensornvme",
    r"`broadcast_buffers` is deprecated",
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
):
    warnings.filterwarnings("ignore", message=_pattern)


# bitsandbytes' harmless kernels warning: filtered by tasks/__init__.py (hf_imports.harmless_bnb_kernels).


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tasks.engine", description="cpt-to-sft engine: run one verb in this torchrun rank"
    )
    p.add_argument("verb", choices=["shard", "train", "shard-train"])
    p.add_argument("--config", required=True, help="job file (JSON) written by the Prefect task")
    return p.parse_args(argv)


def _running(verb: str) -> str:
    """The verb a failure or the end is reported under: a shared launch's part then running (shard, then train)."""
    if verb != "shard-train":
        return verb
    from tasks.engine import handoff

    return handoff.running[0]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    from tasks.core.launch.proctree import die_with_parent

    # torchrun starts each rank in a session of its own; if torchrun dies, the rank goes with it.
    die_with_parent()
    from tasks.engine import rankio

    rankio.install(rank)
    # Every torch.load in this process (ColossalAI's optimizer and lr-scheduler loaders) is a
    # weights-only unpickle, whatever the call site says.
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    started = time.monotonic()

    from tasks.core.errors import PREEMPTED_EXIT, ConfigError, ManifestError, Preempted
    from tasks.core.run.events import DETAIL, ERROR, WARNING

    try:
        from tasks.engine.builders import check_supported
        from tasks.engine.preconditions import check_inputs, load_job

        # shard-train: a shard job, then the train stage's job when it adopts the launch (tasks/engine/handoff.py)
        job = load_job(args.config, verb="shard" if args.verb == "shard-train" else args.verb)
        check_supported(job.phase_cfg.plugin, job.phase)
        if job.nodes is None:  # per-node staging checks what it stages, once the group is up
            check_inputs(job)

        import torch

        from tasks.engine.faults import Injector

        world = int(os.environ.get("WORLD_SIZE", "1"))
        from tasks.engine.lazy_compile import import_colossalai

        # The first import of ColossalAI, without importing torch's compiler for functions this
        # engine never calls (tasks/engine/lazy_compile.py): half of a rank's start-up CPU.
        import_colossalai()
        from tasks.engine import hf_compat

        # ColossalAI's Llama/Mistral/Qwen2 forwards on the installed transformers (refused on one not measured)
        hf_compat.apply()
        patched: list[str] = []
        if not torch.cuda.is_available():
            from tasks.engine import cpu_compat

            patched = cpu_compat.apply()

        # ColossalAI logs through rich, which wraps at the terminal width (80 under a pipe).
        os.environ.setdefault("COLUMNS", "200")
        import colossalai
        import torch.distributed as dist
        from colossalai.logging import get_dist_logger

        colossalai.launch_from_torch(seed=job.phase_cfg.seed, verbose=False)
        # Its INFO lines (e.g. where optimizer shards went) are noise next to our own log.
        get_dist_logger().set_level("WARNING")
        if job.nodes is not None:
            from tasks.engine import node_staging

            job = node_staging.prepare(job)
            check_inputs(job)
        faults = Injector(job.phase, job.stage_dir, rank, world)
        if rank == 0:
            rankio.say(
                f"engine {args.verb} {job.phase}: world size {dist.get_world_size()}, "
                f"{'CUDA' if torch.cuda.is_available() else 'CPU (gloo), cpu_compat patched: ' + (', '.join(patched) or 'none')}",
                DETAIL,
            )

        from tasks.engine import loop

        loop.RANK_STARTED = STARTED_AT
        # What the imports built (torch, transformers, ColossalAI) lives until the process exits;
        # frozen, it is out of the collector's sight, so the full collections that come later
        # (ColossalAI's plugin destructor, transformers between weight shards) scan only what the verb allocates.
        gc.freeze()
        if args.verb == "shard-train":
            from tasks.engine.handoff import shard_then_train

            result = shard_then_train(job, faults, args.config)
        else:
            result = loop.shard(job, faults) if args.verb == "shard" else loop.train(job, faults)
        dist.barrier()
        if rank == 0:
            rankio.say(
                f"engine {_running(args.verb)} {job.phase}: done in {time.monotonic() - started:.1f}s -> {result}",
                DETAIL,
            )
        dist.destroy_process_group()
        return 0
    except Preempted as exc:
        # Every rank agreed on the step and committed what it could: leave together, distinctly.
        import torch.distributed as dist

        if rank == 0:
            rankio.say(str(exc), WARNING)
        dist.barrier()
        dist.destroy_process_group()
        return PREEMPTED_EXIT
    except (ConfigError, ManifestError, ValueError, FileNotFoundError) as exc:
        # One self-contained first line: the launcher quotes it as the stage's cause.
        first, *rest = str(exc).splitlines() or [type(exc).__name__]
        rankio.say(
            f"engine {_running(args.verb)} failed: {exc.one_line() if isinstance(exc, ConfigError) else first}", ERROR
        )
        if rest and not isinstance(exc, ConfigError):
            rankio.say("\n".join(rest), ERROR)
        return 1
    except Exception as exc:  # report anything, then exit non-zero
        # The cause first: the launcher quotes a rank's first error line as the stage's cause.
        rankio.say(f"engine {_running(args.verb)} failed: {type(exc).__name__}: {exc}", ERROR)
        rankio.say(traceback.format_exc(), ERROR)
        return 1


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for stream in (sys.stdout, sys.stderr):
        close = getattr(stream, "close_partial", None)
        if close:
            close()
    # On failure skip interpreter teardown: plugin destructors would try to destroy process
    # groups whose peers may be dead, which can hang instead of exiting.
    if code != 0:
        os._exit(code)
    # On success everything is written, closed and behind a barrier, and the process group is
    # destroyed: run the exit hooks (TensorBoard writers, our stream wrappers), then skip the
    # interpreter's teardown of torch, transformers and ColossalAI, which does nothing this
    # process needs and costs each rank about a second at the end of every stage.
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _exit(main())
