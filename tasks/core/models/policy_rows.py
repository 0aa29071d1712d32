"""Named rows over derived tables: the decoder families ColossalAI 0.5.0 ships a shardformer policy for.

    python -c "from tasks.core.models.policy_rows import POLICY_ROWS; print(sorted(POLICY_ROWS))"

Their layouts are not Llama's (`transformer.h.{i}.`, fused `query_key_value`, Conv1D weights, expert
lists), and the tensor table the installed transformers builds on the meta device reads each of them
exactly (`tasks.core.models.derive`, the same path as any unlisted decoder), so a row here holds only
what a derived table cannot know: the shardformer policy hybrid_parallel shards the family with, the
modules that policy splits over the tp ranks (for the memory estimate: `ModelFamily.tp_column` and
`tp_row`, read from the policy's `SubModuleReplacementDescription`s), and, where the policy does not
run with transformers 4.51.3, the first failure and its cause (`policy_refused`: hybrid_parallel is
refused before launch, the other plugins run the family as a derived one).

Which policies run was measured, not assumed: `benchmarks/shardformer_policies.py` puts a tiny random
model of each family through HybridParallelPlugin at tp=2 on 2 gloo ranks (boost, forward with labels
against the unsharded loss, backward, step, a second forward); the results are in
benchmarks/results/shardformer-policies-2026-12-05.txt. `tasks.core.models.families.family_of` lays a
row over the derived family; the docs' families table lists them (`tasks.core.models.family_table`).
Pure data: no torch, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.core.models.family_spec import MOE_LAYER_ACTIVATIONS, ActivationTerm


@dataclass(frozen=True)
class PolicyRow:
    """What a derived table cannot know about a family that ColossalAI has a policy for."""

    model_class: str
    shardformer_policy: str  # ColossalAI's auto_policy entry for model_class (tests/test_families.py checks it)
    tp_column: tuple[str, ...] = ()  # module suffixes split column-parallel (weight and bias)
    tp_row: tuple[str, ...] = ()  # module suffixes split row-parallel (weight only)
    policy_refused: str = ""  # the policy's first failure under transformers 4.51.3 (then hybrid_parallel refused)
    note: str = ""  # a quirk the families table states
    # Llama's activation terms (the estimate's, for a layout other than Llama's) over what one layer
    # really keeps for its backward, fp32 and bf16 (tests/test_families.py re-measures them): < 1 undercounts
    llama_terms_ratio: tuple[float, float] = (1.0, 1.0)
    # the row's own terms, which the estimate counts instead (within 2 % of what the layer keeps, re-measured)
    layer_activations: tuple[ActivationTerm, ...] = ()


_P = "colossalai.shardformer.policies"
_BLOOM_LIKE = dict(
    tp_column=("self_attention.query_key_value", "mlp.dense_h_to_4h"),
    tp_row=("self_attention.dense", "mlp.dense_4h_to_h"),
)
_RUNS = "ColossalAI 0.5.0's policy trains it at tp=2 with transformers 4.51.3 (benchmarks/shardformer_policies.py)"
POLICY_ROWS: dict[str, PolicyRow] = {
    "gptj": PolicyRow(
        "GPTJForCausalLM", f"{_P}.gptj.GPTJForCausalLMPolicy",
        tp_column=("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in", "lm_head"),
        tp_row=("attn.out_proj", "mlp.fc_out"), note=_RUNS,
        llama_terms_ratio=(0.96, 0.84),
    ),
    "bloom": PolicyRow(
        "BloomForCausalLM", f"{_P}.bloom.BloomForCausalLMPolicy", **_BLOOM_LIKE,
        note=_RUNS + "; ALiBi positions, the fused query_key_value split per head",
        llama_terms_ratio=(1.50, 1.32),
    ),
    "falcon": PolicyRow(
        "FalconForCausalLM", f"{_P}.falcon.FalconForCausalLMPolicy", **_BLOOM_LIKE,
        note=_RUNS + " in both layouts (multi-query, and new_decoder_architecture with num_kv_heads)",
        llama_terms_ratio=(1.66, 1.37),
    ),
    "mixtral": PolicyRow(
        "MixtralForCausalLM", f"{_P}.mixtral.MixtralForCausalLMPolicy",
        tp_column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "block_sparse_moe.gate"),
        tp_row=("self_attn.o_proj",),
        note=_RUNS + "; without expert parallelism (MoeHybridParallelPlugin, which the project does not build) "
        "every tp rank holds every expert whole, and the estimate counts them so",
        llama_terms_ratio=(0.57, 0.59), layer_activations=MOE_LAYER_ACTIVATIONS,
    ),
    "gpt2": PolicyRow(
        "GPT2LMHeadModel", f"{_P}.gpt2.GPT2LMHeadModelPolicy",
        policy_refused="its model forward (colossalai/shardformer/modeling/gpt2.py:258) calls "
        "torch.cuda.set_device(hidden_states.device) for every block, which raises on CPU (ValueError: Expected a "
        "cuda device); not measured on CUDA, so not claimed",
        llama_terms_ratio=(0.93, 1.00),
    ),
    "opt": PolicyRow(
        "OPTForCausalLM", f"{_P}.opt.OPTForCausalLMPolicy",
        policy_refused="its module_policy maps config._attn_implementation to eager or flash_attention_2 only "
        "(colossalai/shardformer/policies/opt.py:62), and transformers 4.51.3 builds OPT with sdpa: KeyError 'sdpa' "
        "while sharding (with attn_implementation eager it trains at tp=2, but the engine loads sdpa)",
        llama_terms_ratio=(1.88, 2.07),
    ),
    "cohere": PolicyRow(
        "CohereForCausalLM", f"{_P}.command.CommandForCausalLMPolicy",
        policy_refused="its attention forward (colossalai/shardformer/modeling/command.py:395) switches "
        "shard_config.enable_flash_attention on and asserts the dict mask that only a model forward run with the "
        "flag on prepares: AssertionError on the first forward (with enable_flash_attention it trains at tp=2, "
        "but the engine turns that on only for sequence parallelism)",
        llama_terms_ratio=(1.10, 1.03),
    ),
}  # fmt: skip
