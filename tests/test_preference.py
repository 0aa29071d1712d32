"""The DPO phase below the flow: its config section, the pair layouts read by the real reader, the encoder,
and the losses checked against a reference written out by hand on the tiny model (no launch here).

    python -m pytest -q -m "" tests/test_preference.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from support import REPO
from tasks.core.config.preference import PAIR_FIELDS_DEFAULT
from tasks.core.data.dataset import IGNORE_INDEX, TokenDataset
from tasks.core.data.pairs import Pair, PairFields, encode_reply, pair_rows, read_pair
from tasks.core.data.prepare import prepare
from tasks.core.data.shard import BadRecordError, load_tokenizer
from tasks.core.data.truncation import describe
from tasks.core.models.demo import IM_END

SAMPLE = REPO / "data" / "sample" / "dpo.jsonl"
SYSTEM = {"role": "system", "content": "Answer in one short sentence."}
USER = {"role": "user", "content": "How many moons does Brisca have?"}
GOOD, BAD = "Brisca has 7 moons.", "Brisca has 2 moons."


def _say(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def _prep(tiny_model_dir, uri, out, **kw):
    kw = {"kind": "dpo", "field": PAIR_FIELDS_DEFAULT, "seq_len": 128, **kw}
    return prepare(str(uri), tiny_model_dir, out, **kw)


# ---------------------------------------------------------------------------------------------
# the layouts users have


@pytest.mark.parametrize(
    "rec",
    [
        {"prompt": [SYSTEM, USER], "chosen": GOOD, "rejected": BAD},
        {"prompt": [SYSTEM, USER], "chosen": [_say(GOOD)], "rejected": [_say(BAD)]},
        {"messages": [SYSTEM, USER], "chosen": _say(GOOD), "rejected": BAD},
        {"chosen": [SYSTEM, USER, _say(GOOD)], "rejected": [SYSTEM, USER, _say(BAD)]},
        # UltraFeedback's: the prompt beside replies that repeat it
        {"prompt": [SYSTEM, USER], "chosen": [SYSTEM, USER, _say(GOOD)], "rejected": [SYSTEM, USER, _say(BAD)]},
    ],
    ids=["strings", "message-lists", "two-endings", "whole-dialogues", "replies-repeat-the-prompt"],
)
def test_every_layout_reads_to_the_same_pair(rec):
    assert read_pair(rec) == Pair([SYSTEM, USER], [_say(GOOD)], [_say(BAD)])


def test_a_string_prompt_is_one_user_turn_and_field_names_are_settings():
    assert read_pair({"q": USER["content"], "yes": GOOD, "no": BAD}, PairFields("q", "yes", "no", "conv")) == Pair(
        [USER], [_say(GOOD)], [_say(BAD)]
    )


BAD_PAIRS = {
    "identical": ({"prompt": "Hi?", "chosen": GOOD, "rejected": GOOD}, "hold the same reply: the pair prefers nothing"),
    "empty-reply": (
        {"prompt": "Hi?", "chosen": GOOD, "rejected": "  "},
        "the rejected reply is empty (whitespace only)",
    ),
    "prompt-ends-with-assistant": (
        {"prompt": [USER, _say(GOOD)], "chosen": GOOD, "rejected": BAD},
        "the prompt ends with an assistant turn (message 1)",
    ),
    "no-rejected": ({"prompt": "Hi?", "chosen": GOOD}, "no field 'rejected' (fields: ['chosen', 'prompt']); set "),
    "no-prompt": ({"chosen": GOOD, "rejected": BAD}, "no field 'prompt' or 'messages'"),
    "reply-with-a-user-turn": (
        {"prompt": "Hi?", "chosen": [_say(GOOD), USER], "rejected": BAD},
        "message 1 is a user turn; the chosen reply holds assistant messages only",
    ),
}


@pytest.mark.parametrize("case", list(BAD_PAIRS))
def test_a_bad_pair_is_refused_naming_the_field_and_the_fix(case, tiny_model_dir, tmp_path):
    rec, said = BAD_PAIRS[case]
    with pytest.raises(ValueError, match=None) as err:
        read_pair(rec)
    assert said in str(err.value)
    # ... and by the real reader, named by file and line, before any training process starts
    data = tmp_path / "pairs.jsonl"
    good = {"prompt": "Hi?", "chosen": GOOD, "rejected": BAD}
    data.write_text("".join(json.dumps(r) + "\n" for r in (good, good, rec)))
    with pytest.raises(BadRecordError) as err:
        _prep(tiny_model_dir, data, tmp_path / "prep")
    assert f"{data}:3: " in str(err.value) and said in str(err.value) and "data.on_bad_record: skip" in str(err.value)


# ---------------------------------------------------------------------------------------------
# the encoder


def test_encode_reply_labels_the_reply_and_its_end_of_turn_only(tok):
    prompt = [SYSTEM, USER, _say("Seven, I think."), {"role": "user", "content": "Sure?"}]  # an earlier reply too
    ids, labels = encode_reply(tok, prompt, [_say(GOOD)])
    start = len(tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
    assert ids[:start] == tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
    assert all(y == IGNORE_INDEX for y in labels[:start])  # the prompt's own assistant turn is not scored
    assert tok.decode([y for y in labels if y != IGNORE_INDEX]) == GOOD + IM_END


def test_the_sample_file_prepares_into_two_rows_a_pair_sharing_the_prompt(tiny_model_dir, tok, tmp_path):
    """data/sample/dpo.jsonl (every layout) through prepare(): pair i is rows 2i (chosen) and 2i+1 (rejected)."""
    r = _prep(tiny_model_dir, SAMPLE, tmp_path / "prep", heldout_fraction=0.1)
    t = r.index["totals"]
    records = [json.loads(x) for x in SAMPLE.read_text().splitlines()]
    assert r.index["kind"] == "dpo" and t["records"] == len(records) and t["skipped"] == 0
    ds = TokenDataset(tmp_path / "prep")
    assert ds.num_items == 2 * (len(records) - t["heldout_records"] // 2) and t["truncation"]["over_seq_len"] == 0
    pairs = ds.num_items // 2
    batch = ds.batch(pair_rows(range(pairs)))
    (held_file,) = (tmp_path / "prep").glob("shards/*/heldout.jsonl")
    held = [json.loads(x) for x in held_file.read_text().splitlines()]
    trained = [read_pair(rec) for rec in records if rec not in held]
    assert len(trained) == pairs
    for i, pair in enumerate(trained):
        c, rj = (batch["input_ids"][i], batch["labels"][i]), (batch["input_ids"][pairs + i], batch["labels"][pairs + i])
        prompt = tok.apply_chat_template(pair.prompt, tokenize=True, add_generation_prompt=True)
        for (ids, labels), reply in ((c, pair.chosen), (rj, pair.rejected)):
            assert list(ids[: len(prompt)]) == prompt and (labels[: len(prompt)] == IGNORE_INDEX).all()
            assert tok.decode(labels[labels != IGNORE_INDEX]) == reply[0]["content"] + IM_END


def test_a_pair_longer_than_seq_len_is_counted_named_and_dropped_as_sft_drops_a_long_chat(
    tiny_model_dir, tok, tmp_path
):
    long = " ".join(["Brisca has seven moons and rings."] * 12)
    recs = [
        {"prompt": "Hi?", "chosen": GOOD, "rejected": BAD},
        {"prompt": USER["content"], "chosen": long, "rejected": BAD},
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    n, too_long = 48, len(encode_reply(tok, [USER], [_say(long)])[0])
    assert too_long > n >= len(encode_reply(tok, [USER], [_say(BAD)])[0])
    r = _prep(tiny_model_dir, data, tmp_path / "prep", seq_len=n)
    assert r.index["totals"]["truncation"] == {
        "over_seq_len": 1,
        "dropped": 1,
        "cut": 0,
        "split": 0,
        "split_rows": 0,
        "exchanges_left_out": 0,
        "chats": 2,
    }
    assert r.index["over_seq_len_at"] == [f"{data}:2 ({too_long} tokens)"]  # named by file and line
    said = describe(r.index["sources"][0]["truncation"], "dpo", "drop", n)  # the log's, the UI's, the card's line
    assert said == "1 of 2 training pairs longer than seq_len=48: 1 dropped (dpo.truncation: drop)", said
    assert TokenDataset(tmp_path / "prep").num_items == 2  # the pair that fits, two rows


# ---------------------------------------------------------------------------------------------
# the loss, exact


def _hand_logp(model, ids: list[int], labels: list[int]) -> float:
    """Sum over the scored positions t of log softmax(logits[t - 1])[ids[t]], one unpadded sequence, token by token."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    total = 0.0
    for t in range(1, len(ids)):
        if labels[t] != IGNORE_INDEX:
            total += float(torch.log_softmax(logits[t - 1], dim=-1)[ids[t]])
    return total


