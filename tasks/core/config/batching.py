"""The batching registry: how a stage's SFT conversations become the rows of each micro-batch.

    python -c "from tasks.core.config.batching import BATCHING; print({n: s.summary for n, s in BATCHING.items()})"

A row is pure data: the sampler (`tasks/engine/sampler.py`) reads `groups_by_length` and `packs`,
the stage's data (`tasks/engine/loop.py` `StageData`) reads `pads_to`, the layout rules refuse
`packs` under a plugin whose attention cannot keep conversations apart (its `packing_refused`). The config field is `<phase>.batching`
(`tasks.core.config.schema.PhaseConfig`), its enum these keys. CPT blocks are all `seq_len` tokens
long, so every row trains CPT the same way: the field only changes SFT.

Measured on the demo's chats (seq_len 128, 57.4 real tokens a row on average): `padded` computes
45 % real tokens; `grouped` cuts the padding to each micro-batch's longest row; `packed` fills rows
with several conversations (position ids restart per conversation; on CPU and with SDPA an exact
block-diagonal causal mask, with flash-attention-2 the varlen kernel from the position ids), so it
computes almost only real tokens. `benchmarks/sft_efficiency.py` prints each mode's useful-token fraction and
epoch time side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PAD_MULTIPLE = 8  # a micro-batch's width is rounded up to this (tensor-core friendly shapes)


@dataclass(frozen=True)
class BatchingSpec:
    name: str
    summary: str
    groups_by_length: bool  # each epoch's order puts conversations of similar length in one global batch
    pads_to: Literal[
        "seq_len", "longest"
    ]  # a micro-batch's width: seq_len, or its longest row rounded up to PAD_MULTIPLE
    packs: bool = False  # a row holds several conversations (best-fit into seq_len), attention kept inside each
    peer_keys: tuple[
        str, ...
    ] = ()  # the keys other trainers turn this mode on with; as a stage key, the error names this row


BATCHING: dict[str, BatchingSpec] = {}


def register(spec: BatchingSpec) -> BatchingSpec:
    BATCHING[spec.name] = spec
    return spec


register(
    BatchingSpec(
        "grouped",
        "global batches of conversations of similar length, each micro-batch padded to its longest row",
        True,
        "longest",
    )
)
register(BatchingSpec("padded", "every row padded to seq_len, in the seeded random order", False, "seq_len"))
register(
    BatchingSpec(
        "packed",
        "several conversations a row (micro_batch_size counts rows), position ids restarting and attention kept "
        "inside each conversation",
        False,
        "longest",
        packs=True,
        peer_keys=("packing", "sample_packing", "packed", "neat_packing", "padding_free"),
    )
)  # LLaMA-Factory, Axolotl, torchtune, TRL


def peer_key_hint(key: str) -> str | None:
    """`batching: <row>` for a key another trainer uses to choose that row, else None."""
    row = next((s.name for s in BATCHING.values() if key in s.peer_keys), None)
    return f"batching: {row}" if row else None


def micro_width(longest: int, seq_len: int, spec: BatchingSpec, pipeline: bool) -> int:
    """Columns of a micro-batch whose longest row has `longest` tokens. A pipeline (pp > 1) sends
    every micro-batch's activations with one cached shape (ColossalAI's p2p metadata cache), so it
    keeps seq_len."""
    if spec.pads_to == "seq_len" or pipeline:
        return seq_len
    return min(seq_len, max(PAD_MULTIPLE, -(-int(longest) // PAD_MULTIPLE) * PAD_MULTIPLE))
