"""The flow process at three model sizes: the logits check's peak RSS, whole vs streamed; the skip
decision on the model's artifact; a finished run re-run against its first run.

    .venv/bin/python benchmarks/flow_process.py            # 50M, 190M, 700M + the demo run twice: ~10 min
    .venv/bin/python benchmarks/flow_process.py --smoke    # the ~0.1M model, no demo run: seconds
    .venv/bin/python benchmarks/scale.py                   # runs this after the ranks' table

Per size, the seeded random Llama of benchmarks/scale.py (an fp32 HF folder, as base/ and cpt/hf/ are):
- logits check: `tasks.core.models.fingerprint.hf_dir_logits` as load_from_hf, unshard, export and
  `cpt-to-sft verify` call it, once loading the model whole (no budget) and once
  streamed (`verify_memory_gb` below it: tasks/core/models/stream.py), in a fresh child that first
  runs both on the tiny model (imports, kernels), then, streamed first, resets its VmHWM
  (/proc/self/clear_refs = 5) before each check and reads it after: the peak over the check itself,
  beside the RSS it started from. The two logits must be bitwise equal (sha256 of their bytes).
- LoRA export: an r=8 adapter on every projection (B made non-zero) merged onto the folder by
  `tasks.core.models.merge.build_merged_dir` into a bf16 export, whole (the fp32 base loaded,
  peft's merge_and_unload) and streamed (`verify_memory_gb` under the model: a tensor at a time),
  peak over start as for the check; the two exports' tensors must be bitwise equal.
- skip decision: the folder published as a run root's `base/` artifact (hard links; a manifest with
  every sha256, then the verification stamp, as Stage.done makes it), then `RunStore.verify` as the
  skip decision ran before stamps (every byte hashed) and as `tasks/flowkit/stage.py` `completed` runs it now.
- re-run (full mode): the demo config (examples/tiny-cpu.yaml) run to completion, then
  the same command again: every stage is skipped; wall time of each, end to end, as a user sees it.
  Twice: the CLI alone (no PREFECT_API_URL: each process starts an embedded Prefect server, about
  4.5 s before the first stage, whatever the run's size), then on a Prefect server already running,
  as scheduled and triggered deployment runs and their retries meet it.

Targets: the check's peak over its start <= the model in the checked dtype + 0.5 GB, and
bounded once streamed (one decoder layer or the embedding, not the model); the skip time not
growing with the artifact; the re-run <= 0.1 x the first run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)

from benchmarks.scale import GB, SIZES, fmt_gb, model_dir, tokenizer_dir
from support import REPO
from support.bench import best_of
from support.tiny import tiny_model

CHILD = r"""
import hashlib, json, sys, time
from tasks.core.models.fingerprint import hf_dir_logits
from tasks.core.run.hostpeak import HostPeak

warm, model, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
hf_dir_logits(warm, dtype=dtype, verify_memory_gb=0)  # imports, the model class, sdpa: what any flow process holds
hf_dir_logits(warm, dtype=dtype)
for mode, budget in (("streamed", 0.0), ("whole", None)):  # streamed first: the whole model's freed pages would raise its start
    span = HostPeak()  # VmHWM := the current RSS
    t = time.perf_counter()
    logits = hf_dir_logits(model, dtype=dtype, verify_memory_gb=budget)
    seconds = time.perf_counter() - t
    added, start = span.added()
    print(json.dumps({"mode": mode, "start": start, "peak": start + added, "seconds": seconds,
                      "sha256": hashlib.sha256(logits.numpy().tobytes()).hexdigest()}))
"""


ADAPTER_CHILD = r"""
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from tasks.core.config.lora import LORA_TARGETS

base, out = sys.argv[1], sys.argv[2]
model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS)))
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, t in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: a trained adapter changes every targeted weight
            t.add_(0.01 * torch.randn(t.shape, generator=g))
model.save_pretrained(out + "/adapter", safe_serialization=True)
"""

MERGE_CHILD = r"""
import hashlib, json, shutil, sys, time
from pathlib import Path
from safetensors import safe_open
from tasks.core.config.outputs import ExportConfig
from tasks.core.models.merge import build_merged_dir
from tasks.core.run.hostpeak import HostPeak

