"""The training-phase registry: CPT, SFT and DPO as rows of one table, read wherever the code used to branch on them.

    python -c "from tasks.core.config.phases import PHASES; print({n: (p.record, p.unit) for n, p in PHASES.items()})"

A phase is a training section of the config (`cpt`, `sft`, `dpo`): its corpus, how a record becomes training
samples, and what its evaluation measures. It is not a stage name (`train_cpt`, `push_to_hub`): the
stages of a phase are rows of `tasks.core.run.stages`. The row holds what differs between phases:
  - the record kind (`record`) and the data field it is read from (`field`, a `DataConfig` field),
  - the encoder that turns records into token shards (`encoder`, "module:Class": this leaf package never
    imports the data code, which resolves it; `tasks.core.data.encoders`; tests/test_structure.py resolves
    every such string and checks it against the layering),
  - the unit of training (`blocks`: one stream cut into seq_len blocks by the reader, else a record a
    row, batched by `<phase>.batching`) and its name in messages (`unit`),
  - the evaluation (`evaluation`, `generation`) and the config paths the evaluation's digest adds
    (`eval_digest`), whether held-out-only sources and LoRA are accepted,
  - whether its section may be left out (`optional`: `dpo`; a run without it trains CPT then SFT, and
    `RunConfig.phases` lists the phases a run trains: iterate that, not PHASES, over a config).
Adding a phase is one `register(PhaseSpec(...))` plus its config section (tests/test_phases.py adds one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Phase = Literal["cpt", "sft", "dpo"]  # a training phase (a config section), never a stage name such as "train_cpt"
# A run root written before the phase was called a phase names it "stage" in its job files, its
# checkpoints' manifest meta and its engine records; `phase_of` reads either, writers write "phase".
OLD_PHASE_KEY = "stage"


def phase_of(record: Mapping[str, Any]) -> Any:
    """The training phase a job file, a checkpoint's manifest meta, train_state.json or an engine
    record names: its "phase", or the "stage" such a record written before the rename holds."""
    return record["phase"] if "phase" in record else record.get(OLD_PHASE_KEY)


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    title: str  # how messages name it: "CPT"
    record: Literal["text", "chat", "pair"]  # what one record holds: a document, a conversation, or a preference pair
    # the data-section field naming the record's field: "text_field", "messages_field" (a DataConfig field), or
    # "pair_fields" (PreferenceData: the pair's four field names in one string)
    field: str
    default_field: str  # that field's default, for the development command lines
    encoder: str  # "module:Class" of its record encoder (tasks/core/data/encoders.py)
    unit: str  # one training sample in messages and index.json's blend: "blocks" or "conversations"
    # True: the records' tokens are one stream the reader cuts into seq_len blocks (shards do not depend
    # on seq_len, a document longer than a block continues in the next); False: a record is a row, cut
    # to seq_len by `<phase>.truncation` and batched by `<phase>.batching` (grouped, padded, packed).
    blocks: bool
    # held-out metric of its evaluation stage ("preference": accuracy, reward margin, chosen log-likelihood)
    evaluation: Literal["perplexity", "assistant_loss", "preference"]
    generation: bool = False  # its evaluation also generates (the gate's generation check)
    eval_digest: tuple[str, ...] = ()  # config paths its evaluation stage's digest adds
    heldout_sources: bool = False  # eval.heldout_sources accepted: held-out-only sources, by perplexity
    lora_refused: str | None = None  # why `<phase>.lora` is refused; None: accepted
    # why `<phase>.context` (RoPE, positions) is refused; None: the phase sets the model's context (it
    # starts from the base; a later phase starts from its cpt/hf, whose config.json carries them)
    context_refused: str | None = None
    optional: bool = False  # its config section may be left out (off unless configured: the run trains without it)
    # the rows a record becomes in a shard (a pair: its chosen then its rejected sequence), and what messages call one
    rows_per_record: int = 1
    record_noun: str = "chats"

    @property
    def templated(self) -> bool:
        """Its records are rendered by the model's chat template (conversations, preference pairs)."""
        return self.record != "text"

    @property
    def rows(self) -> bool:
        """A record is a row (not a block of a stream): `batching`, `truncation` and a row's attention mask apply."""
        return not self.blocks


PHASES: dict[str, PhaseSpec] = {}


def register(spec: PhaseSpec) -> PhaseSpec:
    PHASES[spec.name] = spec
    return spec


register(
    PhaseSpec(
        name="cpt",
        title="CPT",
        record="text",
        field="text_field",
        default_field="text",
        encoder="tasks.core.data.encoders:TextEncoder",
        unit="blocks",
        blocks=True,
        evaluation="perplexity",
        heldout_sources=True,
        # cpt/hf is the full CPT model every later stage starts from (reboost, evaluate_cpt, the SFT
        # adapter's base): a CPT adapter would need a merged artifact of its own in between.
        lora_refused=(
            "LoRA is for SFT only: cpt/hf, the model SFT starts from and its adapter's base, is the full CPT "
            "model "
            "(continued pre-training updates every weight); put the lora section under sft"
        ),
    )
)
register(
    PhaseSpec(
        name="sft",
        title="SFT",
        record="chat",
        field="messages_field",
        default_field="messages",
        encoder="tasks.core.data.encoders:ChatEncoder",
        unit="conversations",
        blocks=False,
        evaluation="assistant_loss",
        generation=True,
        eval_digest=("gate.max_new_tokens", "gate.num_prompts"),
        context_refused=(
            "context settings are for CPT only: SFT starts from cpt/hf, whose config.json carries cpt.context; "
            "move them to cpt.context"
        ),
    )
)

register(
    PhaseSpec(
        name="dpo",
        title="DPO",
        record="pair",
        field="pair_fields",
        default_field="prompt,chosen,rejected,messages",  # preference.PAIR_FIELDS_DEFAULT
        encoder="tasks.core.data.pairs:PairEncoder",
        unit="pairs",
        blocks=False,
        evaluation="preference",
        rows_per_record=2,
        record_noun="pairs",
        context_refused=(
            "context settings are for CPT only: DPO starts from the SFT model, whose config.json carries cpt.context; "
            "move them to cpt.context"
        ),
        optional=True,
    )
)


def phase(name: str) -> PhaseSpec:
    """The row of `name`, or a clear error naming the phases there are."""
    try:
        return PHASES[name]
    except KeyError:
        raise ValueError(f"phase {name!r}: use one of {', '.join(PHASES)}") from None
