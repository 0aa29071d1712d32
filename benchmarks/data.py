"""Data preparation at corpus scale: prepare throughput, tokenizer overhead, training start-up and RSS.

    .venv/bin/python benchmarks/data.py                      # 100 MB and 400 MB: the README benchmark table's sizes
    .venv/bin/python benchmarks/data.py --sizes 10 40        # quicker, same table
    .venv/bin/python benchmarks/data.py --smoke              # 0.3 MB, one 1-step train launch of 1 rank, children forked: checks the script runs
    .venv/bin/python benchmarks/data.py --sizes --single-mb 200   # the single-file row alone

For each size it generates a JSONL CPT corpus of --files files (demo-style text, every record
distinct) and the demo tokenizer, then runs, each in its own process (peak RSS = VmHWM of the child's own program):
  prepare-1   tasks.core.data.prepare, 1 worker (in process), fresh output: MB/s of input
  prepare-2   the same with a 2-process pool: MB/s, and the ratio to prepare-1 (target >= 1.6)
  tok-file    one worker tokenizing the first file (tokenize_file) vs the tokenizer's own batch
              encode of the same texts on one core, texts already in memory: ratio (target >= 0.8)
  start       a rank's start-up on the prepared data: TokenDataset + ResumableSampler + the
              first global batch of 8 x seq_len blocks (the best of 5 in one process); then the
              same at a late step (resume)
  old-start   the in-rank path without prepared data: each rank reads and tokenizes the raw corpus
              (read_records + pack_cpt) and takes the first batch, at sizes up to --old-max-mb (it needs
              ~55 bytes of RAM per byte of text): what prepared data saves
  train       the real thing: the engine's train verb under torchrun with 2 CPU ranks (torch_ddp fp32,
              a tiny random Llama with 1024 positions) on the prepared corpus, through
              tasks.core.launch.torchrun.run_engine as the train task launches it, --train-steps steps: seconds
              from launch to the first step's @@progress record, and the peak RSS of each rank
              (psutil, sampled every 0.1 s, over the whole run); the faster of two launches and the
              larger RSS. --no-train skips it. --smoke launches (shard and train) one rank: a rank
              process is ~6 s of CPU in imports, and the smoke's figures are not judged; it also
              forks the children above from the script, which imported theirs once (84 -> 33 CPU-s).
and a single-file row (--single-mb, default 200; 0 skips it): one JSONL file of that size prepared
with 1 and 2 workers (tokenized in chunks of data.tokenize.chunk_mb, --chunk-mb, cut at newlines and
merged back): the 2w/1w ratio (target >= 1.7); the whole prepare's MB/s (1w, and 2w/2) against the
tokenizer's own single-core batch encode of the file's first --raw-mb MB; and one worker on one chunk
(the first a 2-worker prepare hands out: tokenize_chunk) against the tokenizer's encode of the same
texts, side by side in one process, --reps times, wall and CPU, min/median (target >= 0.8).
Every process runs with TOKENIZERS_PARALLELISM=false (one core per worker). On a shared machine
the absolute figures move with the neighbours' load; the ratios are measured side by side.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from support import REPO
from support.bench import child as bench_child
from support.bench import print_table, workdir
from support.tiny import tiny_tokenizer

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
SEQ_LEN = 1024


def make_corpus(dest: Path, mb: float, files: int, seed: int = 0) -> int:
    """`files` JSONL files of ~mb MB in all; documents of 1-6 sample sentences, numbers varied."""
    from tasks.core.models.demo import DEFAULT_CORPUS

    sentences = []
    with open(DEFAULT_CORPUS[0], encoding="utf-8") as f:
        for line in f:
            sentences += [s.strip() + "." for s in json.loads(line)["text"].split(".") if s.strip()]
    rng = random.Random(seed)
    dest.mkdir(parents=True, exist_ok=True)
    per_file = int(mb * 1e6 / files)
    total, doc = 0, 0
    for k in range(files):
        with open(dest / f"part-{k:04d}.jsonl", "w", encoding="utf-8") as out:
            written = 0
            while written < per_file:
                text = f"Log {doc}, cycle {rng.randrange(10**6)}: " + " ".join(
                    rng.choice(sentences) for _ in range(rng.randint(4, 24))
                )
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                written += len(line)
                doc += 1
            total += written
    return total


# --smoke: each child forked from this process (support.bench.child), which imported theirs once
FORK = False


def child(code: str, *args: str) -> dict:
    """support.bench.child under this script's ENV: one JSON line, its peak RSS (MB) and seconds."""
    return bench_child(code, args, ENV, fork=FORK)


