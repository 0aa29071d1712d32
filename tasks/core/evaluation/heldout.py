"""Held-out evaluation on HF-format artifacts with plain `transformers` (the gate's verdict on it:
`tasks.core.evaluation.verdict`).

    python -m tasks.core.evaluation.heldout cpt --reference runs/tiny-demo/base --candidate runs/tiny-demo/cpt/hf --data runs/tiny-demo/data/cpt/heldout.jsonl --seq-len 64
    python -m tasks.core.evaluation.heldout sft --reference runs/tiny-demo/cpt/hf --candidate runs/tiny-demo/export --data runs/tiny-demo/data/sft/heldout.jsonl --seq-len 128

Both sides of a comparison see the same tensors: the held-out records are tokenized once (with
the candidate's tokenizer, which must equal the reference's), packed by `tasks.core.data.samples`'s
`pack_cpt` / `encode_sft` exactly as training packs them, cut to the same batches, and scored by
both models in the same dtype. The metric is a token-weighted mean of the next-token cross
entropy in float64 (CPT: every token; SFT: the assistant tokens the SFT loss is trained on), so
batch size changes memory, not the number. Where each model goes (`tasks.core.evaluation.placement`):
the CPU without CUDA, else the first GPU, or, when it does not fit there, every visible GPU through
accelerate's `device_map="auto"`; in `eval.dtype`, which defaults to the export's on a GPU and to
fp32 on CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
import weakref
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.core.config.kernels import cuda_available
from tasks.core.config.outputs import ExportConfig
from tasks.core.config.phases import PHASES, Phase
from tasks.core.config.schema import EvalConfig
from tasks.core.data.samples import encode_sft_with_stats, pack_cpt
from tasks.core.evaluation import placement as where
from tasks.core.evaluation import release
from tasks.core.evaluation.chunked import token_nll
from tasks.core.models.fingerprint import torch_dtype
from tasks.core.run import meter

if TYPE_CHECKING:
    import torch

# torch is imported where a model is scored, not with this module: the flow process imports it to
# build its tasks, and a re-run that skips every stage never scores anything (torch's import is
# ~2.5 s of CPU).
_PPL_CAP = 700.0  # exp(700) is near float64's limit; a loss that high is "infinite" perplexity


def eval_device() -> torch.device:
    import torch

    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < _PPL_CAP else float("inf")


def resolved(cfg: EvalConfig) -> EvalConfig:
    """`cfg` with its dtype decided: as set, else the default export dtype on a GPU, fp32 on CPU
    (the flow passes its own export.dtype, `tasks.stages.evaluate`)."""
    default = ExportConfig.model_fields["dtype"].default
    return cfg if cfg.dtype else cfg.model_copy(update={"dtype": where.eval_dtype(None, default, cuda_available())})


def load_model(
    model_dir: str | Path,
    dtype: str,
    device: torch.device,
    trust_remote_code: bool = False,
    placement: where.Placement | None = None,
):
    """The model in `dtype`, on `device`, or where `placement` puts it (a GPU, or spread over the
    visible GPUs); a placement that fits nowhere is refused before anything is read."""
    if placement is not None and placement.kind == "refused":
        raise ValueError(
            f"{model_dir} cannot be evaluated on this node's GPUs: {placement.problem}; set eval.dtype: bf16 (half of "
            "fp32), "
            "a smaller eval.batch_size, or run the evaluation on a node with more GPU memory"
        )
    from transformers import AutoModelForCausalLM, GenerationConfig

    kwargs = dict(
        dtype=torch_dtype(dtype),
        use_safetensors=True,
        trust_remote_code=trust_remote_code,
        low_cpu_mem_usage=True,
    )
    if (
        placement is not None and placement.device_map is not None
    ):  # straight onto the GPU(s), never whole in host memory
        return AutoModelForCausalLM.from_pretrained(
            model_dir, device_map=placement.device_map, max_memory=placement.max_memory or None, **kwargs
        ).eval()
    if device.type == "cpu" and any(Path(model_dir).glob("*.safetensors")):  # one copy of the weights, never two
        model = release.load_on_cpu(model_dir, kwargs["dtype"], trust_remote_code)
        if (Path(model_dir) / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(model_dir)
        return model.eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).to(device).eval()


def input_device(model, device: torch.device) -> torch.device:
    """Where the inputs of a model spread by accelerate go (its embedding's GPU); else `device`."""
    return model.get_input_embeddings().weight.device if getattr(model, "hf_device_map", None) else device


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


_release = release.release  # after the last name for a model is dropped: collect only if it lives on, trim the heap


def same_tokenizer(a: Path, b: Path) -> None:
    """Both sides must see the same token ids; the flow copies tokenizer files, so this holds."""
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt"):
        fa, fb = Path(a) / name, Path(b) / name
        if (
            fa.is_file()
            and fb.is_file()
            and hashlib.sha256(fa.read_bytes()).digest() != hashlib.sha256(fb.read_bytes()).digest()
        ):
            raise ValueError(
                f"{fa} and {fb} differ: the two models do not share a tokenizer, so their losses are not comparable"
            )


# ------------------------------------------------------------------------------------------------
# Batches and losses


def limit_rows(batch: dict[str, torch.Tensor], cfg: EvalConfig) -> dict[str, torch.Tensor]:
    if cfg.max_batches is None:
        return batch
    n = cfg.batch_size * cfg.max_batches
    return {k: v[:n] for k, v in batch.items()}


def cpt_batch(
    tokenizer, records: Sequence[dict], text_field: str, seq_len: int, cfg: EvalConfig
) -> dict[str, torch.Tensor]:
    try:
        blocks = pack_cpt(tokenizer, records, text_field=text_field, seq_len=seq_len)
    except ValueError as exc:
        raise ValueError(
            f"CPT held-out set ({len(records)} records): {exc}; raise cpt.eval.heldout_fraction or give "
            "cpt.eval.heldout_uri"
        ) from None
    return limit_rows({"input_ids": blocks, "labels": blocks.clone()}, cfg)


def sft_batch(
    tokenizer, records: Sequence[dict], messages_field: str, seq_len: int, cfg: EvalConfig
) -> tuple[dict[str, torch.Tensor], int]:
    try:
        batch, dropped = encode_sft_with_stats(tokenizer, records, messages_field=messages_field, seq_len=seq_len)
    except ValueError as exc:
        raise ValueError(f"SFT held-out set ({len(records)} records): {exc}") from None
    return limit_rows(batch, cfg), dropped


def heldout_loss(model, batch: dict[str, torch.Tensor], batch_size: int, device: torch.device) -> dict[str, float]:
    """Token-weighted next-token cross entropy over every labelled position (float64 sums of the fp32
    per-position losses, `token_nll`: the logits a chunk of positions at a time)."""
    import torch

    with torch.no_grad():
        total, count = 0.0, 0
        n = batch["input_ids"].shape[0]
        for i in range(0, n, batch_size):
            ids = batch["input_ids"][i : i + batch_size].to(device)
            labels = batch["labels"][i : i + batch_size].to(device)
            mask = batch.get("attention_mask")
            kwargs = {"attention_mask": mask[i : i + batch_size].to(device)} if mask is not None else {}
            nll = token_nll(model, ids, labels, kwargs)
            total += float(nll.double().sum())
            count += int(nll.numel())
        if count == 0:
            raise ValueError("the held-out batch has no labelled token to score")
        loss = total / count
        return {"loss": loss, "perplexity": perplexity(loss), "tokens": count}


def compare_many(
    reference_dir: Path,
    candidate_dir: Path,
    batches: dict[str, dict[str, torch.Tensor]],
    cfg: EvalConfig,
    trust_remote_code: bool = False,
) -> dict[str, tuple[dict, dict]]:
    """{name: (reference, candidate) losses} on the very same batches, each model loaded once, one in
    memory at a time; each result names where its model ran (`device`)."""
    cfg = resolved(cfg)
    tokens = cfg.batch_size * max((int(b["input_ids"].shape[-1]) for b in batches.values()), default=0)
    out: dict[str, list[dict]] = {name: [] for name in batches}
    rows = sum(int(b["input_ids"].shape[0]) for b in batches.values())
    for model_dir in (reference_dir, candidate_dir):
        placed = where.place(model_dir, cfg.dtype, tokens)
        model = load_model(model_dir, cfg.dtype, eval_device(), trust_remote_code, placed)
        device = input_device(model, eval_device())
        # progress in sequences scored, counted where every forward pass starts (its embedding), so
        # however the loss is computed from the logits
        progress = meter.meter(f"held-out loss of {'/'.join(model_dir.parts[-2:])}", rows, "sequences")
        hook = model.get_input_embeddings().register_forward_hook(lambda _m, a, _o, p=progress: p.add(len(a[0])))
        try:
            for name, batch in batches.items():
                out[name].append({**heldout_loss(model, batch, cfg.batch_size, device), "device": placed.describe()})
        finally:
            hook.remove()
            progress.finish()
            gone = weakref.ref(model)
            del model  # before the next model loads: one in memory at a time
            _release(gone)
    return {name: (a, b) for name, (a, b) in out.items()}


def compare(
    reference_dir: Path,
    candidate_dir: Path,
    batch: dict[str, torch.Tensor],
    cfg: EvalConfig,
    trust_remote_code: bool = False,
) -> tuple[dict, dict]:
    """(reference, candidate) losses on the very same batch, one model in memory at a time."""
    return compare_many(reference_dir, candidate_dir, {"": batch}, cfg, trust_remote_code)[""]


def _pct(after: float, before: float) -> float:
    return 100.0 * (after - before) / before if before and math.isfinite(before) else float("inf")


def evaluate_cpt(
    base_dir: Path,
    cpt_dir: Path,
    heldout: Sequence[dict],
    text_field: str,
    seq_len: int,
    cfg: EvalConfig,
    trust_remote_code: bool = False,
    by_source: dict[str, Sequence[dict]] | None = None,
    heldout_only: Collection[str] = (),
) -> dict[str, Any]:
    """Held-out loss and perplexity of the base model and of the CPT model on the CPT held-out set;
    with `by_source` (each source's held-out records), also on each source's own, in `sources` (a
    source with too little held-out text for one block says so in `skipped`); the names in
    `heldout_only` (eval.heldout_sources, never trained on) are marked `held_out_only`."""
    started = time.monotonic()
    cfg = resolved(cfg)
    same_tokenizer(base_dir, cpt_dir)
    tok = load_tokenizer(cpt_dir, trust_remote_code)
    batches = {"": cpt_batch(tok, heldout, text_field, seq_len, cfg)}
    skipped = {}
    for name, records in (by_source or {}).items():
        b = cpt_batch(tok, records, text_field, seq_len, cfg)
        if b["input_ids"].shape[0]:
            batches[f"source:{name}"] = b
        else:
            skipped[name] = f"{len(records)} held-out records, fewer tokens than one block of seq_len={seq_len}"
    pairs = compare_many(base_dir, cpt_dir, batches, cfg, trust_remote_code)
    base, cpt = pairs[""]
    batch = batches[""]
    sources = {
        name: {"skipped": skipped[name]} if name in skipped else _change(*pairs[f"source:{name}"])
        for name in (by_source or {})
    }
    for name in heldout_only:
        sources[name]["held_out_only"] = True
    return {
        **({"sources": sources} if by_source else {}),
        "base": _lp(base),
        "cpt": _lp(cpt),
        "perplexity_change_pct": _pct(cpt["perplexity"], base["perplexity"]),
        "tokens": cpt["tokens"],
        "sequences": int(batch["input_ids"].shape[0]),
        "seq_len": seq_len,
        "batch_size": cfg.batch_size,
        "dtype": cfg.dtype,
        "device": cpt["device"],
        "seconds": round(time.monotonic() - started, 3),
    }


def evaluate_sft(
    pre_dir: Path,
    sft_dir: Path,
    heldout: Sequence[dict],
    messages_field: str,
    seq_len: int,
    cfg: EvalConfig,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Held-out loss on assistant tokens of the pre-SFT (CPT) model and of the SFT export."""
    started = time.monotonic()
    cfg = resolved(cfg)
    same_tokenizer(pre_dir, sft_dir)
    batch, dropped = sft_batch(load_tokenizer(sft_dir, trust_remote_code), heldout, messages_field, seq_len, cfg)
    pre, sft = compare(pre_dir, sft_dir, batch, cfg, trust_remote_code)
    return {
        "pre_sft": _lp(pre),
        "sft": _lp(sft),
        "loss_change": sft["loss"] - pre["loss"],
        "tokens": sft["tokens"],
        "sequences": int(batch["input_ids"].shape[0]),
        "dropped_records": dropped,
        "seq_len": seq_len,
        "batch_size": cfg.batch_size,
        "dtype": cfg.dtype,
        "device": sft["device"],
        "seconds": round(time.monotonic() - started, 3),
    }


def _change(base: dict, cpt: dict) -> dict[str, Any]:
    return {
        "base": _lp(base),
        "cpt": _lp(cpt),
        "perplexity_change_pct": _pct(cpt["perplexity"], base["perplexity"]),
        "tokens": cpt["tokens"],
    }


def _lp(d: dict) -> dict[str, float]:
    return {"loss": d["loss"], "perplexity": d["perplexity"]}


def evaluate_one(
    model_dir: Path, records: Sequence[dict], kind: Phase, field: str, seq_len: int, cfg: EvalConfig
) -> dict[str, Any]:
    """Held-out loss and perplexity of one HF folder: packed text (cpt) or assistant tokens (sft)."""
    tok = load_tokenizer(model_dir)
    batch = (
        cpt_batch(tok, records, field, seq_len, cfg)
        if PHASES[kind].evaluation == "perplexity"
        else sft_batch(tok, records, field, seq_len, cfg)[0]
    )
    cfg = resolved(cfg)
    placed = where.place(model_dir, cfg.dtype, cfg.batch_size * seq_len)
    model = load_model(model_dir, cfg.dtype, eval_device(), placement=placed)
    device = input_device(model, eval_device())
    try:
        return {
            "model": str(model_dir),
            **heldout_loss(model, batch, cfg.batch_size, device),
            "sequences": int(batch["input_ids"].shape[0]),
            "seq_len": seq_len,
            "dtype": cfg.dtype,
            "device": placed.describe(),
        }
    finally:
        gone = weakref.ref(model)
        del model
        _release(gone)


def main(argv: Sequence[str] | None = None) -> None:
    from tasks.core.data.records import read_records

    p = argparse.ArgumentParser(
        prog="cpt-to-sft eval", description="Held-out metrics of an HF model folder on a data file, or of two compared."
    )
    p.add_argument(
        "kind", choices=list(PHASES), help="cpt: packed raw text; sft: chat records, loss on assistant tokens"
    )
    p.add_argument("--candidate", "--model", required=True, help="the HF folder to evaluate")
    p.add_argument(
        "--reference",
        default=None,
        help="a second HF folder to compare with (e.g. the base model); omit for one folder",
    )
    p.add_argument("--data", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--field", default=None)
    a = p.parse_args(argv)
    cfg = EvalConfig()
    records = read_records(a.data)
    field = a.field or PHASES[a.kind].default_field
    if a.reference is None:
        m = evaluate_one(Path(a.candidate), records, a.kind, field, a.seq_len, cfg)
    elif PHASES[a.kind].evaluation == "perplexity":
        m = evaluate_cpt(Path(a.reference), Path(a.candidate), records, field, a.seq_len, cfg)
    else:
        m = evaluate_sft(Path(a.reference), Path(a.candidate), records, field, a.seq_len, cfg)
    print(json.dumps(m, indent=2))


if __name__ == "__main__":
    main()
