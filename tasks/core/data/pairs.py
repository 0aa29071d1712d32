"""Preference pairs: the layouts users already have, read into one form, checked, and encoded for DPO.

    python -m tasks.core.data.pairs --model build/demo-inputs/tiny-llama --uri data/sample/dpo.jsonl --seq-len 128

A pair is a prompt (chat messages that do not end with an assistant turn) and two endings, the chosen and
the rejected reply (assistant messages). `read_pair` accepts, field names configurable (`dpo.data.*_field`):
  - strings:          {"prompt": "...", "chosen": "...", "rejected": "..."}   (the prompt is one user turn)
  - message lists:    {"prompt": [{role, content}, ...], "chosen": [{"role": "assistant", ...}], "rejected": [...]}
                      (a reply list that repeats the prompt first, as UltraFeedback's does, is read after it)
  - two endings:      {"messages": [...the shared conversation...], "chosen": ..., "rejected": ...}
  - whole dialogues:  {"chosen": [...conversation...], "rejected": [...conversation...]}, no prompt: the
                      messages both share up to the last turn that is not the assistant's are the prompt.
A bad pair (a missing field, an empty reply, identical replies, a prompt ending with an assistant turn)
is a ValueError naming the field and the fix, which the shard frame turns into a bad record named by
file and line (`tasks.core.data.shard.tokenize_records`).

`encode_reply` renders prompt + reply with the model's chat template and labels the reply's assistant
tokens only (SFT's prefix method, `samples.encode_chat`; -100 elsewhere, the prompt's earlier assistant
turns included). `PairEncoder` writes one pair as two consecutive rows of a shard, chosen then rejected;
a pair longer than seq_len is dropped and counted as SFT's over-long chats are under `truncation: drop`,
and the first ones are named by file and line in the shard summary and index.json (`over_seq_len_at`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.core.data.samples import IGNORE_INDEX, ROLES, encode_chat, render_chat
from tasks.core.data.shard import KEEP_BAD, ShardSpec, load_tokenizer
from tasks.core.data.truncation import SFT_KEYS

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class PairFields:
    """The record fields a pair is read from (dpo.data.prompt_field, chosen_field, rejected_field, messages_field)."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    messages: str = "messages"

    @classmethod
    def parse(cls, joined: str) -> PairFields:
        """From the shard spec's one `field` string (PreferenceData.pair_fields: the four names, comma-joined)."""
        parts = joined.split(",")
        if len(parts) != 4 or not all(parts):
            raise ValueError(
                f"field={joined!r}: a preference phase's field is 'prompt,chosen,rejected,messages' (its four field "
                "names, comma-joined)"
            )
        return cls(*parts)


@dataclass(frozen=True)
class Pair:
    prompt: Messages
    chosen: Messages  # assistant messages, usually one
    rejected: Messages


