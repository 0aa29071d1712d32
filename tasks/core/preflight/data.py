"""Pre-flight's look at each dataset: it exists, a directory's files that are not data are named once,
and its first records have the fields and roles the stage needs.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check
"""

from __future__ import annotations

from tasks.core.config.paths import resolve_local
from tasks.core.config.phases import PHASES
from tasks.core.data.records import head_records, text_problem
from tasks.core.preflight.mixture import warn_not_data
from tasks.core.preflight.report import CheckContext


def check_data(ctx: CheckContext) -> None:
    """Each dataset exists and its first records have the fields and roles the stage needs."""
    from tasks.core.data.inputs import InputError, resolve_inputs
    from tasks.core.data.pairs import PairFields, read_pair  # the preference pair rules, defined once
    from tasks.core.data.samples import validate_messages  # the SFT record rules, defined once

    datasets = []
    for name in ctx.cfg.phases:
        phase_cfg = getattr(ctx.cfg, name)
        for i, src in enumerate(phase_cfg.data.source_list):  # each source of a mixture on its own, named by its field
            datasets.append(
                (
                    name,
                    f"{name}.data.uri"
                    if phase_cfg.data.sources is None
                    else f"{name}.data.sources[{i}] ({src.name}).uri",
                    src.uris,
                )
            )
        if phase_cfg.eval.heldout_uri:
            datasets.append((name, f"{name}.eval.heldout_uri", [phase_cfg.eval.heldout_uri]))
        for i, src in enumerate(phase_cfg.eval.heldout_sources or ()):  # held out only: evaluated, never trained on
            datasets.append((name, f"{name}.eval.heldout_sources[{i}] ({src.name}).uri", src.uris))
    for name, where, raw_uris in datasets:
        d = getattr(ctx.cfg, name).data
        # Every file is listed (a glob matching nothing, an empty directory, an unreadable file is
        # refused here); only the first file's head is read: prepare_data reads every record.
        try:
            inputs = resolve_inputs(
                [resolve_local(u) for u in raw_uris],
                checksums=False,
                label=where,
                formats=d.folder_formats,
                skipped=(not_data := []),
            )
        except (
            InputError,
            ValueError,
            OSError,
        ) as exc:  # InputError: no file, an empty glob/dir; ValueError: an unknown format
            ctx.problem(where, str(exc).removeprefix(f"{where}: "))
            continue
        warn_not_data(
            ctx, where, not_data, f"{name}.data.formats", d.formats
        )  # a directory's files that are not data: said once
        # The head sampled is the first file's that holds a record: an empty file among good ones
        # is warned about and counted, as prepare_data does, not refused.
        empty, records, uri, failed = [i.uri for i in inputs if i.size == 0], [], inputs[0].uri, False
        for inp in (i for i in inputs if i.size):
            uri = inp.uri
            try:
                records = head_records(uri)
            except (ValueError, UnicodeDecodeError, OSError) as exc:
                ctx.problem(where, str(exc))
                failed = True
                break
            if records:
                break
            empty.append(uri)
        if failed:
            continue
        if not records:
            ctx.problem(
                where,
                f"{uri} holds no records"
                if len(inputs) == 1
                else f"none of its {len(inputs)} files holds a record ({uri}, ...)",
            )
            continue
        if empty:
            ctx.warn(
                f"{where}: {len(empty)} empty input file(s) (0 bytes or no record) add nothing: {', '.join(empty[:5])}{', ...' if len(empty) > 5 else ''}"
            )
        for lineno, rec in records:
            at = f"{uri}:{lineno}"
            if PHASES[name].record == "text":
                why = text_problem(rec, d.text_field, f"{name}.data.text_field")
                if (
                    why and d.text_field in rec and d.on_bad_record == "skip"
                ):  # the record's fault, and skipping was asked for
                    ctx.warn(
                        f"{at}: {text_problem(rec, d.text_field, record_fix=False)}: skipped "
                        f"({name}.data.on_bad_record: skip)"
                    )
                elif why:
                    ctx.problem(f"{name}.data.text_field" if d.text_field not in rec else where, f"{at}: {why}")
                    failed = True
            elif PHASES[name].record == "pair":  # read as prepare_data reads it: a pair's every refusal, by line
                try:
                    read_pair(rec, PairFields.parse(d.pair_fields))
                except ValueError as exc:
                    ctx.problem(where, f"{at}: {exc}")
                    failed = True
            elif d.messages_field not in rec:
                ctx.problem(
                    f"{name}.data.messages_field",
                    f"{at}: no field {d.messages_field!r} (fields: {sorted(rec)}); "
                    f"set {name}.data.messages_field to the field holding the chat",
                )
                failed = True
            else:
                try:
                    validate_messages(rec[d.messages_field])
                except ValueError as exc:
                    ctx.problem(where, f"{at}: {exc}")
                    failed = True
            if failed:
                break  # one example per dataset is enough to say what is wrong
        if not failed:
            what = (
                f"field {d.text_field!r} is text"
                if PHASES[name].record == "text"
                else "each is a preference pair (a prompt, two different replies)"
                if PHASES[name].record == "pair"
                else f"{d.messages_field!r} have valid roles and an assistant turn"
            )
            more = (
                f" (+{len(inputs) - 1} more files, {sum(i.size for i in inputs) / 1e6:.1f} MB in all)"
                if len(inputs) > 1
                else ""
            )
            ctx.ok(f"{name} data {uri}{more}: first {len(records)} record(s) parse, {what}")
