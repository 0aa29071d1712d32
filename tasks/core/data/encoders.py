"""One encoder per record kind: what `shard.tokenize_records` does with a record of that kind.

    python -c "from tasks.core.data.encoders import ChatEncoder; print(ChatEncoder.masked)"

A phase's row (`tasks.core.config.phases.PhaseSpec.encoder`) names its encoder class; the shared frame in
shard.py (cache check, bad records, the record id and held-out split, the summary written last) calls:
  value(rec)           what of the record it reads: its phase's field (a pair encoder: the record)
  problem(rec, value)  why the record is unusable (rejected as a bad record), or None
  encode(value)        what `add` needs of it; a ValueError rejects the record
  add(side, value, encoded)   append it to side "train" or "heldout"
  finish()             flush what is pending; `extra()`: the kind's own summary fields
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.core.data.records import text_problem
from tasks.core.data.samples import IGNORE_INDEX, encode_chat, training_rows
from tasks.core.data.shard import ShardSpec, Side, fast_backend, frozen_or_loaded, load_tokenizer
from tasks.core.data.truncation import SFT_KEYS

_BATCH_CHARS = 1 << 20  # texts are batch-encoded ~1 MB at a time: the tokenizer's fast path


class TextEncoder:
    """A document a record: its tokens then eos, appended to the side's stream (CPT packing into
    seq_len blocks is arithmetic over that stream, done by the reader)."""

    masked = False  # every token is a label

    def __init__(self, spec: ShardSpec, tokenizer_dir: str, out_dir: Path, counts: dict[str, int]):
        self.spec = spec
        self.tok = frozen_or_loaded(tokenizer_dir, out_dir, spec.tokenizer_sha256)
        if self.tok.eos_token_id is None:
            raise ValueError(
                "the tokenizer has no eos_token: CPT packing needs one to separate documents; set eos_token in "
                "tokenizer_config.json"
            )
        # The fast tokenizer's backend gives the ids tok(texts, add_special_tokens=False) gives (that
        # call is this encode_batch plus a per-text conversion to Python dicts, ~10 % of the time)
        # unless tokenizer.json configures truncation or padding, which tok() would switch off.
        self.backend = fast_backend(self.tok)
        self.sides: dict[str, Side] = {}
        self.pending: dict[str, list[str]] = {"train": [], "heldout": []}
        self.pending_chars = 0

    def value(self, rec: dict) -> Any:
        return rec.get(self.spec.field)

    def problem(self, rec: dict, value: Any) -> str | None:
        field = self.spec.field
        if not isinstance(value, str):
            return text_problem(rec, field, record_fix=False)
        if not value.strip():
            return (
                f"field {field!r} is empty{' (whitespace only)' if value else ''}: no text to train on; "
                "fill it or drop the record"
            )
        return None

    def encode(self, value: str) -> str:
        return value  # batch-encoded in `flush`

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if self.backend is not None:
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def flush(self) -> None:
        for name, texts in self.pending.items():
            if texts:
                self.sides[name].add(self._encode(texts), eos=self.tok.eos_token_id)
                texts.clear()
        self.pending_chars = 0

    def add(self, side: str, value: str, encoded: str) -> None:
        self.pending[side].append(value)
        self.pending_chars += len(value)
        if self.pending_chars >= _BATCH_CHARS:
            self.flush()

    def finish(self) -> None:
        self.flush()

    def extra(self) -> dict[str, Any]:
        return {}


class ChatEncoder:
    """A conversation a record: rendered by the chat template, labels on assistant tokens only; a
    training chat longer than seq_len becomes what `spec.truncation` says (samples.training_rows)."""

    masked = True  # one bit per token: a label or not

    def __init__(self, spec: ShardSpec, tokenizer_dir: str, out_dir: Path, counts: dict[str, int]):
        self.spec, self.counts = spec, counts
        self.tok = load_tokenizer(tokenizer_dir)
        if getattr(self.tok, "chat_template", None) is None:
            raise ValueError(
                "the tokenizer has no chat_template: SFT needs one to render conversations; add it to "
                "tokenizer_config.json"
            )
        self.sides: dict[str, Side] = {}
        # training chats longer than seq_len, by what spec.truncation made of them (`truncation_counts`)
        self.over = dict.fromkeys(SFT_KEYS, 0)

    def value(self, rec: dict) -> Any:
        return rec.get(self.spec.field)

    def problem(self, rec: dict, value: Any) -> str | None:
        if value is None:
            return (
                f"no field {self.spec.field!r} (fields: {sorted(rec)}); set data.messages_field to the field "
                "holding the chat"
            )
        return None

    def encode(self, value: Any) -> tuple[list[int], list[int]]:
        return encode_chat(self.tok, value, None)  # whole: the held-out side and the truncation rule cut it

    def add(self, side: str, value: Any, encoded: tuple[list[int], list[int]]) -> None:
        ids, labels = encoded
        seq_len = self.spec.seq_len
        if side == "heldout":  # evaluated as the records are, cut to seq_len
            self.sides[side].add([ids[:seq_len]], [[int(y != IGNORE_INDEX) for y in labels[:seq_len]]])
            return
        rows, fate, left_out = (
            training_rows(self.tok, value, seq_len, self.spec.truncation)
            if len(ids) > seq_len
            else ([(ids, labels)], "fits", 0)
        )
        if fate != "fits":
            self.over["over_seq_len"] += 1
            self.over[fate] += 1
            self.over["split_rows"] += len(rows) if fate == "split" else 0
            self.over["exchanges_left_out"] += left_out
        masks = [[int(y != IGNORE_INDEX) for y in lab] for _, lab in rows]
        kept = [(r[0], m) for r, m in zip(rows, masks) if any(m)]
        if not kept:
            if fate != "dropped":
                self.counts["dropped_no_labels"] += 1  # encode_sft's rule: truncation left no assistant token
            return
        self.sides[side].add([r for r, _ in kept], [m for _, m in kept])

    def finish(self) -> None:
        pass

    def extra(self) -> dict[str, Any]:
        return {"truncation": self.over}
