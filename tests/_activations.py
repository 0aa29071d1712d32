"""What torch keeps for the backward of one decoder layer, per token: the measure the memory
estimate's activation terms are checked against (tests/test_memory_estimate.py, tests/test_families.py)."""

from __future__ import annotations

import torch


def kept_per_token(model: torch.nn.Module, layer: str, vocab: int = 300, masks: bool = True) -> float:
    """Bytes of the tensors saved for backward inside submodule `layer` (parameters excluded), per token,
    from one training forward of a 2 x 32 batch of random ids below `vocab`. `masks=False` leaves out the
    batch x 1 x 32 x 32 attention masks: built once per forward and kept by every layer (transformers >= 4.52
    builds one even without padding), they are not a layer's own."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    on, seen = [False], {}

    def pack(t):
        if not masks and t.dim() == 4 and t.shape[1] == 1 and t.shape[-2:] == (32, 32):
            return t
        if on[0] and t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    module = model.get_submodule(layer)
    hooks = [
        module.register_forward_pre_hook(lambda *_: on.__setitem__(0, True)),
        module.register_forward_hook(lambda *_: on.__setitem__(0, False)),
    ]
    ids = torch.randint(3, vocab, (2, 32))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.train()(input_ids=ids, labels=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return sum(seen.values()) / ids.numel()
