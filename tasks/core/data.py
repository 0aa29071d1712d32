"""Training data: read records, pack CPT text, render and loss-mask SFT chats, order batches.

Pure functions used by the training loop inside each torchrun rank (no prefect, no colossalai).
To eyeball what a stage will train on:

    python -m tasks.engine.data --model runs/demo/base-model --uri data/sample/sft.jsonl --kind sft --seq-len 64
    python -m tasks.engine.data --model runs/demo/base-model --uri data/sample/cpt.jsonl --kind cpt --seq-len 64

Conventions (see tasks/core/demo_inputs.py for the demo tokenizer): no bos is added here, the
tokenizer and its chat template decide; CPT documents are joined by eos; SFT labels are the
assistant tokens plus the assistant's end-of-turn token, -100 elsewhere.
"""

from __future__ import annotations

from typing import Iterator

import argparse
import hashlib
import json
import logging
from collections.abc import Sequence
from typing import Any

import fsspec
import torch

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # what torch.nn.CrossEntropyLoss (and HF models) skip
ROLES = ("system", "user", "assistant")
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
FORMATS = (".jsonl", ".txt", ".parquet")


# --------------------------------------------------------------------------------------------
# Reading


def _format_of(uri: str) -> str:
    name = uri.rsplit("/", 1)[-1].lower()
    for comp in _COMPRESSIONS:
        if name.endswith(comp):
            name = name[: -len(comp)]
    for fmt in FORMATS:
        if name.endswith(fmt):
            return fmt
    raise ValueError(f"data uri {uri!r}: unknown format; use one of {', '.join(FORMATS)} (optionally compressed {', '.join(_COMPRESSIONS)})")


def read_records(uri: str) -> list[dict]:
    """All records of a .jsonl, .txt (one {"text": line} per non-empty line) or .parquet file.

    fsspec, so `s3://...` works like a local path. Deliberately not `datasets`: its cache and
    fingerprinting would race between ranks and pull in a large dependency for a list of dicts.
    """
    fmt = _format_of(uri)
    if fmt == ".parquet":
        import pyarrow.parquet as pq  # only parquet users pay for the import

        with fsspec.open(uri, "rb") as f:
            return pq.read_table(f).to_pylist()

    return [rec for _, rec in iter_text_records(uri, fmt)]


def iter_text_records(uri: str, fmt: str | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, record) of a .jsonl or .txt file, streamed: pre-flight reads only a head."""
    fmt = fmt or _format_of(uri)
    with fsspec.open(uri, "rt", encoding="utf-8", compression="infer") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            if fmt == ".txt":
                yield lineno, {"text": line}
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{uri}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); every line must be one JSON object") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{uri}:{lineno}: expected a JSON object per line, got {type(rec).__name__}")
            yield lineno, rec


# --------------------------------------------------------------------------------------------
# CPT


def pack_cpt(tokenizer, records: Sequence[dict], text_field: str = "text", seq_len: int = 256) -> torch.LongTensor:
    """[N, seq_len] blocks of the concatenated corpus, each document followed by eos.

    Packing (no padding) keeps every token a training token; blocks cross document boundaries
    on purpose, the eos tells the model where a document ended. The tail that does not fill a
    block is dropped.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token: CPT packing needs one to separate documents; set eos_token in tokenizer_config.json")
    texts = []
    for i, rec in enumerate(records):
        text = rec.get(text_field) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"record {i}: no string field {text_field!r} (fields: {sorted(rec) if isinstance(rec, dict) else type(rec).__name__}); set data.text_field to the field holding the text")
        texts.append(text)
    eos = tokenizer.eos_token_id
    flat: list[int] = []
    # No special tokens inside documents: some tokenizers (Llama) would add a bos per call.
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
        flat.extend(ids)
        flat.append(eos)
    n = len(flat) // seq_len
    if n == 0:
        raise ValueError(f"the corpus has {len(flat)} tokens, fewer than seq_len={seq_len}: add data or lower seq_len")
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