PREPARE = """
import json, sys, time
from tasks.core.data.prepare import prepare
corpus, tok, out, workers, chunk_mb = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
chunks = []
t = time.monotonic()
r = prepare(corpus, tok, out, workers=workers, kind="cpt", field="text", seq_len=1024, heldout_fraction=0.01, chunk_mb=chunk_mb,
            progress=lambda s: chunks.append(1) if "n" in s.get("chunk", {}) else None)
print(json.dumps({"seconds": time.monotonic() - t, "tokens": r.index["totals"]["train_tokens"], "files": len(r.tokenized), "chunks": len(chunks)}))
"""

RAW = """
import json, sys, time
from tasks.core.data.shard import load_tokenizer
path, tokdir, limit = sys.argv[1], sys.argv[2], float(sys.argv[3]) * 1e6
backend = load_tokenizer(tokdir).backend_tokenizer
texts, size = [], 0
with open(path, encoding="utf-8") as f:
    for line in f:
        texts.append(json.loads(line)["text"]); size += len(line.encode())
        if size >= limit:
            break
# The tokenizer alone, one core: its Rust batch encode in ~1 MB batches, texts already in memory.
t = time.monotonic(); n = 0; batch = []; chars = 0
for x in texts:
    batch.append(x); chars += len(x)
    if chars >= 1 << 20:
        n += sum(len(e.ids) for e in backend.encode_batch(batch, add_special_tokens=False)); batch = []; chars = 0
n += sum(len(e.ids) for e in backend.encode_batch(batch, add_special_tokens=False)) if batch else 0
print(json.dumps({"bytes": size, "seconds": time.monotonic() - t, "tokens": n}))
"""

TOKFILE = """
import json, sys, time
from pathlib import Path
from tasks.core.data.inputs import resolve_inputs
from tasks.core.data.shard import ShardSpec, tokenize_file, load_tokenizer
from tasks.core.data.index import tokenizer_fingerprint
path, tokdir, out = sys.argv[1], sys.argv[2], sys.argv[3]
tok = load_tokenizer(tokdir)
texts = [json.loads(l)["text"] for l in open(path, encoding="utf-8")]
# The tokenizer alone: its Rust batch encode (what tok(texts) runs, minus the conversion to Python
# dicts) in ~1 MB batches as the worker sends them. Wall and CPU seconds: the machine is shared.
backend = tok.backend_tokenizer
def raw_pass():
    n = 0; batch = []; size = 0
    for x in texts:
        batch.append(x); size += len(x)
        if size >= 1 << 20:
            n += sum(len(e.ids) for e in backend.encode_batch(batch, add_special_tokens=False)); batch = []; size = 0
    return n + (sum(len(e.ids) for e in backend.encode_batch(batch, add_special_tokens=False)) if batch else 0)
t = time.monotonic(); c = time.process_time(); n = raw_pass(); raw = time.monotonic() - t; raw_cpu = time.process_time() - c
inp = resolve_inputs(path)[0]
spec = ShardSpec(kind="cpt", field="text", seq_len=1024, tokenizer_sha256=tokenizer_fingerprint(tokdir), heldout_fraction=0.01)
t = time.monotonic(); c = time.process_time(); s = tokenize_file(inp, spec, tokdir, out); worker = time.monotonic() - t; worker_cpu = time.process_time() - c
print(json.dumps({"bytes": inp.size, "raw_s": raw, "worker_s": worker, "raw_cpu_s": raw_cpu, "worker_cpu_s": worker_cpu, "raw_tokens": n,
                  "worker_tokens": s["train"]["tokens"] + s["heldout"]["tokens"] - s["records"]}))
"""

