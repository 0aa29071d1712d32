"""The layout-neutral view of a checkpoint's state, on hand-made layouts (no launch): pieces cut by
`local_piece` from whole tensors, written as the engine writes them, read back whole, bitwise; and
which plugins keep (and so save) fp32 masters, as the disk estimate counts them.

    pytest -q tests/test_state_view.py

The same view on checkpoints the engine really wrote (tp=2, pp=2, ZeRO-2, DDP, tied, bf16) against
each rank's live state: tests/test_engine_dist.py::test_layout_neutral_view_equals_the_state_it_came_from.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tasks.core.config.plugins import PLUGINS
from tasks.core.errors import ConversionError, ManifestError
from tasks.core.models.convert.state_view import (
    MASTERS,
    CheckpointState,
    Piece,
    local_piece,
    rank_record_name,
    rank_tensor_name,
)


def _pieces(name: str, pid: int, shape, tp_dim, tp_size: int, zero_size: int) -> list[list[Piece]]:
    """[tp rank][zero rank] pieces of one parameter, as ColossalAI cuts it: a tp slice (rows past a
    padded vocabulary included), then equal flat shares of it, the last one padded."""
    local = list(shape)
    if tp_dim is not None:
        local[tp_dim] = -(-shape[tp_dim] // tp_size)
    numel = math.prod(local)
    length = -(-numel // zero_size)
    return [
        [
            Piece(name, pid, tuple(shape), tuple(local), tp_dim, t, tp_size, z * length, length, saved=True)
            for z in range(zero_size)
        ]
        for t in range(tp_size if tp_dim is not None else 1)
    ]


def _write(ckpt: Path, params: dict[str, tuple[torch.Tensor, object, int, int]]) -> dict[str, list[Piece]]:
    """masters/ and optimizer/ of a checkpoint whose ranks hold `params` (name: whole, tp_dim, tp, zero)."""
    ranks: dict[int, list[tuple[Piece, torch.Tensor]]] = {}
    cut: dict[str, list[Piece]] = {}
    states, weight_map = {}, {}
    for pid, (name, (whole, tp_dim, tp, zero)) in enumerate(params.items()):
        grid = _pieces(name, pid, whole.shape, tp_dim, tp, zero)
        for t, row in enumerate(grid):
            for z, p in enumerate(row):
                rank = t * zero + z
                ranks.setdefault(rank, []).append((p, local_piece(whole, p)))
                cut.setdefault(name, []).append(p)
        states[pid] = {"step": torch.tensor(7.0), "exp_avg": whole * 0.5, "exp_avg_sq": whole * whole}
        weight_map[str(pid)] = "pytorch_optim-00001.bin"
    (ckpt / MASTERS).mkdir(parents=True)
    for rank, held in ranks.items():
        save_file({p.name: v for p, v in held}, str(ckpt / MASTERS / rank_tensor_name(rank)))
        rec = {"rank": rank, "world_size": len(ranks), "plugin": "test", "params": [p.record() for p, _ in held]}
        (ckpt / MASTERS / rank_record_name(rank)).write_text(json.dumps(rec))
    (ckpt / "optimizer").mkdir()
    torch.save(states, ckpt / "optimizer" / "pytorch_optim-00001.bin")
    (ckpt / "optimizer" / "pytorch_optim.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return cut


def test_whole_masters_and_adam_state_come_back_bitwise_from_any_cut(tmp_path):
    g = torch.Generator().manual_seed(0)
    params = {
        "embed (padded vocabulary, tp rows)": (torch.randn(515, 6, generator=g), 0, 2, 1),
        "o_proj (tp columns, ZeRO 2 inside each slice)": (torch.randn(6, 10, generator=g), 1, 2, 2),
        "norm (odd numel, ZeRO 4, last share padded)": (torch.randn(7, generator=g), None, 1, 4),
        "head (tp 2 and ZeRO 3, uneven)": (torch.randn(9, 5, generator=g), 0, 2, 3),
    }
    cut = _write(tmp_path, params)
    view = CheckpointState(tmp_path)
    assert view.names() == list(params) and view.has_masters
    for name, (whole, *_rest) in params.items():
        assert torch.equal(view.master(name), whole), name
        adam = view.adam(name)
        assert (
            torch.equal(adam["exp_avg"], whole * 0.5)
            and torch.equal(adam["exp_avg_sq"], whole * whole)
            and adam["step"] == 7.0
        )
        for p in cut[name]:  # the padding past a slice's end is zeros, as the optimizers pad
            piece = local_piece(whole, p)
            assert piece.shape == (p.length,) and not piece[max(0, p.local_numel - p.start) :].any()


def test_one_target_piece_is_read_from_the_source_files_bitwise_without_the_whole(tmp_path):
    """`read_piece` and `segments` give `local_piece`'s bytes of every state for target cuts the source
    did not make (tp along rows, columns, a padded vocabulary, ZeRO shares mid-row and past the end):
    from the files where the source keeps the state flat, cut from the whole where its master is tp-cut."""
    g = torch.Generator().manual_seed(1)
    params = {
        "embed": (torch.randn(515, 6, generator=g), None, 1, 2),  # ZeRO-2 source: flat masters
        "o_proj": (torch.randn(40, 10, generator=g), None, 1, 3),
        "norm": (torch.randn(7, generator=g), None, 1, 4),
        "head": (torch.randn(9, 5, generator=g), 0, 2, 3),  # a tp-cut source master: read whole
    }
    _write(tmp_path, params)
    view = CheckpointState(tmp_path)
    assert view.extents("embed", "master") is not None and view.extents("embed", "exp_avg") is not None
    assert view.extents("head", "master") is None and view.extents("head", "exp_avg_sq") is not None
    for name, (whole, *_rest) in params.items():
        states = {"master": whole, "exp_avg": whole * 0.5, "exp_avg_sq": whole * whole}
        dims = [None, *range(whole.dim())]
        for tp_dim, tp, zero in [
            (d, t, z) for d in dims for t in (1, 2, 3) for z in (1, 2, 3, 5) if (d is None) == (t == 1)
        ]:
            for p in [p for row in _pieces(name, 0, whole.shape, tp_dim, tp, zero) for p in row]:
                for key, full in states.items():
                    want = local_piece(full, p)
                    assert torch.equal(view.read_piece(name, key, p), want), (name, key, p)
                    segs = view.segments(name, key, p)
                    if segs is not None:  # what a file-to-file writer copies
                        got = b"".join(bytes(n) if fd < 0 else os.pread(fd, n, at) for n, fd, at in segs)
                        assert got == want.numpy().tobytes(), (name, key, p)
    view.close()
    with pytest.raises(ValueError, match="one of master, exp_avg, exp_avg_sq"):
        view.read_piece("norm", "step", _pieces("norm", 0, (7,), None, 1, 1)[0][0])
    f = tmp_path / MASTERS / rank_tensor_name(1)
    f.write_bytes(f.read_bytes()[:-8])  # rank 1's last master piece cut short: its header check names it
    (last,) = _pieces("norm", 0, (7,), None, 1, 1)[0]
    with pytest.raises(ConversionError, match="rank-00001.safetensors: .* \\(truncated\\)"):
        CheckpointState(tmp_path).read_piece("norm", "master", last)


def test_a_rank_reads_its_adamw_state_and_masters_as_its_pieces(tmp_path):
    """tasks/engine/state_read.py's `load_optimizer` then masters.restore, the reads Engine.load runs, on a
    torch AdamW over each target rank's fp32 master shares of cuts the source did not make (tp along rows
    and columns, a padded vocabulary, ZeRO 3 mid-row and past the end): each rank's masters and moments
    are `local_piece` of the whole states (the cut ColossalAI's loaders make), bitwise; step and the
    parameter groups are the files'. An optimizer state it does not know (amsgrad's) is left to ColossalAI."""
    from types import SimpleNamespace

    from tasks.engine import masters, state_read

    g = torch.Generator().manual_seed(2)
    params = {
        "embed": (torch.randn(515, 6, generator=g), None, 1, 2),
        "o_proj": (torch.randn(40, 10, generator=g), None, 1, 2),
        "norm": (torch.randn(7, generator=g), None, 1, 2),
        "head": (torch.randn(9, 5, generator=g), 0, 2, 1),  # a tp-cut source master: cut from the whole
    }
    _write(tmp_path, params)
    groups = torch.optim.AdamW([torch.zeros(1)], lr=3e-4, weight_decay=0.05).state_dict()["param_groups"]
    groups[0]["params"] = list(range(len(params)))
    torch.save(groups, tmp_path / "optimizer" / "groups.bin")
    index = tmp_path / "optimizer" / "pytorch_optim.bin.index.json"
    index.write_text(json.dumps({"metadata": {"param_groups": "groups.bin"}, **json.loads(index.read_text())}))
    target = {"embed": (0, 2, 3), "o_proj": (1, 2, 3), "norm": (None, 1, 3), "head": (1, 2, 3)}  # tp_dim, tp, ZeRO
    for t in range(2):
        for z in range(3):
            held = []
            for pid, (name, (whole, *_)) in enumerate(params.items()):
                tp_dim, tp, zero = target[name]
                p = _pieces(name, pid, whole.shape, tp_dim, tp, zero)[t if tp > 1 else 0][z]
                q = torch.zeros(p.length)
                held.append(masters.Local(p, q, q, None, q, p))
            opt = torch.optim.AdamW([loc.param for loc in held], lr=1.0)
            eng = SimpleNamespace(optimizer=opt, cfg=SimpleNamespace(lora=None), weights_dtype="bf16", rank=t * 3 + z)
            view = CheckpointState(tmp_path)
            said = state_read.load_optimizer(eng, tmp_path, view, held)
            assert said.startswith(f"read this rank's AdamW state of {tmp_path.name} as its pieces: 8 tensors"), said
            restored = masters.restore(eng, tmp_path, held=held, view=view)
            assert "(4 cut from the whole tensors for this layout)" in restored, restored
            view.close()
            assert opt.param_groups[0]["lr"] == 3e-4 and opt.param_groups[0]["weight_decay"] == 0.05
            for loc, (whole, *_) in zip(held, params.values()):
                st, p = opt.state[loc.param], loc.piece
                assert list(st) == ["step", "exp_avg", "exp_avg_sq"] and float(st["step"]) == 7.0
                for got, full in ((loc.master, whole), (st["exp_avg"], whole * 0.5), (st["exp_avg_sq"], whole * whole)):
                    assert torch.equal(got, local_piece(full, p)), (p, t, z)
    opt = torch.optim.AdamW([loc.param for loc in held], amsgrad=True)
    eng = SimpleNamespace(optimizer=opt, cfg=SimpleNamespace(lora=None))
    assert state_read.load_optimizer(eng, tmp_path, CheckpointState(tmp_path), held) == ""


def test_a_missing_piece_is_named(tmp_path):
    _write(tmp_path, {"w": (torch.arange(12.0).reshape(4, 3), None, 1, 2)})
    rec = json.loads((tmp_path / MASTERS / rank_record_name(1)).read_text())
    rec["params"][0]["saved"] = False
    (tmp_path / MASTERS / rank_record_name(1)).write_text(json.dumps(rec))
    with pytest.raises(ManifestError, match="the master pieces of w cover 6 of its 12 elements"):
        CheckpointState(tmp_path).master("w")


def test_an_fp32_lora_checkpoints_weights_come_from_its_adapter_under_peft_keys(tmp_path):
    """No masters (fp32) and no model/: the view reads each adapter weight from adapter/ under the key peft
    saved it with (the PeftModel's prefix, no adapter name), and names a missing one."""
    name = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    whole = torch.arange(8.0).reshape(2, 4)
    _write(tmp_path, {name: (whole, None, 1, 2)})
    for f in (tmp_path / MASTERS).glob("rank-*.json"):  # fp32: the records say where, no piece is saved
        rec = json.loads(f.read_text())
        rec["params"] = [{**p, "saved": False} for p in rec["params"]]
        f.write_text(json.dumps(rec))
    (tmp_path / "adapter").mkdir()
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({key: whole}, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    view = CheckpointState(tmp_path)
    assert not view.has_masters and torch.equal(view.master(name), whole)
    assert view.weights_dtype(name) == torch.float32 and torch.equal(view.adam(name)["exp_avg"], whole * 0.5)
    save_file({"other": whole}, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    with pytest.raises(ManifestError, match="no weight model.layers.0.self_attn.q_proj.lora_A.weight"):
        CheckpointState(tmp_path).master(name)


def test_a_checkpoint_without_records_is_refused_naming_why(tmp_path):
    with pytest.raises(ManifestError, match="no masters/rank-\\*.json"):
        CheckpointState(tmp_path)


@pytest.mark.parametrize(
    "plugin, precision, zero, saves",
    [
        ("low_level_zero", "bf16", 2, True),
        ("low_level_zero", "fp16", 1, True),
        ("hybrid_parallel", "bf16", 0, True),
        ("hybrid_parallel", "bf16", 1, True),
        ("hybrid_parallel", "fp32", 0, False),
        ("gemini", "bf16", 0, True),
        ("torch_ddp", "bf16", 0, False),
        ("torch_ddp", "fp32", 0, False),
    ],
)
def test_which_plugins_save_fp32_masters(plugin, precision, zero, saves):
    assert PLUGINS[plugin].saves_masters(precision, zero) is saves


def test_the_disk_estimate_counts_the_masters_a_checkpoint_holds():
    from support.engine import run_raw
    from tasks.core.config.load import parse_config
    from tasks.core.preflight.model_info import estimate_parameters
    from tasks.core.preflight.storage import estimate_local_bytes

    mc = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    n = estimate_parameters(mc)

    def need(plugin: dict) -> int:
        raw = run_raw(Path("/m"), Path("/r"), "sft", plugin, keep_last=1)  # sft: the HF copies stay the same
        return estimate_local_bytes(parse_config(raw), mc, local_run_root=True)[0]

    ddp = need({"name": "torch_ddp", "precision": "fp32"})
    # two checkpoints of the stage (keep_last 1, plus the one being written)
    assert need({"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}) - ddp == 2 * n * (
        (2 + 8 + 4) - (4 + 8)
    )
    assert need({"name": "torch_ddp", "precision": "bf16"}) == ddp  # fp32 weights under autocast: no masters apart


# ---- pre-flight: what a training stage does with the checkpoints under the run root ----------------


def _run_root_with_checkpoint(tmp_path, raw: dict) -> dict[str, str]:
    """base/ and data/cpt/ built, and cpt/step-000003 committed under `raw`'s layout; the parents' content digests."""
    from tasks.core.config.schema import RunConfig
    from tasks.core.run.digest import config_digest, content_digest
    from tasks.core.run.manifest import write_manifest
    from tasks.core.run.segments import record

    root = Path(raw["run_root"])
    parents = {}
    for stage, rel in (("load_from_hf", "base"), ("prepare_cpt", "data/cpt")):
        (root / rel).mkdir(parents=True)
        (root / rel / "f.bin").write_bytes(rel.encode())
        parents[stage] = content_digest(write_manifest(root / rel, kind="test", config_digest=f"digest of {rel}"))
    cfg = RunConfig.model_validate(raw)
    ckpt = root / "cpt" / "step-000003"
    ckpt.mkdir(parents=True)
    (ckpt / "train_state.json").write_text("{}")
    p = cfg.cpt.plugin
    layout = record(
        {"name": p.name, "tp": p.tp_size, "pp": p.pp_size, "zero": p.zero_stage},
        2,
        1,
        cfg.cpt.micro_batch_size,
        cfg.cpt.grad_accum_steps,
    )
    write_manifest(
        ckpt,
        kind="colossalai-checkpoint",
        meta={"layout": layout},
        config_digest=config_digest(cfg, "boost_and_shard", parents),
    )
    return parents


@pytest.mark.parametrize(
    "change, expect",
    [
        (
            lambda c: c.update(plugin={"name": "torch_ddp", "precision": "fp32"}, launch={"nproc_per_node": 1}),
            (
                "ok",
                (
                    "cpt: resuming step-000003, written under hybrid_parallel tp=2 dp=1 on 2 ranks (4 x 1 a rank), "
                    "under torch_ddp dp=1 on 1 rank (4 x 1 a rank): model and optimizer re-sharded"
                ),
            ),
        ),
        (
            lambda c: c.update(
                plugin={"name": "torch_ddp", "precision": "fp32"}
            ),  # dp 1 -> 2: the global batch doubles
            (
                "problem",
                (
                    "its checkpoints were trained at a global batch of 4 sequences; torch_ddp dp=2 on 2 ranks (4 x 1 "
                    "a rank) makes "
                    "4 x 1 x dp 2 = 8: set micro_batch_size: 2 to continue them"
                ),
            ),
        ),
        (lambda c: c.update(lr=1e-4), ("ok", "cpt: what the model learns from changed since step-000003")),
        (lambda c: None, ("ok", "cpt: resuming step-000003 under the layout that wrote it")),
    ],
)
def test_preflight_says_how_a_stage_continues_its_checkpoints(tmp_path, change, expect):
    import copy

    from tasks.core.preflight.checks import load_for_check
    from tasks.core.preflight.report import CheckContext, PreflightReport
    from tasks.core.preflight.resume import check_resume
    from tests.conftest import tiny_config_raw, write_config

    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    _run_root_with_checkpoint(tmp_path, raw)
    new = copy.deepcopy(raw)
    change(new["cpt"])
    ctx = CheckContext(load_for_check(write_config(tmp_path / "c.yaml", new)), None, None, None, PreflightReport())
    check_resume(ctx)
    kind, text = expect
    if kind == "ok":
        assert any(line.startswith(text) for line in ctx.report.checked), ctx.report.checked
        assert not ctx.report.problems
    else:
        assert [where for where, _ in ctx.report.problems] == ["cpt.grad_accum_steps"], ctx.report.problems
        assert text in ctx.report.problems[0][1]


@pytest.mark.parametrize(
    "change, moved",
    [
        (lambda c: c.update(lr=1e-4), True),
        (lambda c: c.update(seed=7), True),
        (lambda c: c.update(plugin={"name": "torch_ddp", "precision": "fp32"}, launch={"nproc_per_node": 1}), False),
    ],
)
def test_a_changed_learning_rate_still_moves_the_checkpoints_aside(tmp_path, monkeypatch, change, moved):
    """What the model learns from (lr, seed) changes the shard stage's digest: the training task moves
    the stage's checkpoints aside (kept, never deleted) and trains from step 0; a new layout alone does not."""
    import copy
    import logging

    import tasks.stages.train
    from tasks.core.config.load import load_config
    from tasks.core.run.digest import config_digest
    from tasks.core.storage.fs import RunStore
    from tests.conftest import tiny_config_raw, write_config

    raw = tiny_config_raw(tmp_path / "model", tmp_path / "run")
    parents = _run_root_with_checkpoint(tmp_path, raw)
    new = copy.deepcopy(raw)
    change(new["cpt"])
    cfg = load_config(write_config(tmp_path / "c.yaml", new))
    monkeypatch.setattr(tasks.stages.train, "get_run_logger", lambda: logging.getLogger("test"))
    tasks.stages.train._supersede_foreign(RunStore(cfg.run_uri), "cpt", config_digest(cfg, "boost_and_shard", parents))
    root = tmp_path / "run"
    aside = list(root.glob("cpt.superseded-*"))
    if moved:
        assert len(aside) == 1 and (aside[0] / "step-000003" / "train_state.json").is_file()
        assert not (root / "cpt" / "step-000003").exists()
    else:
        assert not aside and (root / "cpt" / "step-000003" / "train_state.json").is_file()


def test_the_card_lists_each_segment_of_a_stage_that_changed_layout(tmp_path):
    from tasks.core.config.load import parse_config
    from tasks.core.hub.card import model_card, train_facts
    from tasks.core.run.manifest import MANIFEST
    from tasks.core.run.segments import record
    from tests.conftest import tiny_config_raw

    cfg = parse_config(tiny_config_raw(tmp_path / "m", tmp_path))
    two = record({"name": "low_level_zero", "zero": 2}, 2, 2, 4, 1)
    one = record({"name": "low_level_zero", "zero": 2}, 1, 1, 4, 2)
    for phase in ("cpt", "sft"):
        step = tmp_path / phase / f"step-{cfg.phase(phase).max_steps:06d}"
        (step / MANIFEST).parent.mkdir(parents=True)
        segs = [{"from_step": 0, **two}, {"from_step": 4, **one}] if phase == "sft" else [{"from_step": 0, **two}]
        (step / "train_state.json").write_text(json.dumps({"losses": [2.0], "segments": segs}))
        (step / MANIFEST).write_text(json.dumps({"meta": {}}))
    card = model_card(cfg, {"meta": {}}, train_facts(cfg, {}, lambda rel: (tmp_path / rel).read_text()))
    row = next(line for line in card.splitlines() if line.startswith("| plugin and parallel layout |"))
    assert row.endswith(
        "| from step 0: `low_level_zero zero=2 dp=2 on 2 ranks (4 x 1 a rank)`<br>"
        "from step 4: `low_level_zero zero=2 dp=1 on 1 rank (4 x 2 a rank)` |"
    ), row
    assert "`hybrid_parallel` tp=2" in row  # CPT ran under one layout: the config's, as before
