"""Long-context CPT (tasks/core/config/context.py): the RoPE settings a CPT stage trains with, carried
from the engine to the export, and document attention in packed CPT blocks.

    .venv/bin/python -m pytest -q tests/test_long_context.py            # the unit tier
    .venv/bin/python -m pytest -q -m "" tests/test_long_context.py      # with the engine launch and the demo run
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.core.config.context import ROPE_TYPES, ContextConfig, changes_text, config_changes, scaling_problems
from tasks.core.config.layout import layout_problems
from tasks.core.config.load import load_config
from tasks.core.data.dataset import IGNORE_INDEX, TokenDataset
from tasks.core.data.prepare import prepare
from tasks.core.errors import ConfigError
from tasks.core.models.demo import DEFAULT_CORPUS, build_tokenizer
from tasks.engine.packing import chat_token_losses, model_inputs

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny-cpu.yaml"
SEQ = 32
# A value each rope_scaling key takes, for a model of head dimension 16 extended from 256 to 512 positions.
VALUES = {
    "factor": 2.0,
    "original_max_position_embeddings": 256,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "attention_factor": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "short_factor": [1.0] * 8,
    "long_factor": [2.0] * 8,
    "truncate": False,
}


def _transformers_says(scaling: dict) -> tuple[str | None, list[str]]:
    """What LlamaConfig (transformers' rope_config_validation) makes of `scaling`: the error it
    raises, and the warnings it logs."""
    from transformers import LlamaConfig

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger("transformers.modeling_rope_utils")
    handler = Keep(logging.WARNING)
    log.addHandler(handler)
    try:
        LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=512, rope_scaling=dict(scaling))
        return None, seen
    except (KeyError, ValueError) as exc:
        return str(exc), seen
    finally:
        log.removeHandler(handler)


def test_rope_types_and_their_keys_are_those_transformers_builds():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, ROPE_VALIDATION_FUNCTIONS

    assert set(ROPE_TYPES) == set(ROPE_VALIDATION_FUNCTIONS) == set(ROPE_INIT_FUNCTIONS)
    for kind, validate in ROPE_VALIDATION_FUNCTIONS.items():  # the keys each validator reads, as its source spells them
        source = inspect.getsource(validate)
        keys = {
            name: set(re.findall(r'"(\w+)"', m.group(1)))
            for name in ("required_keys", "optional_keys")
            if (m := re.search(rf"{name} = \{{([^}}]*)\}}", source))
        }
        assert set(ROPE_TYPES[kind].required) == keys["required_keys"] - {"rope_type"}, kind
        assert set(ROPE_TYPES[kind].optional) == keys.get("optional_keys", set()), kind
    model = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 512}
    for kind, spec in ROPE_TYPES.items():
        full = {"rope_type": kind, **{k: VALUES[k] for k in spec.required + spec.optional}}
        error, warned = _transformers_says(full)
        assert error is None and not [w for w in warned if "Unrecognized" in w], (kind, error, warned)
        assert scaling_problems(full, model) == [], kind
        for key in spec.required:  # transformers raises; pre-flight names the key
            less = {k: v for k, v in full.items() if k != key}
            error, _ = _transformers_says(less)
            assert error and key in error, (kind, key)
            assert any(key in p for p in scaling_problems(less, model)), (kind, key)
        # A key the type does not read: transformers only warns and trains on; refused here.
        odd = {**full, "scale": 2.0}
        assert any("Unrecognized keys" in w for w in _transformers_says(odd)[1]), kind
        assert any("does not read scale" in p for p in scaling_problems(odd, model)), kind
    # transformers only warns about a factor below 1; refused, naming what the key takes.
    low = {"rope_type": "linear", "factor": 0.5}
    assert _transformers_says(low)[0] is None and scaling_problems(low) == ["factor must be a number >= 1, got 0.5"]
    assert scaling_problems({"type": "linear", "factor": 2.0}) == [
        "'type' is the old name of 'rope_type' (transformers renames it); write rope_type"
    ]
    lr = {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}
    assert scaling_problems(lr, model) == ["short_factor needs 8 numbers (half the rotary head dimension), got 3"]


def test_context_settings_become_the_config_fields_transformers_reads():
    ctx = ContextConfig(
        rope_theta=500000,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8,
            "low_freq_factor": 1,
            "high_freq_factor": 4,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
    )
    changes = config_changes(ctx)
    assert changes == {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
    }
    assert all(isinstance(changes["rope_scaling"][k], float) for k in ("factor", "low_freq_factor"))
    # What the card says is the same from the config as written and as run.json gives it back (keys sorted).
    base = {"rope_theta": 500000.0, "rope_scaling": None, "max_position_embeddings": 8192}
    sorted_back = ContextConfig.model_validate(json.loads(json.dumps(ctx.model_dump(), sort_keys=True)))
    assert (
        changes_text(base, ctx)
        == changes_text(base, sorted_back)
        == [
            (
                "rope_scaling null → {factor: 8.0, high_freq_factor: 4.0, low_freq_factor: 1.0, "
                "original_max_position_embeddings: 8192, rope_type: llama3}"
            ),
            "max_position_embeddings 8192 → 131072",
        ]
    )
    # {rope_type: default} removes a base's scaling; nothing set changes nothing.
    assert config_changes(ContextConfig(rope_scaling={"rope_type": "default"})) == {"rope_scaling": None}
    assert config_changes(None) == {} == config_changes(ContextConfig())


def test_context_settings_are_refused_where_they_cannot_apply():
    with pytest.raises(ConfigError) as info:
        load_config(str(TINY), overrides={"sft.context": {"rope_theta": 20000.0}, "sft.attention": "document"})
    problems = dict(info.value.problems)
    assert "SFT starts from cpt/hf, whose config.json carries cpt.context" in problems["sft.context"]
    assert "SFT keeps conversations apart with batching packed" in problems["sft.attention"]
    # Document attention under a plugin whose attention cannot isolate documents: the reason and the layouts that can.
    with pytest.raises(ConfigError) as info:
        load_config(str(TINY), overrides={"cpt.attention": "document"})
    (msg,) = [m for f, m in info.value.problems if f == "cpt.attention"]
    assert "refused under plugin hybrid_parallel: ColossalAI 0.5.0's shardformer" in msg
    assert "set cpt.plugin.name: torch_ddp and cpt.plugin.tp_size: 1" in msg and "set cpt.attention: causal" in msg
    ok = load_config(
        str(TINY),
        overrides={"cpt.attention": "document", "cpt.plugin": {"name": "torch_ddp", "precision": "fp32"}},
    )
    assert ok.cpt.attention == "document"
    # With the base's config.json: a llama3 scaling must extend past its original length.
    cfg = load_config(
        str(TINY),
        overrides={
            "cpt.context": {
                "rope_scaling": {"rope_type": "llama3", **{k: VALUES[k] for k in ROPE_TYPES["llama3"].required}}
            }
        },
    )
    base = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 256}
    assert layout_problems(cfg.cpt, "cpt", model_config=base) == [
        (
            "cpt.context.rope_scaling",
            (
                "original_max_position_embeddings=256 must be below max_position_embeddings=256 "
                "(set cpt.context.max_position_embeddings to the extended length)"
            ),
        )
    ]
    extended = cfg.cpt.model_copy(
        update={"context": cfg.cpt.context.model_copy(update={"max_position_embeddings": 512})}
    )
    assert layout_problems(extended, "cpt", model_config=base) == []


def test_preflight_checks_seq_len_against_the_extended_limit(tmp_path):
    from tests.test_preflight import Case, _all, _set

    case = Case(tmp_path)
    _all(
        _set("cpt.context", {"max_position_embeddings": 1024, "rope_theta": 40000.0}),
        _set("cpt.seq_len", 1024),
        _set("sft.seq_len", 512),
    )(case)
    report = case.report()
    assert report.ok, report.text()
    assert any(
        "seq_len cpt=1024, sft=512 <= max_position_embeddings=1024 (cpt.context: rope_theta (its config class's "
        "default) → 40000.0; max_position_embeddings 256 → 1024)" in c
        for c in report.checked
    ), report.checked


# -- document attention -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpt_docs(tmp_path_factory) -> TokenDataset:
    """Two files of documents of many lengths (longer and shorter than a block), prepared as
    prepare_cpt does: blocks then cross documents and the file boundary."""
    cpt_sample, _ = DEFAULT_CORPUS
    tok = build_tokenizer(DEFAULT_CORPUS, vocab_size=512)
    root = tmp_path_factory.mktemp("docs")
    tok.save_pretrained(root / "tok")
    texts = [json.loads(line)["text"] for line in Path(cpt_sample).read_text().splitlines() if line.strip()]
    corpus = root / "corpus"
    corpus.mkdir()
    words = " ".join(texts).split()
    docs = [" ".join(words[i : i + n]) for i, n in zip(range(0, 4000, 97), [3, 40, 7, 1, 25, 60, 2, 12] * 6)]
    for name, part in (("a.jsonl", docs[:20]), ("b.jsonl", docs[20:])):
        (corpus / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in part if t))
    prepare(str(corpus), root / "tok", root / "prep", kind="cpt", field="text", seq_len=SEQ, heldout_fraction=0.0)
    return TokenDataset(root / "prep", seq_len=SEQ)


def test_a_document_block_restarts_positions_at_every_document_and_file(cpt_docs):
    eos = int(json.loads((cpt_docs.root / "index.json").read_text())["special_tokens"]["eos"]["id"])
    every = list(range(cpt_docs.num_items))
    plain, docs = cpt_docs.batch(every), cpt_docs.batch_documents(every)
    assert (docs["input_ids"] == plain["input_ids"]).all()
    pieces = 0
    for r in every:
        ids = plain["input_ids"][r]
        # The oracle: a document starts at the block's start and after each eos.
        starts = [0] + [p for p in range(1, SEQ) if ids[p - 1] == eos]
        seg = np.cumsum(np.isin(np.arange(SEQ), starts))
        assert docs["segment_ids"][r].tolist() == seg.tolist()
        assert docs["position_ids"][r].tolist() == [p - starts[s - 1] for p, s in enumerate(seg)]
        labels = plain["labels"][r].copy()
        labels[starts] = IGNORE_INDEX
        assert docs["labels"][r].tolist() == labels.tolist()
        pieces += len(starts)
    assert pieces > 2 * cpt_docs.num_items  # blocks of several documents, the point of the test
    with pytest.raises(ValueError, match="needs cpt data"):
        TokenDataset.batch_documents(type("Sft", (), {"kind": "sft", "root": "x"})(), [0])


def _pieces(batch: dict[str, np.ndarray]) -> tuple[list[list[int]], list[int], list[np.ndarray]]:
    """Each block's documents as chat_token_losses takes packed rows: item ids per row, each item's length, its tokens."""
    rows, lengths, tokens = [], [], []
    for r, seg in enumerate(batch["segment_ids"]):
        row = []
        for s in np.unique(seg):
            where = np.flatnonzero(seg == s)
            row.append(len(lengths))
            lengths.append(len(where))
            tokens.append(batch["input_ids"][r, where])
        rows.append(row)
    return rows, lengths, tokens


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_per_token_loss_of_a_document_block_equals_each_document_alone(cpt_docs, tiny_model_dir, attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attn).eval()
    blocks = [i for i in range(cpt_docs.num_items) if len(np.unique(cpt_docs.batch_documents([i])["segment_ids"])) >= 3]
    batch = cpt_docs.batch_documents(blocks[:3])
    assert len(blocks) >= 3
    rows, lengths, tokens = _pieces(batch)
    b = model_inputs({k: torch.from_numpy(v) for k, v in batch.items()}, attn, torch.float32)
    with torch.no_grad():
        logits = model(**b).logits
        got = chat_token_losses(logits, b["labels"], rows, lengths, IGNORE_INDEX)
        alone = []
        for t in tokens:
            x = torch.from_numpy(t)[None]
            one = model(input_ids=x).logits[0, :-1]
            alone.append(torch.nn.functional.cross_entropy(one, x[0, 1:], reduction="none"))
    for a, w in zip(got, alone, strict=True):
        assert len(a) == len(w)
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)
    flat = torch.cat(alone)
    with torch.no_grad():
        torch.testing.assert_close(model(**b).loss, flat.mean(), rtol=1e-5, atol=1e-6)
        # Causal attention over the same block lets a document see the one before it: not the same losses.
        causal = model(**{k: torch.from_numpy(v) for k, v in cpt_docs.batch(blocks[:3]).items()}).logits
    assert not torch.allclose(causal, logits, atol=1e-4)
    # Under flash attention the restarting position ids alone mark the documents (transformers' varlen path).
    assert "attention_mask" not in model_inputs(
        {k: torch.from_numpy(v) for k, v in batch.items()}, "flash_attention_2", torch.bfloat16
    )


# -- through the engine and the flow ------------------------------------------------------------


@pytest.mark.distributed
def test_the_engine_trains_document_blocks_with_the_context_settings(tmp_path, tiny_model_dir):
    """1 launch (shard and train, as the flow shares them) of a CPT stage under torch_ddp with document attention and a RoPE
    change: its first loss is the one plain transformers computes on the same blocks with the same
    config and the block-diagonal mask, and its checkpoints' config.json holds the settings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from support.engine import phase_raw, shard_train, write_job
    from tasks.engine.sampler import ResumableSampler

    context = {"rope_theta": 40000.0, "max_position_embeddings": 512}
    cfg = phase_raw(
        "cpt", {"name": "torch_ddp", "precision": "fp32"}, attention="document", max_steps=2, context=context
    )
    stage_dir = tmp_path / "cpt"
    shard_job, job = (
        write_job(
            tmp_path / f"{verb}.json",
            verb=verb,
            phase="cpt",
            phase_cfg=cfg,
            model_dir=tiny_model_dir,
            stage_dir=stage_dir,
        )
        for verb in ("shard", "train")
    )
    run = shard_train(shard_job, job)
    first = run.progress[0]
    assert first["step"] == 1 and first["seq_len"] == SEQ
    saved = json.loads((stage_dir / "step-000002" / "model" / "config.json").read_text())
    assert {k: saved[k] for k in context} == context
    assert json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"] == 256

    data = TokenDataset(json.loads(job.read_text())["data_dir"], seq_len=SEQ)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config = type(config).from_dict({**config.to_dict(), **context})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=config, dtype=torch.float32).eval()
    impl = model.config._attn_implementation
    per_rank = cfg["micro_batch_size"] * cfg["grad_accum_steps"]
    glob = ResumableSampler(data.num_items, 0, 2, seed=cfg["seed"]).next_global(per_rank * 2)
    mine = [glob[r * per_rank : (r + 1) * per_rank] for r in range(2)]

    def loss(build, tensors=lambda b: b) -> float:
        with torch.no_grad():
            out = [
                model(**tensors({k: torch.from_numpy(v) for k, v in build(m).items()}), use_cache=False).loss.double()
                for m in mine
            ]
        return float(sum(out) / len(out))

    documents = loss(data.batch_documents, lambda b: model_inputs(b, impl, torch.float32))
    assert first["loss"] == pytest.approx(documents, rel=1e-6, abs=1e-7)
    assert abs(loss(data.batch) - documents) > 1e-4  # causal blocks: another loss, so the test tells them apart


