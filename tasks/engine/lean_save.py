"""ColossalAI's synchronous sharded optimizer save, the same files with fewer copies held at once.

    python -m tasks.engine.lean_save        # prints what apply() patched (then nothing the second time)

ColossalAI 0.5.0 writes an optimizer checkpoint from a generator of blocks (dicts of whole,
gathered per-parameter states, at most `size_per_shard` MiB unless one state is larger); the
caller writes each block as one file. Three things in it make a rank hold far more than one block,
which set the shard verb's peak of a 50M Llama (measured by benchmarks/scale.py, where the
32000 x 512 embedding and LM head dominate):

- the next parameter's state is gathered BEFORE the sharder is asked whether the current block
  must be written first, so the previous block (e.g. the embedding's full Adam state) is still
  held while the LM head's is gathered;
- the caller's loop variable (`for idx, shard_pair in enumerate(gen)`) keeps a yielded block alive
  while the generator computes the next one;
- hybrid_parallel's `gather_from_sharded_optimizer_state` deep-copies the rank's local states,
  gathers into a list, concatenates, then clones the result: about four copies of one full state.

The replacements below decide the flush from the state's size computed from shapes (the same
float sum `StateDictSharder` / `state_dict_shard` compute, so the files break at the same
parameters), empty a yielded block when the generator is resumed (the caller has written it by
then), and gather straight into a preallocated full tensor. The tensors handed to `torch.save` are
the ones ColossalAI hands it: fresh, compact storages for hybrid_parallel (a result that is still
the live state or a view of a larger storage is cloned, as ColossalAI's clone does), and for
low_level_zero the padded gather buffer it already saves a view of (torch.save writes whole
storages, so that padding is part of its files). tests/test_lean_save.py compares the bytes.

Only the synchronous save (`use_async=False`, the engine's) is changed: the async writers keep
the blocks after the generator moves on, so that path runs ColossalAI's code untouched. Idempotent;
applied by the engine before it builds a hybrid_parallel or low_level_zero plugin
(`tasks.engine.builders`).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections import OrderedDict

import torch
import torch.distributed as dist

_MARK = "_cpt_to_sft_lean_save"
_CPU = torch.device("cpu")
_SYNC = threading.local()  # set while a patched synchronous save_sharded_optimizer runs


@contextlib.contextmanager
def _sync_save():
    depth = getattr(_SYNC, "depth", 0)
    _SYNC.depth = depth + 1
    try:
        yield
    finally:
        _SYNC.depth = depth


def _in_sync_save() -> bool:
    return getattr(_SYNC, "depth", 0) > 0


def _size_mib(shape, dtype: torch.dtype) -> float:
    """`calculate_tensor_size` of a tensor of this shape and dtype, without allocating it."""
    from colossalai.checkpoint_io.utils import calculate_tensor_size

    return calculate_tensor_size(torch.empty(shape, dtype=dtype, device="meta"))


def _compact(v: torch.Tensor) -> bool:
    """Whether torch.save would write exactly this tensor's elements (its own storage, no more)."""
    return (
        v.storage_offset() == 0 and v.is_contiguous() and v.untyped_storage().nbytes() == v.numel() * v.element_size()
    )


def _gather(v: torch.Tensor, n: int, dim: int, group) -> torch.Tensor:
    """All ranks' `v` concatenated along `dim`; along dim 0 gathered straight into the result."""
    if dim == 0 and v.is_contiguous():
        full = torch.empty((n * v.shape[0], *v.shape[1:]), dtype=v.dtype, device=v.device)
        dist.all_gather(list(full.chunk(n, dim=0)), v, group=group)
        return full
    parts = [torch.empty_like(v) for _ in range(n)]
    dist.all_gather(parts, v, group=group)
    return torch.cat(parts, dim=dim)