TOKCHUNK = """
import json, statistics, shutil, sys, time
from pathlib import Path
from tasks.core.data import chunks as ck
from tasks.core.data.inputs import resolve_inputs
from tasks.core.data.shard import ShardSpec, freeze_encoder, load_tokenizer
from tasks.core.data.index import tokenizer_fingerprint
path, tokdir, out, chunk_mb, workers, reps = sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
inp = resolve_inputs(path)[0]
fp = tokenizer_fingerprint(tokdir)
spec = ShardSpec(kind="cpt", field="text", seq_len=1024, tokenizer_sha256=fp, heldout_fraction=0.01)
freeze_encoder(tokdir, out, fp)  # as the plan does: the worker loads tokenizers alone
# The first chunk the prepare with `workers` workers hands out (the chunk size it uses).
c = ck.chunk_size([inp.size], workers, int(chunk_mb * 2**20))
ch = next(iter(ck.split(0, inp, c, out / "spill") or []), None) or ck.Chunk(0, 0, inp, "bytes", 0, inp.size, 1, "", inp.size)
with open(path, "rb") as f:
    f.seek(ch.start)
    texts = [json.loads(line)["text"] for line in f.read(ch.end - ch.start).decode().splitlines()]
backend = load_tokenizer(tokdir).backend_tokenizer
def raw_pass():
    n = 0; batch = []; size = 0
    for x in texts:
        batch.append(x); size += len(x)
        if size >= 1 << 20:
            n += sum(len(e.ids) for e in backend.encode_batch(batch, add_special_tokens=False)); batch = []; size = 0
    return n + (sum(len(e.ids) for e in backend.encode_batch(batch, add_special_tokens=False)) if batch else 0)
# Side by side, alternating, `reps` times: the tokenizer alone on the chunk's texts (in memory), then a worker
# tokenizing the chunk from the file (tokenize_chunk: read, parse, split, encode, write, hash).
wall, cpu = [], []
for _ in range(reps):
    shutil.rmtree(ck.chunk_dir(out, ch.key(spec)), ignore_errors=True)
    t = time.monotonic(); c0 = time.process_time(); n = raw_pass(); raw, raw_c = time.monotonic() - t, time.process_time() - c0
    t = time.monotonic(); c0 = time.process_time(); s = ck.tokenize_chunk(ch, spec, tokdir, out)
    w, w_c = time.monotonic() - t, time.process_time() - c0
    assert s["train"]["tokens"] + s["heldout"]["tokens"] - s["records"] == n, (s, n)
    wall.append(raw / w); cpu.append(raw_c / w_c)
print(json.dumps({"bytes": ch.size, "raw_mbs": ch.size / 1e6 / raw, "worker_mbs": ch.size / 1e6 / w,
                  "wall": [min(wall), statistics.median(wall)], "cpu": [min(cpu), statistics.median(cpu)], "reps": reps}))
"""

START = """
import json, sys, time
t0 = time.monotonic()
import numpy as np
from tasks.engine.sampler import ResumableSampler
t1 = time.monotonic()
from tasks.core.data.dataset import TokenDataset
out, late = sys.argv[1], sys.argv[2] == "late"
best = None
for _ in range(5):  # the best of 5 opens: a few milliseconds each, so one reading is mostly noise
    t = time.monotonic()
    ds = TokenDataset(out, 1024)
    s = ResumableSampler(ds.num_items, 0, 1, seed=1)
    if late:
        # A late step inside epoch 3: the batch that crosses an epoch's end draws the next
        # epoch's permutation too, resumed or not, so it is not what a resume costs.
        s.load_state_dict({"epoch": 3, "offset": ds.num_items // 2 + 3, "seed": 1})
    b = ds.batch(s.next_indices(8))
    assert b["input_ids"].shape == (8, 1024)
    best = min(best or 1e9, time.monotonic() - t)
print(json.dumps({"seconds": best, "imports_s": t1 - t0, "items": ds.num_items}))
"""

