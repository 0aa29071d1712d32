"""Tiny, deterministic demo inputs: a BPE tokenizer trained on the sample data and a random model.

    python -m tasks.core.models.demo --out runs/demo/base-model
    python -m tasks.core.models.demo --out /tmp/qwen --family qwen2 --tie-word-embeddings --model-vocab-size 515
    python -m tasks.core.models.demo --out /tmp/olmo2 --family olmo2   # a model_type with no row (derived)

Nothing is downloaded: the tokenizer is trained here on `data/sample/*.jsonl` in well under a
second, and the weights are a seeded random init. The result is an ordinary HF model directory
(config.json, model.safetensors, generation_config.json, tokenizer files with a ChatML chat
template) that every stage of the flow accepts as a "base model".

Token conventions, shared with `tasks/core/data/samples.py`:
- specials get the first ids, in SPECIAL_TOKENS order: <|begin_of_text|>=0, <|end_of_text|>=1,
  <|pad|>=2, <|im_start|>=3, <|im_end|>=4;
- bos is never prepended: the tokenizer has no post-processor and the chat template emits no
  bos, so `tokenizer(text)` and `apply_chat_template` give the same ids whatever
  `add_special_tokens` says; CPT documents are separated by eos only (like Qwen2);
- an assistant turn ends with <|im_end|>, which is therefore an eos id for generation.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from tasks.core.models.families import FAMILIES

BOS, EOS, PAD, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

SAMPLE_DIR = Path(__file__).resolve().parents[3] / "data" / "sample"
DEFAULT_CORPUS = [SAMPLE_DIR / "cpt.jsonl", SAMPLE_DIR / "sft.jsonl"]

# ChatML. The generation prompt is exactly the header that precedes an assistant's content, so
# render(messages[:i], add_generation_prompt=True) is a prefix of render(messages[:i+1]):
# data.encode_chat relies on that to find the assistant tokens.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _corpus_texts(paths: Sequence[str | Path]) -> Iterator[str]:
    """Texts of the corpus files: `text` of CPT records, every message `content` of SFT records,
    each line of a .txt file. Local files only (demo inputs are built from files in the repo)."""
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path} does not exist; pass --corpus with existing .jsonl/.txt files")
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                if path.suffix == ".txt":
                    yield line
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove the line") from None
                if isinstance(rec.get("text"), str):
                    yield rec["text"]
                for m in rec.get("messages") or []:
                    if isinstance(m, dict) and isinstance(m.get("content"), str):
                        yield m["content"]


def build_tokenizer(corpus_paths: Iterable[str | Path] | None = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the corpus, with exactly `vocab_size` tokens including specials.

    Deterministic: the same files give the same tokenizer.json bytes (the BPE trainer breaks
    count ties by pair, and the corpus is read in file order).
    """
    paths = list(corpus_paths) if corpus_paths is not None else list(DEFAULT_CORPUS)
    min_size = 256 + len(SPECIAL_TOKENS)  # byte alphabet + specials
    if vocab_size <= min_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: byte-level BPE needs more than {min_size} (256 bytes + "
            f"{len(SPECIAL_TOKENS)} specials)"
        )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0..4, and registered as added (unsplittable) tokens
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, even unseen ones
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_texts(paths), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the corpus {[str(p) for p in paths]} only supports {tok.get_vocab_size()} BPE tokens, "
            f"not vocab_size={vocab_size}; lower --vocab-size or add text"
        )

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # decode(encode(x)) == x, which the label tests rely on
    )


@dataclass(frozen=True)
class TinyShape:
    """A demo model's dimensions: the defaults train in seconds on two CPU ranks and divide by tp=2
    (4 heads, 2 KV heads); a benchmark's larger model is another shape of the same family."""

    vocab_size: int | None = None  # embedding rows; None: the tokenizer's size (more: rows no token maps to)
    tie_word_embeddings: bool = False
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 256

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size} and "
                f"num_kv_heads={self.num_kv_heads} must divide num_heads"
            )


def build_tiny_model(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerFast,
    family: str = "llama",
    shape: TinyShape | None = None,
    *,
    seed: int = 0,
    max_shard_size: int | str = "5GB",
    **dims: Any,
) -> Path:
    """Write a seeded random fp32 model of `shape`, its tokenizer and generation config to `out_dir`
    (weights in safetensors files of at most `max_shard_size`, with an index when there are several).

    `dims` are `TinyShape` fields over `shape` (`num_layers=2` is `shape=TinyShape(num_layers=2)`).
    `vocab_size` defaults to len(tokenizer); a larger value (e.g. 515, not divisible by tp=2)
    gives embedding rows no token maps to, which is how checkpoints padded for TP look.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family not in FAMILIES and family not in CONFIG_MAPPING:
        raise ValueError(
            f"family={family!r} is neither registered ({sorted(FAMILIES)}) nor a model type transformers knows"
        )
    shape = replace(shape or TinyShape(), **dims)
    vocab_size = len(tokenizer) if shape.vocab_size is None else shape.vocab_size
    if vocab_size < len(tokenizer):
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens): token ids would "
            "overflow the embedding"
        )

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS, PAD, IM_END)}
    # the family registry names the classes and any config fields this family needs set
    # (a model_type with no row: transformers' own config class and causal LM for it, as a derived family reads it)
    spec = FAMILIES.get(family)
    config_cls = getattr(transformers, spec.config_class) if spec else CONFIG_MAPPING[family]
    config = config_cls(
        **(spec.demo_config if spec else {})  # the family's fields first: the demo's own win
        | dict(
            vocab_size=vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_heads,
            num_key_value_heads=shape.num_kv_heads,
            max_position_embeddings=shape.max_position_embeddings,
            tie_word_embeddings=shape.tie_word_embeddings,
            bos_token_id=ids[BOS],
            eos_token_id=ids[EOS],
            pad_token_id=ids[PAD],
            dtype="float32",
        ),
    )
    # fork_rng: a fixed seed for the init without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (
            getattr(transformers, spec.model_class)(config)
            if spec
            else transformers.AutoModelForCausalLM.from_config(config)
        )
        model = model.to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS],
        # A chat reply ends at <|im_end|>, a raw document at <|end_of_text|>: stop at either.
        eos_token_id=[ids[EOS], ids[IM_END]],
        pad_token_id=ids[PAD],
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tasks.core.models.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory to write the HF model into (created)")
    p.add_argument(
        "--family",
        default="llama",
        help=f"a config.json model_type: {', '.join(sorted(FAMILIES))} or any other decoder transformers builds",
    )
    p.add_argument("--vocab-size", type=int, default=512, help="tokenizer size, specials included")
    p.add_argument(
        "--model-vocab-size", type=int, default=None, help="embedding rows if larger than the tokenizer (e.g. 515)"
    )
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument(
        "--corpus",
        action="append",
        default=None,
        help="corpus file (.jsonl/.txt); repeatable; default: data/sample/cpt.jsonl and sft.jsonl",
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    tokenizer = build_tokenizer(a.corpus or DEFAULT_CORPUS, vocab_size=a.vocab_size)
    shape = TinyShape(vocab_size=a.model_vocab_size, tie_word_embeddings=a.tie_word_embeddings)
    out = build_tiny_model(a.out, tokenizer, a.family, shape, seed=a.seed)
    print(f"wrote {a.family} model (vocab {a.model_vocab_size or len(tokenizer)}, tokenizer {len(tokenizer)}) to {out}")


if __name__ == "__main__":
    main()