def gather_full_state(
    state, param: torch.Tensor, original_shape: torch.Size, dp_group, tp_group, use_zero: bool
) -> OrderedDict:
    """`HybridParallelCheckpointIO.gather_from_sharded_optimizer_state(..., inplace=False)`: the same
    values, strides and storages, without the deep copy of the local states or the extra clone."""
    from colossalai.checkpoint_io.utils import search_padding_dim, search_tp_partition_dim
    from colossalai.tensor.padded_tensor import init_as_padded_tensor, to_unpadded_tensor
    from colossalai.utils import get_current_device

    dp_size, tp_size = dist.get_world_size(dp_group), dist.get_world_size(tp_group)
    out = copy.copy(state)  # the state's own mapping type and key order, as its deep copy has; values replaced
    for k, v in state.items():
        if v is None or not isinstance(v, torch.Tensor) or k == "step":
            out[k] = copy.deepcopy(v)
            continue
        live = v
        if use_zero:
            v = v.to(get_current_device())
            flat = torch.empty(dp_size * v.numel(), dtype=v.dtype, device=v.device)
            dist.all_gather(list(flat.chunk(dp_size)), v.reshape(-1), group=dp_group)
            v = flat[: param.numel()].reshape_as(param)
        dim = search_tp_partition_dim(param.shape, original_shape, tp_size)
        if dim is not None:
            v = _gather(v, tp_size, dim, tp_group)
        if v.untyped_storage().data_ptr() == live.untyped_storage().data_ptr():
            v = v.detach().clone()  # unpadding below sets `.data`: never on the optimizer's own tensor
        padding_dim = search_padding_dim(v.shape, original_shape)
        if padding_dim is not None:
            v = init_as_padded_tensor(v, v.shape[padding_dim], original_shape[padding_dim], padding_dim)
            v = to_unpadded_tensor(v)
        v = v.detach()
        if v.device != _CPU:  # ColossalAI's default device for the gathered state
            v = v.to(_CPU)
        elif not _compact(v):
            v = v.clone()
        out[k] = v
    return out


def _full_state_mib(
    state, param: torch.Tensor, original_shape: torch.Size, use_zero: bool, dp_size: int
) -> float | None:
    """The size `StateDictSharder.append_optim_state` will compute for the gathered state (the same
    float sum, in the same order); None when a state is not shaped like its parameter."""
    total = 0.0
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            continue
        if k == "step":
            total += _size_mib(v.shape, v.dtype)
            continue
        local_ok = v.numel() * dp_size >= param.numel() if use_zero else v.shape == param.shape
        if not local_ok:
            return None
        total += _size_mib(original_shape, v.dtype)
    return total


def hybrid_parallel_sharder(optimizer, use_zero: bool, dp_group, tp_group, size_per_shard: int = 1024):
    """`HybridParallelCheckpointIO._optimizer_sharder` without `pinned_state_dicts`: the same blocks,
    each written before the next parameter is gathered and emptied once the caller is done with it."""
    from colossalai.checkpoint_io.utils import StateDictSharder

    sharder = StateDictSharder(size_per_shard)
    param_info = optimizer.param_info
    master_to_working_map = optimizer.get_master_to_working_map()
    dp_size = dist.get_world_size(dp_group)

    def take():
        block, size = sharder.current_block, sharder.current_block_size
        sharder.current_block, sharder.current_block_size = OrderedDict(), 0
        return block, size

    for param, state in optimizer.optim.state.items():
        if param is None:
            continue
        working_param = master_to_working_map[id(param)] if master_to_working_map is not None else param
        param_id = param_info["param2id"][id(working_param)]
        original_shape = param_info["param2shape"][id(working_param)]
        size = _full_state_mib(state, working_param, original_shape, use_zero, dp_size)
        # StateDictSharder's own condition, asked before gathering instead of after
        if (
            size is not None
            and sharder.current_block_size + size > sharder.max_shard_size
            and sharder.current_block_size > 0
        ):
            block, block_size = take()
            yield block, block_size
            block.clear()
        state_ = gather_full_state(state, working_param, original_shape, dp_group, tp_group, use_zero)
        block, block_size = sharder.append_optim_state(param_id, state_)
        if block is not None:  # only where the size could not be known before gathering
            yield block, block_size
            block.clear()
    block, block_size = take()
    yield block, block_size
    block.clear()