@pytest.mark.e2e
@pytest.mark.integration
def test_the_rope_settings_reach_cpt_hf_the_export_and_the_card(demo_run):
    """The session's demo run extends the context in CPT (tests/conftest.py demo_run): every model
    folder made from CPT on holds the settings, and the logits checks of the bridge and the export,
    which load those folders with plain transformers, match the checkpoints' fingerprints."""
    from tasks.core.run.manifest import read_manifest

    root, raw = demo_run.run_root, demo_run.raw
    assert demo_run.rc == 0
    want = config_changes(ContextConfig(**raw["cpt"]["context"]))
    base = json.loads((root / "base" / "config.json").read_text())
    assert all(base.get(k) != v for k, v in want.items()), base
    for rel in ("cpt/step-000008/model", "cpt/hf", "sft/step-000008/model", "export"):
        got = json.loads((root / rel / "config.json").read_text())
        assert {k: got.get(k) for k in want} == want, rel
    for rel in ("cpt/hf", "export"):
        meta = read_manifest(root / rel)["meta"]
        check = meta["verification"]
        assert check["fingerprint_match"] and check["top1_disagreements_beyond_tolerance"] == 0, (rel, check)
    assert read_manifest(root / "cpt/hf")["meta"]["context"] == want
    card = (root / "export" / "README.md").read_text()
    assert (
        "| context length trained | 64 tokens; rope_theta 10000.0 → 20000.0; rope_scaling null → {factor: 2.0, "
        "high_freq_factor: 4.0, low_freq_factor: 1.0, original_max_position_embeddings: 256, rope_type: llama3}; "
        "max_position_embeddings 256 → 512 |" in card
    ), card
    assert "| 128 tokens; RoPE and positions as CPT left them (cpt/hf) |" in card
    rows = {s["stage"]: s for s in demo_run.summary["stages"]}
    for stage, seq in (("train_cpt", 64), ("train_sft", 128)):
        detail = rows[stage]["detail"]
        assert detail["seq_len"] == seq and detail["tokens_per_s"] == detail["medians"]["tokens_per_s"] > 0
