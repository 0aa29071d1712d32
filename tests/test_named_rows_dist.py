"""A named row over a derived table through the real engine on 2 gloo ranks: a tiny random GPT-2 is
sharded under hybrid_parallel tp=2, trained 3 steps, checkpointed, and its checkpoint converted to an
HF folder bitwise that loads in plain transformers with the logits the checkpoint recorded; a tiny random
Gemma 3 with a tied head the same under the derived tensor-parallel policy (ColossalAI has none for it) at
tp=2 with ZeRO-1 in bf16, and resumed at tp=2 from its step-2 checkpoint: steps 3 and 4 again, bitwise,
the same weights.

    .venv/bin/python -m pytest -q -m distributed tests/test_named_rows_dist.py -s

GPT-2's row (tasks/core/models/policy_rows.py) gives it ColossalAI 0.5.0's policy and what that policy
needs from the engine (shardformer's flash attention on, an all-ones mask in a CPT block, no
embedding/residual dropout at tp), so this case runs the most of the rows' engine path; every policy
row is measured at tp=2 and pp=2 by benchmarks/shardformer_policies.py --smoke in
tests/test_benchmarks.py. The named rows gemma3_text and phi3 (the derived policy at tp) run the whole flow under
the plugins that run them in tests/test_derived_flow.py, whose checks hold these (the CPT checkpoint
converted bitwise, with its logits). One launch (shard and train, as the flow shares them) for GPT-2, ~10-15 s of
imports, two for Gemma 3 (the resume).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from support.engine import engine, phase_raw, read_model_dir, shard_train, train_state, write_job
from tasks.core.models.fingerprint import (
    DEFAULT_RTOL,
    compare_logits,
    hf_dir_logits,
    load_fingerprint,
    max_abs_diff,
)

pytestmark = pytest.mark.distributed

CASES = {
    # GPT-2's row has the engine switch shardformer's flash attention on, give a CPT block an all-ones mask
    # and gather the fused c_attn in place on CPU; at tp its config must have no embedding/residual dropout
    "gpt2": ({"name": "hybrid_parallel", "tp_size": 2, "precision": "fp32"}, "GPT2LMHeadModel"),
    # no ColossalAI policy: the derived one from its own plan (tasks/core/models/tp_plan.py; its row's q/k norm
    # gradient sum and base prefix, the embedding's scale kept), a tied head, ZeRO-1 in bf16, built lazily as the
    # engine builds it, and a resume at tp=2 from the step-2 checkpoint that must redo steps 3 and 4 bitwise
    "gemma3_text": (
        {"name": "hybrid_parallel", "tp_size": 2, "zero_stage": 1, "precision": "bf16"},
        "Gemma3ForCausalLM",
    ),
}
RESUME = {"gemma3_text"}
TIED = {"gemma3_text"}
CONFIG = {"gpt2": {"embd_pdrop": 0.0, "resid_pdrop": 0.0}}
STEPS = 3


@pytest.fixture(scope="module", params=sorted(CASES))
def trained(request, tmp_path_factory):
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    family = request.param
    plugin, _ = CASES[family]
    work = tmp_path_factory.mktemp(f"named-{family}")
    tokenizer = build_tokenizer(DEFAULT_CORPUS, vocab_size=512)
    model_dir = build_tiny_model(work / "base", tokenizer, family=family, tie_word_embeddings=family in TIED)
    if CONFIG.get(family):  # fields the row's tp_requires asks of config.json (no weight depends on them)
        mc = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps(mc | CONFIG[family], indent=2))
    stage_dir = work / "cpt"
    steps, every = (STEPS + 1, 2) if family in RESUME else (STEPS, STEPS)
    section = phase_raw("cpt", plugin, max_steps=steps, checkpoint_every=every)
    common = dict(phase="cpt", phase_cfg=section, model_dir=model_dir, tokenizer_dir=model_dir, stage_dir=stage_dir)
    # shard and train in one launch, as the flow shares them
    shard = train = shard_train(
        write_job(work / "shard.json", verb="shard", **common),
        write_job(work / "train.json", verb="train", **common),
    )
    if family in RESUME and train.rc == 0:  # the last checkpoint set aside: the next launch resumes from step 2
        last = stage_dir / f"step-{steps:06d}"
        last.rename(work / last.name)
        train.resumed = engine("train", write_job(work / "train.json", verb="train", **common))
        train.first_run_last = work / last.name
    return family, model_dir, stage_dir, shard, train, work


def test_a_named_row_trains_on_2_ranks_and_its_checkpoint_converts_to_a_model_transformers_loads(trained):
    import transformers

    from tasks.core.models.convert import convert_checkpoint, load_state_dict_from_dir
    from tasks.core.models.families import expected_tensors

    family, model_dir, stage_dir, shard, train, work = trained
    assert shard.rc == 0 and train.rc == 0, (shard.output[-3000:], train.output[-3000:])
    losses = [p["loss"] for p in train.progress]
    steps = STEPS + (family in RESUME)
    assert [p["step"] for p in train.progress] == list(range(1, steps + 1)) and all(map(math.isfinite, losses))
    step = stage_dir / f"step-{steps:06d}"
    if family in RESUME:  # resumed at tp=2 from step 2: steps 3 and 4 again, bitwise, and the same weights
        resumed = train.resumed
        assert resumed.rc == 0 and "resuming cpt from step-000002" in resumed.output, resumed.output[-3000:]
        assert [p["loss"] for p in resumed.progress] == losses[2:], (resumed.progress, losses)
        first, again = read_model_dir(train.first_run_last / "model"), read_model_dir(step / "model")
        assert sorted(first) == sorted(again) and all(torch.equal(first[k], again[k]) for k in first)
    assert train_state(step)["losses"] == losses
    mc = json.loads((model_dir / "config.json").read_text())
    saved = read_model_dir(step / "model")
    assert list(saved) == list(expected_tensors(mc)) or sorted(saved) == sorted(expected_tensors(mc))
    base = read_model_dir(model_dir)
    assert not all(torch.equal(saved[k], base[k]) for k in base)  # trained
    report = convert_checkpoint(step / "model", work / "hf", model_config=mc, fsync=False)
    assert report is not None
    got = load_state_dict_from_dir(work / "hf")
    assert sorted(got) == sorted(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "hf")
    assert type(model).__name__ == CASES[family][1]
    # the logits the engine recorded at the save, from the converted folder
    if CASES[family][0]["precision"] == "bf16":  # the live model computed in bf16: plain transformers in bf16 too
        got = compare_logits(load_fingerprint(step), hf_dir_logits(work / "hf", dtype="bf16"), DEFAULT_RTOL["bf16"])
        assert got["fingerprint_match"], got
    else:
        assert max_abs_diff(load_fingerprint(step), hf_dir_logits(work / "hf", dtype="fp32")) <= 1e-4