OLD_START = """
import json, sys, time
t0 = time.monotonic()
from transformers import AutoTokenizer
from tasks.core.data.records import read_records
from tasks.core.data.samples import pack_cpt
from tasks.engine.sampler import ResumableSampler
t1 = time.monotonic()
corpus, tokdir = sys.argv[1], sys.argv[2]
import glob
tok = AutoTokenizer.from_pretrained(tokdir)
records = [r for p in sorted(glob.glob(corpus + "/*.jsonl")) for r in read_records(p)]
blocks = pack_cpt(tok, records, seq_len=1024)
s = ResumableSampler(blocks.shape[0], 0, 1, seed=1)
b = blocks[s.next_indices(8)]
print(json.dumps({"seconds": time.monotonic() - t1, "imports_s": t1 - t0, "items": int(blocks.shape[0])}))
"""


def _rank_rss_poller(job_path: Path, peaks: dict[int, int], stop) -> None:
    """Peak RSS per rank process (those whose command line names the job file and run tasks.engine
    but are not torchrun itself), sampled every 0.1 s."""
    import psutil

    while not stop.wait(0.1):
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                if str(job_path) in cmd and "tasks.engine" in cmd and "torch.distributed.run" not in cmd:
                    peaks[p.pid] = max(peaks.get(p.pid, 0), p.memory_info().rss)
            except psutil.Error:
                pass


def train_probe(work: Path, tokdir: Path, prepared: Path, steps: int, nproc: int = 2) -> dict:
    """Shard a tiny model once (cached in `work`), then train `steps` steps with `nproc` ranks on `prepared`."""
    import logging
    import threading

    from transformers import AutoTokenizer

    from support.engine import run_raw
    from tasks.core.config.schema import LaunchConfig
    from tasks.core.launch.torchrun import run_engine
    from tasks.core.models.demo import build_tiny_model
    from tasks.core.run.job import parse_job
    from tasks.core.run.stages import step_name

    log = logging.getLogger("bench-data")
    model = work / "tiny-llama-1k"
    run = run_raw(
        model,
        work / "unused",
        "cpt",
        {"name": "torch_ddp", "precision": "fp32"},
        seq_len=SEQ_LEN,
        micro_batch_size=2,
        max_steps=steps,
        checkpoint_every=steps,
        keep_last=1,
    )

    def job(verb: str, stage_dir: Path, path: Path):
        raw = {
            "verb": verb,
            "phase": "cpt",
            "phase_cfg": run["cpt"],
            "trust_remote_code": False,
            "model_dir": str(model),
            "tokenizer_dir": str(tokdir),
            "data_dir": str(prepared),
            "stage_dir": str(stage_dir),
            "parent": {"uri": str(model), "digest": "bench"},
            "config_digest": "0" * 64,
        }
        path.write_text(json.dumps(raw))
        return parse_job(raw, source=str(path))

    base = work / "base-1k"
    if not (base / step_name(0)).is_dir():
        build_tiny_model(model, AutoTokenizer.from_pretrained(tokdir), max_position_embeddings=SEQ_LEN)
        run_engine(
            "shard",
            job("shard", base, work / "shard.json"),
            work / "shard.json",
            LaunchConfig(nproc_per_node=nproc),
            "bench-data-shard",
            log,
        )
    stage = work / "train-stage"
    shutil.rmtree(stage, ignore_errors=True)
    shutil.copytree(base / step_name(0), stage / step_name(0))
    path = work / "train.json"
    j = job("train", stage, path)
    first: list[float] = []
    peaks: dict[int, int] = {}
    stop = threading.Event()
    poller = threading.Thread(target=_rank_rss_poller, args=(path, peaks, stop), daemon=True)
    poller.start()
    t0 = time.monotonic()
    try:
        progress = run_engine(
            "train",
            j,
            path,
            LaunchConfig(nproc_per_node=nproc),
            "bench-data-train",
            log,
            on_progress=lambda rec: first.append(time.monotonic()) if not first else None,
        )
    finally:
        stop.set()
        poller.join()
    wall = time.monotonic() - t0
    last = progress[-1] if progress else {}
    # >= nproc: a rank's short-lived fork (same command line) can be sampled beside the ranks.
    assert int(last.get("step", 0)) == steps and len(peaks) >= nproc, (last, peaks)
    return {
        "train_first_s": first[0] - t0,
        "train_wall_s": wall,
        "train_rank_rss": max(peaks.values()) / 2**20,
        "train_loss": last.get("loss"),
    }


