"""Packed SFT rows -> the model's inputs: attention kept inside each conversation.

    python -c "import torch; from tasks.engine.packing import block_causal_mask; print(block_causal_mask(torch.tensor([[1, 1, 2, 2, 0]]), torch.float32)[0, 0])"

A packed row (`tasks.core.data.dataset.TokenDataset.batch_packed`) holds several conversations
back to back, numbered by `segment_ids`, with position ids that restart at 0 in each. How the
model is told where one ends depends on its attention implementation (`config._attn_implementation`):

- `flash_attention_2`: the position ids alone. transformers 4.51 sees them restart and runs the
  varlen kernel over the conversations (`_flash_attention_forward`, `prepare_fa2_from_position_ids`).
- `eager` and `sdpa` (CPU, and CUDA without flash-attn): a 4D block-diagonal causal mask in the
  additive form Llama's `_update_causal_mask` takes as it is (0 where a token may attend, the
  dtype's minimum elsewhere). Padding forms a block of its own, so no query row is fully masked.
  The mask is [rows, 1, width, width] in the compute dtype: at width 2048, 8 MiB a row in bf16.

The plugins whose forward replaces the model's mask handling are refused for packing by the
layout rules (`PluginSpec.packing_refused`), before any rank starts.
"""

from __future__ import annotations

import torch

VARLEN_FROM_POSITIONS = ("flash_attention_2",)  # implementations that find the boundaries from position ids


def block_causal_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[b, L] segment ids -> [b, 1, L, L] additive mask: token i sees token j iff j <= i in the same segment."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    L = segment_ids.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=segment_ids.device).tril()
    mask = torch.zeros(same.shape, dtype=dtype, device=segment_ids.device)
    mask.masked_fill_(~(same & causal), torch.finfo(dtype).min)
    return mask[:, None]


def model_inputs(mb: dict[str, torch.Tensor], attn_implementation: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A micro-batch as the model's forward takes it: a packed one's segment ids become the mask
    its attention implementation needs; any other passes through unchanged."""
    if "segment_ids" not in mb:
        return mb
    out = {k: v for k, v in mb.items() if k != "segment_ids"}
    if attn_implementation not in VARLEN_FROM_POSITIONS:
        out["attention_mask"] = block_causal_mask(mb["segment_ids"], dtype)
    return out


def chat_token_losses(
    logits: torch.Tensor, labels: torch.Tensor, rows, lengths, ignore_index: int = -100
) -> list[torch.Tensor]:
    """Each packed chat's per-token loss on its labelled tokens, in row order: what the equivalence
    checks (tests/test_batching.py, benchmarks/sft_efficiency.py) hold against the chat padded alone."""
    out = []
    for r, items in enumerate(rows):
        at = 0
        for i in items:
            k = int(lengths[i])
            lab = labels[r, at + 1 : at + k]
            keep = lab != ignore_index
            out.append(torch.nn.functional.cross_entropy(logits[r, at : at + k - 1][keep], lab[keep], reduction="none"))
            at += k
    return out