# --------------------------------------------------------------------------------------------
# SFT


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} objects, got {type(messages).__name__}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {j} must be an object with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"message {j} has role {m['role']!r}; allowed roles are {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {j} ({m['role']}) content must be a string, got {type(m['content']).__name__}")
    if messages[0]["role"] == "assistant":
        raise ValueError("message 0 is an assistant turn; a conversation must open with a system or user message")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message: nothing to train on; every SFT record needs at least one assistant turn")


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    # The template owns bos and every special token; letting the tokenizer add its own would
    # double them (Llama-3 templates start with {{ bos_token }}).
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    # Llama-3's <|eot_id|> is an added special token but not in all_special_ids.
    ids.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return ids


def encode_chat(tokenizer, messages: list[dict], seq_len: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation, truncated to seq_len.

    Prefix method, valid for any chat template: for assistant turn i the ids of
    render(messages[:i], add_generation_prompt=True) are a prefix of render(messages[:i+1]);
    the tokens in between are the assistant's reply. Of those, everything up to and including
    the last special token (the end-of-turn, e.g. <|im_end|> or <|eot_id|>) is labelled, so the
    model learns to stop; what follows it (a newline) is template scaffolding and stays -100.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat_template: SFT needs one to render conversations; add it to tokenizer_config.json")
    _validate_messages(messages)
    full = _render(tokenizer, messages, add_generation_prompt=False)
    labels = [IGNORE_INDEX] * len(full)
    special = _special_ids(tokenizer)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
        turn = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if turn[: len(prompt)] != prompt or full[: len(turn)] != turn:
            raise ValueError(
                f"the chat template is not prefix-stable at message {i} (assistant): rendering the conversation up to that "
                "turn with add_generation_prompt=True is not a token prefix of rendering it with the reply (or a later turn "
                "re-renders earlier ones), so the assistant tokens cannot be located; use a template whose generation prompt "
                "is exactly the assistant header and that renders past turns unchanged"
            )
        end = len(turn)
        for j in range(len(turn) - 1, len(prompt) - 1, -1):
            if turn[j] in special:
                end = j + 1
                break
        labels[len(prompt) : end] = full[len(prompt) : end]
    return full[:seq_len], labels[:seq_len]


def encode_sft_with_stats(
    tokenizer, records: Sequence[dict], messages_field: str = "messages", seq_len: int = 256
) -> tuple[dict[str, torch.LongTensor], int]:
    """encode_sft, also returning how many records were dropped (no labelled token left)."""
    pad = tokenizer.pad_token_id
    if pad is None:
        # Any id works: padded positions are masked out of attention and loss.
        pad = tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither pad_token nor eos_token: set pad_token in tokenizer_config.json")
    rows_ids, rows_labels, lengths, dropped = [], [], [], 0
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or messages_field not in rec:
            raise ValueError(f"record {i}: no field {messages_field!r} (fields: {sorted(rec) if isinstance(rec, dict) else type(rec).__name__}); set data.messages_field to the field holding the chat")
        try:
            ids, labels = encode_chat(tokenizer, rec[messages_field], seq_len)
        except ValueError as e:
            raise ValueError(f"record {i}: {e}") from None
        if all(x == IGNORE_INDEX for x in labels):
            dropped += 1  # truncation cut every assistant token: it would only add zero-loss padding
            continue
        lengths.append(len(ids))
        rows_ids.append(ids + [pad] * (seq_len - len(ids)))
        rows_labels.append(labels + [IGNORE_INDEX] * (seq_len - len(labels)))
    if dropped:
        log.warning("dropped %d of %d SFT records: no assistant token left within seq_len=%d", dropped, len(records), seq_len)
    if not rows_ids:
        raise ValueError(f"no SFT record has an assistant token within seq_len={seq_len} ({len(records)} records, {dropped} dropped): raise seq_len or check the data")
    input_ids = torch.tensor(rows_ids, dtype=torch.long)
    attention_mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": input_ids, "labels": torch.tensor(rows_labels, dtype=torch.long), "attention_mask": attention_mask}, dropped


def encode_sft(tokenizer, records: Sequence[dict], messages_field: str = "messages", seq_len: int = 256) -> dict[str, torch.LongTensor]:
    """{"input_ids", "labels", "attention_mask"}, each [N, seq_len], right-padded with pad_token_id.

    Records whose labels are all -100 after truncation are dropped (the count is logged).
    """
    return encode_sft_with_stats(tokenizer, records, messages_field=messages_field, seq_len=seq_len)[0]


# --------------------------------------------------------------------------------------------
# Order


def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash, not seed + epoch: (seed=1, epoch=0) and (seed=0, epoch=1) must not collide.
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


class ResumableSampler:
    """Deterministic, resumable order of item indices, the same global stream on every rank.

    Epoch e is torch.randperm(num_items) under a generator seeded from (seed, e). Each optimizer
    step takes the next `global_batch` indices of that stream (continuing into epoch e+1 when e
    runs out) and each dp rank keeps its contiguous slice. The state is a position in the global
    stream, independent of dp_rank/dp_size, so a restore continues bitwise-identically.
    """

    def __init__(self, num_items: int, dp_rank: int, dp_size: int, seed: int):
        if num_items < 1:
            raise ValueError(f"num_items={num_items}: the dataset is empty")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.num_items, self.dp_rank, self.dp_size, self.seed = num_items, dp_rank, dp_size, seed
        self.epoch, self.offset = 0, 0
        self._perm: list[int] | None = None
        self._perm_key: tuple[int, int] | None = None

    def _permutation(self) -> list[int]:
        key = (self.seed, self.epoch)
        if self._perm_key != key:
            g = torch.Generator().manual_seed(_epoch_seed(*key))
            self._perm, self._perm_key = torch.randperm(self.num_items, generator=g).tolist(), key
        return self._perm

    def next_global(self, n_global: int) -> list[int]:
        """The next n_global indices of the global stream (all ranks' shares, in rank order)."""
        out: list[int] = []
        while len(out) < n_global:
            perm = self._permutation()
            take = min(n_global - len(out), self.num_items - self.offset)
            out += perm[self.offset : self.offset + take]
            self.offset += take
            if self.offset == self.num_items:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def next_indices(self, n_global: int) -> list[int]:
        """This rank's share of the next global batch of n_global items."""
        if n_global < 1 or n_global % self.dp_size:
            raise ValueError(f"global batch {n_global} must be a positive multiple of dp_size={self.dp_size} (micro_batch_size * grad_accum_steps * dp_size)")
        per = n_global // self.dp_size
        return self.next_global(n_global)[self.dp_rank * per : (self.dp_rank + 1) * per]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed}

    def load_state_dict(self, d: dict[str, int]) -> None:
        missing = {"epoch", "offset", "seed"} - set(d)
        if missing:
            raise ValueError(f"sampler state is missing {sorted(missing)}; it must come from ResumableSampler.state_dict()")
        if not 0 <= d["offset"] < self.num_items or d["epoch"] < 0:
            raise ValueError(f"sampler state {d} does not fit a dataset of {self.num_items} items: was the data changed since the checkpoint?")
        if d["seed"] != self.seed:
            # The checkpoint is the truth about data order: resuming must replay the interrupted run.
            log.warning("sampler seed %d from the checkpoint replaces the configured %d", d["seed"], self.seed)
        self.epoch, self.offset, self.seed = int(d["epoch"]), int(d["offset"]), int(d["seed"])


# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(prog="python -m tasks.engine.data", description="Show how a dataset is tokenized for a stage.")
    p.add_argument("--model", required=True, help="HF model dir holding the tokenizer")
    p.add_argument("--uri", required=True, help="dataset: .jsonl, .txt or .parquet")
    p.add_argument("--kind", choices=["cpt", "sft"], required=True)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--field", default=None, help="text_field (cpt) or messages_field (sft)")
    a = p.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(a.model)
    records = read_records(a.uri)
    if a.kind == "cpt":
        blocks = pack_cpt(tok, records, text_field=a.field or "text", seq_len=a.seq_len)
        print(f"{len(records)} records -> {tuple(blocks.shape)} blocks; first block:\n{tok.decode(blocks[0])!r}")
    else:
        batch, dropped = encode_sft_with_stats(tok, records, messages_field=a.field or "messages", seq_len=a.seq_len)
        ids, labels = batch["input_ids"][0], batch["labels"][0]
        print(f"{len(records)} records -> {tuple(batch['input_ids'].shape)} rows, {dropped} dropped; first row:")
        print(f"  input : {tok.decode(ids[batch['attention_mask'][0].bool()])!r}")
        print(f"  target: {tok.decode(ids[labels != IGNORE_INDEX])!r}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