def fmt(x, unit=""):
    return "-" if x is None else (f"{x:,.1f}{unit}" if isinstance(x, float) else f"{x}{unit}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sizes", type=float, nargs="*", default=[100, 400], help="corpus sizes in MB (none: the single-file row only)"
    )
    ap.add_argument("--single-mb", type=float, default=200, help="the single-file row's JSONL size in MB (0: skip it)")
    ap.add_argument("--chunk-mb", type=float, default=64, help="data.tokenize.chunk_mb for every prepare")
    ap.add_argument(
        "--raw-mb", type=float, default=32, help="MB of the single file the tokenizer's own encode is timed on"
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=3,
        help="single-file row: side-by-side runs of a worker on one chunk vs the tokenizer",
    )
    ap.add_argument("--files", type=int, default=8, help="files per corpus")
    ap.add_argument(
        "--old-max-mb",
        type=float,
        default=100,
        help="run the in-rank path without prepared data up to this size (RAM: ~55x the corpus)",
    )
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--no-train", action="store_true", help="skip the 2-rank training run on each prepared corpus")
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="one 0.3 MB corpus in 2 files, one 1-step train launch: checks the script runs (figures meaningless)",
    )
    a = ap.parse_args()
    if a.smoke:
        a.sizes, a.files, a.train_steps, a.single_mb, a.chunk_mb, a.raw_mb, a.reps = [0.3], 2, 1, 0.3, 0.05, 0.3, 1
    train_launches, nproc = (1, 1) if a.smoke else (2, 2)
    if a.smoke:  # what the children import, once (load_tokenizer imports transformers' AutoTokenizer)
        global FORK
        FORK = True
        from transformers import AutoTokenizer  # noqa: F401

        importlib.import_module("tasks.engine.sampler")
        for m in ("chunks", "dataset", "index", "inputs", "prepare", "records", "samples", "shard"):
            importlib.import_module(f"tasks.core.data.{m}")
    work = workdir(a.workdir, "bench-data-")
    work.mkdir(parents=True, exist_ok=True)
    tokdir = work / "tokenizer"
    tiny_tokenizer().save_pretrained(tokdir)
    rows = []
    try:
        for mb in a.sizes:
            corpus = work / f"corpus-{mb:g}MB"
            nbytes = make_corpus(corpus, mb, a.files)
            r: dict = {"mb": nbytes / 1e6}
            for w in (1, 2):
                out = work / f"prep-{mb:g}-{w}"
                shutil.rmtree(out, ignore_errors=True)
                subprocess.run(["sync"], check=False)
                res = child(PREPARE, str(corpus), str(tokdir), str(out), str(w), str(a.chunk_mb))
                r[f"prep{w}_mbs"] = nbytes / 1e6 / res["seconds"]
                r[f"prep{w}_rss"] = res["peak_rss_mb"]
                r["tokens"] = res["tokens"]
            first = min(corpus.glob("*.jsonl"))
            tf = child(TOKFILE, str(first), str(tokdir), str(work / f"tokfile-{mb:g}"))
            r["raw_mbs"] = tf["bytes"] / 1e6 / tf["raw_s"]
            r["worker_mbs"] = tf["bytes"] / 1e6 / tf["worker_s"]
            r["cpu_ratio"] = tf["raw_cpu_s"] / tf["worker_cpu_s"]
            assert tf["raw_tokens"] == tf["worker_tokens"], tf
            out = work / f"prep-{mb:g}-1"
            st = child(START, str(out), "first")
            late = child(START, str(out), "late")
            r.update(start_s=st["seconds"], start_rss=st["peak_rss_mb"], late_s=late["seconds"], blocks=st["items"])
            if mb <= a.old_max_mb:
                old = child(OLD_START, str(corpus), str(tokdir))
                r.update(old_s=old["seconds"], old_rss=old["peak_rss_mb"])
            if not a.no_train:  # twice: the faster launch, the larger RSS
                runs = [train_probe(work, tokdir, out, a.train_steps, nproc) for _ in range(train_launches)]
                r.update(
                    min(runs, key=lambda x: x["train_first_s"]), train_rank_rss=max(x["train_rank_rss"] for x in runs)
                )
            rows.append(r)
            print(json.dumps(r), flush=True)
            shutil.rmtree(corpus, ignore_errors=True)
            for d in work.glob(f"*-{mb:g}*"):
                shutil.rmtree(d, ignore_errors=True)
        single = single_file(work, tokdir, a) if a.single_mb > 0 else None
    finally:
        if not a.keep and not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    if rows:
        print_rows(rows, a, nproc)
    if single:
        print_single(single, a)
    print(f"\ncommand: python benchmarks/data.py {' '.join(sys.argv[1:])}".rstrip())


