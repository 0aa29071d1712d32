"""torchrun's agent, leaving without the interpreter's teardown and, by default, forking its ranks
from its own imports: `python -m tasks.engine.agent` takes torchrun's arguments (the launcher's
`tasks/core/launch/torchrun.py` `torchrun_argv` starts it).

    python -m tasks.engine.agent --standalone --nproc-per-node 2 -m tasks.engine train --config JOB.json
    CPT_TO_SFT_RANK_START=exec python -m tasks.engine.agent ...   # every rank a fresh interpreter

Once `torch.distributed.run`'s main returns or raises, its ranks are gone and its report written;
what a plain `python -m torch.distributed.run` does after that is the interpreter's teardown of the
torch it imported: 1.4-1.6 s on the project's 2-core machine (a rank's exit to torchrun's, with the
agent noticing the exit in 0.1 s of it), which every stage's end waits on, and after a preemption the
retry too (docs/spot.md, the recovery's `exit`). Here the exit hooks run, the streams are flushed
and the process ends. The exit status is torchrun's: 0; 1 after its error report (a rank failed or
was preempted, a notice's signal); argparse's for bad arguments; 130 on Ctrl-C.

Rank start (RANK_START_ENV, `fork` unless set): `exec` starts each rank as `python -m tasks.engine VERB --config JOB`,
torchrun's own way, and each rank imports torch, ColossalAI's booster, transformers and peft again
(about 5 CPU-s a rank). `fork` imports them once here (`preload`: third-party modules and the
project's engine modules, none of which reads a rank's environment or starts a thread at import,
and none of which touches CUDA: a forked child cannot use a CUDA context its parent made), then has
torchrun's elastic launch start the ranks as forks of this process running `rank` (torch's
`MultiprocessContext`, start method fork): each gets its rank's environment, the agent's stdout and
stderr, and reports its exit status as a subprocess rank does. A launch whose command is not
`-m tasks.engine ...` is torchrun's as given. Figures: docs/spot.md, "Ranks forked from the agent's
imports".
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback

RANK_START_ENV = "CPT_TO_SFT_RANK_START"
RANK_STARTS = ("fork", "exec")
DEFAULT_RANK_START = "fork"


def engine_args(argv: list[str]) -> list[str] | None:
    """The engine's arguments (`VERB --config JOB`) when torchrun's command is `-m tasks.engine ...`."""
    for i in range(len(argv) - 1):
        if argv[i] in ("-m", "--module") and argv[i + 1] == "tasks.engine":
            return argv[i + 2 :]
    return None


def rank_start(environ=os.environ) -> str:
    start = environ.get(RANK_START_ENV, "") or DEFAULT_RANK_START
    if start not in RANK_STARTS:
        raise SystemExit(f"{RANK_START_ENV}={start!r}: unknown rank start; set it to one of {', '.join(RANK_STARTS)}")
    return start


def preload() -> None:
    """Import what every engine rank imports, in the rank's order (ColossalAI under deferred compile
    first), and nothing that reads a rank's environment or starts a thread at import."""
    import torch

    from tasks.engine.lazy_compile import import_colossalai

    import_colossalai()
    import transformers.modeling_utils
    import transformers.models.llama.modeling_llama  # noqa: F401

    import tasks.engine.__main__  # noqa: F401
    from tasks.engine import builders, faults, loop, preconditions, rankio  # noqa: F401

    if torch.cuda.is_initialized():  # a forked rank could not use it
        raise RuntimeError("the agent's imports initialised CUDA: start ranks with CPT_TO_SFT_RANK_START=exec")


def rank(*args: str) -> int:
    """One forked rank: `python -m tasks.engine` for `args`, as if started fresh."""
    import signal
    import time

    # torchrun's handlers (SIGTERM/SIGINT/SIGHUP/SIGQUIT raise its SignalException) came with the
    # fork; a fresh interpreter's defaults are what the engine and its notice watch expect.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The agent's exit hooks are the agent's (multiprocessing's among them), not this rank's.
    atexit._clear()
    from tasks.engine import __main__ as engine

    engine.STARTED_AT = time.time()  # a preemption record's `rank_start`: the fork, not the agent's imports
    code = engine.main(list(args))
    if code != 0:
        engine._exit(code)  # the exit status torchrun reports, as a subprocess rank's
    # Success returns to torchrun's wrapper, which hands the return value to the agent before exiting.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs: threading's count, which sees Python's own threads only
        import threading

        return threading.active_count()


def _forked(argv: list[str], args: list[str]) -> None:
    import gc

    import torch.distributed.run as torchrun

    # Read by OpenMP when torch loads, so before the imports: torchrun gives each rank of a
    # multi-rank launch 1 when it is unset (the launcher always sets it: engine_env).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    preload()
    if _native_threads() > 1:
        # OMP_NUM_THREADS above 1 has torch start OpenMP's pool at import: a fork would hold its state
        # without its threads, so the ranks start fresh as torchrun's own do.
        print(
            f"{_native_threads()} threads after the agent's imports (OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS')}): ranks start as fresh interpreters, not forks",
            file=sys.stderr,
            flush=True,
        )
        torchrun.main(argv)
        return
    # Out of the collector's sight: forks share these pages instead of copying each one a collection touches.
    gc.freeze()
    config_from_args = torchrun.config_from_args

    # torchrun's own main and run (its rendezvous settings, its error report), with the ranks started
    # as forks running `rank`: the one place its command becomes a function.
    def fork_config(parsed):
        config, _cmd, _cmd_args = config_from_args(parsed)
        config.start_method = "fork"
        return config, rank, args

    torchrun.config_from_args = fork_config
    sys.stdout.flush()
    sys.stderr.flush()
    torchrun.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from torch.distributed.run import main as torchrun

    try:
        args = engine_args(argv)
        if args is not None and rank_start() == "fork":
            _forked(argv, args)
        else:
            torchrun(argv)
    except SystemExit as exc:  # argparse's --help or usage error
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        return 130
    except BaseException:  # as the interpreter reports an uncaught one (torchrun's @record has logged its summary)
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
