"""One model at a time: every evaluation the flow process runs (held-out CPT and SFT, the generation
check, the benchmark) peaks at most at the largest compared model in the evaluation dtype plus
0.5 GB over the process's resident set before it, on a model large enough that two copies
(2 x 0.64 GB) would break that bound. In-process, as the stages run them (no torchrun).

    PYTHONPATH=$PWD python -m pytest -q -m "" tests/test_eval_memory.py -s
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

BOUND_EXTRA = int(0.5e9)


def _hwm() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM"))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as fh:  # "5": the peak resident set starts again from now
        fh.write("5")


@pytest.fixture(scope="module")
def two_models(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path, int]:
    """A random 159M-parameter Llama with the demo tokenizer, in fp32 (0.64 GB: the base) and in bf16
    (the export's dtype in tiny-cpu.yaml; evaluated in fp32 on CPU, so it is converted as it loads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("eval-memory")
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=14,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.02)
    a, b = out / "a", out / "b"
    model.save_pretrained(a, safe_serialization=True)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(b, safe_serialization=True)
    del model
    # transformers 4.57 writes the chat template beside tokenizer_config.json, as chat_template.jinja
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
    for name in (*names, "chat_template.jinja"):
        for d in (a, b):
            if (tiny_model_dir / name).is_file():
                shutil.copy(tiny_model_dir / name, d / name)
    return a, b, nbytes


def test_each_evaluation_holds_one_model_at_a_time(two_models, tiny_model_dir, tmp_path):
    import torch  # noqa: F401  (imports outside the measured spans)

    from tasks.core.config.benchmark import BenchmarkConfig
    from tasks.core.config.schema import EvalConfig
    from tasks.core.data.records import read_records
    from tasks.core.evaluation import benchmark as bench
    from tasks.core.evaluation import heldout as ev
    from tasks.core.evaluation.generation import generation_check
    from tasks.core.evaluation.release import rss_bytes

    a, b, nbytes = two_models
    assert 2 * nbytes > nbytes + BOUND_EXTRA  # two copies would break the bound
    cpt = read_records(str(REPO / "data" / "sample" / "cpt.jsonl"))[:24]
    sft = read_records(str(REPO / "data" / "sample" / "sft.jsonl"))[:12]
    cfg = EvalConfig(batch_size=4, max_batches=1)
    tasks = [
        bench.read_task(str(REPO / "data" / "sample" / "benchmarks" / f"{t}.yaml"))
        for t in ("veyra_facts", "general_text")
    ]
    fetched = bench.fetch(tasks, tmp_path / "copies")
    include = bench.runnable(tasks, fetched, tmp_path / "copies", tmp_path / "run", tmp_path / "cache")
    small = BenchmarkConfig(tasks=("x",), batch_size=4, limit=4)
    # a first model of the family and lm-eval imported: their modules stay loaded, not a model's memory
    bench.score(tiny_model_dir, include, [t.name for t in tasks], small, "fp32")

    def both_benchmarks():
        for d in (b, a):
            bench.score(d, include, [t.name for t in tasks], small, "fp32")

    evaluations = {
        "evaluate_cpt": lambda: ev.evaluate_cpt(a, b, cpt, "text", 64, cfg),
        "evaluate_sft": lambda: ev.evaluate_sft(a, b, sft, "messages", 128, cfg),
        "generation_check": lambda: generation_check(b, sft, "messages", 4, 2, "fp32"),
        "benchmark": both_benchmarks,
    }
    peaks = {}
    for name, run in evaluations.items():
        before = rss_bytes()
        _reset_hwm()
        run()
        peaks[name] = _hwm() - before
    print({k: f"{v / 1e9:.3f} GB" for k, v in peaks.items()}, f"model {nbytes / 1e9:.3f} GB")
    over = {k: v for k, v in peaks.items() if v > nbytes + BOUND_EXTRA}
    assert not over, f"peak over {nbytes / 1e9:.2f} + 0.5 GB: {over}"


def _whole_batch_nll(model, ids, labels):
    """The held-out loss as it was computed before the chunks: the whole batch's logits at once."""
    import torch

    from tasks.core.data.samples import IGNORE_INDEX

    logits = model(input_ids=ids, use_cache=False).logits.float()
    target = labels[:, 1:].reshape(-1)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target, reduction="none")
    return nll[target != IGNORE_INDEX]


def test_the_logits_in_chunks_keep_every_number_and_bound_the_peak():
    """A 262144-token vocabulary (Gemma 3's) on a 2-layer model: the held-out loss's logits a chunk of
    positions at a time give every position's loss bitwise (the mean differs only by the old fp32 sum's
    rounding), and the peak no longer grows with rows x seq_len x vocab; a final-logit softcap (Gemma 2)
    is applied as the model applies it."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    from tasks.core.data.samples import IGNORE_INDEX
    from tasks.core.evaluation import heldout as ev
    from tasks.core.evaluation.placement import logits_chunk_tokens
    from tasks.core.evaluation.release import rss_bytes

    vocab = 262144
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    ).eval()
    ids = torch.randint(0, vocab, (4, 128))
    labels = ids.clone()
    labels[1, :50] = IGNORE_INDEX  # an SFT-style prompt: not scored
    step = logits_chunk_tokens(vocab)
    assert step == 64 and ids.numel() > 4 * step
    with torch.no_grad():
        ev.token_nll(llama, ids[:1, :8], labels[:1, :8], {})  # first calls outside the measured spans
        _whole_batch_nll(llama, ids[:1, :8], labels[:1, :8])
        peaks, nll = {}, {}
        for name, run in (
            ("whole", lambda: _whole_batch_nll(llama, ids, labels)),
            ("chunked", lambda: ev.token_nll(llama, ids, labels, {})),
        ):
            before = rss_bytes()
            _reset_hwm()
            nll[name] = run()
            peaks[name] = _hwm() - before
    logits_bytes = ids.numel() * vocab * 4
    print({k: f"{v / 1e6:.0f} MB" for k, v in peaks.items()}, f"whole batch's fp32 logits {logits_bytes / 1e6:.0f} MB")
    assert torch.equal(nll["chunked"], nll["whole"])
    assert peaks["whole"] > 2 * logits_bytes  # the logits, their slice copied, the log-softmax
    assert peaks["chunked"] < logits_bytes / 2
    batch = {"input_ids": ids, "labels": labels}
    loss = ev.heldout_loss(llama, batch, 2, torch.device("cpu"))
    old = float(nll["whole"].double().sum()) / nll["whole"].numel()
    assert loss["tokens"] == nll["whole"].numel() and loss["loss"] == pytest.approx(old, rel=1e-12)

    gemma = Gemma3ForCausalLM(
        Gemma3TextConfig(
            vocab_size=4096,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            final_logit_softcapping=30.0,
            sliding_window=8,
        )
    ).eval()
    with torch.no_grad():
        small = ids[:, :40] % 4096
        assert torch.equal(ev.token_nll(gemma, small, small, {}, chunk=16), _whole_batch_nll(gemma, small, small))
