"""ColossalAI 0.5.0 on CPU: the smallest set of patches that lets its plugins run with gloo.

Applied once, at engine start, and ONLY when `torch.cuda.is_available()` is False
(`tasks.engine.__main__` decides; on a CUDA node nothing here runs). Every patch is idempotent:
calling `apply()` twice changes nothing the second time. Check by hand with

    python -c "from tasks.engine import cpu_compat; print(cpu_compat.apply()); print(cpu_compat.apply())"

What ColossalAI does on CPU without them (measured on colossalai 0.5.0, torch 2.13 CPU):

- `CpuAccelerator.synchronize` raises. Called by the optimizer-checkpoint loader
  (`checkpoint_io.utils.load_states_into_optimizer`) and by ZeRO after backward. CPU kernels are
  synchronous, so a no-op is exact.
- `CpuAccelerator.empty_cache` raises. Nothing to release on CPU: no-op.
- `CpuAccelerator.current_device` / `device_count` raise. Used by pipeline p2p
  (`pipeline.p2p._check_device`, `_cuda_safe_tensor_to_object`) only to pick a CUDA index; the CPU
  has one "device", index 0.
- `CpuAccelerator.get_rng_state(device)` passes `device` to `torch.get_rng_state()`, which takes
  no argument, and `CpuAccelerator.manual_seed` raises. Both are called by shardformer's
  `Randomizer.__init__` (`shardformer.layer.utils`) for every tensor-parallel linear layer, so
  tp > 1 cannot shard a model. On CPU the "device" generator is the CPU generator; Randomizer saves
  and restores it around its own seeding, so the CPU RNG stream is left unchanged.
- `CpuAccelerator.Stream/current_stream/stream` raise. ZeRO's `BucketStore.__init__` creates a
  stream and `LowLevelZeroOptimizer._run_reduction` enters one. torch ships no-op CPU streams
  (`torch.cpu.Stream`, `torch.cpu.current_stream`, `torch.cpu.stream`); we return those.
  `Tensor.record_stream` still fails on CPU, which is why the plugin factory sets
  `overlap_communication=False` for ZeRO without CUDA.
- `torch.distributed.is_hccl_available` does not exist in torch 2.13, yet
  `pipeline.p2p._check_for_nccl_hccl_backend` calls it on every pipeline send/recv: we add it,
  returning False (HCCL is Ascend-only).
- `LowLevelZeroOptimizer._sanity_checks` asserts the accelerator is cuda or npu. The rest of the
  check (every parameter has the working dtype) still matters, so the replacement keeps it and
  drops only the device assertion.
- `ColoAttention` (shardformer's attention, which sequence parallelism always goes through: see
  `tasks.engine.builders.sequence_kwargs`) dispatches to kernel loaders whose every extension needs
  CUDA or an NPU ("No usable kernel found"). On CPU it gets torch's scaled_dot_product_attention, as
  ColossalAI's own `FlashAttentionSdpaCudaExtension` calls it on CUDA; a causal mask without padding
  becomes `is_causal=True` with no mask tensor, which is what transformers' sdpa attention runs for the
  same model without sequence parallelism. `ColoAttention.prepare_attn_kwargs` would also build that causal
  mask as a seq_len x seq_len tensor for every forward (below its 10 GB bound), which the causal kernel never
  reads: an unpadded causal batch gets the empty mask ColossalAI itself passes above that bound.
- Shardformer's GPT-2 forward calls `torch.cuda.set_device(hidden_states.device)` before every block
  (`shardformer/modeling/gpt2.py:258`), as do its GPT-J and OPT pipeline forwards (`gptj.py:190`,
  `opt.py:208`), to keep a multi-GPU model's blocks on their own device: with a CPU tensor it raises
  "Expected a cuda device". Only a CPU device is made a no-op (there is no CUDA device to select);
  any other argument still reaches torch's own `set_device`.
- `gather_fused_qkv_in_gpt2_style` (`shardformer/layer/qkv_fused_linear.py`), which gathers GPT-2's
  fused c_attn over the tp ranks when a checkpoint is saved, moves the shard to CUDA for the
  all_gather (`qkv.cuda()`) and back: on CPU the same gather and reordering run where the tensor
  is (gloo gathers CPU tensors), with nothing moved.
"""

from __future__ import annotations

import contextlib

import torch

_MARK = "_cpt_to_sft_cpu_compat"


def _synchronize(self, device=None):
    return None


def _empty_cache(self):
    return None


def _current_device(self):
    return 0


def _device_count(self):
    return 1


def _get_rng_state(self, device=None):
    return torch.get_rng_state()


def _manual_seed(self, seed):
    torch.manual_seed(seed)


def _Stream(self, device=None, priority=0, **kwargs):
    return torch.cpu.Stream()


def _current_stream(self, device=None):
    return torch.cpu.current_stream()


def _stream(self, stream_):
    if stream_ is None:
        return contextlib.nullcontext()
    return torch.cpu.stream(stream_)


_CUDA_SET_DEVICE: list = []  # torch's own, kept by apply()


def _cuda_set_device(device) -> None:
    if (isinstance(device, torch.device) and device.type == "cpu") or device == "cpu":
        return None
    return _CUDA_SET_DEVICE[0](device)


