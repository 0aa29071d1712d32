"""The DPO training step in one process (no torchrun): pairs batched whole, the pair loss of one forward.

    pytest -q tests/test_dpo_step.py

The tiny pair set is the shipped sample's first pairs, prepared by the real PairEncoder path, and its
reference the real `write_reference` on the tiny model; the engine's `StageData` walks it as a 2-rank
data-parallel job would, and `PairLoss`'s step is held against `pair_loss` and the DPO formula by hand.
Repeated AdamW steps of that step on the same pairs lower their loss, and its vocab-parallel log-softmax
(a tp group of 2 faked with threads) gives the whole log-softmax's loss and gradient.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from support.engine import REPO, phase_raw, reference_for, write_job
from tasks.core.errors import ConfigError
from tasks.core.run.job import load_job, parse_job

DDP = {"name": "torch_ddp", "precision": "fp32"}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("dpo-step")
    src = work / "pairs.jsonl"  # the sample's first 12 records: every layout the reader takes
    src.write_text("".join((REPO / "data" / "sample" / "dpo.jsonl").read_text().splitlines(keepends=True)[:12]))
    section = phase_raw("dpo", DDP, data={"uri": str(src)}, micro_batch_size=2, beta=0.5, label_smoothing=0.1)
    common = dict(phase="dpo", phase_cfg=section, model_dir=tiny_model_dir, stage_dir=work / "dpo")
    shard = write_job(work / "jobs" / "shard.json", verb="shard", **common)
    ref = reference_for(shard, work / "reference")
    train = write_job(work / "jobs" / "train.json", verb="train", reference_dir=ref, **common)
    return load_job(train)


def test_a_pair_stage_walks_pairs_whole_with_their_reference(pairs):
    from tasks.core.data.dataset import TokenDataset
    from tasks.core.evaluation.reference import read_reference
    from tasks.engine.loop import StageData
    from tasks.engine.pairs import REF_LOGPS, REF_TOKENS

    logps, tokens = read_reference(pairs.reference_dir, pairs.data_dir)
    rows = TokenDataset(pairs.data_dir)
    seen: list[int] = []
    for dp_rank in (0, 1):
        data = StageData(pairs, dp_rank, 2)
        assert data.num_items == len(rows) // 2 == logps.shape[0] >= 8  # the sampler's units are pairs
        for _ in range(2):
            (mb,), ntok, computed = data.next_batch()  # micro_batch_size 2 pairs, grad_accum 1: one micro-batch
            ids, labels = mb["input_ids"], mb["labels"]
            assert ids.shape[0] == 4  # 2 pairs, 2 rows each
            # the global batch's real tokens (both rows of every pair of both ranks) and its computed ones
            assert int(mb["attention_mask"].sum()) < ntok <= computed and ids.numel() < computed
            # Which pairs: each row is one of the dataset's rows, chosen rows first, then their rejected rows.
            every, w = torch.from_numpy(rows.batch(range(len(rows)))["input_ids"]), ids.shape[1]  # each at seq_len
            same = [(every[:, :w] == ids[r]).all(-1) & (every[:, w:] == rows.pad).all(-1) for r in range(4)]
            got = [int(s.nonzero()[0]) for s in same]
            p = [got[0] // 2, got[1] // 2]
            assert got == [2 * p[0], 2 * p[1], 2 * p[0] + 1, 2 * p[1] + 1], got
            seen += p
            assert mb[REF_LOGPS].tolist() == [*logps[p, 0].tolist(), *logps[p, 1].tolist()]
            assert mb[REF_TOKENS].tolist() == [*tokens[p, 0].tolist(), *tokens[p, 1].tolist()]
            assert (labels[:, 1:] != -100).sum(-1).tolist() == mb[REF_TOKENS].tolist()  # the same replies scored
    assert len(set(seen)) == len(seen) == 8  # the two ranks' pairs: disjoint, never a split pair


def test_the_pair_step_is_pair_loss_and_the_dpo_formula(pairs):
    from transformers import AutoModelForCausalLM

    from tasks.core.models.preference import PairLogps, pair_loss, sequence_logps
    from tasks.engine.loop import StageData
    from tasks.engine.pairs import REF_LOGPS, REF_TOKENS, SUMS, PairLoss, add_sums

    cfg = pairs.phase_cfg
    model = AutoModelForCausalLM.from_pretrained(pairs.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # a policy that moved away from the reference: one weight nudged
        model.lm_head.weight[:8] += 0.05
    (mb,), _, _ = StageData(pairs, 0, 1).next_batch()
    step = PairLoss(cfg, model.config.vocab_size)
    logits = step.forward(model, mb)
    out = step.step(logits, mb)
    ref = PairLogps.of_batch(mb[REF_LOGPS], mb[REF_TOKENS])
    batch = {k: mb[k] for k in ("input_ids", "labels", "attention_mask")}
    want = pair_loss(model, batch, ref, cfg.beta, cfg.loss, cfg.label_smoothing)
    assert torch.equal(out.losses, want.losses) and torch.equal(out.loss, want.loss)
    # By hand: h the policy's log-ratio of chosen over rejected less the reference's, e = label_smoothing.
    lp, _ = sequence_logps(logits, mb["labels"])
    p = lp.shape[0] // 2
    h = (lp[:p] - mb[REF_LOGPS][:p]) - (lp[p:] - mb[REF_LOGPS][p:])
    e, b = cfg.label_smoothing, cfg.beta
    hand = (-(1 - e) * F.logsigmoid(b * h) - e * F.logsigmoid(-b * h)).mean()
    assert abs(float(out.loss.detach()) - float(hand.detach())) < 1e-6 and float(out.loss.detach()) != pytest.approx(
        math.log(2), abs=1e-4
    )
    # Its backward reaches the policy; the step's sums add up exactly to the metrics.
    out.loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    sums = add_sums([0.0] * len(SUMS), out)
    assert sums[0] == p and sums[2] == float(((lp[:p] - lp[p:]) > (mb[REF_LOGPS][:p] - mb[REF_LOGPS][p:])).sum())
    # IPO, the per-token row: each reply's mean log-probability over its scored tokens, the reference's likewise.
    ipo = PairLoss(cfg.model_copy(update={"loss": "ipo", "label_smoothing": 0.0}), model.config.vocab_size)
    n, rn = (mb["labels"][:, 1:] != -100).sum(-1), mb[REF_TOKENS]
    h = (lp[:p] / n[:p] - mb[REF_LOGPS][:p] / rn[:p]) - (lp[p:] / n[p:] - mb[REF_LOGPS][p:] / rn[p:])
    got = ipo.step(logits.detach(), mb).loss
    assert abs(float(got) - float(((h.detach() - 1 / (2 * b)) ** 2).mean())) < 1e-6


def test_a_pair_job_needs_its_reference_and_keeps_its_section_whole(pairs, tmp_path):
    raw = json.loads(Path(pairs.source).read_text())
    raw.pop("reference_dir")
    with pytest.raises(ConfigError) as exc:
        parse_job(raw)
    assert [f for f, _ in exc.value.problems] == ["reference_dir"]
    assert "set reference_dir to the reference artifact" in str(exc.value)
    parse_job({**raw, "verb": "shard"})  # the shard verb boosts the model: it reads no reference
    # The dpo section round-trips through the job file whole (beta, loss, label_smoothing, the pair fields).
    again = parse_job(json.loads(json.dumps(pairs.model_dump(mode="json"))))
    assert again.phase_cfg == pairs.phase_cfg and (again.phase_cfg.beta, again.phase_cfg.label_smoothing) == (0.5, 0.1)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"plugin": {"name": "hybrid_parallel", "pp_size": 2, "num_microbatches": 2, "precision": "fp32"}}, "pp_size"),
        ({"plugin": {**DDP}, "batching": "packed"}, "batching"),
    ],
)
def test_pipeline_and_packed_rows_are_refused_for_pairs(pairs, change, field):
    raw = json.loads(Path(pairs.source).read_text())
    with pytest.raises(ConfigError) as exc:
        parse_job({**raw, "phase_cfg": {**raw["phase_cfg"], **change}})
    (f, why), *_ = exc.value.problems
    assert f.endswith(field) and "refused for preference pairs" in why


def test_repeated_pair_steps_descend_the_dpo_loss_on_the_same_pairs(pairs):
    from transformers import AutoModelForCausalLM

    from tasks.engine.loop import StageData
    from tasks.engine.pairs import REF_LOGPS, REF_TOKENS, PairLoss

    data = StageData(pairs, 0, 1).pairs
    n = data.pairs
    mb = data.batch(list(range(n)), width=int(data.lengths.max()))  # every pair in one fixed batch
    model = AutoModelForCausalLM.from_pretrained(pairs.model_dir, dtype=torch.float32).eval()
    # The demo flow's dpo settings (beta 0.1, AdamW at lr 2e-3), PairLoss's step as train_step calls it.
    step = PairLoss(pairs.phase_cfg.model_copy(update={"beta": 0.1, "label_smoothing": 0.0}), model.config.vocab_size)
    with torch.no_grad():
        logits = step.forward(model, mb)
        first = float(step.step(logits, mb).loss)
        # Pair i's reference is the reference model's log-probabilities of pair i: the policy starts as that
        # model, so every h is 0 and the loss log 2; another pair's reference (rolled by one) moves it off.
        roll = torch.roll(torch.arange(n), 1)
        moved = {k: torch.cat([mb[k][:n][roll], mb[k][n:][roll]]) for k in (REF_LOGPS, REF_TOKENS)}
        shuffled = float(step.step(logits, {**mb, **moved}).loss)
    assert first == pytest.approx(math.log(2), abs=1e-5) and abs(shuffled - math.log(2)) > 0.05
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(10):
        out = step.step(step.forward(model, mb), mb)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    # Measured: 0.693 0.627 0.584 0.545 0.505 0.458 0.393 0.353 0.316 0.276, each step below the last.
    assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < 0.4, losses


def test_the_vocab_parallel_logps_match_the_whole_log_softmax_and_its_gradient(pairs, monkeypatch):
    import threading
    import types
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import tasks.engine.pairs as engine_pairs
    from tasks.engine.loop import StageData
    from tasks.engine.pairs import PairLoss

    # A tp group of 2 in one process: each "rank" a thread, the collectives vocab_parallel_logps makes
    # (all_gather_object, all_reduce SUM/MAX) done through shared slots, so no torchrun is needed; the
    # barrier's timeout turns a rank that failed before a collective into an error, not a hang.
    ranks, slots, barrier, local = 2, [None, None], threading.Barrier(2, timeout=60), threading.local()

    def exchange(value):
        slots[local.rank] = value
        barrier.wait()
        got = list(slots)
        barrier.wait()
        return got

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        got = torch.stack(exchange(t.detach().clone()))
        t.copy_(got.amax(0) if op == dist.ReduceOp.MAX else got.sum(0))

    def all_gather_object(out, obj, group=None):
        out[:] = exchange(obj)

    fake = types.SimpleNamespace(
        ReduceOp=dist.ReduceOp,
        all_reduce=all_reduce,
        all_gather_object=all_gather_object,
        get_rank=lambda group=None: local.rank,
        get_world_size=lambda group=None: ranks,
    )
    monkeypatch.setattr(engine_pairs, "dist", fake)
    (mb,), _, _ = StageData(pairs, 0, 1).next_batch()
    model = AutoModelForCausalLM.from_pretrained(pairs.model_dir, dtype=torch.float32).eval()
    cfg = pairs.phase_cfg
    vocab = model.config.vocab_size
    with torch.no_grad():
        model.lm_head.weight[:8] += 0.05  # a policy away from the reference: the loss is not flat at h = 0
        logits = PairLoss(cfg, vocab).forward(model, mb)
    whole = logits.clone().requires_grad_()
    want = PairLoss(cfg, vocab).step(whole, mb).loss
    want.backward()
    cut = vocab // 3  # uneven shards, as a vocabulary that does not divide by tp gives
    shards = [logits[..., :cut].clone().requires_grad_(), logits[..., cut:].clone().requires_grad_()]

    def rank(r):
        local.rank = r
        loss = PairLoss(cfg, vocab, tp_group="tp").step(shards[r], mb).loss
        loss.backward()
        return loss.detach()

    with ThreadPoolExecutor(ranks) as pool:
        got = list(pool.map(rank, range(ranks)))
    for loss in got:  # every rank: the same loss as the whole logits' log-softmax
        assert float(loss) == pytest.approx(float(want.detach()), abs=1e-5)
    grad = torch.cat([shards[0].grad, shards[1].grad], dim=-1)
    assert whole.grad.abs().sum() > 0 and torch.allclose(grad, whole.grad, atol=1e-7, rtol=1e-4)


def test_a_mixture_of_pair_sources_is_blended_in_pairs_walked_whole_and_names_a_bad_pair(tmp_path, tiny_model_dir):
    """`dpo.data.sources`: prepare blends pairs (a pair is one sample, its two rows never apart), the sampler
    walks the blend's pair ids with their reference, and a bad pair in one source is named by file and line."""
    import numpy as np

    from support.engine import prepared_data
    from tasks.core.data.dataset import TokenDataset
    from tasks.core.evaluation.reference import read_reference
    from tasks.engine.loop import StageData
    from tasks.engine.pairs import REF_LOGPS

    lines = (REPO / "data" / "sample" / "dpo.jsonl").read_text().splitlines(keepends=True)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(lines[:12]))
    b.write_text("".join(lines[12:16]))  # the smaller source, repeated to meet its weight
    mix = [{"name": "a", "uri": str(a), "weight": 0.5}, {"name": "b", "uri": str(b), "weight": 0.5}]
    section = phase_raw("dpo", DDP, data={"sources": mix}, seq_len=128, max_steps=4)  # 4 steps x 2 pairs x dp 2
    common = dict(phase="dpo", phase_cfg=section, model_dir=tiny_model_dir, stage_dir=tmp_path / "dpo")
    shard = write_job(tmp_path / "jobs" / "shard.json", verb="shard", **common)
    ref = reference_for(shard, tmp_path / "reference")
    job = load_job(write_job(tmp_path / "jobs" / "train.json", verb="train", reference_dir=ref, **common))
    rows = TokenDataset(job.data_dir)
    sources = rows.index["sources"]
    n_a, n_b = (s["samples_available"] for s in sources)
    assert n_a + n_b == len(rows) // 2 and n_b > 0  # samples are pairs, not rows
    stream = np.asarray(rows.blend())
    assert len(stream) == 16 and (stream >= n_a).sum() == 8  # half the planned pairs from each source
    logps, _ = read_reference(job.reference_dir, job.data_dir)
    every = torch.from_numpy(rows.batch(range(len(rows)))["input_ids"])
    walked = []
    for dp_rank in (0, 1):
        data = StageData(job, dp_rank, 2)
        assert data.num_items == len(rows) // 2
        for _ in range(4):
            (mb,), _, _ = data.next_batch()
            ids, w = mb["input_ids"], mb["input_ids"].shape[1]
            got = [
                int(((every[:, :w] == ids[r]).all(-1) & (every[:, w:] == rows.pad).all(-1)).nonzero()[0])
                for r in range(4)
            ]
            p = [got[0] // 2, got[1] // 2]
            assert got == [2 * p[0], 2 * p[1], 2 * p[0] + 1, 2 * p[1] + 1], got  # each pair whole: chosen, rejected
            assert mb[REF_LOGPS].tolist() == [*logps[p, 0].tolist(), *logps[p, 1].tolist()]
            walked += p
    assert sorted(walked) == sorted(stream.tolist())  # the planned steps take exactly the blend's pairs
    # A bad pair in one source: named by its file and line, before any launch.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + json.dumps({"prompt": "Hi", "chosen": "Same.", "rejected": "Same."}) + "\n")
    mix[1]["uri"] = str(bad)
    with pytest.raises(ValueError) as exc:  # BadRecordError: prepare_data's refusal of a bad record
        prepared_data(phase_raw("dpo", DDP, data={"sources": mix}, seq_len=128), "dpo", tiny_model_dir, tmp_path / "p")
    assert f"{bad}:2" in str(exc.value) and "hold the same reply" in str(exc.value), str(exc.value)
