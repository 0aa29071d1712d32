"""Training samples from records: pack CPT text into blocks, render and loss-mask SFT chats.

The one definition of the samples and of the SFT record rules, shared by pre-flight
(`tasks/core/preflight/checks.py`), evaluation (`tasks/core/evaluation/heldout.py`) and data preparation
(`tasks/core/data/`, which writes the token shards the training ranks memory-map; its
output is bit-identical to `pack_cpt` / `encode_sft` over the same records, tests/test_dataprep.py).
Records come from `tasks.core.data.records`. To eyeball what a stage will train on:

    python -m tasks.core.data.samples --model runs/demo/base-model --uri data/sample/sft.jsonl --kind sft --seq-len 64
    python -m tasks.core.data.samples --model runs/demo/base-model --uri data/sample/cpt.jsonl --kind cpt --seq-len 64

Conventions (see tasks/core/models/demo.py for the demo tokenizer): no bos is added here, the
tokenizer and its chat template decide; CPT documents are joined by eos; SFT labels are the
assistant tokens plus the assistant's end-of-turn token, -100 elsewhere.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tasks.core.config.phases import PHASES
from tasks.core.data.chat_template import render_with_tokenizer
from tasks.core.data.records import read_records, text_problem

if TYPE_CHECKING:  # torch is imported where tensors are made: a tokenizing worker never needs it
    import torch

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # what torch.nn.CrossEntropyLoss (and HF models) skip
ROLES = ("system", "user", "assistant")


# --------------------------------------------------------------------------------------------
# CPT


def pack_cpt(tokenizer, records: Sequence[dict], text_field: str = "text", seq_len: int = 256) -> torch.LongTensor:
    """[N, seq_len] blocks of the concatenated corpus, each document followed by eos.

    Packing (no padding) keeps every token a training token; blocks cross document boundaries
    on purpose, the eos tells the model where a document ended. The tail that does not fill a
    block is dropped.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "the tokenizer has no eos_token: CPT packing needs one to separate documents; set eos_token in "
            "tokenizer_config.json"
        )
    texts = []
    for i, rec in enumerate(records):
        why = text_problem(rec, text_field)
        if why:
            raise ValueError(f"record {i}: {why}")
        texts.append(rec[text_field])
    eos = tokenizer.eos_token_id
    flat: list[int] = []
    # No special tokens inside documents: some tokenizers (Llama) would add a bos per call.
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
        flat.extend(ids)
        flat.append(eos)
    n = len(flat) // seq_len
    if n == 0:
        raise ValueError(f"the corpus has {len(flat)} tokens, fewer than seq_len={seq_len}: add data or lower seq_len")
    import torch

    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


# --------------------------------------------------------------------------------------------
# SFT


def validate_messages(messages: Any) -> None:
    """The SFT record rules, defined once for training and pre-flight: ValueError naming the message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of {{'role', 'content'}} objects, got {type(messages).__name__}"
        )
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {j} must be an object with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"message {j} has role {m['role']!r}; allowed roles are {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {j} ({m['role']}) content must be a string, got {type(m['content']).__name__}")
        if m["role"] == "assistant" and not m["content"].strip():
            raise ValueError(
                f"message {j} (assistant) is empty{' (whitespace only)' if m['content'] else ''}: an empty reply "
                "teaches nothing; write the reply or drop the record"
            )
    if messages[0]["role"] == "assistant":
        raise ValueError("message 0 is an assistant turn; a conversation must open with a system or user message")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(
            "no assistant message: nothing to train on; every SFT record needs at least one assistant turn"
        )


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of the conversation as the chat template renders it: transformers' rendering, under
    a budget of work and output (the template is the model folder's, untrusted: a template that
    cannot render raises ChatTemplateError naming its file, never a ValueError that would only
    reject the record)."""
    text = render_with_tokenizer(tokenizer, messages, add_generation_prompt)
    # The template owns bos and every special token; letting the tokenizer add its own would
    # double them (Llama-3 templates start with {{ bos_token }}).
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def special_token_ids(tokenizer) -> set[int]:
    """Every special token id, the end-of-turn tokens included."""
    ids = set(tokenizer.all_special_ids)
    # Llama-3's <|eot_id|> is an added special token but not in all_special_ids.
    ids.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return ids


_PROBE = [
    {"role": "user", "content": "ping"},
    {"role": "assistant", "content": "pong"},
    {"role": "user", "content": "ping again"},
    {"role": "assistant", "content": "pong again"},
]