def digest(folder):  # every tensor's name and bytes, one tensor at a time
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in sorted(st.keys()):
                h.update(k.encode() + st.get_tensor(k).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

import torch
warm_ckpt, warm_base, ckpt, base, out = map(Path, sys.argv[1:6])
for budget in (0.0, None):  # imports, peft, the kernels: what any export stage holds before it merges
    build_merged_dir(warm_ckpt, out / "warm", warm_base, ExportConfig(dtype="bf16"), verify_memory_gb=budget)
    shutil.rmtree(out / "warm")
for mode, budget in (("streamed", 0.0), ("whole", None)):  # streamed first: the whole model's freed pages would raise its start
    span = HostPeak()
    t = time.perf_counter()
    built = build_merged_dir(ckpt, out / mode, base, ExportConfig(dtype="bf16"), verify_memory_gb=budget)
    seconds = time.perf_counter() - t
    added, start = span.added()
    print(json.dumps({"mode": mode, "start": start, "peak": start + added, "seconds": seconds, "merge": built["verification"]["lora"]["merge"],
                      "digest": digest(out / mode)}))
"""


def adapter_ckpt(work: Path, model: Path) -> Path:
    """A LoRA SFT checkpoint's adapter/ for `model` (r=8 on every projection, B made non-zero), in a child."""
    out = work / f"lora-{model.name}"
    if not (out / "adapter" / "adapter_config.json").is_file():
        subprocess.run(
            [sys.executable, "-c", ADAPTER_CHILD, str(model), str(out)],
            check=True,
            cwd=str(REPO),
            capture_output=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    return out


def merge_check(work: Path, warm: Path, model: Path) -> dict:
    """{mode: figures} of the LoRA export (build_merged_dir, bf16) streamed, then whole, in one fresh child."""
    out = work / f"merged-{model.name}"
    shutil.rmtree(out, ignore_errors=True)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            MERGE_CHILD,
            str(adapter_ckpt(work, warm)),
            str(warm),
            str(adapter_ckpt(work, model)),
            str(model),
            str(out),
        ],
        check=True,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"},
    )
    shutil.rmtree(out, ignore_errors=True)
    return {r["mode"]: r for r in map(json.loads, r.stdout.strip().splitlines()[-2:])}


def tiny_dir(work: Path, tok: Path) -> Path:
    """The ~0.1M model, built here (this process imports transformers anyway; a child costs its imports)."""
    out = work / "model-tiny"
    if not (out / "config.json").is_file():
        from transformers import AutoTokenizer

        from tasks.core.models.demo import build_tiny_model

        kw = dict(SIZES["tiny"])
        vocab = kw.pop("vocab_size")
        build_tiny_model(out, AutoTokenizer.from_pretrained(tok), vocab_size=vocab, max_position_embeddings=2048, **kw)
    return out


