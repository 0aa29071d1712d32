"""The preference losses (DPO, IPO) and their metrics, from per-sequence log-probabilities, in fp32.

    python -m tasks.core.models.preference       # the losses and metrics of three made-up pairs

Pure torch, no distributed code: the engine's DPO step and the evaluation of held-out pairs both call it.
A batch holds every pair's chosen sequence, then every rejected one (`tasks.core.data.pairs.pair_rows`);
`sequence_logps` sums each sequence's log-probabilities over its labelled tokens (the reply and its end of
turn: the prompt is -100), with HF's shift (position t's label is scored by the logits at t - 1).

With the policy's log-ratio to the reference model, h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)):
  - sigmoid (DPO):  -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h),  e = label_smoothing
  - ipo (IPO):      (h - 1 / (2 beta))^2, on per-token mean log-probabilities (TRL's IPO)
one function per row of `tasks.core.config.preference.LOSSES` (`LOSS`; a row without one fails at import).
The metrics use the DPO implicit rewards of whole replies, beta (log pi - log ref) summed over the reply,
whatever the loss: preference accuracy (the chosen reward above the rejected), the mean reward margin,
and the chosen reply's log-likelihood under the policy (a run can widen the margin while lowering it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tasks.core.config.preference import LOSSES
from tasks.core.data.dataset import IGNORE_INDEX  # the light import: a rank needs no chat rendering

__all__ = [
    "LOSS",
    "PairLogps",
    "PreferenceOutput",
    "metrics",
    "pair_logps",
    "pair_loss",
    "preference_loss",
    "sequence_logps",
]


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] summed log-probability of each row's labelled tokens, [B] how many), in fp32.

    logits [B, T, V] of input_ids [B, T]; labels [B, T]: the token where it is scored, -100 elsewhere."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    scored = labels != IGNORE_INDEX
    picked = torch.log_softmax(logits, dim=-1).gather(-1, labels.masked_fill(~scored, 0).unsqueeze(-1)).squeeze(-1)
    return (picked * scored).sum(-1), scored.sum(-1)


@dataclass(frozen=True)
class PairLogps:
    """Summed reply log-probabilities of P pairs under one model, and each reply's scored tokens."""

    chosen: torch.Tensor  # [P]
    rejected: torch.Tensor  # [P]
    chosen_tokens: torch.Tensor  # [P]
    rejected_tokens: torch.Tensor  # [P]

    @classmethod
    def of_batch(cls, logps: torch.Tensor, tokens: torch.Tensor) -> PairLogps:
        """From a batch's [2P] sequence log-probabilities, chosen rows first (`pairs.pair_rows`)."""
        if logps.shape[0] % 2:
            raise ValueError(f"a pair batch has an even number of rows (chosen, then rejected), got {logps.shape[0]}")
        p = logps.shape[0] // 2
        return cls(logps[:p], logps[p:], tokens[:p], tokens[p:])

    def per_token(self) -> PairLogps:
        return PairLogps(
            self.chosen / self.chosen_tokens.clamp(min=1),
            self.rejected / self.rejected_tokens.clamp(min=1),
            self.chosen_tokens,
            self.rejected_tokens,
        )


def pair_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> PairLogps:
    """One forward of `model` over a pair batch ({"input_ids", "labels", "attention_mask"}, chosen rows first)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    return PairLogps.of_batch(*sequence_logps(out.logits, batch["labels"]))


def sigmoid_loss(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def ipo_loss(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return (h - 1 / (2 * beta)) ** 2


LOSS: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {"sigmoid": sigmoid_loss, "ipo": ipo_loss}
if set(LOSS) != set(LOSSES):  # a row of the config's registry without its computation, or the reverse
    raise ImportError(
        f"tasks.core.models.preference.LOSS has {sorted(LOSS)}, tasks.core.config.preference.LOSSES {sorted(LOSSES)}: "
        "add the loss function of every registered row"
    )


@dataclass(frozen=True)
class PreferenceOutput:
    loss: torch.Tensor  # the mean over the pairs: what backward() is called on
    losses: torch.Tensor  # [P]
    chosen_rewards: torch.Tensor  # [P] beta (log pi(c) - log ref(c)), summed over the reply, detached
    rejected_rewards: torch.Tensor  # [P]
    chosen_logps: torch.Tensor  # [P] the policy's summed log-likelihood of the chosen reply, detached
    chosen_tokens: torch.Tensor  # [P]

    def sums(self) -> dict[str, float]:
        """Additive totals, so batches and ranks combine exactly (`metrics` of their sum)."""
        return {
            "pairs": float(self.losses.numel()),
            "loss": float(self.losses.detach().sum()),
            "correct": float((self.chosen_rewards > self.rejected_rewards).sum()),
            "margin": float((self.chosen_rewards - self.rejected_rewards).sum()),
            "chosen_logp": float(self.chosen_logps.sum()),
            "chosen_tokens": float(self.chosen_tokens.sum()),
        }


def metrics(sums: dict[str, float]) -> dict[str, float]:
    """Preference accuracy, mean reward margin, the chosen reply's mean log-likelihood (per reply and per
    token) and the mean loss, from `PreferenceOutput.sums` added over batches."""
    n = sums["pairs"] or 1.0
    return {
        "loss": sums["loss"] / n,
        "accuracy": sums["correct"] / n,
        "margin": sums["margin"] / n,
        "chosen_logp": sums["chosen_logp"] / n,
        "chosen_logp_per_token": sums["chosen_logp"] / (sums["chosen_tokens"] or 1.0),
    }


def preference_loss(
    policy: PairLogps, reference: PairLogps, beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0
) -> PreferenceOutput:
    """The loss of row `loss` over P pairs, and the rewards the metrics are made of."""
    row = LOSSES[loss]  # a KeyError names no fix: the config refused an unknown loss before this runs
    if label_smoothing and not row.smoothing:
        raise ValueError(f"label_smoothing={label_smoothing} does not apply to loss {loss!r}; set it to 0")
    pol, ref = (policy.per_token(), reference.per_token()) if row.per_token else (policy, reference)
    h = (pol.chosen - ref.chosen) - (pol.rejected - ref.rejected)
    losses = LOSS[loss](h, beta, label_smoothing)
    with torch.no_grad():
        chosen_rewards = beta * (policy.chosen - reference.chosen)
        rejected_rewards = beta * (policy.rejected - reference.rejected)
    return PreferenceOutput(
        losses.mean(), losses, chosen_rewards, rejected_rewards, policy.chosen.detach(), policy.chosen_tokens
    )


def pair_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    reference: PairLogps,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> PreferenceOutput:
    """A DPO training step's loss: the policy's one forward over a pair batch, against the reference's
    log-probabilities of the same pairs, computed once (`tasks.core.evaluation.reference`)."""
    return preference_loss(pair_logps(model, batch), reference, beta, loss, label_smoothing)


def main() -> None:
    t = torch.tensor
    policy = PairLogps(t([-5.0, -9.0, -4.0]), t([-7.0, -8.0, -6.5]), t([5, 9, 4]), t([6, 8, 5]))
    reference = PairLogps(t([-6.0, -8.5, -4.5]), t([-6.0, -8.5, -6.0]), t([5, 9, 4]), t([6, 8, 5]))
    for name in LOSSES:
        out = preference_loss(policy, reference, beta=0.1, loss=name)
        print(name, {k: round(v, 4) for k, v in metrics(out.sums()).items()})


if __name__ == "__main__":
    main()
