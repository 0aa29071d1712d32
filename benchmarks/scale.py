"""Memory per rank at three model sizes: measured RSS of the project's own engine beside the
pre-flight estimate (tasks/core/preflight/memory.py).

    .venv/bin/python benchmarks/scale.py              # 50M, 190M, 700M x 2 plugins on 2 CPU ranks: ~8 min
    .venv/bin/python benchmarks/scale.py --smoke      # the demo-sized model, one plugin: seconds, same table
    .venv/bin/python benchmarks/scale.py --sizes 50M --plugins hp-tp2-fp32 --keep --workdir /tmp/scale
    .venv/bin/python benchmarks/scale.py --sizes 80M-tied --plugins llz1-fp32 llz2-fp32 --no-flow   # ZeRO's buckets

The flow process's figures (the logits check whole vs streamed, the skip decision, a finished run
re-run) come after the ranks' table, from benchmarks/flow_process.py at the same sizes (--no-flow: not).

Per size, a seeded random Llama is written as an HF directory (in a child process), the CPT sample
corpus is tokenized by the project's prepare step, and each plugin runs the two engine verbs a CPT
stage runs, under torchrun with 2 CPU ranks, exactly as `tasks/core/launch/torchrun.py` launches them:
`shard` (boost_and_shard: from_pretrained, boost, step-000000) and `train` (from_config, boost, load
step-000000, then steps). Nothing in the engine is changed or patched for the measurement. A row is
skipped, with the reason printed, where its ranks would not fit the free memory, or where the plugin
trains in bf16/fp16 and this CPU multiplies in that dtype over HALF_SLOWDOWN_LIMIT times slower than
in fp32 (no native bf16: a few steps would take hours); --force runs it anyway.

What is measured, per rank, from outside (/proc/<pid>/status of torchrun's rank children):
- shard peak: the rank's VmHWM over the whole `shard` verb (construction plus the checkpoint save),
  judged against its limit: 1.3 x the estimate's steady share (weights, gradients and optimizer state
  the plugin places on the rank) plus the baseline below;
- construction peak: VmHWM of the `train` verb up to its "loaded step-000000" line (from_config,
  boost, checkpoint load; under hybrid_parallel built lazily, each rank its share, the checkpoint read
  one tensor at a time); printed, not judged;
- steady: the high-water mark of the training steps. At the first @@progress every rank's VmHWM is
  reset (`/proc/<pid>/clear_refs` = 5: VmHWM := the current RSS) and read at the last one: the peak
  over steps 2..N. The run is stopped there (SIGTERM to torchrun), so the final save does not count.
- baseline: the same steady figure for a model of ~0.1M parameters under the same plugin: what a rank
  holds whatever the model (torch, transformers and colossalai imports, the process group, the
  data). `tasks.core.preflight.memory.RANK_BASELINE_BYTES` is this figure.

The estimate is `tasks.core.preflight.memory.estimate` of the same stage config on the same
config.json: the host side of a CPU rank (baseline + parameters, gradients, master weights,
optimizer moments and buffers as the plugin holds them + the step's activations). Target: the
estimate within +-25 % of the steady figure at every size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support import REPO
from support.bench import workdir
from support.tiny import tiny_tokenizer

GB = 1e9
# Random Llamas; vocab 32000 (the Llama-2 size: divisible by tp=2, large enough that the embedding
# and the LM head weigh what they do in a real model). The demo tokenizer's ids all fall below it.
SIZES: dict[str, dict] = {
    "50M": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1376, vocab_size=32000),
    "190M": dict(
        hidden_size=1024, num_layers=11, num_heads=16, num_kv_heads=8, intermediate_size=2560, vocab_size=32000
    ),
    "700M": dict(
        hidden_size=1536, num_layers=24, num_heads=16, num_kv_heads=8, intermediate_size=4096, vocab_size=32000
    ),
    # Gemma-3-270M's proportions (a tied embedding of most of the parameters): where ZeRO-2's transients show
    "80M-tied": dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1536)
    | dict(vocab_size=131072, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512),
}
# Tokens per micro-batch per size: long sequences at the small size, where activations are a large
# share of a rank's memory, short ones at the large size, where the states dominate (and steps cost).
BATCH = {"50M": (1, 1024), "190M": (1, 512), "700M": (1, 128), "80M-tied": (1, 256), "tiny": (1, 128)}
PLUGINS = {
    "hp-tp2-fp32": {"name": "hybrid_parallel", "tp_size": 2, "precision": "fp32"},
    "llz2-bf16": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "llz1-bf16": {"name": "low_level_zero", "zero_stage": 1, "precision": "bf16"},
    "llz1-fp32": {"name": "low_level_zero", "zero_stage": 1, "precision": "fp32"},
    "llz2-fp32": {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
    "ddp-fp32": {"name": "torch_ddp", "precision": "fp32"},
}
NPROC = 2
LAUNCH_TIMEOUT_S = 900.0  # --launch-timeout: one engine verb, SIGTERMed past it
# A bf16/fp16 row is skipped where this CPU runs a half-precision matmul this many times slower than
# fp32 (a CPU without native bf16 runs it tens of times slower: one 50M bf16 step takes minutes).
HALF_SLOWDOWN_LIMIT = 8.0


def _kib(pid: int, field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _reset_hwm(pid: int) -> None:
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # Linux: VmHWM := the current resident set


class Ranks:
    """The rank processes of one torchrun (its children running tasks.engine, by RANK), and their
    VmRSS sampled every 0.2 s (the last VmHWM seen is kept: a rank's status is gone once it exits)."""

    def __init__(self, torchrun_pid: int):
        import psutil

        self.root = psutil.Process(torchrun_pid)
        self.pids: dict[int, int] = {}
        self.hwm: dict[int, int] = {}
        self.rss: dict[int, list[int]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _find(self) -> None:
        import psutil

        try:
            children = self.root.children(recursive=True)
        except psutil.Error:
            return
        forked = []
        for p in children:
            try:
                cmd = " ".join(p.cmdline())
                if "tasks.engine" in cmd and "torch.distributed.run" not in cmd:
                    rank = int(p.environ().get("RANK", "-1"))
                    if rank >= 0 and rank not in self.pids:
                        self.pids[rank] = p.pid
                    elif rank < 0 and p.ppid() == self.root.pid:
                        forked.append((p.create_time(), p.pid))
            except (psutil.Error, ValueError):
                pass
        if not self.pids and len(forked) == NPROC:  # forked ranks keep the agent's environ: forked 0..N-1 in order
            self.pids = {rank: pid for rank, (_, pid) in enumerate(sorted(forked))}

    def _poll(self) -> None:
        while not self.stop.wait(0.2):
            if len(self.pids) < NPROC:
                self._find()
            for rank, pid in self.pids.items():
                rss, hwm = _kib(pid, "VmRSS"), _kib(pid, "VmHWM")
                if rss is not None:
                    self.rss.setdefault(rank, []).append(rss * 1024)
                if hwm is not None:
                    self.hwm[rank] = hwm * 1024

    def read_hwm(self, reset: bool = False) -> dict[int, int]:
        self._find()
        out = {}
        for rank, pid in self.pids.items():
            v = _kib(pid, "VmHWM")
            if v is not None:
                out[rank] = v * 1024
                self.hwm[rank] = v * 1024
            if reset:
                _reset_hwm(pid)
        return out

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def launch(verb: str, job_path: Path, stop_at_step: int | None = None, timeout: float | None = None) -> dict:
    """One engine verb under torchrun (the project's argv and environment); per-rank peaks by phase."""
    from tasks.core.config.schema import LaunchConfig
    from tasks.core.launch.torchrun import engine_env, torchrun_argv
    from tasks.core.run.events import PROGRESS, parse_line

    argv = torchrun_argv(verb, job_path, LaunchConfig(nproc_per_node=NPROC), f"scale-{verb}")
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        cwd=str(REPO),
        env=engine_env(),
        start_new_session=True,
    )
    ranks = Ranks(proc.pid)
    out: dict = {"lines": []}
    killer = threading.Timer(timeout or LAUNCH_TIMEOUT_S, lambda: _stop(proc, ranks))
    killer.start()
    try:
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            out["lines"].append(line)
            parsed = parse_line(line)
            body = parsed.body
            if verb == "shard" and body.startswith("boosted "):
                out["construction"] = ranks.read_hwm()
            elif verb == "train" and body.startswith("loaded step-"):
                out["construction"] = ranks.read_hwm(reset=True)
            elif parsed.kind == PROGRESS:
                step = int(parsed.record["step"])
                if step == 1:
                    ranks.read_hwm(reset=True)
                    out["rss_from"] = {r: len(v) for r, v in ranks.rss.items()}
                if stop_at_step is not None and step >= stop_at_step:
                    out["steady"] = ranks.read_hwm()
                    out["rss_to"] = {r: len(v) for r, v in ranks.rss.items()}
                    out["loss"] = parsed.record.get("loss")
                    _stop(proc, ranks)
                    break
        rc = proc.wait()
    finally:
        killer.cancel()
        ranks.close()
    out["peak"] = dict(ranks.hwm)
    out["rss"] = ranks.rss
    if stop_at_step is None and rc != 0 or stop_at_step is not None and "steady" not in out:
        tail = "\n".join(out["lines"][-40:])
        raise RuntimeError(f"engine {verb} failed (exit {rc}):\n{tail}")
    return out


def _stop(proc: subprocess.Popen, ranks: Ranks) -> None:
    """End torchrun and its ranks (the processes this benchmark started, by pid)."""
    import psutil

    ranks._find()
    procs = []
    for pid in [proc.pid, *ranks.pids.values()]:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=20)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    if proc.stdout:
        for _ in proc.stdout:  # drain, so the pipe closes
            pass


