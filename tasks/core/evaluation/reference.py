"""The reference model's log-probabilities of every preference pair, computed once: what DPO trains against.

    python -m tasks.core.evaluation.reference --model runs/x/sft/hf --data runs/x/data/dpo --out /tmp/reference

DPO's loss needs log ref(chosen) and log ref(rejected) of each pair it trains on. The reference model (the
model the phase starts from) never changes, so they are computed once, by a stage of their own, and the
training ranks hold one model. The artifact `write_reference` leaves, files first and the manifest last:
  logps.npy    float32 [pairs, 2]: each pair's chosen and rejected log-probability, summed over the reply's
               scored tokens (`tasks.core.models.preference.sequence_logps`)
  tokens.npy   int64 [pairs, 2]: how many tokens each reply has scored
for the pairs of the prepared data's split in dataset order (pair i is rows 2i and 2i+1), the manifest's meta
naming the split, the pair count and the data's index sha256, which `read_reference` checks against the data
it is read beside, so a reference made for other pairs is never trained against.
"""

from __future__ import annotations

import argparse
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.core.data.dataset import TokenDataset
from tasks.core.data.index import INDEX
from tasks.core.data.pairs import pair_rows
from tasks.core.run.manifest import PROVENANCE_DIR, verify_artifact, write_atomic, write_manifest

KIND = "reference-logps"
LOGPS, TOKENS = "logps.npy", "tokens.npy"


def _index_sha256(data_dir: str | Path) -> str:
    return hashlib.sha256((Path(data_dir) / INDEX).read_bytes()).hexdigest()