def _gather_fused_qkv_in_gpt2_style(qkv, split_sizes, process_group, is_transposed=False):
    # ColossalAI's own, less the round trip through CUDA: [Q1, K1, V1], [Q2, K2, V2] -> [Q1, Q2, K1, K2, V1, V2]
    world = torch.distributed.get_world_size(group=process_group)
    assert all(sz % world == 0 for sz in split_sizes), f"sizes {split_sizes} are not divisible by world_size {world}"
    parts = [torch.zeros_like(qkv) for _ in range(world)]
    torch.distributed.all_gather(parts, qkv.contiguous(), group=process_group)
    dim = -1 if is_transposed else 0
    chunks = torch.split(torch.cat(parts, dim=dim), [sz // world for sz in split_sizes] * world, dim=dim)
    return torch.cat([c for i in range(len(split_sizes)) for c in chunks[i :: len(split_sizes)]], dim=dim)


def _is_hccl_available() -> bool:
    return False


def _zero_sanity_checks(self):
    for param_group in self.optim.param_groups:
        for param in param_group["params"]:
            if not getattr(param, "skip_zero_check", False):
                assert param.dtype == self._dtype, (
                    f"Parameters are expected to have the same dtype `{self._dtype}`, but got `{param.dtype}`"
                )


def _cpu_attention(
    q, k, v, dropout_p=0.0, scale=None, attention_mask=None, is_causal=False, cu_seqlens_q=None, **padding
):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if is_causal and cu_seqlens_q is None:
        return sdpa(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
    return sdpa(q, k, v, attn_mask=attention_mask, dropout_p=dropout_p, scale=scale)


def _dispatch_attention(dtype, mask_type, size):
    return _cpu_attention


_PREPARE_ATTN_KWARGS: list = []  # ColossalAI's own, kept by apply()


def _prepare_attn_kwargs(shape_4d, dtype, device, q_padding_mask=None, kv_padding_mask=None, is_causal=False, **kw):
    from colossalai.shardformer.layer.attn import AttnMaskType

    unpadded = all(m is None or bool(m.bool().all()) for m in (q_padding_mask, kv_padding_mask))
    if is_causal and unpadded:
        empty = torch.empty((0,), dtype=dtype, device=device)
        return {"attention_mask_type": AttnMaskType.CAUSAL, "attention_mask": empty}
    return _PREPARE_ATTN_KWARGS[0](shape_4d, dtype, device, q_padding_mask, kv_padding_mask, is_causal, **kw)


_ACCELERATOR_PATCHES = {
    "synchronize": _synchronize,
    "empty_cache": _empty_cache,
    "current_device": _current_device,
    "device_count": _device_count,
    "get_rng_state": _get_rng_state,
    "manual_seed": _manual_seed,
    "Stream": _Stream,
    "current_stream": _current_stream,
    "stream": _stream,
}


def apply() -> list[str]:
    """Patch ColossalAI for CPU; returns the names patched by THIS call (empty when already done)."""
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    done: list[str] = []
    for name, fn in _ACCELERATOR_PATCHES.items():
        if getattr(getattr(CpuAccelerator, name), _MARK, False):
            continue
        setattr(fn, _MARK, True)
        setattr(CpuAccelerator, name, fn)
        done.append(f"CpuAccelerator.{name}")

    if not hasattr(torch.distributed, "is_hccl_available"):
        setattr(_is_hccl_available, _MARK, True)
        torch.distributed.is_hccl_available = _is_hccl_available
        done.append("torch.distributed.is_hccl_available")

    if not getattr(torch.cuda.set_device, _MARK, False):
        setattr(_cuda_set_device, _MARK, True)
        _CUDA_SET_DEVICE.append(torch.cuda.set_device)
        torch.cuda.set_device = _cuda_set_device
        done.append("torch.cuda.set_device")

    from colossalai.shardformer.layer import qkv_fused_linear

    if not getattr(qkv_fused_linear.gather_fused_qkv_in_gpt2_style, _MARK, False):
        setattr(_gather_fused_qkv_in_gpt2_style, _MARK, True)
        qkv_fused_linear.gather_fused_qkv_in_gpt2_style = _gather_fused_qkv_in_gpt2_style
        done.append("qkv_fused_linear.gather_fused_qkv_in_gpt2_style")

    from colossalai.shardformer.layer.attn import ColoAttention

    if not getattr(ColoAttention._dispatch_kernel, _MARK, False):
        setattr(_dispatch_attention, _MARK, True)
        ColoAttention._dispatch_kernel = staticmethod(_dispatch_attention)
        done.append("ColoAttention._dispatch_kernel")
    if not getattr(ColoAttention.prepare_attn_kwargs, _MARK, False):
        setattr(_prepare_attn_kwargs, _MARK, True)
        _PREPARE_ATTN_KWARGS.append(ColoAttention.prepare_attn_kwargs)
        ColoAttention.prepare_attn_kwargs = staticmethod(_prepare_attn_kwargs)
        done.append("ColoAttention.prepare_attn_kwargs")

    if not getattr(LowLevelZeroOptimizer._sanity_checks, _MARK, False):
        setattr(_zero_sanity_checks, _MARK, True)
        LowLevelZeroOptimizer._sanity_checks = _zero_sanity_checks
        done.append("LowLevelZeroOptimizer._sanity_checks")
    return done


def is_applied() -> bool:
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    return all(getattr(getattr(CpuAccelerator, n), _MARK, False) for n in _ACCELERATOR_PATCHES)
