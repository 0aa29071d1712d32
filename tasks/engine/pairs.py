"""A preference phase's training step inside the ranks: pair micro-batches and the pair loss of one forward.

    torchrun --nproc_per_node=2 -m tasks.engine train --config JOB.json   # a job whose stage's record is "pair"

A pair is two rows of the prepared shards (pair i: rows 2i, its chosen sequence, and 2i + 1, its rejected
one). The sampler walks pairs, never rows, so a pair's two rows always land in the same micro-batch of the
same rank; `PairData.batch` builds a micro-batch of P pairs as `pairs.pair_rows` orders them (every chosen
row, then every rejected one) with the reference model's log-probabilities of the same pairs, read once
from the verified artifact (`tasks.core.evaluation.reference.read_reference`). `PairLoss.step` runs the
policy's one forward over the 2P rows, each sequence's summed log-probability of its reply
(`sequence_logps`'s maths), and the loss row's `preference_loss` against the reference.

Under tensor parallelism the LM head keeps its vocabulary shard: ColossalAI's Llama policy (and the other
shardformer policies) build `VocabParallelLMHead1D` with gather_output = not parallel_output, and the
plugin's parallel_output is True, so each rank's logits hold its own slice of the vocabulary, cut to its
valid (unpadded) part; the derived plan policy (`tasks.engine.plan_policy`) gathers them. The log-softmax is
then computed vocab-parallel (`vocab_parallel_logps`: the max and the sum of exponentials all-reduced over
the tp group, the target's logit taken on the rank that holds it), with no rank holding the whole
[rows, T, V] logits; whole logits (any other plugin, or gathered ones) take `sequence_logps` itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tasks.core.data.dataset import IGNORE_INDEX
from tasks.core.models.preference import PairLogps, PreferenceOutput, preference_loss, sequence_logps

REF_LOGPS, REF_TOKENS = "ref_logps", "ref_tokens"  # a pair micro-batch's reference keys (never model inputs)
SUMS = ("pairs", "loss", "correct", "margin", "chosen_logp", "chosen_tokens")  # PreferenceOutput.sums' keys


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: every rank of the tp group computes the same loss from
    the summed value, so each rank's gradient of its own part is the gradient of that value."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def vocab_parallel_logps(
    logits: torch.Tensor, labels: torch.Tensor, group: Any, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` of logits split along the vocabulary over `group` (this rank: its contiguous slice,
    in group-rank order), without gathering them; the same ([B] summed log-probabilities, [B] tokens) on
    every rank of the group."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    scored = labels != IGNORE_INDEX
    sizes = [0] * dist.get_world_size(group)
    dist.all_gather_object(sizes, int(logits.shape[-1]), group=group)
    if sum(sizes) < vocab_size:
        raise ValueError(f"the tp group's logits cover {sum(sizes)} of the vocabulary's {vocab_size} tokens")
    start = sum(sizes[: dist.get_rank(group)])
    with torch.no_grad():  # a constant shift: the log-softmax does not depend on it
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    total = _SumOverGroup.apply(shifted.exp().sum(-1), group)
    target = labels.masked_fill(~scored, 0) - start
    here = (target >= 0) & (target < logits.shape[-1])
    picked = shifted.gather(-1, target.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * here
    picked = _SumOverGroup.apply(picked, group)
    return ((picked - total.log()) * scored).sum(-1), scored.sum(-1)


class PairData:
    """The reference log-probabilities of a pair phase's data, and its micro-batches with them."""

    def __init__(self, dataset: Any, reference_dir: Any, data_dir: Any):
        from tasks.core.evaluation.reference import read_reference

        if dataset.num_items % 2:
            raise ValueError(f"{data_dir} holds {dataset.num_items} rows: a pair is two rows; prepare the data again")
        self.dataset = dataset
        self.pairs = dataset.num_items // 2
        self.ref_logps, self.ref_tokens = read_reference(reference_dir, data_dir)
        if self.ref_logps.shape[0] != self.pairs:
            raise ValueError(
                f"{reference_dir} holds the reference of {self.ref_logps.shape[0]} pairs, {data_dir} {self.pairs}: "
                "compute the reference again"
            )
        rows = dataset.lengths()
        self.lengths = np.maximum(rows[0::2], rows[1::2])  # a pair's width: its longer sequence
        self.tokens = rows[0::2] + rows[1::2]  # its real tokens, both sequences

    def batch(self, pairs: list[int], width: int) -> dict[str, torch.Tensor]:
        from tasks.core.data.pairs import pair_rows

        out = {k: torch.from_numpy(v) for k, v in self.dataset.batch(pair_rows(pairs), width=width).items()}
        idx = np.asarray(pairs, np.int64)
        out[REF_LOGPS] = torch.from_numpy(
            np.concatenate([self.ref_logps[idx, 0], self.ref_logps[idx, 1]]).astype(np.float32)
        )
        out[REF_TOKENS] = torch.from_numpy(np.concatenate([self.ref_tokens[idx, 0], self.ref_tokens[idx, 1]]))
        return out


class PairLoss:
    """The pair loss of one micro-batch under a phase section's `beta`, `loss` and `label_smoothing`."""

    def __init__(self, section: Any, vocab_size: int, tp_group: Any = None):
        self.beta, self.loss, self.label_smoothing = section.beta, section.loss, section.label_smoothing
        self.vocab_size, self.tp_group = vocab_size, tp_group

    def logps(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp_group is not None and logits.shape[-1] < self.vocab_size:
            return vocab_parallel_logps(logits, labels, self.tp_group, self.vocab_size)
        return sequence_logps(logits[..., : self.vocab_size], labels)  # a padded head's extra columns cut off

    def forward(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in mb.items() if k not in (REF_LOGPS, REF_TOKENS, "labels")}
        return model(**inputs, use_cache=False).logits

    def step(self, logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> PreferenceOutput:
        policy = PairLogps.of_batch(*self.logps(logits, mb["labels"]))
        reference = PairLogps.of_batch(mb[REF_LOGPS].to(policy.chosen.device), mb[REF_TOKENS].to(policy.chosen.device))
        return preference_loss(policy, reference, self.beta, self.loss, self.label_smoothing)


def add_sums(total: list[float], out: PreferenceOutput) -> list[float]:
    s = out.sums()
    return [a + s[k] for a, k in zip(total, SUMS)]
