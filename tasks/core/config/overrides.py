"""The typed per-run overrides of a deployment run: what a user changes per run without editing
the YAML. Prefect renders this model as the labelled fields of the run form (with these
descriptions, taken from the config's own fields), and every value is validated again by
RunConfig once it is applied to the YAML, so a wrong one names the config field.

    python -c "from tasks.core.config.overrides import RunOverrides as R; print(R(run_name='x', cpt={'max_steps': 4}).dotted())"
    prefect deployment run cpt-to-sft/default -p config=examples/tiny-cpu.yaml \
        --params '{"overrides": {"run_name": "smoke", "cpt": {"max_steps": 4, "lr": 1e-4}}}'

`sets` holds `key.path=value` items as `cpt-to-sft run --set` takes them (`parse_sets`): the CLI hands
the flow the user's config file and these, never a resolved copy, so the retry after a preemption
reads what the file says then, with the same overrides applied again.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.core.config.bounded_yaml import load_bounded
from tasks.core.config.phases import PHASES
from tasks.core.config.schema import BaseModelConfig, DataConfig, PhaseConfig, RunConfig
from tasks.core.errors import ConfigError

Problem = tuple[str, str]


def _about(model: type[BaseModel], field: str, prefix: str = "") -> str:
    return f"{prefix}{model.model_fields[field].description} Empty: as in the config."


# Text fields are plain strings, empty meaning "as in the config", so the run form shows a text box
# rather than a "str | None" switch; numbers stay optional (None: as in the config).
class _Overrides(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StageOverrides(_Overrides):
    data_uri: str = Field(default="", title="Data URI", description=_about(DataConfig, "uri", "Training data: "))
    max_steps: int | None = Field(default=None, ge=1, title="Max steps", description=_about(PhaseConfig, "max_steps"))
    lr: float | None = Field(default=None, gt=0, title="Learning rate", description=_about(PhaseConfig, "lr"))


class RunOverrides(_Overrides):
    run_name: str = Field(default="", title="Run name", description=_about(RunConfig, "name"))
    run_root: str = Field(default="", title="Run root", description=_about(RunConfig, "run_root"))
    base_model_uri: str = Field(default="", title="Base model URI", description=_about(BaseModelConfig, "uri"))
    base_model_revision: str = Field(
        default="", title="Base model revision", description=_about(BaseModelConfig, "revision")
    )
    # Not optional (an empty one changes nothing): an optional object is a collapsed "None" toggle
    # in Prefect's run form, and its fields would not show until a user switched it on.
    cpt: StageOverrides = Field(
        default_factory=StageOverrides, title="CPT", description="Continued pre-training: data, steps, learning rate."
    )
    sft: StageOverrides = Field(
        default_factory=StageOverrides, title="SFT", description="Supervised fine-tuning: data, steps, learning rate."
    )
    sets: tuple[str, ...] = Field(
        default=(),
        title="More overrides",
        description="Any config field as key.path=value (e.g. cpt.seq_len=2048; a list item by its index: "
        "cpt.elastic.notices.0.grace_s=5), the value read as YAML; applied in order, before the fields above. "
        "What `cpt-to-sft run --set` passes.",
    )

    def dotted(self) -> dict[str, Any]:
        """The `sets`, then the set fields, as dotted config keys for `read_raw_config` (a field above wins
        over a `sets` item of the same key, as --run-root wins over --set run_root)."""
        out = parse_sets(self.sets)
        for key, (_, value) in self._set().items():
            out.pop(key, None)
            out[key] = value
        return out

    def form_fields(self) -> dict[str, str]:
        """The config key each set field changes -> the field as the run form names it
        (`name` -> `overrides.run_name`): a refusal of that key is about what the form said."""
        return {key: f"overrides.{field}" for key, (field, _) in self._set().items()}

    def _set(self) -> dict[str, tuple[str, Any]]:
        """config key -> (the form's field path, its value), for the fields that are set."""
        out: dict[str, tuple[str, Any]] = {}
        for field, key in _TOP.items():
            if getattr(self, field) not in (None, ""):
                out[key] = (field, getattr(self, field))
        for phase in PHASES:
            if (st := getattr(self, phase, None)) is None:  # a phase the run form has no fields for
                continue
            for field, key in _PER_STAGE.items():
                if getattr(st, field) not in (None, ""):
                    out[f"{phase}.{key}"] = (f"{phase}.{field}", getattr(st, field))
        return out


_TOP = {
    "run_name": "name",
    "run_root": "run_root",
    "base_model_uri": "base_model.uri",
    "base_model_revision": "base_model.revision",
}
_PER_STAGE = {"data_uri": "data.uri", "max_steps": "max_steps", "lr": "lr"}


def parse_sets(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """['a.b=1', 'c=x'] -> {'a.b': 1, 'c': 'x'}, later ones winning, order kept; each value read by the
    bounded YAML loader, like the config file."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key or any(not part for part in key.split(".")):
            raise ConfigError([(f"--set {item}", "expected key.path=value, e.g. --set cpt.max_steps=100")])
        try:
            value = load_bounded(raw, f"--set {key}") if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError([(key, f"--set value {raw!r} is not valid YAML: {exc}")]) from None
        out.pop(key, None)  # re-insert: the last --set of a key applies last
        out[key] = value
    return out


def parse_overrides(value: RunOverrides | dict[str, Any] | None) -> RunOverrides:
    """The form's overrides, or one ConfigError naming every wrong field as the form does (`overrides.cpt.lr`)."""
    if isinstance(value, RunOverrides):
        return value
    try:
        return RunOverrides.model_validate(value or {})
    except ValidationError as exc:
        problems = [("overrides." + ".".join(str(x) for x in e["loc"]), e["msg"]) for e in exc.errors()]
        raise ConfigError(problems, header="invalid run form overrides") from None


def on_form(problems: list[Problem], form: dict[str, str]) -> list[Problem]:
    """`problems` with each config key the form set renamed to the form's field, the key kept in words:
    `overrides.run_name (the config's name): ...`."""
    out: list[Problem] = []
    for field, msg in problems:
        key = next((k for k in form if field == k or field.startswith(k + ".")), None)
        out.append((f"{form[key]}{field[len(key) :]} (the config's {field})", msg) if key else (field, msg))
    return out