def low_level_zero_shard(self, max_shard_size: int = 1024, only_on_master: bool = False):
    """`LowLevelZeroOptimizer.state_dict_shard` without `pinned_state_dicts`: the same blocks (on the
    CPU a block's tensor is a view of the padded gather buffer, as ColossalAI saves it), each written
    before the next parameter is gathered, no deep copy of the local shards, emptied once written."""
    from colossalai.accelerator import get_accelerator
    from colossalai.zero.low_level._utils import all_gather_into_flat_tensor_nd, get_nd_rank, get_nd_world_size

    ret_block, ret_block_size = {}, 0
    device = get_accelerator().get_current_device()
    local_states = self.optim.state_dict()["state"]
    master2idx, cnt = {}, 0
    for param_group in self.optim.param_groups:
        for param in param_group["params"]:
            master2idx[param] = cnt
            cnt += 1

    for param_group in self.optim.param_groups:
        for master_param in param_group["params"]:
            param_idx = master2idx[master_param]
            states = local_states[param_idx]
            working_param = self.master_to_working_param[id(master_param)]
            pg = self.param_to_pg[working_param]
            keep = not only_on_master or get_nd_rank(pg) == 0
            current_block_size = 0
            for k, v in states.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    current_block_size += _size_mib(working_param.shape, v.dtype)
            if ret_block_size + current_block_size > max_shard_size and len(ret_block) > 0:
                block, block_size = ret_block, ret_block_size
                ret_block, ret_block_size = {}, 0
                yield block, block_size
                block.clear()
            current_block = (
                {
                    k: (None if isinstance(v, torch.Tensor) and k != "step" else copy.deepcopy(v))
                    for k, v in states.items()
                }
                if keep
                else {}
            )
            for k, v in states.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    state_tensor = torch.empty(v.numel() * get_nd_world_size(pg), device=device, dtype=v.dtype)
                    all_gather_into_flat_tensor_nd(state_tensor, v.to(device).flatten(), pg)
                    state_tensor = state_tensor[: working_param.numel()].reshape_as(working_param)
                    if keep:
                        current_block[k] = state_tensor.cpu()
                    del state_tensor
            ret_block[param_idx] = current_block
            ret_block_size += current_block_size
    yield ret_block, ret_block_size
    ret_block.clear()


def apply() -> list[str]:
    """Patch ColossalAI's synchronous sharded optimizer saves; return what was patched (empty if done)."""
    from colossalai.booster.plugin.low_level_zero_plugin import LowLevelZeroCheckpointIO
    from colossalai.checkpoint_io.hybrid_parallel_checkpoint_io import HybridParallelCheckpointIO
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    done: list[str] = []
    for io_cls in (HybridParallelCheckpointIO, LowLevelZeroCheckpointIO):
        if getattr(io_cls.save_sharded_optimizer, _MARK, False):
            continue
        original_save = io_cls.save_sharded_optimizer

        def save_sharded_optimizer(
            self,
            optimizer,
            checkpoint,
            gather_dtensor=True,
            prefix=None,
            size_per_shard=1024,
            use_async=False,
            _original=original_save,
        ):
            if use_async:
                return _original(self, optimizer, checkpoint, gather_dtensor, prefix, size_per_shard, use_async)
            with _sync_save():
                return _original(self, optimizer, checkpoint, gather_dtensor, prefix, size_per_shard, use_async)

        setattr(save_sharded_optimizer, _MARK, True)
        save_sharded_optimizer.__wrapped__ = original_save
        save_sharded_optimizer.__doc__ = original_save.__doc__
        io_cls.save_sharded_optimizer = save_sharded_optimizer
        done.append(f"{io_cls.__name__}.save_sharded_optimizer")

    if not getattr(HybridParallelCheckpointIO._optimizer_sharder, _MARK, False):
        original_sharder = HybridParallelCheckpointIO._optimizer_sharder

        def _optimizer_sharder(optimizer, use_zero, dp_group, tp_group, size_per_shard=1024, pinned_state_dicts=None):
            if pinned_state_dicts is None and _in_sync_save():
                return hybrid_parallel_sharder(optimizer, use_zero, dp_group, tp_group, size_per_shard)
            return original_sharder(optimizer, use_zero, dp_group, tp_group, size_per_shard, pinned_state_dicts)

        setattr(_optimizer_sharder, _MARK, True)
        _optimizer_sharder.__wrapped__ = original_sharder
        HybridParallelCheckpointIO._optimizer_sharder = staticmethod(_optimizer_sharder)
        done.append("HybridParallelCheckpointIO._optimizer_sharder")

    if not getattr(LowLevelZeroOptimizer.state_dict_shard, _MARK, False):
        original_shard = LowLevelZeroOptimizer.state_dict_shard

        def state_dict_shard(self, max_shard_size=1024, pinned_state_dicts=None, only_on_master=False):
            if pinned_state_dicts is None and _in_sync_save():
                return low_level_zero_shard(self, max_shard_size, only_on_master)
            return original_shard(self, max_shard_size, pinned_state_dicts, only_on_master)

        setattr(state_dict_shard, _MARK, True)
        state_dict_shard.__wrapped__ = original_shard
        state_dict_shard.__doc__ = original_shard.__doc__
        LowLevelZeroOptimizer.state_dict_shard = state_dict_shard
        done.append("LowLevelZeroOptimizer.state_dict_shard")
    return done


if __name__ == "__main__":
    print(apply())
    print(apply())
