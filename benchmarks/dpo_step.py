"""One DPO training step against one SFT step on the same pairs, side by side: what the preference phase costs.

    .venv/bin/python benchmarks/dpo_step.py                # 32 pairs a step, 21 rounds: about a minute on 2 cores
    .venv/bin/python benchmarks/dpo_step.py --smoke        # 4 pairs, 3 rounds: seconds, same table

Data: the shipped sample's pairs (`data/sample/dpo.jsonl`) prepared by the real path (`support.engine.write_job`:
the dpo section's PrepareSpec, the PairEncoder, the demo tokenizer's chat template, labels on the replies
only), and their reference log-probabilities written by the real `write_reference` (`support.engine.reference_for`,
what the flow's `reference` stage runs) on the demo's tiny random Llama, which is also the policy: the phase
starts from the model that scored the reference, so the first DPO loss is log 2.

Per side, in this one process, fp32 on CPU, each with its own copy of the model and its own AdamW: one
micro-batch of every pair, padded as the engine's `grouped` batching pads it (`micro_width`), then forward,
backward, `optimizer.step()` and `zero_grad()`, as `Engine.train_step` runs them on one rank:
  sft      the chosen rows alone (prompt + chosen reply: what SFT would train on), the model's own loss
  dpo      chosen + rejected rows (`PairData.batch`), `PairLoss.forward` and `.step` against the precomputed
           reference (the `reference` stage's artifact): what the product runs
  dpo+ref  the same with the reference model's forward on the same batch first (`pair_logps`, what
           `reference_logps` runs a batch), no gradient: what a trainer holding two models pays a step
The sides take turns, a round at a time, after one untimed round; printed: each side's median step, real
tokens/s, and the ratios dpo/sft (a, reference excluded) and dpo+ref/sft (b, reference included).

Not measured: the booster and its plugin (gradient all-reduce, ZeRO, tensor parallelism: the same for both
phases per parameter), data loading, checkpoints, the reference stage's one pass over the whole data.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)
import torch

from support.bench import print_table, workdir
from support.engine import REPO, phase_raw, reference_for, write_job
from support.tiny import tiny_model

DDP = {"name": "torch_ddp", "precision": "fp32"}


def build(work: Path, pairs: int, seq_len: int, beta: float):
    """(model, the dpo section, PairData) of the sample's first pairs, prepared and scored by the real code."""
    from transformers import AutoModelForCausalLM

    from tasks.core.config.schema import DpoConfig
    from tasks.core.data.dataset import TokenDataset
    from tasks.engine.pairs import PairData

    model_dir = tiny_model(work / "tiny-llama")
    src = work / "pairs.jsonl"
    # more records than pairs: a pair longer than seq_len is dropped by prepare
    lines = (REPO / "data" / "sample" / "dpo.jsonl").read_text().splitlines(keepends=True)
    src.write_text("".join(lines[: min(len(lines), 2 * pairs)]))
    section = phase_raw("dpo", DDP, data={"uri": str(src)}, micro_batch_size=pairs, seq_len=seq_len, beta=beta)
    common = dict(phase="dpo", phase_cfg=section, model_dir=model_dir, stage_dir=work / "dpo")
    job = write_job(work / "jobs" / "shard.json", verb="shard", **common)
    ref = reference_for(job, work / "reference")
    data_dir = json.loads(job.read_text())["data_dir"]
    data = PairData(TokenDataset(data_dir), ref, data_dir)
    if data.pairs < pairs:
        raise SystemExit(f"only {data.pairs} sample pairs fit seq_len {seq_len}; ask for fewer or a longer seq_len")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, DpoConfig.model_validate(section), data


def batches(data, pairs: int, seq_len: int):
    """(the pair micro-batch of pairs 0..pairs-1, the SFT micro-batch of their chosen rows), each at the width
    the engine's grouped batching gives its longest row."""
    from tasks.core.config.batching import BATCHING, micro_width
    from tasks.core.data.pairs import pair_rows

    idx = list(range(pairs))
    width = micro_width(int(data.lengths[idx].max()), seq_len, BATCHING["grouped"], False)
    mb = data.batch(idx, width)
    chosen = pair_rows(idx)[:pairs]  # pair_rows: every chosen row, then every rejected one
    longest = int(data.dataset.lengths()[chosen].max())
    sft = data.dataset.batch(chosen, width=micro_width(longest, seq_len, BATCHING["grouped"], False))
    return mb, {k: torch.from_numpy(v) for k, v in sft.items()}