def _messages(value: Any, field: str) -> Messages:
    """A list of {role, content} messages with known roles and string contents, or a ValueError naming `field`."""
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"field {field!r} must be a string or a non-empty list of {{'role', 'content'}} messages, got "
            f"{type(value).__name__ if value != [] else 'an empty list'}"
        )
    for j, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"field {field!r}: message {j} must be an object with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(
                f"field {field!r}: message {j} has role {m['role']!r}; allowed roles are {', '.join(ROLES)}"
            )
        if not isinstance(m["content"], str):
            raise ValueError(
                f"field {field!r}: message {j} ({m['role']}) content must be a string, got {type(m['content']).__name__}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _prompt(value: Any, field: str) -> Messages:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"field {field!r} is empty: no prompt to answer; write the prompt or drop the pair")
        return [{"role": "user", "content": value}]
    msgs = _messages(value, field)
    if msgs[0]["role"] == "assistant":
        raise ValueError(
            f"field {field!r}: message 0 is an assistant turn; a prompt opens with a system or user message"
        )
    if msgs[-1]["role"] == "assistant":
        raise ValueError(
            f"field {field!r}: the prompt ends with an assistant turn (message {len(msgs) - 1}), so the two replies "
            "would follow a reply; end the prompt with the user turn they answer (move that turn to the replies or "
            "drop it)"
        )
    return msgs


def _reply(value: Any, field: str, side: str, prompt: Messages | None) -> Messages:
    """One ending: a string, a message or a list of assistant messages (after the prompt, where it repeats it)."""
    if isinstance(value, str):
        msgs = [{"role": "assistant", "content": value}]
    else:
        msgs = _messages([value] if isinstance(value, dict) else value, field)
        if prompt is not None and len(msgs) > len(prompt) and msgs[: len(prompt)] == prompt:
            msgs = msgs[len(prompt) :]
    for j, m in enumerate(msgs):
        if m["role"] != "assistant":
            raise ValueError(
                f"field {field!r}: message {j} is a {m['role']} turn; the {side} reply holds assistant messages only "
                "(the conversation before it goes in the prompt)"
            )
        if not m["content"].strip():
            raise ValueError(
                f"field {field!r}: the {side} reply is empty{' (whitespace only)' if m['content'] else ''}: an empty "
                "reply teaches nothing; write the reply or drop the pair"
            )
    return msgs


def _split_dialogues(chosen: Any, rejected: Any, f: PairFields) -> tuple[Messages, Messages, Messages]:
    """Two whole conversations, no prompt field: the prompt is what they share up to its last non-assistant turn."""
    c, r = _messages(chosen, f.chosen), _messages(rejected, f.rejected)
    k = 0
    while k < min(len(c), len(r)) and c[k] == r[k]:
        k += 1
    while k and c[k - 1]["role"] == "assistant":
        k -= 1
    if k == 0:
        raise ValueError(
            f"no field {f.prompt!r} or {f.messages!r}, and {f.chosen!r} and {f.rejected!r} share no opening turn to "
            f"read the prompt from; give the prompt in {f.prompt!r} (or name its field: dpo.data.prompt_field)"
        )
    return c[:k], c[k:], r[k:]


def read_pair(rec: dict[str, Any], f: PairFields = PairFields()) -> Pair:
    """The pair a record holds, in any accepted layout; a ValueError naming the field and the fix."""
    for name, setting, what in ((f.chosen, "chosen_field", "preferred"), (f.rejected, "rejected_field", "rejected")):
        if rec.get(name) is None:
            raise ValueError(
                f"no field {name!r} (fields: {sorted(rec)}); set dpo.data.{setting} to the field holding the {what} "
                "reply"
            )
    if rec.get(f.prompt) is not None:
        prompt = _prompt(rec[f.prompt], f.prompt)
    elif rec.get(f.messages) is not None:
        prompt = _prompt(rec[f.messages], f.messages)
    elif isinstance(rec[f.chosen], str) or isinstance(rec[f.rejected], str):
        raise ValueError(
            f"no field {f.prompt!r} or {f.messages!r} (fields: {sorted(rec)}): the replies answer no prompt; set "
            "dpo.data.prompt_field (or messages_field) to the field holding it"
        )
    else:
        prompt, chosen, rejected = _split_dialogues(rec[f.chosen], rec[f.rejected], f)
        pair = Pair(prompt, _reply(chosen, f.chosen, "chosen", None), _reply(rejected, f.rejected, "rejected", None))
        return _distinct(pair, f)
    pair = Pair(
        prompt,
        _reply(rec[f.chosen], f.chosen, "chosen", prompt),
        _reply(rec[f.rejected], f.rejected, "rejected", prompt),
    )
    return _distinct(pair, f)


def _distinct(pair: Pair, f: PairFields) -> Pair:
    if pair.chosen == pair.rejected:
        raise ValueError(
            f"fields {f.chosen!r} and {f.rejected!r} hold the same reply: the pair prefers nothing; fix the pair or "
            "drop it"
        )
    return pair


def encode_reply(tokenizer, prompt: Messages, reply: Messages) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of prompt + reply as the chat template renders it, labels on the reply's assistant
    tokens and end of turn only (the prompt, its own assistant turns included, is -100)."""
    ids, labels = encode_chat(tokenizer, prompt + reply, None)  # validates, and proves the template prefix-stable
    start = len(render_chat(tokenizer, prompt, add_generation_prompt=True))
    return ids, [IGNORE_INDEX] * start + labels[start:]


def _mask(labels: list[int]) -> list[int]:
    return [int(y != IGNORE_INDEX) for y in labels]


class PairEncoder:
    """A preference pair a record (`read_pair`): two rows of the shard, chosen then rejected, each masked to
    its reply. A pair longer than seq_len (either sequence) is dropped, counted as SFT counts a dropped chat
    and named by file and line; cutting would cut the very reply the pair scores (the config refuses `cut`)."""

    masked = True

    def __init__(self, spec: ShardSpec, tokenizer_dir: str, out_dir: Path, counts: dict[str, int]):
        self.spec, self.counts = spec, counts
        self.fields = PairFields.parse(spec.field)
        self.tok = load_tokenizer(tokenizer_dir)
        if getattr(self.tok, "chat_template", None) is None:
            raise ValueError(
                "the tokenizer has no chat_template: DPO needs one to render the pairs; add it to tokenizer_config.json"
            )
        self.sides: dict[str, Any] = {}
        self.over = dict.fromkeys(SFT_KEYS, 0)
        self.over_at: list[str] = []  # the first pairs longer than seq_len, by file and line
        self.where = ""  # set by the shard frame before each `add`: the record's file and line

    def value(self, rec: dict[str, Any]) -> dict[str, Any]:
        return rec  # a pair is read from several fields

    def problem(self, rec: dict[str, Any], value: Any) -> str | None:
        return None  # read_pair's refusals come from `encode`, as ValueErrors the frame names by file and line

    def encode(self, value: dict[str, Any]) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
        pair = read_pair(value, self.fields)
        return encode_reply(self.tok, pair.prompt, pair.chosen), encode_reply(self.tok, pair.prompt, pair.rejected)

    def add(self, side: str, value: Any, encoded: Any) -> None:
        (c_ids, c_lab), (r_ids, r_lab) = encoded
        n = self.spec.seq_len
        if side == "heldout":  # evaluated as the records are, cut to seq_len
            self.sides[side].add([c_ids[:n], r_ids[:n]], [_mask(c_lab[:n]), _mask(r_lab[:n])])
            return
        if max(len(c_ids), len(r_ids)) > n:  # dropped, as SFT's default drops a long chat (config: truncation drop)
            self.over["over_seq_len"] += 1
            self.over["dropped"] += 1
            if len(self.over_at) < KEEP_BAD:
                self.over_at.append(f"{self.where} ({max(len(c_ids), len(r_ids))} tokens)")
            return
        self.sides[side].add([c_ids, r_ids], [_mask(c_lab), _mask(r_lab)])

    def finish(self) -> None:
        pass

    def extra(self) -> dict[str, Any]:
        return {"truncation": self.over, **({"over_seq_len_at": self.over_at} if self.over_at else {})}


def pair_rows(pairs: list[int] | np.ndarray) -> list[int]:
    """The dataset rows of `pairs` (pair i is rows 2i, 2i+1): every chosen row, then every rejected row, so
    a model's forward over the batch gives the chosen sequences' outputs first (tasks.core.models.preference)."""
    idx = [int(i) for i in pairs]
    return [2 * i for i in idx] + [2 * i + 1 for i in idx]


def main(argv: list[str] | None = None) -> None:
    from tasks.core.data.records import read_records

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a model folder with a tokenizer and a chat template")
    p.add_argument("--uri", required=True, help="a preference JSONL file")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--fields", default="prompt,chosen,rejected,messages")
    p.add_argument("-n", type=int, default=3, help="pairs to show")
    a = p.parse_args(argv)
    tok, fields = load_tokenizer(a.model), PairFields.parse(a.fields)
    for i, rec in enumerate(read_records(a.uri)[: a.n]):
        pair = read_pair(rec, fields)
        for side, reply in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            ids, labels = encode_reply(tok, pair.prompt, reply)
            shown = tok.decode([t for t, y in zip(ids, labels) if y != IGNORE_INDEX])
            print(f"pair {i} {side}: {len(ids)} tokens, {sum(y != IGNORE_INDEX for y in labels)} labelled: {shown!r}")


if __name__ == "__main__":
    main()