def single_file(work: Path, tokdir: Path, a) -> dict:
    """One JSONL file of --single-mb prepared with 1 and 2 workers (in chunks), and the tokenizer alone on one core."""
    corpus = work / "single"
    nbytes = make_corpus(corpus, a.single_mb, 1, seed=1)
    path = next(corpus.glob("*.jsonl"))
    r: dict = {"mb": nbytes / 1e6, "load_before": os.getloadavg()[0]}
    for w in (1, 2):
        out = work / f"single-prep-{w}"
        shutil.rmtree(out, ignore_errors=True)
        res = child(PREPARE, str(path), str(tokdir), str(out), str(w), str(a.chunk_mb))
        r.update(
            {
                f"prep{w}_mbs": nbytes / 1e6 / res["seconds"],
                f"prep{w}_rss": res["peak_rss_mb"],
                f"chunks{w}": res["chunks"],
                "tokens": res["tokens"],
            }
        )
    shard = json.loads((work / "single-prep-1" / "index.json").read_text())["files"][0]["shard"]
    one = [work / "single-prep-1" / "index.json", *(work / "single-prep-1" / shard).iterdir()]
    same = all(
        f.read_bytes() == (work / "single-prep-2" / f.relative_to(work / "single-prep-1")).read_bytes() for f in one
    )
    raw = child(RAW, str(path), str(tokdir), str(a.raw_mb))
    r.update(raw_mbs=raw["bytes"] / 1e6 / raw["seconds"], same=same)
    tc = child(TOKCHUNK, str(path), str(tokdir), str(work / "single-tokchunk"), str(a.chunk_mb), "2", str(a.reps))
    r.update(chunk_mb=tc["bytes"] / 1e6, chunk_wall=tc["wall"], chunk_cpu=tc["cpu"], reps=tc["reps"])
    r["load_after"] = os.getloadavg()[0]
    print(json.dumps(r), flush=True)
    shutil.rmtree(corpus, ignore_errors=True)
    return r


def print_single(r: dict, a) -> None:
    print(
        f"\nOne JSONL file of {r['mb']:.1f} MB, data.tokenize.chunk_mb {a.chunk_mb:g} (halved for the workers), demo "
        "tokenizer; "
        f"load average {r['load_before']:.1f} before, {r['load_after']:.1f} after, on {os.cpu_count()} cores\n"
    )
    hdr = [
        "file MB",
        "tokens",
        "chunks 1w/2w",
        "prep 1w MB/s",
        "prep 2w MB/s",
        "2w/1w (>=1.7)",
        "tokenizer 1 core MB/s",
        "prep 1w/tok",
        "prep 2w/2/tok",
        "worker on a chunk/tok (>=0.8) wall, CPU: min/median",
        "1w and 2w bytes equal",
        "RSS 1w/2w MB",
    ]
    row = [
        fmt(r["mb"]),
        f"{r['tokens']:,}",
        f"{r['chunks1']}/{r['chunks2']}",
        fmt(r["prep1_mbs"]),
        fmt(r["prep2_mbs"]),
        f"{r['prep2_mbs'] / r['prep1_mbs']:.2f}",
        fmt(r["raw_mbs"]),
        f"{r['prep1_mbs'] / r['raw_mbs']:.2f}",
        f"{r['prep2_mbs'] / 2 / r['raw_mbs']:.2f}",
        f"{r['chunk_wall'][0]:.2f}/{r['chunk_wall'][1]:.2f}, {r['chunk_cpu'][0]:.2f}/{r['chunk_cpu'][1]:.2f}",
        str(r["same"]),
        f"{r['prep1_rss']:.0f}/{r['prep2_rss']:.0f}",
    ]
    print_table(hdr, [row])
    print(
        f"\nworker on a chunk: the first {r['chunk_mb']:.1f} MB chunk a 2-worker prepare hands out, tokenized by "
        f"tokenize_chunk (read, parse, split, encode, write, hash) against the tokenizer's batch encode of its texts "
        f"held in memory, side by side in one process, {r['reps']} times. prep 1w/tok and 2w/2/tok are the whole "
        "prepare against the tokenizer: they include the stage's fixed costs (the plan loads the tokenizer with "
        "transformers, ~3 s of CPU; the pool's start; hashing and merging the chunks)."
    )


