"""What the Slurm tests run under torchrun on each emulated node (gloo, CPU):

    python -m torch.distributed.run ... tests/_slurm_probe.py allreduce|fail|sleep

- `allreduce`: every rank all-reduces (rank + 1) and prints its node and the sum as JSON;
- `fail`: the rank on node n2 raises after the rendezvous (a failing rank with a traceback);
- `sleep`: every rank prints `ready` and sleeps (a job to cancel).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main(mode: str) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("SLURMD_NODENAME", "?")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    info = {"rank": rank, "world": world, "node": node, "sum": t.item(), "job": os.environ.get("SLURM_JOB_ID")}
    print(f"[rank {rank}] @@probe {json.dumps(info)}", flush=True)
    if mode == "fail" and node == "n2":
        raise RuntimeError(f"probe failure on purpose on {node}")
    if mode == "sleep":
        print(f"[rank {rank}] ready pid={os.getpid()}", flush=True)
        time.sleep(600)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
