"""The preference phase's own settings: the loss registry and the fields a preference pair is read from.

    python -c "from tasks.core.config.preference import LOSSES; print({n: s.summary for n, s in LOSSES.items()})"

The `dpo:` section is a phase section (`tasks.core.config.schema.PhaseConfig`: data, plugin and layout, steps,
learning rate) with `PreferenceFields` beside it; its `data:` is `PreferenceData`, which names the fields of a
pair (docs/data-formats.md). A loss is a row of `LOSSES`; its computation is the row of the same name in
`tasks.core.models.preference` (pure torch, which this leaf never imports).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator, Field, WithJsonSchema, model_validator

from tasks.core.config.base import Frozen
from tasks.core.config.data import DataConfig


@dataclass(frozen=True)
class LossSpec:
    name: str
    summary: str  # the run form's and the reference's words for it
    # True: the sequence log-probabilities are averaged over the reply's tokens (IPO, as TRL computes
    # it: a length-normalised margin); False: summed, as the DPO paper writes the loss.
    per_token: bool
    smoothing: bool  # label_smoothing applies (conservative DPO); refused with a loss where it does not


LOSSES: dict[str, LossSpec] = {}


def register(spec: LossSpec) -> LossSpec:
    LOSSES[spec.name] = spec
    return spec


register(
    LossSpec(
        "sigmoid",
        "DPO: -log sigmoid(beta * margin), margin the policy's log-ratio of chosen over rejected less the reference's",
        per_token=False,
        smoothing=True,
    )
)
register(
    LossSpec(
        "ipo",
        "IPO: (margin - 1 / (2 beta))^2 on per-token mean log-probabilities, a squared loss that does not saturate",
        per_token=True,
        smoothing=False,
    )
)


def _registered_loss(name: str) -> str:
    if name not in LOSSES:
        raise ValueError(f"unknown preference loss {name!r}; registered losses: {', '.join(LOSSES)}")
    return name


LossName = Annotated[str, AfterValidator(_registered_loss), WithJsonSchema({"type": "string", "enum": list(LOSSES)})]


def _field_name(value: str) -> str:
    if not value or "," in value:
        raise ValueError(f"{value!r} is no record field name: give the field's name, without commas")
    return value


FieldName = Annotated[str, AfterValidator(_field_name)]


class PreferenceData(DataConfig):
    """A preference phase's data: a DataConfig whose records are pairs (messages_field: the shared
    conversation of the two-endings form)."""

    prompt_field: FieldName = Field(
        default="prompt",
        description="DPO: the record field holding the prompt: a string (one user turn) or a list of messages.",
    )
    chosen_field: FieldName = Field(
        default="chosen",
        description="DPO: the record field holding the preferred reply: a string, or a list of assistant messages "
        "(or the whole conversation, when the record has no prompt).",
    )
    rejected_field: FieldName = Field(
        default="rejected",
        description="DPO: the record field holding the rejected reply, in the same form as the chosen one.",
    )

    @property
    def pair_fields(self) -> str:
        """The four field names a pair is read from, as the shard spec's one `field` carries them."""
        return f"{self.prompt_field},{self.chosen_field},{self.rejected_field},{self.messages_field}"


PAIR_FIELDS_DEFAULT = "prompt,chosen,rejected,messages"


class PreferenceFields(Frozen):
    """The preference loss's settings, beside a phase section's (schema.DpoConfig)."""

    data: PreferenceData = Field(description="Training data of this phase: preference pairs (docs/data-formats.md).")
    beta: float = Field(
        default=0.1,
        gt=0,
        description="Strength of the pull towards the reference model: the implicit reward is beta times the "
        "log-ratio of the policy to the reference (DPO's beta; IPO's target margin is 1 / (2 beta)).",
    )
    loss: LossName = Field(
        default="sigmoid",
        description="The preference loss: " + "; ".join(f"{n} ({s.summary})" for n, s in LOSSES.items()) + ".",
    )
    label_smoothing: float = Field(
        default=0.0,
        ge=0.0,
        lt=0.5,
        description="The share of pairs assumed mislabelled (conservative DPO): the loss is (1 - e) times the "
        "chosen-preferred term plus e times the rejected-preferred one. 0: plain DPO.",
    )

    @model_validator(mode="after")
    def _loss_rules(self):
        if self.label_smoothing and not LOSSES[self.loss].smoothing:
            raise ValueError(
                f"label_smoothing={self.label_smoothing} does not apply to loss {self.loss!r}; set label_smoothing: 0 "
                f"or use loss: {', '.join(n for n, s in LOSSES.items() if s.smoothing)}"
            )
        rule = getattr(self, "truncation", "drop")
        if rule != "drop":
            raise ValueError(
                f"truncation={rule!r}: a pair longer than seq_len is dropped (and counted, and named by file and line): "
                "cutting would cut the reply it scores, and a pair has no whole exchanges to split; set truncation: "
                "drop, or raise seq_len"
            )
        return self


DPO_DESCRIPTION = (
    "Preference tuning (DPO) after SFT on pairs of a chosen and a rejected reply: a phase section plus beta, loss and "
    "label_smoothing; data.prompt_field/chosen_field/rejected_field name the pair's fields. null (the default): no "
    "preference phase, the run is CPT then SFT."
)
