"""The model card's Data section: what each phase trained and evaluated on, from its split records.

    python -c "from tasks.core.config.load import load_config; from tasks.core.hub.card_data import data_section; \
print(chr(10).join(data_section(load_config('examples/tiny-cpu.yaml'), {})))"

Its concerns, one table or list each, all read from the split records `train_facts` gathers
(`tasks.core.hub.card`), never recomputed: each phase's datasets with their sha256, train and
held-out record counts and how the held-out set was split; the records longer than seq_len and what
the phase's rule made of them (`tasks.core.data.truncation`); a weighted mixture's sources, their
weights beside the token shares the steps took; the held-out-only sources a phase is evaluated on
and never trained on. A fact not recorded is `n/a`, never a guess.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.core.config.schema import RunConfig
from tasks.core.data.truncation import describe as describe_truncation
from tasks.core.hub.repo import hub_dataset_id


def _num(x: Any, fmt: str = "{:,}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _data_name(uri: str) -> str:
    return hub_dataset_id(uri) or Path(uri.rstrip("/")).name


def _split(facts: dict[str, dict], phase: str) -> dict[str, Any]:
    return facts.get(phase, {}).get("split") or {}


def data_section(cfg: RunConfig, facts: dict[str, dict]) -> list[str]:
    """The Data section's lines, for each phase the run trains: the datasets table, records longer
    than seq_len, then each phase's mixture and held-out-only sources where it has them."""
    rows = _datasets_table(cfg, facts)
    rows += ["", "Records longer than seq_len:", "", *(_longer_line(cfg, facts, s) for s in cfg.phases)]
    for phase in cfg.phases:
        rows += _mixture_table(facts, phase) + _heldout_only_table(facts, phase)
    return rows


def _datasets_table(cfg: RunConfig, facts: dict[str, dict]) -> list[str]:
    """One row per phase: its datasets and checksums, train and held-out records, the split."""
    data_rows = [
        "| stage | dataset | checksum | train records | held-out records | split |",
        "|---|---|---|---|---|---|",
    ]
    for phase in cfg.phases:
        split = _split(facts, phase)
        held = split.get("heldout_uri")
        how = (
            f"held-out file `{_data_name(held)}`"
            if held
            else (
                f"{split.get('fraction'):g} hash split"
                if split.get("method") == "hash-fraction"
                else split.get("method", "n/a")
            )
        )
        inputs = split.get("inputs") or [{"uri": u, "checksum": "n/a"} for u in cfg.phase(phase).data.uris]
        names = "<br>".join(f"`{_data_name(i['uri'])}`" for i in inputs)
        sums = "<br>".join(f"`{i.get('checksum', 'n/a')}`" for i in inputs)
        data_rows.append(
            f"| {phase.upper()} | {names} | {sums} | {_num(split.get('train_records'))} | "
            f"{_num(split.get('heldout_records'))} | {how} |"
        )
    return data_rows


def _longer_line(cfg: RunConfig, facts: dict[str, dict], phase: str) -> str:
    """Records longer than seq_len: the rule and what it made of them (tasks/core/data/truncation.py)."""
    tr = _split(facts, phase).get("truncation")
    line = tr and describe_truncation(tr, phase, tr.get("rule"), tr.get("seq_len") or cfg.phase(phase).seq_len)
    return (
        f"- {phase.upper()}: {line or f'no training record longer than seq_len={cfg.phase(phase).seq_len}'}."
        if tr
        else f"- {phase.upper()}: not recorded."
    )


def _mixture_table(facts: dict[str, dict], phase: str) -> list[str]:
    """A weighted mixture: what each source was meant to give and what the steps took."""
    sources = _split(facts, phase).get("sources") or []
    if len(sources) <= 1:
        return []
    return [
        "",
        f"{phase.upper()} mixture (blended once for the planned steps):",
        "",
        (
            "| source | weight | realized token share | epochs | training tokens available | held-out records | "
            "longer than seq_len |"
        ),
        "|---|---|---|---|---|---|---|",
    ] + [
        f"| {s['name']} | {s.get('weight', 1):.3f} | {s.get('token_share', 1):.4f} | {_num(s.get('epochs'), '{:.3f}')} "
        "| "
        f"{_num(s.get('tokens_available'))} | {_num(s.get('heldout_records'))} | {_num((s.get('truncation') or {}).get('over_seq_len'))} "
        "|"
        for s in sources
    ]


def _heldout_only_table(facts: dict[str, dict], phase: str) -> list[str]:
    """cpt.eval.heldout_sources: the forgetting check's text, evaluated only."""
    only = _split(facts, phase).get("heldout_sources") or []
    if not only:
        return []
    rows = [
        "",
        f"{phase.upper()} held-out-only sources (evaluated base vs {phase.upper()}, never trained on):",
        "",
        "| source | dataset | checksum | records | tokens |",
        "|---|---|---|---|---|",
    ]
    for s in only:
        names = "<br>".join(f"`{_data_name(i['uri'])}`" for i in s["inputs"])
        sums = "<br>".join(f"`{i['checksum']}`" for i in s["inputs"])
        rows.append(f"| {s['name']} | {names} | {sums} | {_num(s.get('records'))} | {_num(s.get('tokens'))} |")
    return rows