BUILD = """
import sys, json
from pathlib import Path
from transformers import AutoTokenizer
from tasks.core.models.demo import build_tiny_model
out, tok, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
vocab = kw.pop("vocab_size")
build_tiny_model(out, AutoTokenizer.from_pretrained(tok), vocab_size=vocab, max_position_embeddings=2048, **kw)
"""


def model_dir(work: Path, size: str, tokdir: Path) -> Path:
    """The size's random HF model (written once per work dir, in a child: its RAM is not ours)."""
    out = work / f"model-{size}"
    if not (out / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-c", BUILD, str(out), str(tokdir), json.dumps(SIZES[size])],
            check=True,
            cwd=str(REPO),
            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"},
        )
    return out


def tokenizer_dir(work: Path) -> Path:
    out = work / "tokenizer"
    if not (out / "tokenizer.json").is_file():
        tiny_tokenizer().save_pretrained(out)
    return out


def prepared(work: Path, tokdir: Path, seq_len: int) -> Path:
    from tasks.core.data.prepare import prepare

    out = work / f"data-cpt-{seq_len}"
    if not (out / "index.json").is_file():
        prepare(
            str(REPO / "data" / "sample" / "cpt.jsonl"),
            tokdir,
            out,
            kind="cpt",
            field="text",
            seq_len=seq_len,
            heldout_fraction=0.0,
        )
    return out


