"""The engine's lean optimizer save (tasks/engine/lean_save.py) writes ColossalAI's files byte for
byte: both generators run on the same Adam state in a one-process gloo group and their blocks are
written by ColossalAI's own `save_state_dict_shards` / `save_state_dict` into two folders. Small
blocks force several files; a vocab-padded embedding (unpadding leaves a view of a larger tensor)
and ZeRO's padded flat shards cover the copies that must (hybrid_parallel) or must not
(low_level_zero, whose CPU files hold its padded gather buffer) be compacted. Tensor-parallel
gathers need two ranks: tests/test_engine_dist.py's checkpoints exercise those.

    .venv/bin/python -m pytest -q tests/test_lean_save.py
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tasks.engine import lean_save


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'pg'}", rank=0, world_size=1)
    lean_save.apply()
    yield dist.group.WORLD
    dist.destroy_process_group()


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _adam_state(params: list[torch.Tensor], steps: int = 2) -> torch.optim.Adam:
    torch.manual_seed(7)
    opt = torch.optim.Adam(params, lr=1e-2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return opt


def _write(gen, folder: Path, base: str = "pytorch_optim.bin") -> int:
    from colossalai.checkpoint_io import CheckpointIndexFile
    from colossalai.checkpoint_io.utils import save_state_dict_shards

    folder.mkdir()
    index = CheckpointIndexFile(str(folder))
    total = save_state_dict_shards(gen, str(folder), index, base, is_master=True)
    index.append_meta_data("total_size", total)
    index.write_index_file("pytorch_optim.bin.index.json")
    return len(index.weight_map)


@pytest.mark.parametrize("use_zero", [False, True], ids=["tp", "zero"])
def test_hybrid_parallel_blocks_are_colossalais_bytes(group, tmp_path, use_zero):
    from colossalai.checkpoint_io.hybrid_parallel_checkpoint_io import HybridParallelCheckpointIO

    # working params; the embedding's rows are padded (ColossalAI pads the vocabulary to a multiple)
    shapes = {
        "embed": ((40, 16), (37, 16)),
        "norm": ((16,), (16,)),
        "proj": ((24, 16), (24, 16)),
        "head": ((40, 16), (37, 16)),
    }
    working = [torch.nn.Parameter(torch.zeros(cur)) for cur, _ in shapes.values()]
    # ZeRO's master params: flat shards, padded past the working numel
    masters = [torch.nn.Parameter(torch.zeros(w.numel() + 3)) for w in working] if use_zero else working
    opt = _adam_state(masters)
    wrapper = SimpleNamespace(
        optim=opt,
        param_info={
            "param2id": {id(w): i for i, w in enumerate(working)},
            "param2shape": {id(w): torch.Size(orig) for w, (_, orig) in zip(working, shapes.values())},
        },
        get_master_to_working_map=lambda: {id(m): w for m, w in zip(masters, working)} if use_zero else None,
    )
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    original = HybridParallelCheckpointIO._optimizer_sharder.__wrapped__
    size = 0.004  # MiB: a block of one or two parameters' states
    n_ref = _write(original(wrapper, use_zero, group, group, size), tmp_path / "colossalai")
    n_new = _write(lean_save.hybrid_parallel_sharder(wrapper, use_zero, group, group, size), tmp_path / "lean")
    assert n_ref == n_new == len(working)
    ref, new = _digests(tmp_path / "colossalai"), _digests(tmp_path / "lean")
    assert len(ref) > 3 and ref == new
    for p, s in opt.state.items():  # the live state untouched (unpadding sets `.data` on what it gets)
        assert all(torch.equal(v, before[id(p)][k]) for k, v in s.items())
        assert not hasattr(s["exp_avg"], "_padding_dim")


def test_low_level_zero_blocks_are_colossalais_bytes(group, tmp_path):
    from colossalai.checkpoint_io.utils import get_shard_filename, save_state_dict
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    working = [torch.zeros(s) for s in ((37, 16), (16,), (24, 16), (37, 16))]
    masters = [torch.nn.Parameter(torch.zeros(w.numel() + 5)) for w in working]  # padded flat shards
    opt = _adam_state(masters)
    fake = SimpleNamespace(
        optim=opt,
        master_to_working_param={id(m): w for m, w in zip(masters, working)},
        param_to_pg={w: group for w in working},
    )
    original = LowLevelZeroOptimizer.state_dict_shard.__wrapped__
    for name, gen in (
        ("colossalai", original(fake, 0.004, None, True)),
        ("lean", lean_save.low_level_zero_shard(fake, 0.004, True)),
    ):
        folder = tmp_path / name
        folder.mkdir()
        keys = []
        for idx, (shard, _) in enumerate(gen):  # LowLevelZeroCheckpointIO.save_sharded_optimizer's loop
            keys.append(sorted(shard))
            save_state_dict(shard, str(folder / get_shard_filename("pytorch_optim.bin", idx)), use_safetensors=False)
        (folder / "keys").write_text(repr(keys))
    ref, new = _digests(tmp_path / "colossalai"), _digests(tmp_path / "lean")
    assert len(ref) > 3 and ref == new


def test_a_written_block_is_emptied_before_the_next_parameter_is_gathered(group):
    shapes = [(64, 16), (64, 16), (8,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = _adam_state(params, steps=1)
    wrapper = SimpleNamespace(
        optim=opt,
        param_info={
            "param2id": {id(p): i for i, p in enumerate(params)},
            "param2shape": {id(p): p.shape for p in params},
        },
        get_master_to_working_map=lambda: None,
    )
    gen = lean_save.hybrid_parallel_sharder(wrapper, False, group, group, 0.001)
    first, _ = next(gen)
    assert list(first) == [0]
    second, _ = next(gen)  # resumed: the first block's tensors are released before param 1 is gathered
    assert first == {} and list(second) == [1]


def test_apply_is_idempotent_and_the_async_path_is_colossalais(group):
    from colossalai.booster.plugin.low_level_zero_plugin import LowLevelZeroCheckpointIO
    from colossalai.checkpoint_io.hybrid_parallel_checkpoint_io import HybridParallelCheckpointIO

    assert lean_save.apply() == []
    for cls in (HybridParallelCheckpointIO, LowLevelZeroCheckpointIO):
        assert getattr(cls.save_sharded_optimizer, lean_save._MARK)
    assert not lean_save._in_sync_save()  # outside a synchronous save the sharders are ColossalAI's
