"""The tiny model the tests and the benchmarks train: the demo's random Llama with the tokenizer
trained on the sample corpus, and tiny-cpu.yaml pointed at it.

    python -c "from support.tiny import tiny_model; print(tiny_model('/tmp/tiny-llama'))"
"""

from __future__ import annotations

from pathlib import Path

from support import REPO


def tiny_tokenizer(vocab_size: int = 512):
    """The demo tokenizer: byte-level BPE trained on the sample corpus (deterministic)."""
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tokenizer

    return build_tokenizer(DEFAULT_CORPUS, vocab_size=vocab_size)


def tiny_model(out: str | Path, tokenizer=None, **kw) -> Path:
    """The demo's tiny random Llama (and its tokenizer) written to `out`; `kw` as build_tiny_model takes."""
    from tasks.core.models.demo import build_tiny_model

    return build_tiny_model(out, tokenizer if tokenizer is not None else tiny_tokenizer(), **kw)


def tiny_config_raw(model_dir: Path, run_root: Path, **phase_overrides) -> dict:
    """tiny-cpu.yaml pointed at a test model and run root, with fewer steps for speed."""
    import yaml

    raw = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    raw["base_model"]["uri"] = str(model_dir)
    raw["run_root"] = str(run_root)
    for phase in ("cpt", "sft"):
        raw[phase].update(max_steps=8, checkpoint_every=4)
        raw[phase].update(phase_overrides.get(phase, {}))
    # 8 SFT steps of the random demo model learn to end a reply with <|im_end|> (the gate's
    # generation check) in padded's random order of the chats, not always in grouped's; the
    # engine tests and `make demo` (30 steps) train grouped, the default.
    raw["sft"].setdefault("batching", "padded")
    # The benchmark stage runs in the session's demo run (`demo_run`), not in every flow test.
    raw.pop("benchmark", None)
    return raw


def write_config(path: Path, raw: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path
