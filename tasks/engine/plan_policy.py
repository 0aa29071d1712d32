"""The derived shardformer policy: tensor parallelism from the model's own tensor-parallel plan.

    torchrun --standalone --nproc-per-node 2 benchmarks/shardformer_policies.py --plan qwen3

hybrid_parallel passes it as `HybridParallelPlugin(custom_policy=...)` for a family with a row in
`tasks.core.models.tp_plan.PLAN_ROWS` (`builders.plugin_kwargs`). It reads the plan off the model it is
given (`tp_plan.check_plan`: the config's base plan, the causal-LM class's `_tp_plan`, the row's fixes)
and only swaps modules, each for ColossalAI's parallel layer of the same maths: colwise -> `Linear1D_Col`,
rowwise -> `Linear1D_Row`, `*_rep` -> the same gathering or splitting their whole input, the input
embedding -> `VocabParallelEmbedding1D` (a scale the embedding module applies, Gemma 3's sqrt(hidden), kept
as a forward hook), the output embedding -> `VocabParallelLMHead1D` gathering the vocabulary (a tied head
keeps sharing the embedding's parameter, as in ColossalAI's Llama policy); the attention modules' head
counts, where they keep any, are divided per rank (transformers 4.51's forwards reshape with -1). A
module whose style is `replicated_with_grad_allreduce` (or the row's fix saying so) gets a gradient hook
summing its gradient over the tp group. No forward is replaced and no ColossalAI modeling module
imported: the model's own forward runs, with whatever transformers built it. Pipeline and sequence
parallelism are not proven with it: refused here and by pre-flight (`families.policy_problem`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from colossalai.shardformer.layer import Linear1D_Col, Linear1D_Row, VocabParallelEmbedding1D, VocabParallelLMHead1D
from colossalai.shardformer.policies.base_policy import ModulePolicyDescription, Policy, SubModuleReplacementDescription

from tasks.core.models.tp_plan import HEAD_NAMES, PLAN_ROWS, STYLES, PlanRow, check_plan


class PlanPolicy(Policy):
    """A shardformer policy read from the model's tensor-parallel plan and its `PlanRow`."""

    def __init__(self, row: PlanRow | None = None) -> None:
        super().__init__()
        self.row = row
        self.plan: dict[str, str] = {}
        self.embed_scale: float | None = None

    def config_sanity_check(self) -> None:
        sc = self.shard_config
        if sc.pipeline_stage_manager is not None or sc.enable_sequence_parallelism:
            raise ValueError(
                "the derived tensor-parallel policy runs tensor parallelism only (with ZeRO-1): pipeline and "
                "sequence parallelism are not proven with it"
            )

    def preprocess(self) -> torch.nn.Module:
        model = self.model
        if self.row is None:
            self.row = next((r for r in PLAN_ROWS.values() if r.model_class == type(model).__name__), PlanRow(""))
        if not self.shard_config.enable_tensor_parallelism:  # tp=1: nothing to split, nothing to check
            return model
        self.plan, problems = check_plan(model, self.row, self.shard_config.tensor_parallel_size)
        if problems:
            raise ValueError(f"{type(model).__name__}: the derived tensor-parallel policy cannot shard it: "
                             + "; ".join(problems))  # fmt: skip
        scale = getattr(model.get_input_embeddings(), "embed_scale", None)
        if hasattr(scale, "materialize"):  # built under LazyInitContext: float() of the lazy tensor is not its value
            scale = scale.materialize()
        self.embed_scale = None if scale is None else float(scale)
        return model

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        if not self.shard_config.enable_tensor_parallelism:
            return {}
        names = {id(m): n for n, m in self.model.named_modules()}
        embed = names[id(self.model.get_input_embeddings())]
        head_module = self.model.get_output_embeddings()
        head = names.get(id(head_module), "") if head_module is not None else ""
        tp = self.shard_config.tensor_parallel_size
        vocab = {"make_vocab_size_divisible_by": self.shard_config.make_vocab_size_divisible_by}
        subs = [SubModuleReplacementDescription(suffix=embed, target_module=VocabParallelEmbedding1D, kwargs=vocab)]
        if head:  # whatever the plan says of it: a tied head shares the embedding's parameter, which is split now
            subs.append(SubModuleReplacementDescription(
                suffix=head, target_module=VocabParallelLMHead1D, kwargs={**vocab, "gather_output": True}
            ))  # fmt: skip
        attrs: dict[str, int] = {}
        modules = dict(self.model.named_modules())
        for name, style in self.plan.items():
            kind = STYLES[style]
            if name in (embed, head):  # replaced above (a 5.x plan may name the embedding, embedding_rowwise)
                continue
            if kind in ("col", "col_gather"):
                subs.append(SubModuleReplacementDescription(
                    suffix=name, target_module=Linear1D_Col, kwargs={"gather_output": kind == "col_gather"}
                ))  # fmt: skip
                parent = name.rpartition(".")[0]
                for attr in HEAD_NAMES if kind == "col" else ():
                    value = getattr(modules[parent], attr, None)
                    if isinstance(value, int) and not isinstance(value, bool):
                        attrs[f"{parent}.{attr}"] = value // tp
            elif kind in ("row", "row_whole"):
                subs.append(SubModuleReplacementDescription(
                    suffix=name, target_module=Linear1D_Row, kwargs={"parallel_input": kind == "row"}
                ))  # fmt: skip
        return {type(self.model): ModulePolicyDescription(attribute_replacement=attrs, sub_module_replacement=subs)}

    def postprocess(self) -> torch.nn.Module:
        if not self.shard_config.enable_tensor_parallelism:
            return self.model
        if self.embed_scale is not None:  # the scale Gemma 3's embedding module applied in its own forward
            scale = self.embed_scale
            self.model.get_input_embeddings().register_forward_hook(
                lambda _m, _i, out: out * torch.tensor(scale, dtype=out.dtype)
            )
        # A KV cache is sized from config.json's head counts (Gemma 2's and 3's HybridCache is preallocated), which a
        # rank's split attention does not have (sdpa: size mismatch in eval mode): the sharded model runs without one,
        # as the engine always calls it (use_cache=False); nothing generates from a sharded model
        self.model.register_forward_pre_hook(_no_cache, with_kwargs=True)
        group = self.shard_config.tensor_parallel_process_group
        modules = dict(self.model.named_modules())
        for name, style in self.plan.items():
            if STYLES[style] == "grad_allreduce":
                for p in modules[name].parameters():
                    p.register_hook(lambda g: _summed(g, group))
        return self.model

    def get_held_layers(self) -> list[torch.nn.Module]:
        return [self.model]

    def get_shared_params(self) -> list[dict[int, torch.Tensor]]:
        return []


def _summed(grad: torch.Tensor, group: Any) -> torch.Tensor:
    """A replicated parameter's gradient summed over the tp group (it acted on this rank's heads only)."""
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def _no_cache(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, {**kwargs, "use_cache": False}