def phase_cfg(plugin: dict, mbs: int, seq_len: int, steps: int) -> dict:
    return {
        "data": {"uri": str(REPO / "data" / "sample" / "cpt.jsonl")},
        "plugin": plugin,
        "launch": {"nproc_per_node": NPROC},
        "max_steps": steps,
        "micro_batch_size": mbs,
        "seq_len": seq_len,
        "lr": 1e-4,
        "warmup_steps": 0,
        "checkpoint_every": 10_000,
        "keep_last": 1,
        "seed": 1234,
        # stopped by SIGTERM once measured (`_stop`): a teardown, not a notice that would save the step
        "elastic": {"sigterm": False},
    }


def measure(work: Path, size: str, plugin_key: str, steps: int) -> dict:
    """shard then train (stopped after `steps` steps) of one size under one plugin."""
    tokdir = tokenizer_dir(work)
    model = model_dir(work, size, tokdir)
    mbs, seq_len = BATCH[size]
    data = prepared(work, tokdir, seq_len)
    cfg = phase_cfg(PLUGINS[plugin_key], mbs, seq_len, steps + 1)
    stage_dir = work / f"stage-{size}-{plugin_key}"
    shutil.rmtree(stage_dir, ignore_errors=True)
    jobs = {}
    for verb in ("shard", "train"):
        job = {
            "verb": verb,
            "phase": "cpt",
            "phase_cfg": cfg,
            "trust_remote_code": False,
            "model_dir": str(model),
            "tokenizer_dir": str(tokdir),
            "data_dir": str(data),
            "stage_dir": str(stage_dir),
            "parent": {"uri": str(model), "digest": "bench"},
            "config_digest": "0" * 64,
        }
        jobs[verb] = work / f"job-{size}-{plugin_key}-{verb}.json"
        jobs[verb].write_text(json.dumps(job))
    t0 = time.monotonic()
    shard = launch("shard", jobs["shard"])
    t1 = time.monotonic()
    train = launch("train", jobs["train"], stop_at_step=steps)
    t2 = time.monotonic()
    shutil.rmtree(stage_dir, ignore_errors=True)  # checkpoints of the 700M model are ~8 GB
    config = json.loads((model / "config.json").read_text())
    return {
        "size": size,
        "plugin": plugin_key,
        "config": config,
        "phase_cfg": cfg,
        "mbs": mbs,
        "seq_len": seq_len,
        "shard_peak": max(shard["peak"].values()),
        "construction": max(train["construction"].values()),
        "steady": max(train["steady"].values()),
        "steady_by_rank": train["steady"],
        "loss": train.get("loss"),
        "shard_s": t1 - t0,
        "train_s": t2 - t1,
    }