def end_of_turn_tokens(tokenizer) -> list[int]:
    """Special token ids the template puts after an assistant reply, in order of appearance: what
    encode_chat labels last in a turn (the SFT end of turn), found by rendering a conversation."""
    special = special_token_ids(tokenizer)
    found: list[int] = []
    for i, m in enumerate(_PROBE):
        if m["role"] != "assistant":
            continue
        prompt = render_chat(tokenizer, _PROBE[:i], add_generation_prompt=True)
        turn = render_chat(tokenizer, _PROBE[: i + 1], add_generation_prompt=False)
        if turn[: len(prompt)] != prompt:
            continue  # not prefix-stable: encode_chat refuses such templates before training
        # The reply's text has no special tokens, and the header is in the generation prompt:
        # every special token in between is the template closing the turn (what encode_chat labels).
        found += [int(t) for t in turn[len(prompt) :] if t in special and int(t) not in found]
    return found


def encode_chat(tokenizer, messages: list[dict], seq_len: int | None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation, truncated to seq_len (None: whole).

    Prefix method, valid for any chat template: for assistant turn i the ids of
    render(messages[:i], add_generation_prompt=True) are a prefix of render(messages[:i+1]);
    the tokens in between are the assistant's reply. Of those, everything up to and including
    the last special token (the end-of-turn, e.g. <|im_end|> or <|eot_id|>) is labelled, so the
    model learns to stop; what follows it (a newline) is template scaffolding and stays -100.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "the tokenizer has no chat_template: SFT needs one to render conversations; add it to tokenizer_config.json"
        )
    validate_messages(messages)
    full = render_chat(tokenizer, messages, add_generation_prompt=False)
    labels = [IGNORE_INDEX] * len(full)
    special = special_token_ids(tokenizer)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        turn = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if turn[: len(prompt)] != prompt or full[: len(turn)] != turn:
            raise ValueError(
                f"the chat template is not prefix-stable at message {i} (assistant): rendering the conversation up to "
                "that "
                "turn with add_generation_prompt=True is not a token prefix of rendering it with the reply (or a "
                "later turn "
                "re-renders earlier ones), so the assistant tokens cannot be located; use a template whose generation "
                "prompt "
                "is exactly the assistant header and that renders past turns unchanged"
            )
        end = len(turn)
        for j in range(len(turn) - 1, len(prompt) - 1, -1):
            if turn[j] in special:
                end = j + 1
                break
        labels[len(prompt) : end] = full[len(prompt) : end]
    return (full, labels) if seq_len is None else (full[:seq_len], labels[:seq_len])


# What a training conversation longer than seq_len becomes (`<phase>.truncation`); the default is the first.
TRUNCATION = ("drop", "cut", "split_turns")


def _unlabel_cut_reply(labels: list[int], full_labels: list[int], seq_len: int) -> list[int]:
    """labels[:seq_len] without the reply the cut goes through: its end is past seq_len, so none of it is
    trained (the model would learn a reply it never sees finish)."""
    out = list(labels)
    if len(full_labels) > seq_len and full_labels[seq_len] != IGNORE_INDEX:
        j = seq_len - 1
        while j >= 0 and out[j] != IGNORE_INDEX:
            out[j] = IGNORE_INDEX
            j -= 1
    return out