def check(warm: Path, model: Path, dtype: str) -> dict:
    """{mode: figures} of the check streamed, then whole, in one fresh child."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(warm), str(model), dtype],
        check=True,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"},
    )
    return {r["mode"]: r for r in map(json.loads, out.stdout.strip().splitlines()[-2:])}


def sizes_of(model: Path, dtype: str) -> dict:
    """The model's bytes in `dtype` and its largest streamed unit (a decoder layer or a lone module)."""
    import torch

    from tasks.core.models.stream import meta_model, model_bytes, stream_units

    meta = meta_model(model, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    unit = max(
        sum(p.numel() * p.element_size() for p in (u.parameters() if r else u.parameters(recurse=False)))
        for u, r in stream_units(meta)
    )
    return {
        "model_bytes": model_bytes(meta),
        "largest_unit": unit,
        "parameters": sum(p.numel() for p in meta.parameters()),
    }


def skip_times(work: Path, size: str, model: Path) -> dict:
    """RunStore.verify of the model as a base/ artifact: every byte hashed vs the verification stamp."""
    from tasks.core.run.manifest import write_manifest
    from tasks.core.storage.fs import RunStore

    store = RunStore(str(work / f"run-{size}"))
    art = store.local_path("base")
    if not store.exists("base"):
        art.mkdir(parents=True, exist_ok=True)
        for f in model.iterdir():
            if f.is_file():
                os.link(f, art / f.name)
        write_manifest(art, kind="hf-model", config_digest="0" * 64)
        store.publish("base")
    store.verify("base")  # one warm read: both columns then see the same page cache
    t = time.perf_counter()
    store.verify("base")
    hashed = time.perf_counter() - t
    assert "hashed" in store.last_verify, store.last_verify
    stamped = best_of(lambda: store.verify("base", trust_stamp=True), 5)
    assert store.last_verify.startswith("by its verification stamp"), store.last_verify
    return {
        "artifact_bytes": sum(f.stat().st_size for f in art.rglob("*") if f.is_file()),
        "hashed_s": hashed,
        "stamp_s": stamped,
    }


def rerun(work: Path) -> dict:
    """The demo run twice (the second finds every stage done), wall time of each through the CLI,
    in both ways a flow process meets Prefect: {"cli": ..., "server": ...}."""
    import yaml

    from flows.embedded_api import embedded_api

    base = work / "demo-base"
    if not (base / "config.json").is_file():
        tiny_model(base)
    raw = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    raw.update(run_root=str(work / "demo-run"), name="flow-process-bench")
    raw["base_model"]["uri"] = str(base)
    cfg = work / "demo.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PREFECT_HOME": str(work / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("PREFECT_API_URL", None)
    out = {"cli": twice(cfg, work / "demo-run", env)}  # no PREFECT_API_URL: each process starts its embedded server
    os.environ["PREFECT_HOME"] = env["PREFECT_HOME"]
    with embedded_api() as url:  # a server that is already running, as a deployment's runs (and their retries) meet it
        out["server"] = twice(cfg, work / "demo-run", {**env, "PREFECT_API_URL": url})
    return out


def twice(cfg: Path, run_root: Path, env: dict) -> dict:
    shutil.rmtree(run_root, ignore_errors=True)  # the first run starts from nothing
    walls = []
    for _ in range(2):
        t = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "flows.cpt_to_sft", "--config", str(cfg)],
            check=True,
            cwd=str(REPO),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        walls.append(time.monotonic() - t)
    statuses = {s["stage"]: s["status"] for s in json.loads((run_root / "run.json").read_text())["stages"]}
    return {"first_s": walls[0], "rerun_s": walls[1], "statuses": statuses}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="*", default=["50M", "190M", "700M"], help="none: only the demo run twice")
    ap.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="the checked dtype (base/ and cpt/hf/ are checked in fp32)",
    )
    ap.add_argument("--workdir", default=None, help="keep the models here (default: a temporary directory, removed)")
    ap.add_argument("--no-rerun", action="store_true", help="leave out the demo run twice")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--smoke", action="store_true", help="the ~0.1M model only, no demo run: checks the script runs")
    a = ap.parse_args(argv)
    sizes = ["tiny"] if a.smoke else a.sizes
    tmp = None if a.workdir else tempfile.TemporaryDirectory(prefix="flow-process-")
    work = Path(a.workdir or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        tok = tokenizer_dir(work)
        warm = tiny_dir(work, tok)
        rows = []
        for size in sizes:
            model = warm if size == "tiny" else model_dir(work, size, tok)
            row = {"size": size, **sizes_of(model, a.dtype)}
            row.update(check(warm, model, a.dtype))
            row["merge"] = merge_check(work, warm, model)
            row.update(skip_times(work, size, model))
            rows.append(row)
            print(
                f"[{time.monotonic() - started:5.0f} s] {size}: whole +{fmt_gb(row['whole']['peak'] - row['whole']['start'])} "
                "GB, "
                f"streamed +{fmt_gb(row['streamed']['peak'] - row['streamed']['start'])} GB",
                flush=True,
            )
        demo = None if a.smoke or a.no_rerun else rerun(work)
    finally:
        if tmp is not None:
            tmp.cleanup()
    print_table(rows, demo, a.dtype)
    print(f"wall {time.monotonic() - started:.0f} s; command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "rerun": demo}, indent=1))
    return 0


def print_table(rows: list[dict], demo: dict | None, dtype: str) -> None:
    if rows:
        print(
            f"\nthe flow process's logits check ({dtype}), GB (1e9 bytes): peak = VmHWM over the check, start = RSS "
            "before it "
            "(imports, after a warm-up check on the tiny model); logits bitwise equal whole vs streamed"
        )
        head = [
            "size",
            "params",
            f"model {dtype}",
            "largest unit",
            "whole: start",
            "peak",
            "peak-start",
            "s",
            "streamed: start",
            "peak",
            "peak-start",
            "s",
            "bitwise",
            "skip: hashed s",
            "stamp s",
        ]
        print(" | ".join(head))
        for r in rows:
            w, s = r["whole"], r["streamed"]
            print(
                " | ".join(
                    [
                        r["size"],
                        f"{r['parameters'] / 1e6:.1f}M",
                        fmt_gb(r["model_bytes"]),
                        fmt_gb(r["largest_unit"]),
                        fmt_gb(w["start"]),
                        fmt_gb(w["peak"]),
                        fmt_gb(w["peak"] - w["start"]),
                        f"{w['seconds']:.1f}",
                        fmt_gb(s["start"]),
                        fmt_gb(s["peak"]),
                        fmt_gb(s["peak"] - s["start"]),
                        f"{s['seconds']:.1f}",
                        "yes" if w["sha256"] == s["sha256"] else "NO",
                        f"{r['hashed_s']:.3f}",
                        f"{r['stamp_s']:.4f}",
                    ]
                )
            )
        over = [r for r in rows if r["whole"]["peak"] - r["whole"]["start"] > r["model_bytes"] + 0.5 * GB]
        print(
            f"\nwhole: peak over start <= model + 0.5 GB at every size: {'yes' if not over else 'NO: ' + ', '.join(r['size'] for r in over)}"
        )
        streamed = [r["streamed"]["peak"] - r["streamed"]["start"] for r in rows]
        models = [r["model_bytes"] for r in rows]
        print(
            f"streamed: peak over start {', '.join(fmt_gb(x) for x in streamed)} GB for models of {', '.join(fmt_gb(x) for x in models)} "
            "GB "
            f"(largest / smallest: {streamed[-1] / max(streamed[0], 1):.2f} vs model {models[-1] / models[0]:.1f})"
        )
        print(
            "\nthe LoRA export (build_merged_dir: cpt/hf + an r=8 adapter on every projection, merged in fp32, "
            "exported bf16), GB: "
            "peak = VmHWM over the export, start = RSS before it; whole = the base loaded in fp32 and "
            "merge_and_unload, streamed = "
            "verify_memory_gb under the model (a tensor at a time); exports bitwise equal"
        )
        print("size | model fp32 | whole: peak-start | s | streamed: peak-start | s | bitwise")
        for r in rows:
            w, m = r["merge"]["whole"], r["merge"]["streamed"]
            print(
                " | ".join(
                    [
                        r["size"],
                        fmt_gb(r["model_bytes"] if dtype == "fp32" else 2 * r["model_bytes"]),
                        fmt_gb(w["peak"] - w["start"]),
                        f"{w['seconds']:.1f}",
                        fmt_gb(m["peak"] - m["start"]),
                        f"{m['seconds']:.1f}",
                        "yes" if w["digest"] == m["digest"] else "NO",
                    ]
                )
            )
        stamp = ", ".join(f"{r['stamp_s'] * 1e3:.1f} ms" for r in rows)
        hashed = ", ".join(f"{r['hashed_s']:.2f} s" for r in rows)
        print(
            f"skip decision by stamp: {stamp} for artifacts of {', '.join(fmt_gb(r['artifact_bytes']) for r in rows)} "
            f"GB (hashed: {hashed})"
        )
    for mode, how in (
        ("cli", "the CLI alone, each process starting its embedded Prefect server"),
        ("server", "the CLI on a running Prefect server (PREFECT_API_URL), as a deployment's runs and retries"),
    ):
        if demo and mode in demo:
            d = demo[mode]
            ran = sorted(k for k, v in d["statuses"].items() if v in ("completed", "failed"))
            print(
                f"re-run of a finished demo run, {how}: {d['rerun_s']:.1f} s vs {d['first_s']:.1f} s first = "
                f"{d['rerun_s'] / d['first_s']:.3f} x "
                f"(target <= 0.1 x); stages the re-run did not skip: {', '.join(ran) or 'none'}"
            )


if __name__ == "__main__":
    sys.exit(main())
