"""Data functions of the training loop: reading, CPT packing, SFT loss masks, resumable order.

    python -m pytest tests/test_data.py -q

The SFT mask is checked against an independent oracle: the ChatML text is built here by hand,
the character spans of each assistant reply + <|im_end|> are known, and token offsets say
which tokens fall inside them.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tasks.core.data.records import read_records
from tasks.core.data.samples import IGNORE_INDEX, encode_chat, encode_sft, encode_sft_with_stats, pack_cpt
from tasks.core.models.demo import DEFAULT_CORPUS, build_tokenizer
from tasks.engine.sampler import ResumableSampler


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DEFAULT_CORPUS, vocab_size=512)


# --------------------------------------------------------------------------------------------
# read_records


def test_read_jsonl_skips_blank_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n\n   \n{"text": "b"}\n')
    assert read_records(str(p)) == [{"text": "a"}, {"text": "b"}]


def test_read_jsonl_malformed_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "a"}\n\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        read_records(str(p))
    p.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object"):
        read_records(str(p))


def test_read_txt_and_parquet(tmp_path):
    t = tmp_path / "d.txt"
    t.write_text("first line\n\nsecond line\n")
    assert read_records(str(t)) == [{"text": "first line"}, {"text": "second line"}]
    q = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["x", "y"], "n": [1, 2]}), q)
    assert read_records(str(q)) == [{"text": "x", "n": 1}, {"text": "y", "n": 2}]
    assert read_records(f"file://{q}") == read_records(str(q))  # fsspec URI


def test_read_unknown_format(tmp_path):
    with pytest.raises(ValueError, match=r"unknown format.*\.jsonl"):
        read_records(str(tmp_path / "d.csv"))


def test_sample_files_are_well_formed():
    cpt = read_records(str(DEFAULT_CORPUS[0]))
    sft = read_records(str(DEFAULT_CORPUS[1]))
    assert 400 <= len(cpt) <= 800 and all(isinstance(r["text"], str) for r in cpt)
    assert len(sft) == 200
    n_assistant = [sum(m["role"] == "assistant" for m in r["messages"]) for r in sft]
    assert min(n_assistant) >= 1 and 2 in n_assistant
    assert any(r["messages"][0]["role"] == "system" for r in sft)


# --------------------------------------------------------------------------------------------
# pack_cpt


def test_pack_cpt_shapes_and_eos(tok):
    texts = ["Zorvath has 3 moons.", "A day on Brisca lasts 9 hours.", "Quellin is teal."]
    flat = []
    for t in texts:
        flat += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    seq_len = 7
    blocks = pack_cpt(tok, [{"text": t} for t in texts], seq_len=seq_len)
    n = len(flat) // seq_len
    assert blocks.dtype == torch.long and blocks.shape == (n, seq_len)
    assert blocks.flatten().tolist() == flat[: n * seq_len]  # remainder dropped
    # One eos per document, right after it; no bos anywhere.
    eos_pos = [i for i, x in enumerate(flat) if x == tok.eos_token_id]
    assert len(eos_pos) == len(texts) and eos_pos[-1] == len(flat) - 1
    assert tok.bos_token_id not in flat


def test_pack_cpt_errors(tok):
    with pytest.raises(ValueError, match=r"record 1: no field 'body' \(fields: \['text'\]\); set data.text_field"):
        pack_cpt(tok, [{"body": "a"}, {"text": "b"}], text_field="body", seq_len=4)
    with pytest.raises(ValueError, match="fewer than seq_len=512"):
        pack_cpt(tok, [{"text": "tiny"}], seq_len=512)


# --------------------------------------------------------------------------------------------
# encode_chat: labels are -100 exactly off the assistant replies


def chatml_with_spans(messages):
    """Hand-built ChatML text and the character spans that must be labelled."""
    text, spans = "", []
    for m in messages:
        text += f"<|im_start|>{m['role']}\n"
        start = len(text)
        text += m["content"] + "<|im_end|>"
        if m["role"] == "assistant":
            spans.append((start, len(text)))
        text += "\n"
    return text, spans


def u(c):
    return {"role": "user", "content": c}


def a(c):
    return {"role": "assistant", "content": c}


def s(c):
    return {"role": "system", "content": c}


CASES = {
    "single turn": [u("How many moons does Zorvath have?"), a("Zorvath has 3 moons.")],
    "system": [s("Answer in one short sentence."), u("Who discovered Brisca?"), a("Tobias Fenn discovered Brisca.")],
    "two assistant turns": [
        s("You are a concise guide to the Veyra system."),
        u("What colour is Tamsor?"),
        a("Tamsor is jade."),
        u("And how many moons?"),
        a("Tamsor has 4 moons."),
    ],
    "ends with user": [u("Hi"), a(" Hello there."), u("Bye")],
}


@pytest.mark.parametrize("name", list(CASES))
def test_labels_cover_exactly_the_assistant_replies(tok, name):
    messages = CASES[name]
    text, spans = chatml_with_spans(messages)
    assert tok.apply_chat_template(messages, tokenize=False) == text
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    expected = [any(lo <= b0 and b1 <= hi for lo, hi in spans) for b0, b1 in enc["offset_mapping"]]

    ids, labels = encode_chat(tok, messages, seq_len=1024)
    assert ids == enc["input_ids"] and len(labels) == len(ids)
    for i, (x, y, want) in enumerate(zip(ids, labels, expected)):
        assert y == (x if want else IGNORE_INDEX), f"position {i} ({tok.decode([x])!r})"

    # Each contiguous labelled run decodes to one reply followed by its end-of-turn token.
    runs, cur = [], []
    for x, y in zip(ids, labels):
        if y != IGNORE_INDEX:
            cur.append(y)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    assert [tok.decode(r) for r in runs] == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


def test_truncation_cuts_an_assistant_turn(tok):
    messages = CASES["two assistant turns"]
    full_ids, full_labels = encode_chat(tok, messages, seq_len=1024)
    second = [i for i, y in enumerate(full_labels) if y != IGNORE_INDEX][-1]  # the final <|im_end|>
    seq_len = second - 2  # inside the second reply
    ids, labels = encode_chat(tok, messages, seq_len=seq_len)
    assert ids == full_ids[:seq_len] and labels == full_labels[:seq_len]
    kept = [y for y in labels if y != IGNORE_INDEX]
    assert tok.decode(kept).startswith("Tamsor is jade.<|im_end|>Tamsor")
    assert tok.decode(kept).count("<|im_end|>") == 1


def test_llama3_style_template(tok):
    """Another template family: bos in the template, headers, a different end-of-turn token."""
    t = copy.deepcopy(tok)
    t.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>\n\n"
        "{{ m['content'] | trim }}<|end_of_text|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant<|im_end|>\n\n{% endif %}"
    )
    messages = CASES["two assistant turns"]
    ids, labels = encode_chat(t, messages, seq_len=1024)
    assert ids[0] == t.bos_token_id and ids.count(t.bos_token_id) == 1  # no second bos from the tokenizer
    kept = [y for y in labels if y != IGNORE_INDEX]
    assert t.decode(kept) == "Tamsor is jade.<|end_of_text|>Tamsor has 4 moons.<|end_of_text|>"


def test_prefix_unstable_template_is_refused(tok):
    t = copy.deepcopy(tok)  # keep the module fixture's template untouched
    # The generation prompt says "bot" but replies render as "assistant".
    t.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>bot\n{% endif %}"
    )
    with pytest.raises(ValueError, match="not prefix-stable at message 1"):
        encode_chat(t, CASES["single turn"], seq_len=64)
    # Earlier replies re-rendered once a later turn exists (like templates that strip reasoning).
    t.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}[old]{% else %}{{ m['content'] }}{% endif "
        "%}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="not prefix-stable at message 2"):
        encode_chat(t, CASES["two assistant turns"], seq_len=64)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([u("hi"), u("anyone?")], "no assistant message"),
        (
            [u("hi"), {"role": "bot", "content": "x"}],
            r"message 1 has role 'bot'; allowed roles are system, user, assistant",
        ),
        ([a("hello"), u("hi"), a("x")], "message 0 is an assistant turn"),
        ([u("hi"), {"role": "assistant"}], "message 1 must be an object with 'role' and 'content'"),
        ([u("hi"), {"role": "assistant", "content": ["x"]}], "message 1 .assistant. content must be a string"),
        ([], "non-empty list"),
    ],
)
def test_bad_conversations_name_the_problem(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(tok, messages, seq_len=64)


# --------------------------------------------------------------------------------------------
# encode_sft


def test_encode_sft_pads_and_masks(tok):
    records = [{"messages": CASES["single turn"]}, {"messages": CASES["two assistant turns"]}]
    seq_len = 128
    out = encode_sft(tok, records, seq_len=seq_len)
    assert set(out) == {"input_ids", "labels", "attention_mask"}
    assert all(v.shape == (2, seq_len) and v.dtype == torch.long for v in out.values())
    for r, rec in enumerate(records):
        ids, labels = encode_chat(tok, rec["messages"], seq_len)
        n = len(ids)
        assert n < seq_len
        assert out["input_ids"][r, :n].tolist() == ids and out["labels"][r, :n].tolist() == labels
        assert (out["input_ids"][r, n:] == tok.pad_token_id).all()
        assert (out["labels"][r, n:] == IGNORE_INDEX).all()
        assert out["attention_mask"][r].tolist() == [1] * n + [0] * (seq_len - n)


def test_encode_sft_drops_records_without_labels(tok, caplog):
    long_prompt = {"messages": [u("Zorvath " * 40), a("Yes.")]}
    records = [{"messages": CASES["single turn"]}, long_prompt]
    with caplog.at_level(logging.WARNING, logger="tasks.core.data.samples"):
        out, dropped = encode_sft_with_stats(tok, records, seq_len=48)
    assert dropped == 1 and out["input_ids"].shape == (1, 48)
    assert "dropped 1 of 2" in caplog.text
    with pytest.raises(ValueError, match="no SFT record has an assistant token"):
        encode_sft(tok, [long_prompt], seq_len=48)


def test_encode_sft_errors_name_the_record(tok):
    with pytest.raises(ValueError, match=r"record 1: no field 'messages'"):
        encode_sft(tok, [{"messages": CASES["single turn"]}, {"conversation": []}], seq_len=32)
    with pytest.raises(ValueError, match=r"record 0: no assistant message"):
        encode_sft(tok, [{"messages": [u("hi")]}], seq_len=32)


def test_encode_sft_on_sample_data(tok):
    records = read_records(str(DEFAULT_CORPUS[1]))
    out, dropped = encode_sft_with_stats(tok, records, seq_len=128)
    assert dropped == 0 and out["input_ids"].shape == (200, 128)
    assert (out["attention_mask"][:, -1] == 0).all()  # 128 holds every sample conversation whole
    assert ((out["labels"] != IGNORE_INDEX).sum(1) > 0).all()
    assert ((out["labels"] == tok.convert_tokens_to_ids("<|im_end|>")).sum(1) >= 1).all()


# --------------------------------------------------------------------------------------------
# ResumableSampler


def test_each_epoch_is_a_fresh_permutation():
    s = ResumableSampler(10, dp_rank=0, dp_size=1, seed=7)
    e0, e1 = s.next_indices(10), s.next_indices(10)
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
    assert ResumableSampler(10, 0, 1, seed=7).next_indices(10) == e0
    assert ResumableSampler(10, 0, 1, seed=8).next_indices(10) != e0


def test_resume_continues_bitwise_across_epoch_boundary():
    num_items, dp_size, global_batch, steps = 23, 2, 6, 12  # 12 steps * 6 = 72 items > 3 epochs
    reference = [ResumableSampler(num_items, r, dp_size, seed=3) for r in range(dp_size)]
    expected = [[s.next_indices(global_batch) for s in reference] for _ in range(steps)]

    k = 3  # interrupted mid-epoch 0, the next step crosses into epoch 1
    first = [ResumableSampler(num_items, r, dp_size, seed=3) for r in range(dp_size)]
    got = [[s.next_indices(global_batch) for s in first] for _ in range(k)]
    state = first[0].state_dict()
    assert state == first[1].state_dict() == {"epoch": 0, "offset": 18, "seed": 3}
    state = json.loads(json.dumps(state))  # it goes through a checkpoint file
    resumed = [ResumableSampler(num_items, r, dp_size, seed=999) for r in range(dp_size)]
    for s in resumed:
        s.load_state_dict(state)  # the checkpoint's seed wins over the configured one
    got += [[s.next_indices(global_batch) for s in resumed] for _ in range(steps - k)]
    assert got == expected
    assert resumed[0].state_dict()["epoch"] == 3


def test_dp_shards_are_disjoint_and_cover_the_global_batch():
    num_items, dp_size, global_batch = 50, 4, 8
    ranks = [ResumableSampler(num_items, r, dp_size, seed=1) for r in range(dp_size)]
    oracle = ResumableSampler(num_items, 0, 1, seed=1)
    for _ in range(5):
        shares = [s.next_indices(global_batch) for s in ranks]
        assert all(len(x) == global_batch // dp_size for x in shares)
        assert len(set().union(*map(set, shares))) == global_batch  # disjoint
        assert list(itertools.chain.from_iterable(shares)) == oracle.next_global(global_batch)  # rank r holds slice r


def test_sampler_errors():
    with pytest.raises(ValueError, match="multiple of dp_size=4"):
        ResumableSampler(10, 0, 4, 0).next_indices(6)
    with pytest.raises(ValueError, match=r"dp_rank=2 must be in \[0, dp_size=2\)"):
        ResumableSampler(10, 2, 2, 0)
    with pytest.raises(ValueError, match="dataset is empty"):
        ResumableSampler(0, 0, 1, 0)
    with pytest.raises(ValueError, match="does not fit a dataset of 10 items"):
        ResumableSampler(10, 0, 1, 0).load_state_dict({"epoch": 0, "offset": 12, "seed": 0})
    with pytest.raises(ValueError, match=r"missing \['offset'\]"):
        ResumableSampler(10, 0, 1, 0).load_state_dict({"epoch": 0, "seed": 0})
