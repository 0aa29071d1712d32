"""Pre-flight on a stage's sources: how often the planned steps repeat each one, weights that do not
sum to 1 (normalized and said, or refused under data.strict_weights), and the files of a source's
directory that are not data (named in one line, never read).

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check

A warning, never a refusal: a small source repeated many times (an instruction set replayed, a
tiny domain corpus) may be what the user wants, but it should be a decision. The planned samples
are max_steps x the global batch (`tasks.core.config.layout.global_batch`; SFT packed counts rows,
each at least one conversation, so the estimate is a lower bound there), each source's share of
them its normalized weight. What a source holds is estimated from its bytes and its first records
(the records pre-flight parses anyway): CPT blocks from the tokens per byte of those records under
the base model's `tokenizer.json` (local base models only: nothing is downloaded for this), SFT
conversations from their mean size. Compressed and parquet files have no byte count to scale, so
such a source is not estimated. prepare_data reports the exact figure (index.json `sources`, the
`data-<phase>-mixture` table) and warns again.
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.core.config.layout import global_batch
from tasks.core.config.paths import resolve_local
from tasks.core.config.phases import PHASES
from tasks.core.data.blend import normalized
from tasks.core.data.records import head_records
from tasks.core.preflight.report import CheckContext

_SCALABLE = (".jsonl", ".txt")  # formats whose file size is the size of the records it holds


def _encoder(ctx: CheckContext):
    if ctx.model is None or ctx.model.source != "local" or "tokenizer.json" not in ctx.model.files:
        return None
    from tokenizers import Tokenizer  # the Rust library alone: no transformers import in pre-flight

    return Tokenizer.from_file(str(Path(ctx.model.where) / "tokenizer.json"))


def _samples(
    uris: list[str], phase: str, text_field: str, seq_len: int, encoder, formats: tuple[str, ...]
) -> tuple[float, int] | None:
    """(estimated samples, bytes) of one source, or None when it cannot be estimated."""
    from tasks.core.data.inputs import resolve_inputs

    try:
        inputs = resolve_inputs([resolve_local(u) for u in uris], checksums=False, formats=formats)
    except (ValueError, OSError):
        return None  # check_data reports it
    if not inputs or any(f.fmt not in _SCALABLE or f.uri.endswith((".gz", ".bz2", ".xz", ".zst")) for f in inputs):
        return None
    total = sum(f.size for f in inputs)
    first = next((f for f in inputs if f.size), None)
    try:
        head = [rec for _, rec in head_records(first.uri)] if first else []
    except (ValueError, UnicodeDecodeError, OSError):
        return None
    if not head:
        return None
    head_bytes = sum(len(json.dumps(r, ensure_ascii=False).encode()) + 1 for r in head)
    if PHASES[phase].rows:  # a record a sample
        return total * len(head) / head_bytes, total
    texts = [r.get(text_field) for r in head if isinstance(r.get(text_field), str)]
    if encoder is None or not texts:
        return None
    tokens = sum(len(e.ids) + 1 for e in encoder.encode_batch(texts, add_special_tokens=False))  # + eos per document
    return total * tokens / head_bytes / seq_len, total


def check_source_epochs(ctx: CheckContext) -> None:
    """Warn when the planned steps would repeat a source more than `<phase>.data.max_source_epochs` times."""
    encoder = None
    for phase in ctx.cfg.phases:
        phase_cfg = getattr(ctx.cfg, phase)
        d = phase_cfg.data
        if PHASES[phase].blocks and encoder is None:
            try:
                encoder = _encoder(ctx)
            except Exception as exc:  # an unreadable tokenizer.json: other checks name the model's problems
                ctx.warn(f"{phase} source epochs not estimated: {ctx.model.where}/tokenizer.json does not load ({exc})")
        planned = phase_cfg.max_steps * global_batch(phase_cfg)
        unit = PHASES[phase].unit
        shown = []
        for i, (src, w) in enumerate(zip(d.source_list, normalized([s.weight for s in d.source_list]))):
            where = f"{phase}.data.uri" if d.sources is None else f"{phase}.data.sources[{i}] ({src.name})"
            est = _samples(
                src.uris,
                phase,
                d.text_field,
                phase_cfg.seq_len,
                encoder if PHASES[phase].blocks else None,
                d.folder_formats,
            )
            if est is None or est[0] <= 0:
                continue
            epochs = planned * float(w) / est[0]
            shown.append(f"{src.name} ~{epochs:.2g}")
            if epochs > d.max_source_epochs:
                ctx.warn(
                    f"{where}: the planned {phase_cfg.max_steps} steps take about {planned * float(w):,.0f} {unit} from it, "
                    f"about {epochs:.1f} passes over "
                    f"its ~{est[0]:,.0f} ({est[1] / 1e6:.1f} MB; estimated from its first records, prepare_{phase} "
                    "reports the exact figure), "
                    f"more than {phase}.data.max_source_epochs={d.max_source_epochs:g}: give it more data, a lower "
                    "weight, or fewer steps"
                )
        if shown:
            ctx.ok(f"{phase} epochs per source over {phase_cfg.max_steps} steps (estimated): {', '.join(shown)}")


def check_mixture_weights(ctx: CheckContext) -> None:
    """Weights that do not sum to 1 are normalized, and said with the shares used; refused under data.strict_weights."""
    for phase in ctx.cfg.phases:
        d = getattr(ctx.cfg, phase).data
        if d.sources is None:
            continue
        weights = [s.weight for s in d.sources]
        total = sum(weights)
        if abs(total - 1.0) <= 1e-9:
            ctx.ok(f"{phase} mixture weights {', '.join(f'{w:g}' for w in weights)} sum to 1")
            continue
        shares = ", ".join(f"{float(w):.3f}" for w in normalized(weights))
        said = (
            f"weights {', '.join(f'{w:g}' for w in weights)} ({', '.join(s.name for s in d.sources)}) sum to {total:g}"
        )
        if d.strict_weights:
            ctx.problem(
                f"{phase}.data.sources",
                f"{said}, and {phase}.data.strict_weights is true: make them sum to 1 (normalized they would be "
                f"{shares}), "
                f"or set {phase}.data.strict_weights: false to have them normalized",
            )
        else:
            ctx.warn(
                f"{phase}.data.sources: {said}: normalized to {shares} (set {phase}.data.strict_weights: true to "
                "refuse weights that do not sum to 1)"
            )


def warn_not_data(ctx: CheckContext, where: str, names: list[str], field: str, formats: tuple[str, ...]) -> None:
    """The one pre-flight line naming a directory's files that are not data: 'skipped 3 files that are not data: ...'."""
    if not names:
        return
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    txt = [
        n
        for n in names
        if n.lower().removesuffix(".gz").removesuffix(".bz2").removesuffix(".xz").removesuffix(".zst").endswith(".txt")
    ]
    hint = (
        f" ({len(txt)} .txt: plain text is read from a folder only when {field} lists txt)"
        if txt and "txt" not in formats
        else ""
    )
    ctx.warn(
        f"{where}: skipped {len(names)} file{'s' if len(names) != 1 else ''} that {'are' if len(names) != 1 else 'is'} "
        f"not data ({field}: {', '.join(formats)}): {shown}{hint}"
    )
