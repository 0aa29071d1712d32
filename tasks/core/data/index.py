"""The prepared data's index file, the tokenizer fingerprint it records, and the one check that the
data fits a model: made with the model's tokenizer, every token id inside its vocabulary.

    python -c "from tasks.core.data.index import tokenizer_fingerprint; print(tokenizer_fingerprint('runs/demo/base-model'))"

prepare.py writes `INDEX` last; reader.py (the ranks) and prepared.py (the tasks) read it. The
check runs in the task before any launch (`tasks.core.data.stage_data.check_against_model`) and in
every rank against the model it built (`tasks.engine.loop`), with the same messages.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tasks.core.config.phases import PHASES, Phase

INDEX = "index.json"  # prepare.py writes it last
# Every file a Hugging Face tokenizer may be built from; the fingerprint covers those present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)


class PrepareError(ValueError):
    """The corpus as a whole cannot be trained on (empty, too small, no split possible, no tokenizer)."""


def tokenizer_fingerprint(tokenizer_dir: str | Path) -> str:
    """sha256 over (name, sha256) of the tokenizer's files: equal iff the same tokenizer bytes."""
    d = Path(tokenizer_dir)
    h = hashlib.sha256()
    found = []
    for name in TOKENIZER_FILES:
        p = d / name
        if p.is_file():
            found.append(name)
            h.update(f"{name}\0{hashlib.sha256(p.read_bytes()).hexdigest()}\n".encode())
    if not found:
        raise PrepareError(
            f"{d}: no tokenizer file ({', '.join(TOKENIZER_FILES[:3])}, ...); the model directory must hold its "
            "tokenizer"
        )
    return h.hexdigest()


def check_fits_model(
    index: dict[str, Any],
    data_dir: str | Path,
    model_dir: str | Path,
    phase: Phase,
    *,
    vocab_size: int | None = None,
    fingerprint: bool = True,
) -> None:
    """Refuse shards made with another tokenizer than model_dir's, or holding ids beyond its vocabulary.

    `vocab_size`: the built model's (default: model_dir/config.json's, none there: not checked).
    `fingerprint=False` skips the tokenizer comparison (a rank: the task compared before launching).
    """
    if fingerprint:
        have = tokenizer_fingerprint(model_dir)
        if have != index["tokenizer_sha256"]:
            raise ValueError(
                f"the tokenizer of {model_dir} (sha256 {have}) is not the one {data_dir} was prepared with (sha256 "
                f"{index['tokenizer_sha256']}): "
                f"{phase} would train on token ids the model reads differently; prepare the data again with this "
                "model's tokenizer"
            )
    if vocab_size is None:
        vocab_size = json.loads((Path(model_dir) / "config.json").read_text()).get("vocab_size")
    if vocab_size is not None and index["max_token_id"] >= vocab_size:
        raise ValueError(
            f"token id {index['max_token_id']} in {data_dir} does not fit the vocab_size {vocab_size} of "
            f"{model_dir}/config.json: tokenizer and model do not belong together"
        )


def special_tokens(tok, kind: Phase) -> dict[str, Any]:
    """The special tokens the prepared data was made with (index.json `special_tokens`): what ends a
    CPT document (eos), what pads an SFT row (pad, else eos), bos, and the SFT end of turn (the
    special token(s) the chat template closes an assistant turn with, the last labelled tokens)."""
    from tasks.core.data.samples import end_of_turn_tokens

    def one(i: int | None) -> dict[str, Any] | None:
        return None if i is None else {"id": int(i), "token": tok.convert_ids_to_tokens(int(i))}

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = {
        "eos": one(tok.eos_token_id),
        "bos": one(tok.bos_token_id),
        "pad": one(pad),
        "pad_is": "pad_token" if tok.pad_token_id is not None else "eos_token",
    }
    if PHASES[kind].templated:
        out["end_of_turn"] = [one(i) for i in end_of_turn_tokens(tok)]
    return out