def print_rows(rows: list[dict], a, nproc: int) -> None:
    print(
        f"\nCPT corpora of {a.files} JSONL files, demo tokenizer (vocab 512), seq_len {SEQ_LEN}, "
        f"os.cpu_count()={os.cpu_count()}\n"
    )
    hdr = [
        "corpus MB",
        "tokens",
        "prep 1w MB/s",
        "prep 2w MB/s",
        "2w/1w (>=1.6)",
        "worker MB/s",
        "tokenizer MB/s",
        "worker/tok (>=0.8)",
        "same, CPU s",
        "start s",
        "start RSS MB",
        "resume/start (<=1.1)",
        "old start s",
        "old RSS MB",
        "old/new start",
        "old/new RSS",
    ]
    table = []
    for r in rows:
        table.append(
            [
                fmt(r["mb"]),
                f"{r['tokens']:,}",
                fmt(r["prep1_mbs"]),
                fmt(r["prep2_mbs"]),
                f"{r['prep2_mbs'] / r['prep1_mbs']:.2f}",
                fmt(r["worker_mbs"]),
                fmt(r["raw_mbs"]),
                f"{r['worker_mbs'] / r['raw_mbs']:.2f}",
                f"{r['cpu_ratio']:.2f}",
                f"{r['start_s']:.3f}",
                fmt(r["start_rss"]),
                f"{r['late_s'] / r['start_s']:.2f}",
                fmt(r.get("old_s")),
                fmt(r.get("old_rss")),
                f"{r['old_s'] / r['start_s']:.0f}x" if "old_s" in r else "-",
                f"{r['old_rss'] / r['start_rss']:.1f}x" if "old_s" in r else "-",
            ]
        )
    print_table(hdr, table)
    if not a.no_train:
        print(
            f"\nThe engine's train verb, {nproc} CPU rank{'s' if nproc > 1 else ''} (torchrun, torch_ddp fp32, tiny "
            f"Llama, seq_len {SEQ_LEN}, micro-batch 2), "
            f"{a.train_steps} steps:"
        )
        print("corpus MB | launch -> first step s | whole run s | peak RSS per rank MB | last loss")
        for r in rows:
            print(
                f"{r['mb']:9.1f} | {r['train_first_s']:22.1f} | {r['train_wall_s']:11.1f} | "
                f"{r['train_rank_rss']:20.0f} | {r['train_loss']}"
            )
    if len(rows) >= 2:
        lo, hi = rows[0], rows[-1]
        print(
            f"\nfrom {lo['mb']:.0f} MB to {hi['mb']:.0f} MB: start-up x{hi['start_s'] / lo['start_s']:.2f}, start-up "
            f"RSS x{hi['start_rss'] / lo['start_rss']:.2f} (target <= 1.10 each)"
        )
        if not a.no_train:
            print(
                f"  a real 2-rank launch: launch -> first step x{hi['train_first_s'] / lo['train_first_s']:.2f}, "
                f"peak RSS per rank x{hi['train_rank_rss'] / lo['train_rank_rss']:.2f} (target <= 1.10 each)"
            )


if __name__ == "__main__":
    main()
