"""Per-step training metrics on rank 0: the extra fields of each `@@progress` record and the
TensorBoard event files under `<stage_dir>/tensorboard/`.

    torchrun --nproc_per_node=2 -m tasks.engine train --config JOB.json   # writes them as it trains
    python -m tasks.core.run.tbevents <stage_dir>/tensorboard                  # reads them back
    tensorboard --logdir <run_root>                                        # both stages side by side

Per optimizer step: loss, lr, grad_norm (the norm the plugin's optimizer computed for clipping,
before clipping; absent when the plugin did not compute one, e.g. max_norm 0), tokens_per_s (real
tokens of the global batch / step time, at the stage's `seq_len`, which the record also carries), step_s (wall time of the step on rank 0, which waits for
the collectives of every rank), peak_mem_bytes (CUDA: max allocated since the previous step on
the device of each rank; CPU: each rank's peak RSS since the process started, the kernel keeps no
other peak), the largest of every rank's, and peak_mem_rank, the rank that had it, mfu (tasks.core.models.flops, from the real tokens; only on a device with a known peak),
computed_tokens (rows x width of the global batch's micro-batches, padding included) and
padding_frac (1 - real / computed: the share of the step's work spent on padding).

Every rank also logs what building its model cost in host memory (`HostPeak`, Linux /proc): the
peak from the start of construction (VmHWM, reset there) to the weights read into its share, over
the RSS it held at that start; the peak_mem_bytes of a CPU rank then counts from that start too.

The ranks never import a tracking client: MLflow is written by the Prefect task from these
records (tasks/flowkit/tracking.py). TensorBoard needs no server, so the engine writes it itself, with
tensorboardX (a pure-Python writer: tensorboard itself pulls grpcio and a Rust data server).
A write error of the event file is logged once and the training goes on: the files are a view.
"""

from __future__ import annotations

import atexit
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

from tasks.core.models.flops import flops_per_token, mfu, peak_flops
from tasks.core.run.stages import TENSORBOARD as TB_DIR

# The @@progress field -> its TensorBoard tag. One scalar per step per field that has a value.
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "seq_len": "perf/seq_len",
    "step_s": "perf/step_s",
    "peak_mem_bytes": "perf/peak_mem_bytes",
    "peak_mem_rank": "perf/peak_mem_rank",
    "mfu": "perf/mfu",
    "padding_frac": "perf/padding_frac",
    "computed_tokens": "perf/computed_tokens",
}


def count_params(model: torch.nn.Module) -> int:
    """Parameters of the unsharded model (call before boosting: plugins shard them)."""
    return sum(p.numel() for p in model.parameters())


def grad_norm(optimizer: Any, fallback: Any = None) -> float | None:
    """The pre-clipping global grad norm ColossalAI's optimizer wrappers keep after `step()`
    (`get_grad_norm()`: HybridParallel, LowLevelZero, Gemini, mixed precision); torch_ddp's
    OptimizerWrapper does not implement it, there `fallback` is what `clip_grad_by_norm` returned."""
    value = None
    try:
        value = optimizer.get_grad_norm()
    except (NotImplementedError, AttributeError):
        value = None
    if value is None:
        value = fallback
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def peak_over_ranks(value: int) -> tuple[int, int]:
    """(the largest of every rank's `value`, the rank that had it): one all-gather of one number,
    on the device the process group's backend reduces on (NCCL: this rank's GPU)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return int(value), 0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([int(value)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    values = [int(t.item()) for t in every]
    rank = max(range(len(values)), key=values.__getitem__)
    return values[rank], rank


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class StepMetrics:
    """Times each step and turns it into the fields of the @@progress record; rank 0 also writes
    them to TensorBoard. `world` devices share the work (MFU is per device)."""

    def __init__(
        self,
        stage_dir: Path,
        *,
        rank: int,
        world: int,
        n_params: int,
        model_config: Any,
        seq_len: int,
        precision: str,
        write: bool | None = None,
        purge_step: int | None = None,
    ):
        self.rank, self.world, self.seq_len = rank, world, seq_len
        self.per_token = flops_per_token(
            n_params,
            int(getattr(model_config, "num_hidden_layers", 0) or 0),
            int(getattr(model_config, "hidden_size", 0) or 0),
            seq_len,
        )
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        self.device_name = name or "cpu"
        self.peak = peak_flops(name, precision)
        self.logdir = Path(stage_dir) / TB_DIR
        self._writer = None
        self._t0 = None
        if write if write is not None else rank == 0:
            try:
                from tensorboardX import SummaryWriter

                self.logdir.mkdir(parents=True, exist_ok=True)
                # flush_secs: the files are followed live by `tensorboard --logdir`.
                # tensorboardX names the file by the second: a relaunch within it must not truncate it.
                suffix = f".{os.getpid()}.{time.time_ns() % 10**9:09d}"
                self._writer = SummaryWriter(
                    logdir=str(self.logdir), flush_secs=5, purge_step=purge_step, filename_suffix=suffix
                )
                atexit.register(self.close)  # a rank that dies of an exception still flushes its points
            except Exception as exc:
                print(f"TensorBoard writer unavailable under {self.logdir}: {exc}", flush=True)

    def start(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._t0 = time.perf_counter()

    def stop(
        self,
        step: int,
        *,
        loss: float,
        lr: float,
        tokens: int,
        computed: int | None = None,
        optimizer: Any = None,
        clip_norm: Any = None,
    ) -> dict[str, Any]:
        """The metric fields of step `step` (call right after the optimizer step)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_s = time.perf_counter() - (self._t0 if self._t0 is not None else time.perf_counter())
        tps = tokens / step_s if step_s > 0 else 0.0
        rec: dict[str, Any] = {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm(optimizer, clip_norm) if optimizer is not None else None,
            "tokens_per_s": round(tps, 3),
            "seq_len": self.seq_len,  # what tokens_per_s was measured at: it falls as sequences grow
            "step_s": round(step_s, 6),
            **dict(zip(("peak_mem_bytes", "peak_mem_rank"), peak_over_ranks(peak_memory_bytes()), strict=True)),
            "mfu": mfu(tps, self.per_token, self.peak, self.world),
            # What the step computed beyond the real tokens: the padding of its micro-batches.
            "computed_tokens": computed,
            "padding_frac": round(1.0 - tokens / computed, 6) if computed else None,
        }
        rec = {k: v for k, v in rec.items() if v is not None}
        self.write(step, rec)
        return rec

    def write(self, step: int, rec: dict[str, Any]) -> None:
        if self._writer is None:
            return
        try:
            for key, tag in TAGS.items():
                if key in rec:
                    self._writer.add_scalar(tag, float(rec[key]), step)
        except Exception as exc:
            print(f"TensorBoard write failed under {self.logdir}, no more points this launch: {exc}", flush=True)
            self._writer = None

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception as exc:
                print(f"TensorBoard close failed under {self.logdir}: {exc}", flush=True)
            self._writer = None