def half_slowdown(dtype: str) -> float:
    """How many times slower this CPU multiplies 512x512 matrices in `dtype` than in fp32, one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(512, 512)
        took = {}
        for name, dt in (("fp32", torch.float32), (dtype, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])):
            x = a.to(dt)
            x @ x
            t = time.perf_counter()
            for _ in range(3):
                x @ x
            took[name] = time.perf_counter() - t
        return took[dtype] / took["fp32"]
    finally:
        torch.set_num_threads(threads)


def room_needed(work: Path, size: str, plugin_key: str, steps: int) -> float:
    """What the ranks of one run need at their peak, by the estimate: the larger of the steady RSS and
    the construction figure, x 1.15 (a checkpoint save and the step's transients, measured up to
    1.1x the steady figure at 700M under hybrid_parallel and 1.24x at 190M under low_level_zero)."""
    from tasks.core.config.schema import PhaseConfig
    from tasks.core.preflight.memory import estimate

    mbs, seq_len = BATCH[size]
    dims = SIZES[size]
    config = {
        "model_type": "llama",
        "vocab_size": dims["vocab_size"],
        "hidden_size": dims["hidden_size"],
        "intermediate_size": dims["intermediate_size"],
        "num_hidden_layers": dims["num_layers"],
        "num_attention_heads": dims["num_heads"],
        "num_key_value_heads": dims["num_kv_heads"],
        "tie_word_embeddings": dims.get("tie_word_embeddings", False),
    }
    est = estimate(
        config, PhaseConfig.model_validate(phase_cfg(PLUGINS[plugin_key], mbs, seq_len, steps + 1)), cuda=False
    )
    return NPROC * 1.15 * max(est.host_steady, est.construction_host)


def estimate_row(row: dict) -> dict:
    """The pre-flight estimate of the same stage config on the same config.json, for a CPU rank."""
    from tasks.core.config.schema import PhaseConfig
    from tasks.core.preflight.memory import estimate

    est = estimate(row["config"], PhaseConfig.model_validate(row["phase_cfg"]), cuda=False)
    # the steady share: parameters, gradients and optimizer state the plugin places on the rank (no activations)
    states = est.total("always", "grads", "backward")
    return {
        "estimate": est.host_steady,
        "fp32_model": est.parameters * 4,
        "parameters": est.parameters,
        "states": states,
    }


def fmt_gb(b: float | None) -> str:
    return "-" if b is None else f"{b / GB:.2f}"


def main() -> None:
    global LAUNCH_TIMEOUT_S
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["50M", "190M", "700M"], choices=[s for s in SIZES if s != "tiny"])
    ap.add_argument("--plugins", nargs="+", default=["hp-tp2-fp32", "llz2-bf16"], choices=list(PLUGINS))
    ap.add_argument(
        "--steps", type=int, default=3, help="training steps measured (the steady figure is the peak over steps 2..N)"
    )
    ap.add_argument(
        "--workdir", default=None, help="keep models, data and results here (default: a temporary directory)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument(
        "--force",
        action="store_true",
        help="run a size even when the estimate says this machine's free memory cannot hold its "
        "ranks, or when its CPU has no fast bf16/fp16 matmul for a half-precision plugin",
    )
    ap.add_argument(
        "--launch-timeout",
        type=float,
        default=LAUNCH_TIMEOUT_S,
        help="seconds one engine verb may run before it is stopped",
    )
    ap.add_argument(
        "--table-from", default=None, help="print the table of a --json file again (re-estimated), measuring nothing"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the ~0.1M-parameter model under hybrid_parallel tp=2 only, 2 steps: checks the script runs",
    )
    ap.add_argument(
        "--no-flow", action="store_true", help="leave out the flow process's figures (benchmarks/flow_process.py)"
    )
    a = ap.parse_args()
    if a.table_from:
        rows = json.loads(Path(a.table_from).read_text())
        print_table([{**r, **estimate_row(r)} for r in rows], a.steps)
        return
    if a.smoke:
        a.sizes, a.plugins, a.steps = [], ["hp-tp2-fp32"], 2
    LAUNCH_TIMEOUT_S = a.launch_timeout
    slow = {h: half_slowdown(h) for h in {PLUGINS[p].get("precision") for p in a.plugins} & {"bf16", "fp16"}}
    work = workdir(a.workdir, "scale-")
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    import psutil

    rows, skipped = [], []
    try:
        for plugin in a.plugins:
            base = measure(work, "tiny", plugin, a.steps)
            rows.append(base)
            print(f"[{time.monotonic() - started:5.0f} s] baseline {plugin}: {fmt_gb(base['steady'])} GB", flush=True)
        for size in a.sizes:
            for plugin in a.plugins:
                half = PLUGINS[plugin].get("precision")
                if slow.get(half, 1.0) > HALF_SLOWDOWN_LIMIT and not a.force:
                    skipped.append(
                        f"{size} {plugin}: this CPU multiplies {half} matrices {slow[half]:.0f}x slower than fp32 (no "
                        "native "
                        f"{half}), so its steps would take hours (--force runs it anyway)"
                    )
                    print(f"[{time.monotonic() - started:5.0f} s] skipped {skipped[-1]}", flush=True)
                    continue
                need, have = room_needed(work, size, plugin, a.steps), psutil.virtual_memory().available
                if need > 0.9 * have and not a.force:
                    skipped.append(
                        f"{size} {plugin}: its {NPROC} ranks need about {need / GB:.1f} GB (the estimate x 1.15), "
                        f"{have / GB:.1f} GB is available (--force runs it anyway)"
                    )
                    print(f"[{time.monotonic() - started:5.0f} s] skipped {skipped[-1]}", flush=True)
                    continue
                row = measure(work, size, plugin, a.steps)
                rows.append(row)
                print(
                    f"[{time.monotonic() - started:5.0f} s] {size} {plugin}: steady {fmt_gb(row['steady'])} GB, "
                    "construction "
                    f"{fmt_gb(row['construction'])} GB, shard {fmt_gb(row['shard_peak'])} GB",
                    flush=True,
                )
    finally:
        if not a.keep and a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    for row in rows:
        row.update(estimate_row(row))
    print_table(rows, a.steps)
    for line in skipped:
        print(f"skipped: {line}")
    print(f"wall {time.monotonic() - started:.0f} s; command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=str))
    if not a.no_flow:
        flow = [
            sys.executable,
            str(REPO / "benchmarks" / "flow_process.py"),
            *(["--smoke"] if a.smoke else ["--sizes", *a.sizes]),
        ]
        subprocess.run(flow, check=True, cwd=str(REPO))


def print_table(rows: list[dict], steps: int) -> None:
    print()
    print(
        f"per-rank RSS on {NPROC} CPU ranks, GB (1e9 bytes); steady = peak over training steps 2..{steps}, estimate = "
        "tasks.core.preflight.memory's host figure; construction = the train verb up to its checkpoint loaded "
        "(printed, not judged)"
    )
    head = [
        "size",
        "params",
        "plugin",
        "mbs x seq",
        "fp32 model",
        "shard peak",
        "shard limit",
        "construction",
        "steady",
        "estimate",
        "est/steady",
    ]
    print(" | ".join(head))
    base = {r["plugin"]: r["steady"] for r in rows if r["size"] == "tiny"}
    over = []
    for r in rows:
        # target: the shard verb's peak within 1.3 x the estimated steady share (weights, gradients,
        # optimizer state) plus the import baseline (the plugin's tiny-model steady RSS)
        limit = 1.3 * r["states"] + base.get(r["plugin"], 0) if "states" in r else None
        if limit is not None and r["size"] != "tiny" and r["shard_peak"] > limit:
            over.append(f"{r['size']} {r['plugin']}")
        print(
            " | ".join(
                [
                    r["size"],
                    f"{r['parameters'] / 1e6:.1f}M",
                    r["plugin"],
                    f"{r['mbs']}x{r['seq_len']}",
                    fmt_gb(r["fp32_model"]),
                    fmt_gb(r["shard_peak"]),
                    fmt_gb(limit) if limit is not None else "-",
                    fmt_gb(r["construction"]),
                    fmt_gb(r["steady"]),
                    fmt_gb(r["estimate"]),
                    f"{r['estimate'] / r['steady']:.2f}",
                ]
            )
        )
    errors = [abs(r["estimate"] / r["steady"] - 1) for r in rows if r["size"] != "tiny"]
    worst = f"{max(errors):.0%}" if errors else "- (no size measured)"
    baselines = ", ".join(f"{r['plugin']} {fmt_gb(r['steady'])} GB" for r in rows if r["size"] == "tiny")
    print(
        f"\nlargest |estimate/steady - 1| over the sizes: {worst} (target <= 25%); baseline per plugin (steady RSS of "
        "the "
        f"~0.1M model): {baselines}"
    )
    print(
        "shard peak over its limit (1.3 x the estimated weights, gradients and optimizer state + the baseline): "
        + (", ".join(over) if over else "none")
    )


if __name__ == "__main__":
    main()
