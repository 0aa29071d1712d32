"""What one phase's corpus is prepared from: the PrepareSpec, built once from the phase's config section.

    python -c "from tasks.core.config.load import load_config; from tasks.core.data.spec import prepare_spec; \
print(prepare_spec(load_config('examples/tiny-cpu.yaml').cpt, 'cpt'))"

`prepare_spec` is the one mapping from a phase's config to what `tasks.core.data.prepare.plan` reads;
the prepare_data stage and the engine tests' prepared data both build their spec with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from tasks.core.config.paths import resolve_local
from tasks.core.config.phases import PHASES, Phase
from tasks.core.data.blend import BlendPlan, Source
from tasks.core.data.records import FOLDER_FORMATS
from tasks.core.data.stage_data import blend_plan

__all__ = ["MAIN_SOURCE", "PrepareSpec", "as_sources", "prepare_spec"]

MAIN_SOURCE = "main"  # the name of data.uri's one source (tasks.core.config.schema.MAIN_SOURCE)


def as_sources(uri: str | Sequence[str] | Sequence[Source]) -> list[Source]:
    """A list of Source as it is; data.uri's value (a uri or a list of them) as its one source, 'main'."""
    if not isinstance(uri, str) and uri and all(isinstance(s, Source) for s in uri):
        return list(uri)
    return [Source(MAIN_SOURCE, uri)]


@dataclass(frozen=True)
class PrepareSpec:
    """What one phase's corpus is prepared from: built once from its config section (`prepare_spec`), or
    from keywords (`prepare`). `sources`: data.uri's one source or a mixture's; `blend_plan`: the steps a
    mixture is blended for; `heldout_sources`: held-out-only sources (tasks/core/data/heldout_only.py),
    accepted where the phase's row says so."""

    sources: tuple[Source, ...]
    kind: Phase
    field: str
    seq_len: int
    heldout_fraction: float = 0.0
    heldout_uri: str | Sequence[str] | None = None
    on_bad_record: str = "error"
    max_bad_records: int = 100
    max_record_chars: int = 1 << 24
    blend_plan: BlendPlan | None = None
    heldout_sources: tuple[Source, ...] = ()
    truncation_rule: str = "drop"
    formats: tuple[str, ...] = tuple(FOLDER_FORMATS)

    @classmethod
    def of(cls, uri: str | Sequence[str] | Sequence[Source], **kw: Any) -> PrepareSpec:
        """From data.uri's value (or a list of Source) and prepare()'s keywords."""
        kw["heldout_sources"] = tuple(kw.get("heldout_sources") or ())
        kw["formats"] = tuple(kw.get("formats") or FOLDER_FORMATS)
        return cls(tuple(as_sources(uri)), **kw)

    def to_json(self) -> dict[str, Any]:
        """Plain data, e.g. to key a cache of prepared directories by (`digest.digest` over it)."""
        out = asdict(replace(self, blend_plan=None))
        out["blend_plan"] = self.blend_plan.to_json() if self.blend_plan is not None else None
        return out


def prepare_spec(section: Any, kind: Phase) -> PrepareSpec:
    """The PrepareSpec of phase `kind`'s config section (a PhaseConfig): its sources with local paths
    resolved, the field its row reads records from, the split, bad-record and truncation settings, and a
    mixture's blend plan. The one mapping from config to prepare()."""
    d, ev = section.data, section.eval
    return PrepareSpec(
        sources=tuple(Source(s.name, [resolve_local(u) for u in s.uris], s.weight) for s in d.source_list),
        kind=kind,
        field=getattr(d, PHASES[kind].field),
        seq_len=section.seq_len,
        heldout_fraction=0.0 if ev.heldout_uri else ev.heldout_fraction,
        heldout_uri=resolve_local(ev.heldout_uri) if ev.heldout_uri else None,
        on_bad_record=d.on_bad_record,
        max_bad_records=d.max_bad_records,
        max_record_chars=d.max_record_chars,
        blend_plan=blend_plan(section, kind),
        heldout_sources=tuple(
            Source(s.name, [resolve_local(u) for u in s.uris], 0.0) for s in ev.heldout_sources or ()
        ),
        truncation_rule=section.truncation,
        formats=tuple(d.folder_formats),
    )
