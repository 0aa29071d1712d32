"""SFT batching (tasks/core/config/batching.py): the length-grouped order and per-micro-batch widths
change which padding is computed, never a loss.

    .venv/bin/python -m pytest -q tests/test_batching.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.core.config.batching import BATCHING, PAD_MULTIPLE, BatchingSpec, micro_width, register
from tasks.core.data.prepare import prepare
from tasks.core.data.reader import IGNORE_INDEX, TokenDataset
from tasks.core.models.demo import DEFAULT_CORPUS, build_tokenizer
from tasks.engine.sampler import LengthGroups, ResumableSampler

CPT, SFT = DEFAULT_CORPUS


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    tok = build_tokenizer(DEFAULT_CORPUS, vocab_size=512)
    root = tmp_path_factory.mktemp("batching")
    tok.save_pretrained(root / "tok")
    prepare(str(SFT), root / "tok", root / "prep", kind="sft", field="messages", seq_len=128)
    return TokenDataset(root / "prep")


def test_registry_rows_reach_the_config_and_the_schema():
    from tasks.core.config.schema import RunConfig, StageConfig

    assert StageConfig.model_fields["batching"].default == "grouped"
    register(BatchingSpec("dummy", "a test row", False, "seq_len"))
    try:
        prop = RunConfig.model_json_schema()["$defs"]["StageConfig"]["properties"]["batching"]
        assert "dummy" in prop["enum"] and "a test row" in prop["description"]
    finally:
        BATCHING.pop("dummy")


def test_micro_width_rounds_up_and_keeps_seq_len_where_it_must():
    grouped, padded = BATCHING["grouped"], BATCHING["padded"]
    assert [micro_width(n, 128, grouped, pipeline=False) for n in (1, 8, 9, 57, 121, 128)] == [8, 8, 16, 64, 128, 128]
    assert micro_width(9, 128, padded, pipeline=False) == 128
    assert micro_width(9, 128, grouped, pipeline=True) == 128  # a pipeline keeps one shape
    assert PAD_MULTIPLE == 8


def test_grouped_order_is_a_seeded_permutation_of_similar_lengths_that_resumes_bitwise():
    lengths = np.random.RandomState(0).lognormal(5.5, 0.6, size=1000).astype(np.int64).clip(8, 2048)
    gb = 8

    def sampler():
        return ResumableSampler(len(lengths), 0, 1, seed=7, group=LengthGroups(lengths, gb, megabatch=16))

    s = sampler()
    epoch = s.next_global(len(lengths))
    assert sorted(epoch) == list(range(len(lengths)))  # every conversation once an epoch
    assert sampler().next_global(len(lengths)) == epoch  # the seed decides
    random = ResumableSampler(len(lengths), 0, 1, seed=7).next_global(len(lengths))

    def spread(order):  # mean (longest - shortest) / longest of a global batch
        return float(np.mean([np.ptp(lengths[order[i : i + gb]]) / lengths[order[i : i + gb]].max() for i in range(0, len(order) - gb + 1, gb)]))

    assert spread(epoch) < 0.25 * spread(random), (spread(epoch), spread(random))
    # A restore from any step's state continues exactly, into the next epoch too.
    s = sampler()
    first = [s.next_global(gb) for _ in range(70)]
    state = s.state_dict()
    rest = [s.next_global(gb) for _ in range(200)]
    resumed = sampler()
    resumed.load_state_dict(state)
    assert [resumed.next_global(gb) for _ in range(200)] == rest and first[0] == epoch[:gb]


def _per_token_losses(model, batch: dict[str, np.ndarray]) -> list[torch.Tensor]:
    """Each row's per-token loss on its labelled (assistant) tokens."""
    t = {k: torch.from_numpy(v) for k, v in batch.items()}
    with torch.no_grad():
        logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits
    out = []
    for r in range(len(logits)):
        labels = t["labels"][r, 1:]
        keep = labels != IGNORE_INDEX
        out.append(torch.nn.functional.cross_entropy(logits[r, :-1][keep], labels[keep], reduction="none"))
    return out


def test_per_token_loss_of_a_grouped_micro_batch_equals_the_padded_one(sft_data, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    lengths = sft_data.lengths()
    assert (lengths == sft_data.batch(range(sft_data.num_items))["attention_mask"].sum(1)).all()  # what each row really holds
    rows = list(np.argsort(lengths)[:4])  # the four shortest: the narrowest grouped width
    width = micro_width(int(lengths[rows].max()), sft_data.seq_len, BATCHING["grouped"], pipeline=False)
    assert width < sft_data.seq_len
    narrow, full = sft_data.batch(rows, width=width), sft_data.batch(rows)
    assert narrow["input_ids"].shape == (4, width) and full["input_ids"].shape == (4, sft_data.seq_len)
    for a, b in zip(_per_token_losses(model, narrow), _per_token_losses(model, full), strict=True):
        assert len(a) == len(b) > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # And so the micro-batch's loss (the mean over its labelled tokens) is the same.
    t = {k: torch.from_numpy(v) for k, v in narrow.items()}
    f = {k: torch.from_numpy(v) for k, v in full.items()}
    with torch.no_grad():
        torch.testing.assert_close(model(**t).loss, model(**f).loss, rtol=1e-5, atol=1e-6)


def test_a_batch_narrower_than_a_row_is_refused(sft_data):
    longest = int(np.argmax(sft_data.lengths()))
    with pytest.raises(ValueError, match="more than the batch width"):
        sft_data.batch([longest], width=8)
