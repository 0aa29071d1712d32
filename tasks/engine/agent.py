"""torchrun's agent, leaving without the interpreter's teardown: `python -m tasks.engine.agent` takes
torchrun's arguments (the launcher's `tasks/core/launch/torchrun.py` `torchrun_argv` starts it).

    python -m tasks.engine.agent --standalone --nproc-per-node 2 -m tasks.engine train --config JOB.json

Once `torch.distributed.run`'s main returns or raises, its ranks are gone and its report written;
what a plain `python -m torch.distributed.run` does after that is the interpreter's teardown of the
torch it imported: 1.4-1.6 s on the project's 2-core machine (a rank's exit to torchrun's, with the
agent noticing the exit in 0.1 s of it), which every stage's end waits on, and after a preemption the
retry too (docs/spot.md, the recovery's `exit`). Here the exit hooks run, the streams are flushed
and the process ends. The exit status is torchrun's: 0; 1 after its error report (a rank failed or
was preempted, a notice's signal); argparse's for bad arguments; 130 on Ctrl-C.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SystemExit as exc:  # argparse's --help or usage error
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
