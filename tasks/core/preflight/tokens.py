"""Pre-flight's look at the base model's tokenizer: the special tokens agree with the model, and how
many sampled SFT chats are longer than seq_len.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check

Read without transformers (whose import pulls in torch): `tokenizer.json` through the `tokenizers`
library, `tokenizer_config.json` / `special_tokens_map.json` for the token names, and the chat
template rendered the way transformers renders it, under the budget prepare_sft renders it under
(`tasks.core.data.chat_template`): a template that cannot render a plain conversation (over the
budget, reaching for Python internals, a syntax error) is refused naming its file. Local base models only: nothing is downloaded for this; prepare_data
records what it used in index.json `special_tokens` either way.

- `check_special_tokens`: the tokenizer's eos ends every CPT document (prepare_cpt), so it must be
  an eos of config.json and generation_config.json, else it is refused naming the files, the ids
  and the fix; the chat template must close an assistant turn with a special token (the SFT end of
  turn, the last labelled token of every reply), else SFT teaches no stop and is refused. pad and
  bos that disagree change nothing trained (pad positions carry no loss; no bos is added to
  documents) and are warnings.
- `check_sft_lengths`: the sampled chats (the records check_data parses) rendered and tokenized;
  a share longer than sft.seq_len is a warning that names what sft.truncation will do with them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.core.config.paths import resolve_local
from tasks.core.data.chat_template import REFUSED, ChatTemplateError, render
from tasks.core.data.records import head_records
from tasks.core.preflight.report import CheckContext

PROBE = [
    {"role": "user", "content": "ping"},
    {"role": "assistant", "content": "pong"},
    {"role": "user", "content": "ping again"},
    {"role": "assistant", "content": "pong again"},
]
SAMPLE = 64  # chats per SFT source: the head check_data parses
_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _content(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken written out: {"content": ..., "special": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


@dataclass
class TokenizerFiles:
    """A local tokenizer as its files say it: the names of its special tokens, their ids, its template."""

    where: Path
    config: dict[str, Any]
    names: dict[str, str | None]  # bos_token/eos_token/pad_token/unk_token -> its text
    template: str | None
    backend: Any  # tokenizers.Tokenizer
    special: set[int] = field(default_factory=set)
    template_file: str = "tokenizer_config.json"

    def id_of(self, name: str) -> int | None:
        text = self.names.get(name)
        return None if text is None else self.backend.token_to_id(text)

    def token(self, i: int) -> str:
        return str(self.backend.id_to_token(int(i)))

    def show(self, i: int | None) -> str:
        return "none" if i is None else f"{self.token(i)!r} (id {i})"

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The template rendered as prepare_sft renders it, under the same budget (ChatTemplateError naming its file)."""
        context = {
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        text = render(
            self.template or "",
            {**context, **{k: v for k, v in self.names.items() if v is not None}},
            self.template_file,
        )
        return self.backend.encode(text, add_special_tokens=False).ids


def _template(root: Path, config: dict[str, Any]) -> tuple[str | None, str]:
    """The chat template and the file it is written in (chat_template.jinja, .json, else tokenizer_config.json)."""
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(), str(root / "chat_template.jinja")
    if (root / "chat_template.json").is_file():
        return json.loads((root / "chat_template.json").read_text()).get("chat_template"), str(
            root / "chat_template.json"
        )
    t = config.get("chat_template")
    if isinstance(t, list):  # named templates: the default one
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return (t if isinstance(t, str) else None), str(root / "tokenizer_config.json")


def read_tokenizer(ctx: CheckContext) -> TokenizerFiles | None:
    """The base model's tokenizer from its files; None where it is not local or has no tokenizer.json."""
    if ctx.model is None or ctx.model.source != "local" or "tokenizer.json" not in ctx.model.files:
        return None
    from tokenizers import Tokenizer  # the Rust library alone: no transformers import in pre-flight

    root = Path(ctx.model.where)
    config = ctx.model.tokenizer_config or {}
    stmap_path = root / "special_tokens_map.json"
    stmap = json.loads(stmap_path.read_text()) if stmap_path.is_file() else {}
    names = {k: _content(config.get(k)) or _content(stmap.get(k)) for k in _TOKENS}
    raw = json.loads((root / "tokenizer.json").read_text())
    special = {int(t["id"]) for t in raw.get("added_tokens") or [] if t.get("special")}
    template, template_file = _template(root, config)
    return TokenizerFiles(
        root, config, names, template, Tokenizer.from_str(json.dumps(raw)), special, template_file=template_file
    )


def _generation_config(ctx: CheckContext) -> dict[str, Any] | None:
    path = Path(ctx.model.where) / "generation_config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None  # a broken file is another check's to name


def end_of_turn(tf: TokenizerFiles) -> list[int] | None:
    """The special tokens the template closes an assistant turn with (samples.end_of_turn_tokens's
    rule); None when the template is not prefix-stable (prepare_sft refuses it, naming why)."""
    found: list[int] = []
    for i, m in enumerate(PROBE):
        if m["role"] != "assistant":
            continue
        prompt, turn = tf.render(PROBE[:i], True), tf.render(PROBE[: i + 1], False)
        if turn[: len(prompt)] != prompt:
            return None
        found += [t for t in turn[len(prompt) :] if t in tf.special and t not in found]
    return found


def check_special_tokens(ctx: CheckContext) -> None:
    """The tokenizer's eos (the CPT document separator) is the model's; the template ends a reply with a special token."""
    try:
        tf = read_tokenizer(ctx)
    except (
        OSError,
        ValueError,
        Exception,
    ) as exc:  # a tokenizer.json the library refuses: other checks name broken files
        ctx.warn(
            f"special tokens not compared: the tokenizer of {ctx.model.where} does not load "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        )
        return
    if tf is None:
        if ctx.model is not None:
            ctx.ok(
                f"special tokens: not compared before the run ({ctx.model.where} is not a local folder with a "
                "tokenizer.json); "
                "prepare_data records the ones it uses in index.json"
            )
        return
    where = tf.where
    gen = _generation_config(ctx)
    eos = tf.id_of("eos_token")
    files = [("config.json", eos_ids(ctx.model.config.get("eos_token_id")))]
    if gen is not None:
        files.append(("generation_config.json", eos_ids(gen.get("eos_token_id"))))
    said = "; ".join(
        f"{name} eos_token_id {ids if len(ids) > 1 else ids[0]} ({', '.join(repr(tf.token(i)) for i in ids)})"
        for name, ids in files
        if ids
    )
    if eos is None:
        hint = files[0][1][0] if files[0][1] else None
        named = tf.names.get("eos_token")
        ctx.problem(
            "base_model.uri",
            f"{where}/tokenizer_config.json: the tokenizer has no eos_token{'' if named is None else f' in its vocabulary ({named!r})'}; "
            f'prepare_cpt ends every CPT document with it. Set "eos_token" in tokenizer_config.json'
            + (
                f" to {tf.token(hint)!r}, the token config.json's eos_token_id {hint} names" if hint is not None else ""
            ),
        )
        return
    disagree = [(name, ids) for name, ids in files if ids and eos not in ids]
    if disagree:
        want = disagree[0][1][0]
        ctx.problem(
            "base_model.uri",
            (
                f"the tokenizer's eos is {tf.show(eos)} ({where}/tokenizer_config.json) but {said}: prepare_cpt would "
                "end every CPT document "
                f"with {tf.token(eos)!r}, a boundary the model does not stop at. Fix the file that is wrong: set "
                f'"eos_token": {tf.token(want)!r} in '
                "tokenizer_config.json (and special_tokens_map.json if it names one) so the tokenizer's eos is id "
                f"{want}, or correct eos_token_id in "
                f"{' and '.join(n for n, _ in disagree)} if the tokenizer is right"
            ),
        )
    pad, bos = tf.id_of("pad_token"), tf.id_of("bos_token")
    for name, mine, key in (("pad", pad, "pad_token_id"), ("bos", bos, "bos_token_id")):
        for fname, conf in (("config.json", ctx.model.config), ("generation_config.json", gen or {})):
            theirs = conf.get(key)
            if mine is not None and isinstance(theirs, int) and theirs != mine:
                why = (
                    "padded positions carry no loss"
                    if name == "pad"
                    else "no bos is added to CPT documents; the chat template writes its own"
                )
                ctx.warn(
                    f"base_model.uri: the tokenizer's {name} is {tf.show(mine)} but {fname} {key} is "
                    f"{tf.show(theirs)}; nothing trained changes ({why}), "
                    f"but generation reads {fname}: make them agree"
                )
    eot = None
    if tf.template:
        try:
            eot = end_of_turn(tf)
        except ChatTemplateError as exc:
            if exc.kind in REFUSED:  # it fails on any conversation: prepare_sft would too
                ctx.problem("base_model.uri", str(exc))
                return
            ctx.warn(
                f"sft end of turn not checked: {exc.source}: the chat template raised on a plain conversation ({exc.reason})"
            )
    if tf.template and eot is None and not any("end of turn not checked" in w for w in ctx.report.warnings):
        ctx.warn(
            "sft end of turn not checked: rendering a reply with the chat template does not extend its generation "
            "prompt token for token "
            "(prepare_sft refuses such a template when it renders the chats with transformers)"
        )
    if eot == []:
        ctx.problem(
            "base_model.uri",
            (
                f"the chat template of {where} closes an assistant turn with no special token (rendered: user 'ping', "
                "assistant 'pong'), so SFT "
                "would teach the model no token to stop at; end each assistant turn in the template with a special "
                "token of the tokenizer "
                '(e.g. its eos_token, or an added token marked "special": true in tokenizer.json such as <|im_end|>)'
            ),
        )
    if not disagree and eot != []:
        eos_where = (
            ", ".join(f"{n} {ids if len(ids) > 1 else ids[0]}" for n, ids in files if ids)
            or "no eos_token_id in config.json"
        )
        turn = (
            ""
            if not eot
            else (
                f"; SFT end of turn {', '.join(tf.show(t) for t in eot)}"
                + (
                    ""
                    if all(any(t in ids for _, ids in files) for t in eot)
                    else " (the export adds it to generation_config.json's eos_token_id)"
                )
            )
        )
        ctx.ok(
            f"special tokens: CPT document separator eos {tf.show(eos)} = {eos_where}; pad {tf.show(pad if pad is not None else eos)}"
            f"{'' if pad is not None else ' (the eos: no pad_token)'}; bos {tf.show(bos)}{turn}"
        )


def check_sft_lengths(ctx: CheckContext) -> None:
    """Warn when a share of the sampled SFT chats is longer than sft.seq_len, saying what sft.truncation does with them."""
    try:
        tf = read_tokenizer(ctx)
    except Exception:  # check_special_tokens said why
        return
    phase_cfg = ctx.cfg.sft
    if tf is None or not tf.template:
        return
    from tasks.core.data.inputs import resolve_inputs
    from tasks.core.data.samples import validate_messages

    fates = {
        "drop": "left out of training",
        "cut": "cut to their first tokens, the reply the cut goes through unlabelled",
        "split_turns": "split into rows of whole exchanges (an exchange longer than seq_len left out)",
    }
    fate, others = fates[phase_cfg.truncation], " or ".join(r for r in fates if r != phase_cfg.truncation)
    for i, src in enumerate(phase_cfg.data.source_list):
        where = "sft.data.uri" if phase_cfg.data.sources is None else f"sft.data.sources[{i}] ({src.name}).uri"
        try:
            files = [
                f
                for f in resolve_inputs(
                    [resolve_local(u) for u in src.uris],
                    checksums=False,
                    label=where,
                    formats=phase_cfg.data.folder_formats,
                )
                if f.size
            ]
            first = files[0]
            chats = [rec.get(phase_cfg.data.messages_field) for _, rec in head_records(first.uri, SAMPLE)]
            lengths = []
            for m in chats:
                validate_messages(m)
                lengths.append(len(tf.render(m, False)))
        except ChatTemplateError as exc:
            if exc.kind in REFUSED and not any(exc.source in p for _, p in ctx.report.problems):
                ctx.problem("base_model.uri", f"{exc} (rendering a chat of {first.uri})")
            continue
        except Exception:  # noqa: S112
            # check_data names a source it cannot read; a template that does not render is check_special_tokens's
            continue
        over = sum(n > phase_cfg.seq_len for n in lengths)
        shortest = _shortest_if_none_fits(tf, files, phase_cfg) if lengths and over == len(lengths) else None
        if shortest is not None:
            ctx.problem(
                where,
                f"every chat of this source ({shortest[1]:,}, read to the end) is longer than sft.seq_len={phase_cfg.seq_len} "
                f"tokens (the shortest {shortest[0]}), and sft.truncation: drop leaves each one out, so nothing "
                f"would train: raise sft.seq_len to at least {shortest[0]}, or set sft.truncation: cut or split_turns",
            )
        elif over:
            ctx.warn(
                f"{where}: {over} of the first {len(lengths)} chats of {first.uri} ({100 * over / len(lengths):.0f} "
                "%) are longer than "
                f"sft.seq_len={phase_cfg.seq_len} tokens (the longest {max(lengths)}); with sft.truncation: {phase_cfg.truncation} "
                f"they are {fate}. "
                f"Raise sft.seq_len, or choose sft.truncation: {others}; prepare_sft counts them exactly"
            )
        elif lengths:
            ctx.ok(
                f"sft chats: the first {len(lengths)} of {first.uri} fit sft.seq_len={phase_cfg.seq_len} (the longest "
                f"{max(lengths)} tokens)"
            )


SCAN = 20_000  # chats read past the sample before "every one is too long" is left a warning


def _shortest_if_none_fits(tf: Any, files: list[Any], phase_cfg: Any) -> tuple[int, int] | None:
    """(the shortest length, the chats read) when sft.truncation is drop and no chat of the source's
    `files` fits sft.seq_len, read to the end (at most SCAN chats); None when one fits, the rule
    keeps them in some form, or the source is longer than SCAN (the warning then stands)."""
    if phase_cfg.truncation != "drop":
        return None
    from tasks.core.data.records import iter_records

    shortest, seen = None, 0
    try:
        for f in files:
            for _, rec in iter_records(f.uri):
                seen += 1
                if seen > SCAN:
                    return None
                n = len(tf.render(rec.get(phase_cfg.data.messages_field), False))
                if n <= phase_cfg.seq_len:
                    return None
                shortest = n if shortest is None else min(shortest, n)
    except Exception:  # a bad record or chat further on: check_data and prepare_sft name it
        return None
    return (shortest, seen) if shortest is not None else None
