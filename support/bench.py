"""The measuring kit of the benchmarks: a work directory, best-of timing, a right-aligned table, a child process.

python -c "from support.bench import best_of; print(best_of(lambda: sum(range(10**6)), 3))"
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def workdir(given: str | Path | None, prefix: str) -> Path:
    """`given`, or a new directory under the system's temporary one (kept: a benchmark's outputs outlive it)."""
    return Path(given or tempfile.mkdtemp(prefix=prefix))


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of `repeat` wall times of fn(), in seconds: the run least disturbed by the rest of the machine."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """`header` and `rows` as a ` | `-separated table, each column right-aligned to its widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(" | ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths)))


# Peak RSS of the child's own program: VmHWM of its address space, which starts anew at exec.
# (wait4's ru_maxrss is not usable: it also counts the pages of this parent process that the
# child shared between fork and exec, so every child reported at least the parent's RSS.)
PRELUDE = """
import atexit, json as _json
from tasks.core.run.hostpeak import status_bytes as _status_bytes
atexit.register(lambda: print(_json.dumps({"hwm_kb": _status_bytes("VmHWM") // 1024})))
"""


def child(code: str, args: tuple[str, ...] | list[str], env: dict[str, str], fork: bool = False) -> dict:
    """Run `code` in a fresh interpreter (`python -c code *args` under `env`); it prints one JSON line,
    returned with its peak RSS (MB, the pool's worker processes not included) and its seconds. `fork`:
    in a fork of this process instead, whose imports then cost the child nothing (a smoke run's knob:
    its RSS and seconds are not a fresh process's)."""
    t0 = time.monotonic()
    if fork:
        out = forked(code, args, env)
    else:
        p = subprocess.run(
            [sys.executable, "-c", PRELUDE + code, *args], env=env, capture_output=True, text=True, check=False
        )
        if p.returncode != 0:
            raise RuntimeError(f"child failed:\n{p.stderr[-3000:]}")
        out = p.stdout
    *rest, hwm = out.strip().splitlines()
    rec = json.loads(rest[-1])
    rec["peak_rss_mb"] = json.loads(hwm)["hwm_kb"] / 1024
    rec["process_s"] = time.monotonic() - t0
    return rec


def forked(code: str, args: tuple[str, ...] | list[str], env: dict[str, str]) -> str:
    """What `python -c code *args` prints under `env`, run in a fork of this process instead: the imports
    this process holds cost nothing again (a smoke run's knob: its seconds and RSS are not a fresh
    process's). The child has its own `__main__` (a spawn pool it starts does not re-import the caller's
    script); a last line `{"hwm_kb": VmHWM}` is added, as PRELUDE prints it in a fresh interpreter."""
    import traceback
    import types

    from tasks.core.run.hostpeak import status_bytes

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        rc = 0
        try:
            os.close(r)
            os.environ.clear()
            os.environ.update(env)
            sys.stdout = open(w, "w", buffering=1)  # noqa: SIM115 (the child's life)
            sys.argv = ["-c", *args]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(code, "<child>", "exec"), main.__dict__)  # noqa: S102 - the calling benchmark's own code
            print(json.dumps({"hwm_kb": status_bytes("VmHWM") // 1024}), flush=True)
        except BaseException:
            traceback.print_exc()
            rc = 1
        finally:
            os._exit(rc)
    os.close(w)
    with open(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"forked child failed (its traceback is above):\n{out[-3000:]}")
    return out
