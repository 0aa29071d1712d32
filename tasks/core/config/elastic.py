"""A training stage's preemption settings (`<phase>.elastic`) and the keep-the-global-batch rule.

    python -c "from tasks.core.config.elastic import kept_accumulation; print(kept_accumulation(8, 2, 1))"  # 4

`notices` lists the notice sources (tasks/core/config/notices.py) the ranks listen to, each with its
grace budget; on a notice the engine finishes the step in flight, commits a checkpoint of it and
exits preempted (docs/spot.md). `sigterm` (on by default) adds the `sigterm` source at its documented
grace when `notices` does not list it: a machine's shutdown signals every process with SIGTERM, and
the step in flight is kept; `sigterm: false` makes a SIGTERM tear the stage down again. `keep_global_batch` lets a stage continue its checkpoints on another
number of ranks: gradient accumulation is set so that micro_batch_size x grad_accum_steps x dp is the
checkpoint's global batch again, so the learning-rate schedule (counted in steps) and the data order
(counted in samples, tasks/engine/sampler.py) continue as if uninterrupted. Neither changes the bytes
a stage writes beyond that, so no digest holds the section (tasks/core/run/stages.py NEVER_DIGESTED);
with `keep_global_batch` the stage's digest holds "kept" in place of the global batch its layout
fields make, so a new world size does not start the stage over.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tasks.core.config.base import Frozen
from tasks.core.config.notices import NOTICES, endpoint_problem
from tasks.core.errors import ConfigError

FIELD = "elastic.keep_global_batch"


class NoticeConfig(Frozen):
    source: str = Field(description="A notice source (tasks/core/config/notices.py): " + ", ".join(NOTICES) + ".")
    grace_s: float | None = Field(
        default=None,
        gt=0,
        description="Seconds from the notice to the machine's end; null: the source's documented budget.",
    )
    endpoint: str | None = Field(
        default=None,
        description="A polled source's endpoint: the metadata service's http(s) base URL (default "
        "http://169.254.169.254) or the notice file's absolute path (required for `file`; nothing may be there yet).",
    )
    poll_s: float = Field(default=5.0, gt=0, description="Seconds between two polls of a polled source.")

    @field_validator("source")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in NOTICES:
            raise ValueError(f"unknown notice source {v!r}: one of {', '.join(NOTICES)}")
        return v

    @field_validator("endpoint")
    @classmethod
    def _endpoint_form(cls, v: str | None, info: ValidationInfo) -> str | None:
        row = NOTICES.get(info.data.get("source") or "")
        if v is not None and row is not None and row.poll is not None:
            problem = endpoint_problem(row.endpoint_kind, v)
            if problem:
                raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _endpoint(self) -> NoticeConfig:
        row = NOTICES[self.source]
        if row.poll is not None and row.endpoint is None and not self.endpoint:
            raise ValueError(f"notice source {self.source!r} needs `endpoint` (e.g. a path under the run's node)")
        if row.signal is not None and self.endpoint:
            raise ValueError(f"notice source {self.source!r} is a signal ({row.signal}): remove `endpoint`")
        return self

    @property
    def grace(self) -> float:
        return self.grace_s if self.grace_s is not None else NOTICES[self.source].grace_s

    @property
    def where(self) -> str | None:
        return self.endpoint or NOTICES[self.source].endpoint


class ElasticConfig(Frozen):
    notices: tuple[NoticeConfig, ...] = Field(
        default=(),
        description="Preemption notices the ranks listen to, e.g. [{source: sigterm, grace_s: 30}, {source: aws}]: "
        "on one the stage finishes its step, commits a checkpoint of it and exits preempted. `sigterm` is added "
        "when not listed, unless `sigterm: false`.",
    )
    sigterm: bool = Field(
        default=True,
        description="SIGTERM is a preemption notice (the `sigterm` source at its documented grace, added to `notices` "
        "when they do not list it): a machine's shutdown keeps the step in flight. A cancel from Prefect still "
        "cancels. false: a SIGTERM tears the stage down.",
    )
    keep_global_batch: bool = Field(
        default=False,
        description="Continue checkpoints on another number of ranks at their global batch, by setting "
        "grad_accum_steps (refused, naming this field, when no whole number does it).",
    )
    max_preemptions: int = Field(
        default=3,
        ge=0,
        description="How many times the flow run retries itself after this stage was preempted (its own bound: a "
        "preemption uses none of the flow run's failure retries); one more ends the run Failed, named Preempted.",
    )
    retry_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="Seconds the flow waits for capacity to come back before it retries a preempted stage.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_sigterm(cls, data: Any) -> Any:
        """`sigterm: true` (the default) lists the `sigterm` source when `notices` does not."""
        if not isinstance(data, dict) or data.get("sigterm", True) in (False, 0, "false", "no", "off", "0"):
            return data
        notices = data.get("notices") or ()
        if not isinstance(notices, (list, tuple)):
            return data  # the field's own validation says what is wrong
        listed = [n.get("source") if isinstance(n, dict) else getattr(n, "source", None) for n in notices]
        return data if "sigterm" in listed else {**data, "notices": [*notices, {"source": "sigterm"}]}

    @model_validator(mode="after")
    def _sigterm_off(self) -> ElasticConfig:
        if not self.sigterm and any(n.source == "sigterm" for n in self.notices):
            raise ValueError("`sigterm: false` with the `sigterm` source in `notices`: remove one of the two")
        return self

    @property
    def grace_s(self) -> float | None:
        """The shortest budget of the listed sources (None: no notice is listened to)."""
        return min((n.grace for n in self.notices), default=None)


def kept_accumulation(global_batch: int, micro_batch_size: int, dp: int) -> int | None:
    """grad_accum_steps that makes `global_batch` at this micro-batch and dp (None: no whole number)."""
    per = micro_batch_size * dp
    return global_batch // per if global_batch % per == 0 and global_batch >= per else None


def keep_global_batch(phase_cfg: Any, where: str, was: int, dp: int, world: int) -> Any:
    """`phase_cfg` with grad_accum_steps (and the launch's world size) set so that it trains at the
    checkpoint's global batch `was` on `world` ranks of data-parallel size `dp`; ConfigError naming
    `<where>.elastic.keep_global_batch` when no whole number of accumulation steps does."""
    ga = kept_accumulation(was, phase_cfg.micro_batch_size, dp)
    if ga is None:
        why = (
            f"the checkpoints' global batch of {was} is not micro_batch_size {phase_cfg.micro_batch_size} x a whole "
            f"number of grad_accum_steps x dp {dp} on {world} rank(s): set {where}.micro_batch_size to a divisor of "
            f"{was // dp if was % dp == 0 else was} or run on a number of ranks whose dp divides {was}"
        )
        raise ConfigError([(f"{where}.{FIELD}", why)], header="cannot keep the global batch")
    launch = phase_cfg.launch
    per_node = world // launch.nnodes if world % launch.nnodes == 0 else world
    nnodes = launch.nnodes if world % launch.nnodes == 0 else 1
    return phase_cfg.model_copy(
        update={
            "grad_accum_steps": ga,
            "launch": launch.model_copy(update={"nproc_per_node": per_node, "nnodes": nnodes}),
        }
    )