@pytest.fixture(scope="module")
def five(tiny_model_dir, tmp_path_factory):
    """The sample file's first five pairs (each layout at least once), prepared; the tiny model as the policy and,
    every weight moved a little, as the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("five")
    recs = [json.loads(x) for x in SAMPLE.read_text().splitlines()[:5]]
    (out / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    _prep(tiny_model_dir, out / "pairs.jsonl", out / "prep")
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return [read_pair(r) for r in recs], out / "prep", policy, reference


def _full_batch(prep: Path, pairs: int) -> dict:
    import torch

    return {k: torch.from_numpy(v) for k, v in TokenDataset(prep).batch(pair_rows(range(pairs))).items()}


def test_the_losses_match_a_reference_written_out_by_hand_on_the_tiny_model(five, tok):
    import torch

    from tasks.core.models.preference import metrics, pair_logps, preference_loss

    pairs, prep, policy, reference = five
    batch = _full_batch(prep, len(pairs))  # padded to seq_len: the hand's sequences are not
    with torch.no_grad():
        pol, ref = pair_logps(policy, batch), pair_logps(reference, batch)

    hand = []  # (policy chosen, policy rejected, reference chosen, reference rejected, chosen tokens, rejected tokens)
    for pair in pairs:
        c, r = encode_reply(tok, pair.prompt, pair.chosen), encode_reply(tok, pair.prompt, pair.rejected)
        count = lambda lab: sum(y != IGNORE_INDEX for y in lab)
        hand.append(
            (
                _hand_logp(policy, *c),
                _hand_logp(policy, *r),
                _hand_logp(reference, *c),
                _hand_logp(reference, *r),
                count(c[1]),
                count(r[1]),
            )
        )
    got = torch.stack([pol.chosen, pol.rejected, ref.chosen, ref.rejected, pol.chosen_tokens, pol.rejected_tokens], 1)
    torch.testing.assert_close(got, torch.tensor(hand, dtype=torch.float32), rtol=1e-5, atol=1e-4)

    log_sigmoid = lambda x: -math.log1p(math.exp(-x))
    for beta, eps in ((0.1, 0.0), (0.5, 0.2)):
        out = preference_loss(pol, ref, beta=beta, loss="sigmoid", label_smoothing=eps)
        want = [
            -(1 - eps) * log_sigmoid(beta * ((pc - rc) - (pr - rr)))
            - eps * log_sigmoid(-beta * ((pc - rc) - (pr - rr)))
            for pc, pr, rc, rr, _, _ in hand
        ]
        torch.testing.assert_close(out.losses, torch.tensor(want), rtol=1e-5, atol=1e-6)
        assert abs(float(out.loss) - sum(want) / len(want)) < 1e-5
    out = preference_loss(pol, ref, beta=0.1, loss="ipo")
    want = [((pc / nc - rc / nc) - (pr / nr - rr / nr) - 1 / (2 * 0.1)) ** 2 for pc, pr, rc, rr, nc, nr in hand]
    torch.testing.assert_close(out.losses, torch.tensor(want), rtol=1e-5, atol=1e-5)

    m = metrics(preference_loss(pol, ref, beta=0.1).sums())
    rewards = [(0.1 * (pc - rc), 0.1 * (pr - rr)) for pc, pr, rc, rr, _, _ in hand]
    assert m["accuracy"] == sum(a > b for a, b in rewards) / len(hand)
    assert abs(m["margin"] - sum(a - b for a, b in rewards) / len(hand)) < 1e-5
    assert abs(m["chosen_logp"] - sum(h[0] for h in hand) / len(hand)) < 1e-4
    assert abs(m["chosen_logp_per_token"] - sum(h[0] for h in hand) / sum(h[4] for h in hand)) < 1e-5
    with pytest.raises(ValueError, match="label_smoothing=0.1 does not apply to loss 'ipo'"):
        preference_loss(pol, ref, beta=0.1, loss="ipo", label_smoothing=0.1)


# ---------------------------------------------------------------------------------------------
# the config section


def _raw(tmp_path: Path, **dpo) -> dict:
    from support.tiny import tiny_config_raw

    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    raw["dpo"] = {
        "data": {"uri": str(SAMPLE)},
        "plugin": {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
        "max_steps": 4,
        "seq_len": 128,
        "lr": 1.0e-5,
        **dpo,
    }
    return raw


def test_the_dpo_section_is_a_phase_section_with_the_loss_fields(tmp_path):
    from tasks.core.config.load import parse_config
    from tasks.core.data.spec import prepare_spec

    cfg = parse_config(_raw(tmp_path, beta=0.2, loss="ipo", data={"uri": str(SAMPLE), "chosen_field": "better"}))
    assert list(cfg.phases) == ["cpt", "sft", "dpo"] and cfg.phase("dpo") is cfg.dpo
    assert (cfg.dpo.beta, cfg.dpo.loss, cfg.dpo.label_smoothing, cfg.dpo.truncation) == (0.2, "ipo", 0.0, "drop")
    spec = prepare_spec(cfg.dpo, "dpo")
    assert spec.kind == "dpo" and PairFields.parse(spec.field) == PairFields(chosen="better")


def test_without_a_dpo_section_the_config_is_todays(tmp_path):
    from support.tiny import tiny_config_raw
    from tasks.core.config.load import parse_config

    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    cfg = parse_config(raw)
    assert cfg.dpo is None and list(cfg.phases) == ["cpt", "sft"]
    assert "dpo" not in cfg.model_dump(mode="json") and "dpo" not in json.loads(cfg.model_dump_json())
    with pytest.raises(KeyError, match="'dpo': this run has no dpo: section; the phases it trains are cpt, sft"):
        cfg.phase("dpo")


@pytest.mark.parametrize(
    "dpo,said",
    [
        ({"loss": "kto"}, "unknown preference loss 'kto'; registered losses: sigmoid, ipo"),
        ({"loss": "ipo", "label_smoothing": 0.1}, "label_smoothing=0.1 does not apply to loss 'ipo'"),
        ({"truncation": "split_turns"}, "truncation='split_turns': a pair longer than seq_len is dropped"),
        ({"truncation": "cut"}, "truncation='cut': a pair longer than seq_len is dropped"),
        ({"beta": 0}, "dpo.beta"),
        ({"data": {"uri": str(SAMPLE), "prompt_field": "a,b"}}, "'a,b' is no record field name"),
    ],
)
def test_a_bad_dpo_setting_is_refused_naming_it(dpo, said, tmp_path):
    from tasks.core.config.load import parse_config
    from tasks.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        parse_config(_raw(tmp_path, **dpo))
    assert said in str(err.value)


# ---------------------------------------------------------------------------------------------
# the reference pass, once, and a training step against it


def test_the_reference_logprobs_are_one_verified_artifact_made_for_its_pairs(five, tiny_model_dir, tmp_path):
    import torch

    from tasks.core.evaluation.reference import LOGPS, read_reference, write_reference
    from tasks.core.models.preference import pair_logps
    from tasks.core.run.manifest import MANIFEST, ManifestError

    pairs, prep, _, reference = five
    m = write_reference(reference, prep, tmp_path / "ref", batch_pairs=2)  # batches of 2 pairs, each its own width
    assert (
        m["kind"] == "reference-logps" and m["meta"]["pairs"] == len(pairs) and (tmp_path / "ref" / MANIFEST).is_file()
    )
    logps, tokens = read_reference(tmp_path / "ref", prep)
    with torch.no_grad():
        whole = pair_logps(reference, _full_batch(prep, len(pairs)))
    np.testing.assert_allclose(logps, torch.stack([whole.chosen, whole.rejected], 1).numpy(), rtol=1e-5, atol=1e-4)
    assert (tokens == torch.stack([whole.chosen_tokens, whole.rejected_tokens], 1).numpy()).all()
    # made for other pairs: refused
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt": "Hi?", "chosen": GOOD, "rejected": BAD}) + "\n")
    _prep(tiny_model_dir, other, tmp_path / "other")
    with pytest.raises(ValueError, match="made for other pairs .* compute the reference again"):
        read_reference(tmp_path / "ref", tmp_path / "other")
    # a file changed after the manifest: refused by its sha256
    (tmp_path / "ref" / LOGPS).write_bytes((tmp_path / "ref" / LOGPS).read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ManifestError, match="fails its sha256 check"):
        read_reference(tmp_path / "ref", prep)


def test_dpo_steps_against_the_stored_reference_start_at_log_2_and_widen_the_margin(five, tmp_path):
    """The policy starts as the reference: every margin 0, the sigmoid loss log 2; three AdamW steps on
    pair_loss raise the preference accuracy and the margin."""
    import copy

    import torch

    from tasks.core.evaluation.reference import pair_metrics, read_reference, reference_logps, write_reference
    from tasks.core.models.preference import PairLogps, metrics, pair_loss

    pairs, prep, _, reference = five
    write_reference(reference, prep, tmp_path / "ref")
    logps, tokens = (torch.from_numpy(a) for a in read_reference(tmp_path / "ref", prep))
    ref = PairLogps(logps[:, 0], logps[:, 1], tokens[:, 0], tokens[:, 1])
    policy = copy.deepcopy(reference).train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    batch, seen = _full_batch(prep, len(pairs)), []
    for _ in range(4):
        out = pair_loss(policy, batch, ref, beta=0.1)
        seen.append(metrics(out.sums()))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert abs(seen[0]["loss"] - math.log(2)) < 1e-5 and abs(seen[0]["margin"]) < 1e-5
    assert seen[-1]["loss"] < seen[0]["loss"] and seen[-1]["margin"] > 0 and seen[-1]["accuracy"] == 1.0
    # the figures the evaluation reports, before (the reference itself) and after, from each model's pass
    ds = TokenDataset(prep)
    before = pair_metrics((logps.numpy(), tokens.numpy()), (logps.numpy(), tokens.numpy()), beta=0.1)
    after = pair_metrics(reference_logps(policy.eval(), ds), (logps.numpy(), tokens.numpy()), beta=0.1)
    assert before["margin"] == 0 and before["accuracy"] == 0 and before["loss"] == pytest.approx(math.log(2))
    assert after["margin"] > seen[-1]["margin"] and after["accuracy"] == 1.0 and after["loss"] < seen[-1]["loss"]