def reference_logps(model: Any, ds: TokenDataset, batch_pairs: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """([pairs, 2] float32 summed reply log-probabilities, [pairs, 2] scored tokens) of `model` over every
    pair of `ds`, `batch_pairs` pairs a forward, each batch padded to its longest row only."""
    import torch

    from tasks.core.models.preference import pair_logps

    if ds.phase.record != "pair":
        raise ValueError(f"{ds.root} holds {ds.kind} data, not preference pairs: prepare the dpo phase's data")
    pairs, lengths = ds.num_items // 2, ds.lengths()
    logps, tokens = np.zeros((pairs, 2), np.float32), np.zeros((pairs, 2), np.int64)
    device = next(model.parameters()).device  # the batches go where the model's first weights are
    with torch.no_grad():
        for a in range(0, pairs, batch_pairs):
            rows = pair_rows(range(a, min(a + batch_pairs, pairs)))
            batch = ds.batch(rows, width=int(lengths[rows].max()))
            out = pair_logps(model, {k: torch.from_numpy(v).to(device) for k, v in batch.items()})
            b = a + out.chosen.shape[0]
            logps[a:b] = torch.stack([out.chosen, out.rejected], 1).float().cpu().numpy()
            tokens[a:b] = torch.stack([out.chosen_tokens, out.rejected_tokens], 1).cpu().numpy()
    return logps, tokens


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def write_reference(
    model: Any, data_dir: str | Path, out_dir: str | Path, split: str = "train", batch_pairs: int = 8, **manifest: Any
) -> dict[str, Any]:
    """Score `data_dir`'s pairs of `split` with `model` (an HF causal LM, eval mode) into `out_dir`, the manifest
    last; `manifest`: write_manifest's keywords (parent, config_digest). Returns the manifest."""
    ds = TokenDataset(data_dir, split=split)
    logps, tokens = reference_logps(model, ds, batch_pairs)
    out = Path(out_dir)
    (out / PROVENANCE_DIR).mkdir(parents=True, exist_ok=True)
    write_atomic(out / LOGPS, _npy(logps))
    write_atomic(out / TOKENS, _npy(tokens))
    meta = {"split": split, "pairs": int(logps.shape[0]), "data_index_sha256": _index_sha256(data_dir)}
    return write_manifest(out, kind=KIND, meta=meta, **manifest)


def read_reference(out_dir: str | Path, data_dir: str | Path, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """The artifact's (logps, tokens), verified (every file's sha256, and made for these pairs) or a clear error."""
    m = verify_artifact(out_dir)
    meta = m.get("meta") or {}
    if m.get("kind") != KIND:
        raise ValueError(f"{out_dir}: a {m.get('kind')!r} artifact, not the reference log-probabilities")
    if meta.get("split") != split or meta.get("data_index_sha256") != _index_sha256(data_dir):
        raise ValueError(
            f"{out_dir}: made for other pairs ({meta.get('split')} split of data index "
            f"{str(meta.get('data_index_sha256'))[:12]}…), not {data_dir}'s {split} split; compute the reference again"
        )
    logps = np.load(Path(out_dir) / LOGPS, allow_pickle=False)
    tokens = np.load(Path(out_dir) / TOKENS, allow_pickle=False)
    if logps.shape != (meta["pairs"], 2) or tokens.shape != logps.shape:
        raise ValueError(f"{out_dir}: {LOGPS} {logps.shape} and {TOKENS} {tokens.shape}, manifest says {meta['pairs']}")
    return logps, tokens


def pair_metrics(
    policy: tuple[np.ndarray, np.ndarray],
    reference: tuple[np.ndarray, np.ndarray],
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> dict[str, float]:
    """The held-out figures of a model from its (logps, tokens) and the reference's over the same pairs
    (`reference_logps` of each): preference accuracy, mean reward margin, the chosen reply's
    log-likelihood, the loss. The reference scored against itself is the starting point: margin 0."""
    import torch

    from tasks.core.models.preference import PairLogps, metrics, preference_loss

    def of(arrays: tuple[np.ndarray, np.ndarray]) -> PairLogps:
        lp, n = (torch.from_numpy(np.asarray(a)) for a in arrays)
        return PairLogps(lp[:, 0], lp[:, 1], n[:, 0], n[:, 1])

    return metrics(preference_loss(of(policy), of(reference), beta, loss, label_smoothing).sums())


@dataclass(frozen=True)
class PairScoring:
    """How pairs are scored: the loss row and its settings (a `dpo:` section carries the same three)."""

    beta: float
    loss: str = "sigmoid"
    label_smoothing: float = 0.0


def evaluate_pairs(
    reference_dir: str | Path,
    candidate_dir: str | Path,
    data_dir: str | Path,
    scoring: PairScoring,
    *,
    dtype: str = "fp32",
    batch_pairs: int = 8,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """The held-out pairs of `data_dir` scored by the reference (the SFT model) and the candidate (the DPO
    model): `pair_metrics` of each against the reference (the reference's own: margin 0, its starting
    point), `prefers_chosen` (the share of pairs whose chosen reply the model gives the higher log-probability,
    a figure of each model alone) and the change of the chosen reply's mean log-likelihood. `scoring`: a
    `PairScoring`, or the run's `dpo:` section."""
    beta, loss, label_smoothing = scoring.beta, scoring.loss, scoring.label_smoothing
    import time

    from tasks.core.evaluation.heldout import eval_device, load_model

    started = time.monotonic()
    ds = TokenDataset(data_dir, split="heldout")
    scored = {}
    for name, folder in (("reference", reference_dir), ("candidate", candidate_dir)):
        model = load_model(folder, dtype, eval_device(), trust_remote_code)
        scored[name] = reference_logps(model, ds, batch_pairs)
        del model
    ref, cand = scored["reference"], scored["candidate"]
    out: dict[str, Any] = {"pairs": int(ref[0].shape[0]), "beta": beta, "loss": loss}
    for key, logps in (("sft", ref), ("dpo", cand)):
        out[key] = pair_metrics(logps, ref, beta, loss, label_smoothing)
        out[key]["prefers_chosen"] = float((logps[0][:, 0] > logps[0][:, 1]).mean()) if out["pairs"] else 0.0
    out["chosen_logp_change"] = out["dpo"]["chosen_logp"] - out["sft"]["chosen_logp"]
    out["seconds"] = round(time.monotonic() - started, 2)
    return out


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the reference model: an HF model folder")
    p.add_argument("--data", required=True, help="the dpo phase's prepared data (data/dpo)")
    p.add_argument("--out", required=True)
    p.add_argument("--split", default="train", choices=["train", "heldout"])
    a = p.parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32).eval()
    m = write_reference(model, a.data, a.out, a.split)
    print(f"{a.out}: {m['meta']['pairs']} pairs' reference log-probabilities")


if __name__ == "__main__":
    main()
