"""Stop tokens of an export: the base model's eos plus the chat template's end-of-turn token(s).

    python -m tasks.core.models.stop_tokens MODEL_DIR     # what an export of MODEL_DIR would get

A base whose `eos_token_id` is `</s>` or `<|endoftext|>`, fine-tuned with a ChatML-style template,
learns to end a reply with `<|im_end|>`; if generation does not stop there it never stops. The
end-of-turn tokens are found from the template itself, the way `tasks.core.data.samples.encode_chat`
labels them: render a conversation, take each assistant turn's tokens between the generation
prompt and the end of the turn, and keep the special tokens among them (the reply's text has none). No table of
token names is involved, so any template works. The gate's generation check
(`tasks.core.evaluation.generation.generation_check`) stays an independent check of the result.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tasks.core.data.samples import end_of_turn_tokens

__all__ = ["WHY", "align_generation_config", "describe", "end_of_turn_tokens", "eos_ids"]

WHY = (
    "the chat template closes an assistant turn with it (found by rendering a conversation with the template), "
    "and SFT trained the model to emit it at the end of every reply, so generation must stop there"
)


def eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def align_generation_config(
    gen: dict[str, Any] | None, model_config: dict[str, Any], tokenizer, align: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(generation config to write, record for the log and verification.json).

    eos_token_id becomes [base eos..., end-of-turn tokens not already there]; pad_token_id is
    the tokenizer's when it has one. With `align` false nothing changes and the record says
    what would have been added.
    """
    gen = (
        dict(gen)
        if gen
        else {k: model_config[k] for k in ("bos_token_id", "eos_token_id") if model_config.get(k) is not None}
    )
    base = (
        eos_ids(gen.get("eos_token_id")) or eos_ids(model_config.get("eos_token_id")) or eos_ids(tokenizer.eos_token_id)
    )
    eot = end_of_turn_tokens(tokenizer)
    added = [{"id": i, "token": tokenizer.convert_ids_to_tokens(i), "why": WHY} for i in eot if i not in base]
    record: dict[str, Any] = {
        "aligned": align,
        "base_eos_token_id": base,
        "end_of_turn": [{"id": i, "token": tokenizer.convert_ids_to_tokens(i)} for i in eot],
    }
    if not align:
        record.update(
            eos_token_id=eos_ids(gen.get("eos_token_id")),
            would_add=added,
            added=[],
            pad_token_id=gen.get("pad_token_id"),
        )
        return gen, record
    gen["eos_token_id"] = base + [a["id"] for a in added]
    pad = tokenizer.pad_token_id
    if pad is not None:
        gen["pad_token_id"] = int(pad)
    record.update(eos_token_id=gen["eos_token_id"], added=added, pad_token_id=gen.get("pad_token_id"))
    return gen, record


def describe(record: dict[str, Any]) -> str:
    """One line for the export log."""
    if not record["aligned"]:
        would = ", ".join(f"{a['token']} ({a['id']})" for a in record["would_add"]) or "nothing"
        return (
            f"stop tokens left as the base model's eos_token_id {record['eos_token_id']} "
            f"(export.align_stop_tokens: false); aligning would add {would}"
        )
    if not record["added"]:
        return (
            f"stop tokens: eos_token_id {record['eos_token_id']} already holds the chat template's end-of-turn "
            f"token(s); pad_token_id {record['pad_token_id']}"
        )
    added = ", ".join(f"{a['token']} ({a['id']})" for a in record["added"])
    return (
        f"stop tokens: eos_token_id {record['base_eos_token_id']} -> {record['eos_token_id']}, added {added}: "
        f"{WHY}; pad_token_id {record['pad_token_id']}"
    )


def main(argv: list[str] | None = None) -> int:
    from pathlib import Path

    from transformers import AutoTokenizer

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tasks.core.models.stop_tokens MODEL_DIR", file=sys.stderr)
        return 2
    root = Path(args[0])
    gen_path = root / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    _, record = align_generation_config(
        gen, json.loads((root / "config.json").read_text()), AutoTokenizer.from_pretrained(root)
    )
    print(describe(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
