"""A torchrun rank that ignores SIGTERM and keeps writing, like a training rank stuck between
saves: the target of tests/test_proctree.py.

    torchrun --standalone --nproc-per-node 2 tests/_stubborn_rank.py WATCHED_DIR
"""

import os
import signal
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
out = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))
n = 0
while True:
    n += 1
    tmp = os.path.join(out, f".rank-{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {n}\n")
    os.replace(tmp, os.path.join(out, f"rank-{rank}.txt"))
    time.sleep(0.1)