def run(a: argparse.Namespace) -> dict:
    from tasks.core.models.preference import pair_logps
    from tasks.engine.pairs import REF_LOGPS, PairLoss

    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    work = workdir(a.work, "dpo-step-")
    base, cfg, data = build(work, a.pairs, a.seq_len, a.beta)
    mb, sft_mb = batches(data, a.pairs, a.seq_len)
    loss_fn = PairLoss(cfg, base.config.vocab_size)
    reference = copy.deepcopy(base).eval()  # the SFT model the phase starts from, never trained
    inputs = {k: mb[k] for k in ("input_ids", "labels", "attention_mask")}
    with torch.no_grad():  # the reference pass on this batch gives the artifact's figures (a consistency check)
        live = pair_logps(reference, inputs)
    ref_gap = float((torch.cat([live.chosen, live.rejected]) - mb[REF_LOGPS]).abs().max())

    def policy():
        m = copy.deepcopy(base).train()
        return m, torch.optim.AdamW(m.parameters(), lr=a.lr)

    sides = {name: policy() for name in ("sft", "dpo", "dpo+ref")}

    def sft_step() -> float:
        model, opt = sides["sft"]
        loss = model(**sft_mb, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    def dpo_step(name: str, with_reference: bool) -> float:
        model, opt = sides[name]
        batch = mb
        if with_reference:  # the reference model's forward on the same batch, in place of the artifact's figures
            with torch.no_grad():
                r = pair_logps(reference, inputs)
            batch = {**mb, REF_LOGPS: torch.cat([r.chosen, r.rejected]).float()}
        out = loss_fn.step(loss_fn.forward(model, batch), batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        return float(out.loss.detach())

    steps = {"sft": sft_step, "dpo": lambda: dpo_step("dpo", False), "dpo+ref": lambda: dpo_step("dpo+ref", True)}
    first = {name: fn() for name, fn in steps.items()}  # untimed: the first step's allocations and lazy set-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(a.repeats):  # the sides take turns, so a change in the machine's load falls on all of them
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    real_pairs = int(mb["attention_mask"].sum())
    tokens = {"sft": int(sft_mb["attention_mask"].sum()), "dpo": real_pairs, "dpo+ref": real_pairs}
    return {
        "pairs": a.pairs,
        "width": {"sft": int(sft_mb["input_ids"].shape[1]), "dpo": int(mb["input_ids"].shape[1])},
        "tokens": tokens,
        "median_s": med,
        "tokens_per_s": {n: tokens[n] / med[n] for n in med},
        "dpo_over_sft": med["dpo"] / med["sft"],
        "dpo_ref_over_sft": med["dpo+ref"] / med["sft"],
        "first_loss": first,
        "log2": math.log(2),
        "reference_gap": ref_gap,
        "repeats": a.repeats,
        "threads": a.threads,
        "load_average": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="4 pairs, 3 repeats: the same code path in seconds")
    ap.add_argument("--pairs", type=int, default=32, help="pairs in the step's micro-batch")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--work", help="work directory (default: a new temporary one, kept)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.pairs, a.repeats, a.seq_len = 4, 3, 128
    r = run(a)
    print(
        f"{r['pairs']} pairs, fp32 CPU, {r['threads']} thread(s), median of {r['repeats']}, load {r['load_average']:.1f}"
    )
    rows = [
        [name, str(r["tokens"][name]), f"{1000 * r['median_s'][name]:.1f}", f"{r['tokens_per_s'][name]:.0f}",
         f"{r['median_s'][name] / r['median_s']['sft']:.2f}", f"{r['first_loss'][name]:.4f}"]
        for name in ("sft", "dpo", "dpo+ref")
    ]  # fmt: skip
    print_table(["side", "real tokens", "step ms", "tokens/s", "x sft", "first loss"], rows)
    print(f"(a) dpo/sft, reference precomputed: {r['dpo_over_sft']:.2f}")
    print(f"(b) dpo+ref/sft, reference forward each step: {r['dpo_ref_over_sft']:.2f}")
    print(f"first dpo loss {r['first_loss']['dpo']:.6f} (log 2 = {r['log2']:.6f}); "
          f"reference pass vs artifact max |diff| {r['reference_gap']:.2e}")  # fmt: skip
    print("@@dpo_step " + json.dumps(r))
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
