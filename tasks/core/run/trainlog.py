"""What the console shows of a run: a training log, not the record.

    python -m tasks.core.run.trainlog    # prints a stage's lines for a made-up 2,000-step run

The record of every step stays where it was (TensorBoard, MLflow, `train_state.json`, the progress
artifact and the run's log in the Prefect UI). The console gets, per training stage, a start line,
one line per `log_every` steps (the stage's setting; unset: a round interval giving at most
`LINES` lines, `default_log_every`), an end line, and at the end of the run a table of the stages.
A warning every rank of a launch prints is one console line naming the ranks (`SameWarnings`).

    cpt  step 120/2000 | loss 2.314 | lr 2.0e-05 | 41.2k tok/s | pad 3% | mfu 38% | mem 61.2 GiB | eta 3h12m
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from tasks.core.run.preemptions import describe as describe_preemption
from tasks.core.run.stages import ROWS

LINES = 25  # step lines per stage at most, when log_every is unset
_RANK = re.compile(r"rank (\d+)$")


def default_log_every(max_steps: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that prints at most LINES step lines."""
    every, k = 1, 0
    while math.ceil(max_steps / every) > LINES:
        k += 1
        every = (1, 2, 5)[k % 3] * 10 ** (k // 3)
    return every


def duration(seconds: float) -> str:
    """3h12m, 4m05s, 9.4s."""
    seconds = max(float(seconds), 0.0)
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def count(n: float) -> str:
    """41.2k, 1.3M, 950."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def eta_s(record: dict[str, Any], first_step: int) -> float | None:
    """Seconds left at this launch's pace: elapsed / steps done in it × steps to go."""
    step, total, elapsed = record.get("step"), record.get("total"), record.get("elapsed_s")
    done = (step or 0) - first_step + 1
    if not isinstance(elapsed, (int, float)) or not total or done <= 0:
        return None
    return elapsed / done * max(int(total) - int(step), 0)


class TrainLog:
    """Fed every @@progress record of one stage's launch; `__call__` returns its console line every
    `every` steps and at the last step, else None. Keeps what the end line says: the first and last
    loss and the largest peak memory of any rank (`peak`: bytes, rank)."""

    def __init__(self, phase: str, total: int, every: int | None = None):
        self.phase, self.total = phase, max(int(total), 1)
        self.every = max(int(every or default_log_every(self.total)), 1)
        self.first_step: int | None = None
        self.first_loss: float | None = None
        self.last: dict[str, Any] = {}
        self.peak: tuple[int, int | None] | None = None
        self._mark: tuple[float, int] | None = None  # (elapsed_s, tokens) at the previous line

    @property
    def tag(self) -> str:
        return f"{self.phase:<4}"

    def start(self, what: str) -> str:
        return f"{self.tag} start | {self.total} steps | {what} | a line every {self.every} step{'s' if self.every > 1 else ''}"

    def __call__(self, record: dict[str, Any]) -> str | None:
        step = int(record.get("step", 0))
        if self.first_step is None:
            self.first_step = step
            self.first_loss = record.get("loss")
            self._mark = (
                0.0,
                int(record.get("tokens", 0)) - int(record.get("tokens_per_s", 0) * record.get("step_s", 0)),
            )
        self.last = record
        mem = record.get("peak_mem_bytes")
        if isinstance(mem, (int, float)) and (self.peak is None or mem > self.peak[0]):
            self.peak = (int(mem), record.get("peak_mem_rank"))
        if step % self.every and step < self.total:
            return None
        return self.line(record)

    def line(self, record: dict[str, Any]) -> str:
        parts = [f"{self.tag} step {record.get('step')}/{self.total}"]
        loss, lr = record.get("loss"), record.get("lr")
        if isinstance(loss, (int, float)):
            parts.append(f"loss {loss:.3f}")
        if isinstance(lr, (int, float)):
            parts.append(f"lr {lr:.1e}")
        tps = self._interval_tokens_per_s(record)
        if tps is not None:
            parts.append(f"{count(tps)} tok/s")
        if isinstance(record.get("padding_frac"), (int, float)):
            parts.append(f"pad {100 * record['padding_frac']:.0f}%")
        if isinstance(record.get("mfu"), (int, float)):
            parts.append(f"mfu {100 * record['mfu']:.0f}%")
        if isinstance(record.get("peak_mem_bytes"), (int, float)):
            parts.append(f"mem {gib(record['peak_mem_bytes'])}")
        eta = record.get("eta_s", eta_s(record, self.first_step or 1))
        if eta is not None and int(record.get("step", 0)) < self.total:
            parts.append(f"eta {duration(eta)}")
        return " | ".join(parts)

    def _interval_tokens_per_s(self, record: dict[str, Any]) -> float | None:
        """Real tokens per second since the previous line (one step is noisy), else the step's."""
        elapsed, tokens = record.get("elapsed_s"), record.get("tokens")
        if (
            isinstance(elapsed, (int, float))
            and isinstance(tokens, int)
            and self._mark is not None
            and elapsed > self._mark[0]
        ):
            tps = (tokens - self._mark[1]) / (elapsed - self._mark[0])
            self._mark = (float(elapsed), tokens)
            return tps
        return record.get("tokens_per_s")

    def end(self, seconds: float, medians: dict[str, float] | None = None) -> str:
        """The stage's end line: steps and time, loss first → last, medians, the peak memory."""
        medians = medians or {}
        parts = [f"{self.tag} done  | step {self.last.get('step', 0)}/{self.total} in {duration(seconds)}"]
        last = self.last.get("loss")
        if isinstance(self.first_loss, (int, float)) and isinstance(last, (int, float)):
            parts.append(f"loss {self.first_loss:.3f} → {last:.3f}")
        if "tokens_per_s" in medians:
            seq = self.last.get("seq_len")  # throughput falls as sequences grow: say at which length
            at = f" at seq_len {seq:,}" if isinstance(seq, int) else ""
            parts.append(f"median {count(medians['tokens_per_s'])} tok/s{at}")
        if "padding_frac" in medians:
            parts.append(f"pad {100 * medians['padding_frac']:.0f}%")
        if "mfu" in medians:
            parts.append(f"mfu {100 * medians['mfu']:.0f}%")
        if self.peak is not None:
            parts.append(
                f"peak mem {gib(self.peak[0])}" + (f" (rank {self.peak[1]})" if self.peak[1] is not None else "")
            )
        return " | ".join(parts)


def ranks_label(whos: Iterable[str]) -> str:
    """["rank 0", "rank 1", "rank 2", "rank 5"] -> "ranks 0-2,5"; other names as they are."""
    whos = list(dict.fromkeys(whos))
    nums = [int(m.group(1)) for w in whos if (m := _RANK.search(w)) and w == m.group(0)]
    if len(nums) != len(whos):
        return ", ".join(whos)
    if len(nums) == 1:
        return f"rank {nums[0]}"
    runs: list[list[int]] = []
    for n in sorted(nums):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return "ranks " + ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


class SameWarnings:
    """One console line for a warning every rank of a launch prints: a warning is held until
    `ranks` processes have said it, `window_s` has passed since its first, or `flush()` (the launch
    ended, or an error line is about to be printed); then returned once with the ranks that said it."""

    def __init__(self, ranks: int, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.ranks, self.window_s, self.clock = max(int(ranks), 1), window_s, clock
        self._pending: dict[str, tuple[float, list[str]]] = {}

    def add(self, who: str, body: str) -> list[tuple[str, str]]:
        """(label, body) lines ready now: this one if every rank has said it, and any overdue."""
        _, whos = self._pending.setdefault(body, (self.clock(), []))
        if who not in whos:
            whos.append(who)
        ready = self.due()
        if body in self._pending and len(whos) >= self.ranks:
            del self._pending[body]
            ready.append((ranks_label(whos), body))
        return ready

    def due(self) -> list[tuple[str, str]]:
        now = self.clock()
        late = [b for b, (t, _) in self._pending.items() if now - t >= self.window_s]
        return [(ranks_label(self._pending.pop(b)[1]), b) for b in late]

    def flush(self) -> list[tuple[str, str]]:
        out = [(ranks_label(whos), b) for b, (_, whos) in self._pending.items()]
        self._pending.clear()
        return out


def size(n: float) -> str:
    """427.1 kB, 16.1 GB (decimal, as disks are sold)."""
    for div, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def _change(before: Any, after: Any, fmt: str) -> str:
    return (
        f"{before:{fmt}} → {after:{fmt}}"
        if isinstance(before, (int, float)) and isinstance(after, (int, float))
        else ""
    )


def _over_seq_len(tr: dict[str, Any]) -> str:
    """'; 3 of 200 chats over seq_len=128 (drop)': what the truncation rule did, from a prepare row's counts."""
    n = int(tr.get("over_seq_len") or 0)
    if not n:
        return ""
    what = "chats" if "chats" in tr else "documents"
    return f"; {n:,} of {int(tr.get(what) or 0):,} {what} over seq_len={tr.get('seq_len')} ({tr.get('rule')})"


def _scores(tasks: dict[str, Any], shown: int = 2) -> str:
    """'veyra_facts acc 0.6 → 0.57': each benchmark metric, base to export, the first `shown` of them."""
    figs = []
    for task, metrics in tasks.items():
        for metric, m in (metrics or {}).items():
            after = m.get("export")
            figs.append(f"{task} {metric} {_change(m.get('base'), after, '.4g') or _g(after)}")
    return "; ".join(figs[:shown]) + (f" (+{len(figs) - shown} more)" if len(figs) > shown else "")


def _g(x: Any) -> str:
    return format(x, ".4g") if isinstance(x, (int, float)) else "-"


def key_figure(row: dict[str, Any]) -> str:
    """The one figure a stage's row of run.json is read for: perplexity, loss, export size, ..."""
    d, name = row.get("detail") or {}, row.get("stage", "")
    if str(row.get("status")) == "failed":
        return "its cause is the run's last line"  # a failure is one line on the console (tasks/flowkit/console_log.py)
    m = d.get("metrics") or {}
    if name == ROWS.load_from_hf.name and d.get("model_type"):
        return f"{d['model_type']}, vocab {d.get('vocab_size')}"
    if name.startswith("prepare_") and "train_tokens" in d:
        return (
            f"{count(d['train_tokens'])} train tokens, {count(d.get('heldout_tokens', 0))} held out"
            f"{_over_seq_len(d.get('truncation') or {})}"
        )
    if name in (ROWS.boost_and_shard.name, ROWS.reboost.name, ROWS.reboost_dpo.name) and d.get("plugin"):
        return str(d["plugin"])
    if name.startswith("train_") and d.get("final_loss") is not None:
        return f"loss {_change(d.get('first_loss'), d['final_loss'], '.3f') or format(d['final_loss'], '.3f')}"
    if name in (ROWS.unshard.name, ROWS.unshard_sft.name) and d.get("fingerprint_max_abs_diff") is not None:
        return f"logits within {d['fingerprint_max_abs_diff']:.2g} of the checkpoint's"
    if name == ROWS.evaluate_cpt.name and m:
        return f"held-out perplexity {_change((m.get('base') or {}).get('perplexity'), (m.get('cpt') or {}).get('perplexity'), '.2f')}"
    if name == ROWS.evaluate_sft.name and m:
        gen = m.get("generation") or {}
        stops = f"; {gen.get('stopped')}/{gen.get('prompts')} generations stop" if gen else ""
        return f"held-out loss {_change((m.get('pre_sft') or {}).get('loss'), (m.get('sft') or {}).get('loss'), '.3f')}{stops}"
    if name == ROWS.evaluate_dpo.name and m.get("dpo"):
        s, p = m.get("sft") or {}, m["dpo"]
        return (
            f"preference accuracy {_g(p.get('accuracy'))}, margin {_g(p.get('margin'))}; chosen log-likelihood/token "
            f"{_change(s.get('chosen_logp_per_token'), p.get('chosen_logp_per_token'), '.3f')}"
        )
    if name == ROWS.reference.name and d.get("pairs") is not None:
        return f"{d['pairs']} pairs scored by the SFT model"
    if name == ROWS.benchmark.name and m.get("tasks"):
        return _scores(m["tasks"])
    if name == ROWS.export.name and d.get("bytes") is not None:
        return f"{size(d['bytes'])} {d.get('dtype', '')}".strip()
    if name == ROWS.gate.name and "passed" in d:
        return "passed" if d["passed"] else "; ".join(d.get("reasons") or [])[:160]
    if name == ROWS.push_to_hub.name:
        return str(d.get("commit_url") or d.get("reason") or "")
    return ""


def summary_table(stages: list[dict[str, Any]], run_root: str) -> str:
    """The run's end: each stage, its status, duration, CPU time (the flow process's and the processes it
    waited for: tasks/core/run/cputime.py) and key figure; where the artifacts are."""
    rows = [
        (
            s["stage"],
            str(s["status"]),
            duration(s["seconds"]) if s.get("seconds") else "-",
            duration(s["cpu_seconds"]) if s.get("cpu_seconds") else "-",
            key_figure(s),
        )
        for s in stages
    ]
    head = ("stage", "status", "duration", "CPU", "")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    lines = [
        f"{'stage':<{widths[0]}}  {'status':<{widths[1]}}  {'duration':>{widths[2]}}  {'CPU':>{widths[3]}}  key figure"
    ]
    lines += [
        f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {u:>{widths[3]}}  {d}".rstrip()
        for a, b, c, u, d in rows
    ]
    # each preemption on its own line: when, the step checkpointed, steps lost, notice to commit, restart
    lines += [describe_preemption(p) for s in stages for p in (s.get("detail") or {}).get("preemptions") or []]
    lines.append(f"artifacts: {run_root}  (run.json: every stage's record)")
    return "\n".join(lines)


if __name__ == "__main__":
    log = TrainLog("cpt", 2000, every=500)
    print(log.start("hybrid_parallel tp=8 pp=1 zero=1 bf16 | 64 ranks"))
    for s in range(1, 2001):
        out = log(
            {
                "step": s,
                "total": 2000,
                "loss": 3.0 - s / 2000,
                "lr": 2e-5,
                "tokens": s * 2060,
                "elapsed_s": s * 0.05,
                "tokens_per_s": 41200.0,
                "padding_frac": 0.03,
                "mfu": 0.38,
                "peak_mem_bytes": 61.2 * 2**30,
                "peak_mem_rank": 5,
            }
        )
        if out:
            print(out)
    print(log.end(100.0, {"tokens_per_s": 41200.0, "padding_frac": 0.03}))