def _exchanges(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(leading system messages, the rest cut before each user message that follows a reply)."""
    k = 0
    while k < len(messages) and messages[k]["role"] == "system":
        k += 1
    parts: list[list[dict]] = []
    for m in messages[k:]:
        if not parts or (m["role"] == "user" and any(x["role"] == "assistant" for x in parts[-1])):
            parts.append([])
        parts[-1].append(m)
    return messages[:k], parts


def training_rows(
    tokenizer, messages: list[dict], seq_len: int, truncation: str
) -> tuple[list[tuple[list[int], list[int]]], str, int]:
    """The training rows of one conversation, what became of it and how many of its exchanges were
    left out: 'fits' (one row), or, longer than seq_len, by `truncation`: 'drop' -> no row
    ('dropped'); 'cut' -> its first seq_len tokens, the reply the cut goes through unlabelled ('cut';
    no row when no label is left); 'split_turns' -> rows of whole exchanges (a user turn and what
    follows it up to the next user turn), each with the leading system messages, as many exchanges a
    row as fit ('split'); an exchange with a reply that alone is longer than seq_len is left out, and
    counted (the third value; 0 under the other rules)."""
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation={truncation!r}: use one of {', '.join(TRUNCATION)}")
    ids, labels = encode_chat(tokenizer, messages, None)
    if len(ids) <= seq_len:
        return [(ids, labels)], "fits", 0
    if truncation == "drop":
        return [], "dropped", 0
    if truncation == "cut":
        cut = _unlabel_cut_reply(labels[:seq_len], labels, seq_len)
        return ([(ids[:seq_len], cut)] if any(x != IGNORE_INDEX for x in cut) else []), "cut", 0
    system, parts = _exchanges(messages)
    rows: list[tuple[list[int], list[int]]] = []
    window: list[dict] = []
    best: tuple[list[int], list[int]] | None = None
    left_out = 0
    for part in parts:
        if not any(m["role"] == "assistant" for m in part):
            continue  # a last user turn without a reply: nothing to train
        enc = encode_chat(tokenizer, system + window + part, None)
        if len(enc[0]) <= seq_len:
            window, best = window + part, enc
            continue
        if best is not None:
            rows.append(best)
        enc = encode_chat(tokenizer, system + part, None)
        window, best = (part, enc) if len(enc[0]) <= seq_len else ([], None)
        left_out += best is None
    if best is not None:
        rows.append(best)
    return rows, "split" if rows else "dropped", left_out


def encode_sft_with_stats(
    tokenizer,
    records: Sequence[dict],
    messages_field: str = "messages",
    seq_len: int = 256,
    truncation: str | None = None,
) -> tuple[dict[str, torch.LongTensor], int]:
    """encode_sft, also returning how many records were dropped (no labelled token left, or, with a
    `truncation` rule, left out by it). truncation=None: every record cut to seq_len as it is (evaluation's
    held-out records); a TRUNCATION rule: the rows training gets (`training_rows`), what prepare_data writes."""
    pad = tokenizer.pad_token_id
    if pad is None:
        # Any id works: padded positions are masked out of attention and loss.
        pad = tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither pad_token nor eos_token: set pad_token in tokenizer_config.json")
    rows_ids, rows_labels, lengths, dropped = [], [], [], 0
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or messages_field not in rec:
            raise ValueError(
                f"record {i}: no field {messages_field!r} (fields: {sorted(rec) if isinstance(rec, dict) else type(rec).__name__}); "
                "set data.messages_field to the field holding the chat"
            )
        try:
            rows = (
                [encode_chat(tokenizer, rec[messages_field], seq_len)]
                if truncation is None
                else training_rows(tokenizer, rec[messages_field], seq_len, truncation)[0]
            )
        except ValueError as e:
            raise ValueError(f"record {i}: {e}") from None
        rows = [(ids, labels) for ids, labels in rows if any(x != IGNORE_INDEX for x in labels)]
        if not rows:
            dropped += (
                1  # truncation cut every assistant token (or the rule left it out): it would only add zero-loss padding
            )
            continue
        for ids, labels in rows:
            lengths.append(len(ids))
            rows_ids.append(ids + [pad] * (seq_len - len(ids)))
            rows_labels.append(labels + [IGNORE_INDEX] * (seq_len - len(labels)))
    if dropped:
        log.warning(
            "dropped %d of %d SFT records: no assistant token left within seq_len=%d", dropped, len(records), seq_len
        )
    if not rows_ids:
        raise ValueError(
            f"no SFT record has an assistant token within seq_len={seq_len} ({len(records)} records, {dropped} "
            "dropped): raise seq_len or check the data"
        )
    import torch

    input_ids = torch.tensor(rows_ids, dtype=torch.long)
    attention_mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {
        "input_ids": input_ids,
        "labels": torch.tensor(rows_labels, dtype=torch.long),
        "attention_mask": attention_mask,
    }, dropped


def encode_sft(
    tokenizer,
    records: Sequence[dict],
    messages_field: str = "messages",
    seq_len: int = 256,
    truncation: str | None = None,
) -> dict[str, torch.LongTensor]:
    """{"input_ids", "labels", "attention_mask"}, each [N, seq_len], right-padded with pad_token_id.

    Records whose labels are all -100 after truncation are dropped (the count is logged).
    """
    return encode_sft_with_stats(
        tokenizer, records, messages_field=messages_field, seq_len=seq_len, truncation=truncation
    )[0]


# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(
        prog="python -m tasks.core.data.samples", description="Show how a dataset is tokenized for a stage."
    )
    p.add_argument("--model", required=True, help="HF model dir holding the tokenizer")
    p.add_argument("--uri", required=True, help="dataset: .jsonl, .txt or .parquet")
    p.add_argument("--kind", choices=list(PHASES), required=True)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--field", default=None, help="text_field (cpt) or messages_field (sft)")
    a = p.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(a.model)
    records = read_records(a.uri)
    if PHASES[a.kind].record == "text":
        blocks = pack_cpt(tok, records, text_field=a.field or PHASES[a.kind].default_field, seq_len=a.seq_len)
        print(f"{len(records)} records -> {tuple(blocks.shape)} blocks; first block:\n{tok.decode(blocks[0])!r}")
    else:
        field = a.field or PHASES[a.kind].default_field
        batch, dropped = encode_sft_with_stats(tok, records, messages_field=field, seq_len=a.seq_len)
        ids, labels = batch["input_ids"][0], batch["labels"][0]
        print(f"{len(records)} records -> {tuple(batch['input_ids'].shape)} rows, {dropped} dropped; first row:")
        print(f"  input : {tok.decode(ids[batch['attention_mask'][0].bool()])!r}")
        print(f"  target: {tok.decode(ids[labels != IGNORE_INDEX])!r}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
