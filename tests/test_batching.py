"""SFT batching (tasks/core/config/batching.py): the length-grouped order, per-micro-batch widths
and packed rows change which padding is computed, never a loss.

    .venv/bin/python -m pytest -q tests/test_batching.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.core.config.batching import BATCHING, PAD_MULTIPLE, BatchingSpec, micro_width, register
from tasks.core.data.dataset import IGNORE_INDEX, TokenDataset
from tasks.core.data.prepare import prepare
from tasks.core.models.demo import DEFAULT_CORPUS, build_tokenizer
from tasks.engine.packing import block_causal_mask, chat_token_losses, model_inputs
from tasks.engine.sampler import LengthGroups, Packs, ResumableSampler

CPT, SFT = DEFAULT_CORPUS


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    tok = build_tokenizer(DEFAULT_CORPUS, vocab_size=512)
    root = tmp_path_factory.mktemp("batching")
    tok.save_pretrained(root / "tok")
    prepare(str(SFT), root / "tok", root / "prep", kind="sft", field="messages", seq_len=128)
    return TokenDataset(root / "prep")


def test_registry_rows_reach_the_config_and_the_schema():
    from tasks.core.config.schema import PhaseConfig, RunConfig

    assert PhaseConfig.model_fields["batching"].default == "grouped"
    register(BatchingSpec("dummy", "a test row", False, "seq_len"))
    try:
        prop = RunConfig.model_json_schema()["$defs"]["PhaseConfig"]["properties"]["batching"]
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
        return float(
            np.mean(
                [
                    np.ptp(lengths[order[i : i + gb]]) / lengths[order[i : i + gb]].max()
                    for i in range(0, len(order) - gb + 1, gb)
                ]
            )
        )

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

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    lengths = sft_data.lengths()
    assert (
        lengths == sft_data.batch(range(sft_data.num_items))["attention_mask"].sum(1)
    ).all()  # what each row really holds
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


def test_packed_order_holds_every_conversation_once_fills_its_rows_and_resumes_bitwise():
    lengths = np.random.RandomState(1).lognormal(np.log(300), 0.7, size=1500).astype(np.int64).clip(8, 2048)

    def sampler():
        return ResumableSampler(len(lengths), 0, 1, seed=11, group=Packs(lengths, 2048, chunk=512))

    s = sampler()
    rows = s.next_global(s.units())
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["offset"] == 0  # the epoch's units are its rows
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert max(int(lengths[list(r)].sum()) for r in rows) <= 2048
    assert lengths.sum() / (len(rows) * 2048) >= 0.95  # best-fit decreasing within each chunk
    assert (
        sampler().next_global(len(rows)) == rows and s.next_global(len(rows)) != rows
    )  # seeded, and each epoch its own
    s = sampler()
    first = [s.next_global(8) for _ in range(30)]
    state = s.state_dict()
    rest = [s.next_global(8) for _ in range(60)]  # into the next epoch
    resumed = sampler()
    resumed.load_state_dict(state)
    assert [resumed.next_global(8) for _ in range(60)] == rest and first[0] == rows[:8]
    bad = sampler()
    with pytest.raises(ValueError, match="does not fit a dataset"):
        bad.load_state_dict({**state, "offset": len(rows)})
    assert bad.state_dict() == {"epoch": 0, "offset": 0, "seed": 11}  # a refused state changes nothing
    with pytest.raises(ValueError, match="longer than seq_len 256"):
        Packs(lengths, 256)


def test_a_packed_row_restarts_positions_and_never_labels_across_conversations(sft_data):
    lengths = sft_data.lengths()
    items = [int(i) for i in np.argsort(lengths)[:3]]
    width = int(lengths[items].sum()) + 5
    b = sft_data.batch_packed([items], width=width)
    seg, pos, labels = b["segment_ids"][0], b["position_ids"][0], b["labels"][0]
    starts = np.concatenate([[0], np.cumsum(lengths[items])[:-1]])
    assert seg.tolist() == [s + 1 for s, i in enumerate(items) for _ in range(int(lengths[i]))] + [0] * 5
    assert all(pos[a] == 0 for a in starts) and pos[starts[1] - 1] == lengths[items[0]] - 1
    assert all(labels[a] == IGNORE_INDEX for a in starts)
    one = sft_data.batch([items[1]])
    k = int(lengths[items[1]])
    assert (b["input_ids"][0, starts[1] : starts[1] + k] == one["input_ids"][0, :k]).all()
    assert (labels[starts[1] + 1 : starts[1] + k] == one["labels"][0, 1:k]).all()
    with pytest.raises(ValueError, match="more than the batch width"):
        sft_data.batch_packed([items], width=width - 6)
    mask = block_causal_mask(torch.tensor([[1, 1, 2, 2, 0]]), torch.float32)[0, 0]
    sees = (mask == 0).int().tolist()
    assert sees == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]
    assert "attention_mask" not in model_inputs(
        {k: torch.from_numpy(v) for k, v in b.items()}, "flash_attention_2", torch.bfloat16
    )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_per_token_loss_of_a_packed_row_equals_the_padded_rows(sft_data, tiny_model_dir, attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attn).eval()
    assert model.config._attn_implementation == attn
    lengths = sft_data.lengths()
    rows = Packs(lengths, sft_data.seq_len).order(
        torch.randperm(sft_data.num_items, generator=torch.Generator().manual_seed(0)), torch.Generator().manual_seed(1)
    )
    packed_rows = [r for r in rows if len(r) >= 3][:2]  # rows of three or more conversations
    assert len(packed_rows) == 2
    width = micro_width(
        max(int(lengths[list(r)].sum()) for r in packed_rows), sft_data.seq_len, BATCHING["packed"], pipeline=False
    )
    b = model_inputs(
        {k: torch.from_numpy(v) for k, v in sft_data.batch_packed(packed_rows, width=width).items()},
        attn,
        torch.float32,
    )
    with torch.no_grad():
        logits = model(**b).logits
    got = chat_token_losses(logits, b["labels"], packed_rows, lengths, IGNORE_INDEX)
    want = [w for items in packed_rows for w in _per_token_losses(model, sft_data.batch(list(items)))]
    for a, w in zip(got, want, strict=True):
        assert len(a) == len(w) > 0
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)
    # The packed micro-batch's loss is the mean over the same labelled tokens.
    flat = torch.cat(want)
    with torch.no_grad():
        torch.testing.assert_close(model(**b).loss, flat.mean(), rtol=1e-5, atol=1e-6)
