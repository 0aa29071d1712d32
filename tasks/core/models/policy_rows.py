"""Named rows over derived tables: the decoder families ColossalAI 0.5.0 ships a shardformer policy for.

    python -c "from tasks.core.models.policy_rows import POLICY_ROWS; print(sorted(POLICY_ROWS))"

Their layouts are not Llama's (`transformer.h.{i}.`, fused `query_key_value`, Conv1D weights, expert
lists), and the tensor table the installed transformers builds on the meta device reads each of them
exactly (`tasks.core.models.derive`, the same path as any unlisted decoder), so a row here holds only
what a derived table cannot know: the shardformer policy hybrid_parallel shards the family with, the
modules that policy splits over the tp ranks (for the memory estimate: `ModelFamily.tp_column` and
`tp_row`, read from the policy's `SubModuleReplacementDescription`s), what the policy needs of the
model and the plugin, which the engine passes under a plugin that shards with it (`shard_settings`:
the attention implementation, shardformer flags; `attention_mask`: a mask in every batch), what it
assumes of config.json at tp (`tp_requires`) and whether it runs at pp (`pp`), both refused by
pre-flight otherwise (`families.policy_problem`), and, where the policy does not run with
transformers 4.51.3, the first failure and its cause (`policy_refused`: hybrid_parallel is refused
before launch, the other plugins run the family as a derived one).

Which policies run was measured, not assumed: `benchmarks/shardformer_policies.py` puts a tiny random
model of each family through HybridParallelPlugin at tp=2 and at pp=2 on 2 gloo ranks, fed as the
engine feeds it (boost, the live logits fingerprint and the loss against the unsharded model's,
backward, step, the replicated parameters equal on the tp ranks); the results are in
benchmarks/results/shardformer-policies-2026-12-05-rows.txt. `tasks.core.models.families.family_of` lays a
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
    # What the policy needs of the model and the plugin, which the engine passes under a plugin that shards
    # with it (`shard_settings`): the attention implementation the model is built with (from_pretrained's
    # attn_implementation; "" = transformers' default, sdpa) and shardformer flags (HybridParallelPlugin arguments)
    attn_implementation: str = ""
    shard_flags: tuple[tuple[str, bool], ...] = ()
    pp: bool = False  # measured at pp=2 (tp=1) through the 1F1B schedule; False: pre-flight refuses pp_size > 1
    # its forward reads a mask in every batch: the engine adds all-ones to a CPT block, and mask and labels to the
    # live fingerprint's probe (GPT-2's also reads the labels unconditionally)
    attention_mask: bool = False
    # its modules keep plain tensor attributes (not parameters or buffers) that ColossalAI's LazyInitContext leaves
    # on the meta device: the engine builds it whole on every rank, then shards it (`lazy_init_safe`)
    eager_build: bool = False
    # (config field, value, why): what the policy assumes of config.json at tp_size > 1; pre-flight refuses tp otherwise
    tp_requires: tuple[tuple[str, object, str], ...] = ()
    note: str = ""  # a quirk the families table states
    # Llama's activation terms (the estimate's, for a layout other than Llama's) over what one layer
    # really keeps for its backward, fp32 and bf16 (tests/test_families.py re-measures them): < 1 undercounts
    llama_terms_ratio: tuple[float, float] = (1.0, 1.0)
    # the same on transformers 4.57.x, where Llama's terms are one q-wide tensor fewer (family_spec); () where it is
    # within 0.03 of the 4.51.3 figure
    llama_terms_ratio_4_57: tuple[float, float] = ()
    # the row's own terms, which the estimate counts instead (within 2 % of what the layer keeps, re-measured)
    layer_activations: tuple[ActivationTerm, ...] = ()


_P = "colossalai.shardformer.policies"
_BLOOM_LIKE = dict(
    tp_column=("self_attention.query_key_value", "mlp.dense_h_to_4h"),
    tp_row=("self_attention.dense", "mlp.dense_4h_to_h"),
)
_RUNS = (
    "ColossalAI 0.5.0's policy trains it at tp=2 and at pp=2 with transformers 4.57.6, as with 4.51.3 "
    "(benchmarks/shardformer_policies.py)"
)


def _replicated_dropout(where: str) -> tuple[tuple[str, object, str], ...]:
    """tp_requires for a policy that gives the embedding and residual dropouts DropoutForParallelInput: no dropout."""
    why = (
        f"its policy's DropoutForParallelInput (colossalai/shardformer/policies/{where}) draws a different dropout "
        "mask on each tp rank for activations every rank holds whole, so the parameters tp does not split drift apart "
        "from the first step"
    )
    return tuple((field, 0.0, why) for field in ("embd_pdrop", "resid_pdrop"))


_OPT_TIES = (
    "at tp without pp its postprocess makes lm_head the embedding's weight whatever config.json says "
    "(colossalai/shardformer/policies/opt.py:433), so an untied head would be dropped from training and from every "
    "checkpoint"
)
POLICY_ROWS: dict[str, PolicyRow] = {
    "gptj": PolicyRow(
        "GPTJForCausalLM", f"{_P}.gptj.GPTJForCausalLMPolicy",
        tp_column=("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in", "lm_head"),
        tp_row=("attn.out_proj", "mlp.fc_out"), pp=True, tp_requires=_replicated_dropout("gptj.py:63-134"),
        eager_build=True,
        note=_RUNS + "; its pipeline forward calls torch.cuda.set_device for every block (colossalai/shardformer/"
        "modeling/gptj.py:190), a no-op for a CPU tensor there (tasks/engine/cpu_compat.py); its attention keeps "
        "scale_attn and embed_positions as plain tensors, which ColossalAI's LazyInitContext leaves on the meta device "
        "(RuntimeError in the first forward), so hybrid_parallel builds it whole on every rank before sharding it",
        llama_terms_ratio=(0.96, 0.84), llama_terms_ratio_4_57=(0.92, 0.82),
    ),
    "bloom": PolicyRow(
        "BloomForCausalLM", f"{_P}.bloom.BloomForCausalLMPolicy", **_BLOOM_LIKE, pp=True,
        note=_RUNS + "; ALiBi positions, the fused query_key_value split per head",
        llama_terms_ratio=(1.50, 1.32), llama_terms_ratio_4_57=(1.44, 1.28),
    ),
    "falcon": PolicyRow(
        "FalconForCausalLM", f"{_P}.falcon.FalconForCausalLMPolicy", **_BLOOM_LIKE, pp=True,
        note=_RUNS + " in both layouts (multi-query, and new_decoder_architecture with num_kv_heads)",
        llama_terms_ratio=(1.66, 1.37), llama_terms_ratio_4_57=(1.60, 1.32),
    ),
    "mixtral": PolicyRow(
        "MixtralForCausalLM", f"{_P}.mixtral.MixtralForCausalLMPolicy",
        tp_column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "block_sparse_moe.gate"),
        tp_row=("self_attn.o_proj",), pp=True,
        note=_RUNS + "; without expert parallelism (MoeHybridParallelPlugin, which the project does not build) "
        "every tp rank holds every expert whole, and the estimate counts them so",
        llama_terms_ratio=(0.57, 0.59), layer_activations=MOE_LAYER_ACTIVATIONS,
    ),
    "gpt2": PolicyRow(
        "GPT2LMHeadModel", f"{_P}.gpt2.GPT2LMHeadModelPolicy",
        tp_column=("attn.c_attn", "mlp.c_fc"), tp_row=("attn.c_proj", "mlp.c_proj"),  # Conv1D: [in, out]
        shard_flags=(("enable_flash_attention", True),), pp=True, attention_mask=True,
        tp_requires=_replicated_dropout("gpt2.py:73-135"),
        note=_RUNS + " with shardformer's flash attention on, which hybrid_parallel always passes for it: without "
        "it the policy's model forward hands transformers' sdpa attention a padding-only mask "
        "(colossalai/shardformer/modeling/gpt2.py:97), so no causal mask applies and every token sees the ones "
        "after it (tp=2 loss 6.2519 against 6.2635 unsharded); its forward calls torch.cuda.set_device for every "
        "block (gpt2.py:258), a no-op for a CPU tensor (tasks/engine/cpu_compat.py), and reads the attention mask "
        "and the labels unconditionally, so the engine gives a CPT block an all-ones mask and its live fingerprint "
        "both; saving a tp checkpoint gathers the fused c_attn through CUDA (qkv_fused_linear.py:124), done in "
        "place on CPU (cpu_compat)",
        llama_terms_ratio=(0.93, 1.00),
    ),
    "opt": PolicyRow(
        "OPTForCausalLM", f"{_P}.opt.OPTForCausalLMPolicy", attn_implementation="eager", pp=True, attention_mask=True,
        tp_requires=(("tie_word_embeddings", True, _OPT_TIES),),
        tp_column=("q_proj", "k_proj", "v_proj", "fc1"), tp_row=("out_proj", "fc2"),
        note=_RUNS + " with eager attention, which hybrid_parallel always builds it with: the policy maps "
        "config._attn_implementation to eager or flash_attention_2 only (colossalai/shardformer/policies/opt.py:62; "
        "transformers' default sdpa: KeyError 'sdpa'), and its flash-attention forward fails with transformers 4.51.3 "
        "(TypeError: unexpected keyword argument 'position_ids'); eager attention keeps each layer's attention "
        "probabilities (heads x sequence per token), which the estimate does not count: leave headroom at long context; "
        "its pipeline forward builds a missing mask from the embeddings a later stage does not hold "
        "(colossalai/shardformer/modeling/opt.py:142), so the engine gives a CPT block an all-ones mask",
        llama_terms_ratio=(1.88, 2.07), llama_terms_ratio_4_57=(1.78, 1.98),
    ),
    "cohere": PolicyRow(
        "CohereForCausalLM", f"{_P}.command.CommandForCausalLMPolicy",
        tp_column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        tp_row=("self_attn.o_proj", "mlp.down_proj"),
        shard_flags=(("enable_flash_attention", True),), pp=True,
        note=_RUNS + " with shardformer's flash attention on, which hybrid_parallel always passes for it: its "
        "attention forward (colossalai/shardformer/modeling/command.py:395) asserts the dict mask that only the "
        "model forward run with that flag prepares (AssertionError on the first forward without it)",
        llama_terms_ratio=(1.10, 1.03),
    ),
}  # fmt: skip


def lazy_init_safe(model_type: str | None) -> bool:
    """Whether a plugin that materializes a lazily built model shard by shard may build this family so."""
    row = POLICY_ROWS.get(model_type or "")
    return row is None or not row.eager_build


def needs_attention_mask(model_type: str | None) -> bool:
    """Whether the family's policy forward reads an attention mask in every batch (under a plugin that shards with it)."""
    row = POLICY_ROWS.get(model_type or "")
    return row is not None and row.attention_mask


def shard_settings(model_type: str | None) -> tuple[dict[str, str], dict[str, bool]]:
    """(from_pretrained arguments, HybridParallelPlugin arguments) a policy row's family needs under a plugin
    that shards with its policy; both empty for any other model_type."""
    row = POLICY_ROWS.get(model_type or "")
    if row is None:
        return {}, {}
    model = {"attn_implementation": row.attn_implementation} if row.attn_implementation else {}
    return model, dict(row.shard_flags)
