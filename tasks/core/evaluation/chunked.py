"""The held-out loss's logits a chunk of positions at a time: the decoder's output from one forward, then the
LM head over 64 MiB of fp32 logits at a time (`placement.LOGITS_CHUNK_BYTES`), each chunk's cross entropy
kept and the chunk dropped, so a 262k vocabulary does not cost rows x seq_len x vocab; every position's loss
bitwise what the whole batch's logits give (docs/scaling.md "Evaluation at scale").

    python -c "from tasks.core.evaluation.chunked import token_nll; help(token_nll)"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tasks.core.data.samples import IGNORE_INDEX
from tasks.core.evaluation import placement as where

if TYPE_CHECKING:
    import torch


def _head_logits(model, head, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of `hidden` through the model's output head, as its forward makes them (a family's final
    softcapping included: Gemma 2's tanh, in the same operations)."""
    import torch

    logits = head(hidden)
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


def _decoder_output(model, ids: torch.Tensor, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any] | None:
    """(the final hidden states, the output head) from one forward that computes the logits of the last
    position only (`logits_to_keep=1`), or None where the model has no separate decoder and head, takes no
    logits_to_keep, or its own last-position logits are not bitwise what its head makes of the hidden
    states (the caller then runs the whole forward)."""
    import inspect

    import torch

    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None or "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or head is None or decoder is model:
        return None
    seen: list[torch.Tensor] = []
    handle = decoder.register_forward_hook(lambda _m, _i, out: seen.append(out[0]))
    try:
        own = model(input_ids=ids, use_cache=False, logits_to_keep=1, **kwargs).logits
    finally:
        handle.remove()
    if len(seen) != 1 or seen[0].dim() != 3 or seen[0].shape[:2] != ids.shape:
        return None
    hidden = seen[0]
    if not torch.equal(_head_logits(model, head, hidden[:, -1:]), own.float()):
        return None
    return hidden, head


def token_nll(
    model, ids: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, Any], chunk: int | None = None
) -> torch.Tensor:
    """fp32 next-token cross entropy of every labelled position (IGNORE_INDEX left out), in the order of the
    flattened batch. The logits are made `chunk` positions at a time (default `placement.logits_chunk_tokens`:
    64 MiB of fp32 logits) from the decoder's output, so memory does not grow with rows x seq_len x vocab;
    per position the same numbers as the whole batch's logits (tests/test_eval_memory.py)."""
    import torch

    target = labels[:, 1:]
    split = _decoder_output(model, ids, kwargs)
    if split is None:  # the whole batch's logits at once
        logits = model(input_ids=ids, use_cache=False, **kwargs).logits.float()
        target = target.to(logits.device)  # a spread model's logits are on its last GPU
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
        )
        return nll[target.reshape(-1) != IGNORE_INDEX]
    hidden, head = split
    keep = (target != IGNORE_INDEX).to(hidden.device)
    rows = hidden[:, :-1][keep]  # the labelled positions' hidden states only
    wanted = target.to(hidden.device)[keep]
    vocab = int(head.weight.shape[0]) if hasattr(head, "weight") else int(model.config.vocab_size)
    step = chunk or where.logits_chunk_tokens(vocab)
    out, n = [], rows.shape[0]
    for i in range(0, n, step):
        # the last chunk reaches back to a whole chunk's rows: every product has the same shape (BLAS takes
        # another path for a few rows, whose results can differ in the last bit)
        lo = max(0, min(i, n - step))
        logits = _head_logits(model, head, rows[lo : i + step])
        nll = torch.nn.functional.cross_entropy(logits, wanted[lo : i + step].to(logits.device), reduction="none")
        out.append(nll[i - lo :])
        del logits
    return torch.cat(out) if out else torch.zeros(0)
