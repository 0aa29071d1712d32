"""SFT without padding waste: one epoch of the same chats under each batching mode, side by side.

    .venv/bin/python benchmarks/sft_efficiency.py              # 192 chats, seq_len 2048: a few minutes on 2 cores
    .venv/bin/python benchmarks/sft_efficiency.py --smoke      # 16 chats, seq_len 256: seconds, same table

Data: chats generated with a realistic length distribution (log-normal, median about 300 tokens of
the rendered conversation, a tail that reaches seq_len), tokenized by the project's own prepare
step (`tasks.core.data.prepare`, the demo tokenizer, its chat template, assistant-only labels) into
the shards the engine reads (`tasks.core.data.dataset.TokenDataset`).

Per mode (a row of tasks/core/config/batching.py's BATCHING), in this one process, fp32 on CPU, a
small Llama (hidden 64, 2 layers): the epoch's micro-batches exactly as `tasks.engine.loop.StageData`
builds them (the sampler's order, each micro-batch's width from `micro_width`), one forward and
backward each, timed. Every mode trains the same chats once, so an epoch is equal real tokens.
Printed per mode: the useful-token fraction (real / computed tokens), the epoch's wall time and its
speed-up over `padded`; then the loss equivalence: the per-token losses on assistant tokens of the
same chats at the grouped width, and packed several to a row (block-diagonal causal mask, position
ids restarting), against each chat alone padded to seq_len (max |difference|).

Targets: grouped >= 0.7 useful tokens; packed >= 0.9 and a packed epoch >= 3x faster
than padded.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401 - first: the checkout on sys.path (support/ is not installed)
import numpy as np
import torch

from support.tiny import tiny_tokenizer

WORDS = (
    "the",
    "model",
    "data",
    "train",
    "token",
    "batch",
    "sample",
    "loss",
    "learn",
    "chat",
    "reply",
    "ask",
    "answer",
    "cluster",
    "node",
    "shard",
)


def make_chats(n: int, seq_len: int, seed: int, median_tokens: float, tokens_per_word: float) -> list[dict]:
    """n chats whose rendered lengths are log-normal around median_tokens, a tail past seq_len
    (left out by prepare under sft.truncation's default, drop, as a real corpus's longest chats are)."""
    rng = np.random.RandomState(seed)
    sizes = np.clip(
        rng.lognormal(math.log(median_tokens / tokens_per_word), 0.7, size=n), 8, 1.5 * seq_len / tokens_per_word
    ).astype(int)
    chats = []
    for size in sizes:
        user, reply = max(4, int(size) // 3), max(4, int(size) - int(size) // 3)
        chats.append(
            {
                "messages": [
                    {"role": "user", "content": " ".join(rng.choice(WORDS, user))},
                    {"role": "assistant", "content": " ".join(rng.choice(WORDS, reply))},
                ]
            }
        )
    return chats


def epoch_microbatches(ds, mode: str, micro: int, seed: int) -> list[list]:
    """The epoch's micro-batches (one rank, grad_accum 1) in the order the engine takes them: rows
    of item indices, or under packing rows of tuples of them (a short last micro-batch included,
    so every mode trains every chat once)."""
    from tasks.core.config.batching import BATCHING
    from tasks.engine.sampler import LengthGroups, Packs, ResumableSampler

    spec = BATCHING[mode]
    group = (
        Packs(ds.lengths(), ds.seq_len)
        if spec.packs
        else LengthGroups(ds.lengths(), micro)
        if spec.groups_by_length
        else None
    )
    s = ResumableSampler(ds.num_items, 0, 1, seed=seed, group=group)
    units = s.units()
    return [s.next_global(min(micro, units - i)) for i in range(0, units, micro)]


def run_mode(model, ds, mode: str, micro: int, seed: int) -> dict:
    from tasks.core.config.batching import BATCHING, micro_width
    from tasks.engine.packing import model_inputs

    spec = BATCHING[mode]
    lengths = ds.lengths()
    impl = model.config._attn_implementation
    real = computed = 0
    t0 = time.perf_counter()
    for rows in epoch_microbatches(ds, mode, micro, seed):
        row_lens = [int(lengths[list(r)].sum()) for r in rows] if spec.packs else [int(lengths[r]) for r in rows]
        width = micro_width(max(row_lens), ds.seq_len, spec, pipeline=False)
        build = ds.batch_packed if spec.packs else ds.batch
        b = model_inputs({k: torch.from_numpy(v) for k, v in build(rows, width=width).items()}, impl, torch.float32)
        model(**b).loss.backward()
        real += sum(row_lens)
        computed += len(rows) * width
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return {
        "mode": mode,
        "useful": real / computed,
        "real_tokens": real,
        "computed_tokens": computed,
        "seconds": seconds,
    }


def _padded_per_token(model, ds, rows: list[int], width: int) -> torch.Tensor:
    from tasks.core.data.dataset import IGNORE_INDEX

    b = {k: torch.from_numpy(v) for k, v in ds.batch(rows, width=width).items()}
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    labels = b["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    return torch.nn.functional.cross_entropy(logits[:, :-1][keep], labels[keep], reduction="none")


def loss_equivalence(model, ds, seed: int) -> dict[str, float]:
    """max |per-token assistant loss - the same token's loss in a row padded to seq_len|: the
    shortest chats at the grouped width, and the chats of two packed rows in their rows."""
    from tasks.core.config.batching import BATCHING, micro_width
    from tasks.core.data.dataset import IGNORE_INDEX
    from tasks.engine.packing import chat_token_losses, model_inputs
    from tasks.engine.sampler import Packs

    lengths = ds.lengths()
    out = {}
    with torch.no_grad():
        rows = [int(i) for i in np.argsort(lengths)[:4]]
        width = micro_width(int(lengths[rows].max()), ds.seq_len, BATCHING["grouped"], pipeline=False)
        out["grouped"] = float(
            (_padded_per_token(model, ds, rows, width) - _padded_per_token(model, ds, rows, ds.seq_len)).abs().max()
        )
        packs = Packs(lengths, ds.seq_len).order(
            torch.randperm(ds.num_items, generator=torch.Generator().manual_seed(seed)),
            torch.Generator().manual_seed(seed),
        )
        packs = sorted(packs, key=len, reverse=True)[:2]  # the rows holding the most chats
        b = model_inputs(
            {k: torch.from_numpy(v) for k, v in ds.batch_packed(packs).items()},
            model.config._attn_implementation,
            torch.float32,
        )
        logits = model(**b).logits
        got = chat_token_losses(logits, b["labels"], packs, lengths, IGNORE_INDEX)
        want = torch.cat([_padded_per_token(model, ds, list(items), ds.seq_len) for items in packs])
        out["packed"] = float((torch.cat(got) - want).abs().max())
        out["packed_chats"] = sum(len(p) for p in packs)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--smoke", action="store_true", help="16 chats at seq_len 256: checks the script runs (figures meaningless)"
    )
    ap.add_argument("--chats", type=int, default=192)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--median-tokens", type=float, default=300.0)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.smoke:
        a.chats, a.seq_len, a.median_tokens = 16, 256, 60.0
    torch.manual_seed(a.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.core.config.batching import BATCHING
    from tasks.core.data.dataset import TokenDataset
    from tasks.core.data.prepare import prepare

    with tempfile.TemporaryDirectory(prefix="sft-eff-") as tmp:
        root = Path(tmp)
        tok = tiny_tokenizer()
        tok.save_pretrained(root / "tok")
        src = root / "chats.jsonl"
        sample = " ".join(WORDS * 8)
        per_word = len(tok(sample)["input_ids"]) / (len(WORDS) * 8)
        src.write_text(
            "".join(json.dumps(c) + "\n" for c in make_chats(a.chats, a.seq_len, a.seed, a.median_tokens, per_word))
        )
        prepare(str(src), root / "tok", root / "prep", kind="sft", field="messages", seq_len=a.seq_len)
        ds = TokenDataset(root / "prep")
        lengths = ds.lengths()
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(tok),
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=a.seq_len,
                pad_token_id=tok.pad_token_id,
            )
        ).float()
        print(
            f"{ds.num_items} chats, seq_len {a.seq_len}, tokens per chat: median {int(np.median(lengths))}, p90 "
            f"{int(np.percentile(lengths, 90))}, "
            f"max {int(lengths.max())}; micro_batch_size {a.micro_batch_size}; fp32 CPU, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
            "parameters"
        )
        run_mode(model, ds, "grouped", a.micro_batch_size, a.seed)  # warm-up: allocator, kernels
        rows = [run_mode(model, ds, mode, a.micro_batch_size, a.seed) for mode in BATCHING]
        base = next(r for r in rows if r["mode"] == "padded")
        print(f"\n{'mode':<10} {'useful tokens':>14} {'computed tokens':>16} {'epoch s':>9} {'speed-up vs padded':>19}")
        for r in rows:
            print(
                f"{r['mode']:<10} {r['useful']:>14.3f} {r['computed_tokens']:>16,} {r['seconds']:>9.2f} "
                f"{base['seconds'] / r['seconds']:>18.2f}x"
            )
        grouped = next(r for r in rows if r["mode"] == "grouped")
        packed = next(r for r in rows if r["mode"] == "packed")
        eq = loss_equivalence(model, ds, a.seed)
        print(
            f"\nloss equivalence (fp32, attention {model.config._attn_implementation}): max |per-token assistant loss "
            "- the same token padded to seq_len|"
        )
        print(
            f"  at the grouped width: {eq['grouped']:.2e}    in packed rows ({eq['packed_chats']} chats in 2 rows): "
            f"{eq['packed']:.2e}"
        )
        speed = base["seconds"] / packed["seconds"]
        same = max(eq["grouped"], eq["packed"]) < 1e-4
        checks = [
            ("grouped useful >= 0.7", grouped["useful"] >= 0.7, f"{grouped['useful']:.3f}"),
            ("packed useful >= 0.9", packed["useful"] >= 0.9, f"{packed['useful']:.3f}"),
            ("packed epoch >= 3x faster than padded", speed >= 3.0, f"{speed:.2f}x"),
            ("equal per-token losses", same, f"{max(eq['grouped'], eq['packed']):.1e}"),
        ]
        print("targets: " + "; ".join(f"{name}: {'met' if good else 'NOT met'} ({fig})" for name, good, fig in checks))
        ok = all(good for _, good, _ in checks)
        print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    return 0 if ok or a.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
