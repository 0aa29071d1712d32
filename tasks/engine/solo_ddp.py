"""HybridParallelPlugin without torch DDP where its data-parallel group is one rank.

    python -m tasks.engine.solo_ddp        # prints what apply() patched (then nothing the second time)

ColossalAI 0.5.0's `HybridParallelPlugin.configure` wraps the sharded model in torch's
DistributedDataParallel whenever `pp_size == 1` and either ZeRO is off or `dp_size == 1`
(`use_ddp = (dp > 1 and pp == 1 and zero == 0) or (dp == 1 and pp == 1)`). At dp=1 (every rank
holds a different tensor-parallel slice: tp=2 on 2 ranks, tp=8 on a node) DDP has nothing to
average, yet its Reducer allocates a gradient bucket for every parameter while it is constructed:
one more copy of the rank's share, measured as the construction peak of a 102M Llama at tp=2
(0.48 GB over the start per rank, against a 0.20 GB share), and again beside the gradients in
training. The plugin's module already works without it: `no_sync`, `sync_dp_grads` (a no-op for
a group of one) and `unwrap` all read `use_ddp`, and ZeRO-1 at dp > 1 runs without DDP there.

`apply()` replaces the plugin module's `HybridParallelModule` with a subclass that turns `use_ddp`
off when the data-parallel group has one rank; every other argument passes through. The result is
bitwise the same: DDP's all-reduce over one rank divides by 1 and copies the gradient back.
Idempotent; applied by the engine before it builds a hybrid_parallel plugin (`tasks.engine.builders`).
"""

from __future__ import annotations

_MARK = "_cpt_to_sft_solo_ddp"


def apply() -> list[str]:
    """Patch ColossalAI's hybrid parallel plugin module; return what was patched (empty if done)."""
    from colossalai.booster.plugin import hybrid_parallel_plugin as hpp

    if getattr(hpp.HybridParallelModule, _MARK, False):
        return []
    original = hpp.HybridParallelModule

    class HybridParallelModule(original):
        def __init__(self, *args, use_ddp: bool, dp_group, **kwargs):
            super().__init__(*args, use_ddp=use_ddp and dp_group.size() > 1, dp_group=dp_group, **kwargs)

    setattr(HybridParallelModule, _MARK, True)
    HybridParallelModule.__qualname__ = original.__qualname__
    HybridParallelModule.__doc__ = original.__doc__
    hpp.HybridParallelModule = HybridParallelModule
    return ["HybridParallelModule: no torch DDP over a data-parallel group of one rank"]


if __name__ == "__main__":
    print(apply())
    print(apply())
