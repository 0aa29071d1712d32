"""The table of model families x plugins, written from the registries (never by hand).

    python -m tasks.core.models.family_table > docs/reference/families.md

One row per `FAMILIES` entry (tasks/core/models/families.py) and one for every other decoder the
installed transformers builds (a derived family), one column per plugin row (tasks/core/config/
plugins.py): what runs, what pre-flight refuses and why. `tests/test_docs.py` regenerates it and
fails when the checked-in page differs, so a family or plugin row shows up here in the same commit.
"""

from __future__ import annotations

from tasks.core.config.plugins import PLUGINS
from tasks.core.config.sequence import SP_MODES
from tasks.core.models.families import FAMILIES, ModelFamily
from tasks.core.models.policy_rows import POLICY_ROWS, PolicyRow
from tasks.core.models.tp_plan import PLAN_POLICY, PLAN_ROWS, PlanRow

COMMAND = "python -m tasks.core.models.family_table > docs/reference/families.md"
INTRO = (
    "Which base models train under which plugin, generated from the family registry "
    "(`tasks/core/models/families.py`) and the plugin registry (`tasks/core/config/plugins.py`). "
    "A family's row holds its tensor table (keys, symbolic shapes, tied and vocabulary-indexed keys, save order), "
    "which the converter, the weight proof, the logits fingerprint, the export, LoRA target resolution and the "
    "memory estimate read.\n\nA `model_type` with no row is **derived**: its table is read from the model the installed "
    "transformers builds on the meta device from config.json (its own config class and `AutoModelForCausalLM`, "
    "never `trust_remote_code` or code from the model folder); pre-flight says so in one line and imports torch and "
    "transformers for it. A plugin that shards with a shardformer policy (hybrid_parallel, even at tp=pp=1) runs "
    "only a family whose row names one; pre-flight refuses it for any other family before anything launches, naming "
    "the plugins that run it.\n\nThe families ColossalAI 0.5.0 has a policy for but whose layout is not Llama's "
    "(`tasks/core/models/policy_rows.py`) have a named row over the derived table: it adds the policy, the modules it "
    "splits over the tp ranks, what the policy needs of the model and the plugin (the attention implementation the "
    "engine builds the model with, shardformer flags it always passes), whether it runs at pp, and, where the policy "
    "does not run with transformers 4.51.3, its first failure (measured by `benchmarks/shardformer_policies.py`: a "
    "tiny random model of each at tp=2 and at pp=2 on 2 CPU ranks, loss against the unsharded model, backward and a "
    "step, and the engine's live logits fingerprint). A derived family never takes ColossalAI's policy for its class "
    "by itself: three of the seven decoder policies outside the registry fail with transformers 4.51.3 as they ship "
    "(GPT-2's without flash attention even trains with no causal mask), so a policy is used only from a row whose "
    "claims `benchmarks/shardformer_policies.py --smoke` re-measures in the suite.\n\nA family ColossalAI has no "
    "policy for runs at tp under hybrid_parallel with the **derived** policy (`PlanPolicy`, "
    "`tasks/core/models/tp_plan.py`) where a plan row names it: read from the model's own tensor-parallel plan "
    "(`config.base_model_tp_plan` and the causal-LM class's `_tp_plan`), completed or corrected by its row, it "
    "only swaps modules for ColossalAI's parallel linears and vocabulary-parallel embedding and head, and "
    "replaces no forward; pre-flight refuses a plan it cannot map (MoE, MLA and local styles, heads or KV heads "
    "that tp does not divide, an entry that matches no module, a linear narrower than tp), and pipeline and "
    "sequence parallelism with it, which are not proven. Each plan row is measured at tp=2 against the "
    "unsharded model (losses, every gradient, the converted weights, and a save and resume at tp=2, bitwise) by "
    "`benchmarks/shardformer_policies.py --plan` (the suite's `--smoke`: every row, the resume for SmolLM3 and "
    "OLMo 3).\n\nLlama, Mistral and Qwen2 keep ColossalAI's own policy, which gives them pipeline (and, for Llama "
    "and Qwen2, sequence) parallelism and a loss computed on each rank's vocabulary shard: at SmolLM2-135M's "
    "shape at tp=3 (`--smollm2`) both policies train to the same losses (within 1.7e-7) and held-out perplexity "
    "(within 2.4e-7), and ColossalAI's step took 7.4 s against the derived one's 11.2 s, which gathers the "
    "49,152-wide logits on every rank. The "
    "plugins' own rules (CUDA, precisions, LoRA) are in the "
    "[configuration reference](config.md)."
)


def _cell(family: ModelFamily | None, plugin: str) -> str:
    spec = PLUGINS[plugin]
    if not spec.shardformer:
        return "runs"
    if family is None:
        return "refused: a derived family names no shardformer policy"
    if not family.shardformer_policy:
        return f"refused: ColossalAI 0.5.0 has no policy for {family.model_class}"
    if family.shardformer_policy == PLAN_POLICY:
        return _PLAN_CELL
    usable = [m for m in family.sp_modes if m in SP_MODES and not SP_MODES[m].refused]
    sp = f"sequence parallelism: {', '.join(usable)}" if usable else "no sequence parallelism"
    return f"runs (tp, pp; {sp})"


_PLAN_CELL = "runs (tp with ZeRO-0/1, derived policy, measured at 2; pp and sequence parallelism refused: not proven)"


def _plan_note(row: PlanRow) -> str:
    fixes: dict[str, list[str]] = {}
    for pattern, style, why in row.fixes:  # one sentence per reason (the q and k norms share theirs)
        fixes.setdefault(why, []).append(f"{pattern}: {style}")
    said = [row.note] if row.note else []
    if row.min_transformers:  # a family later than some transformers the project runs on
        said.insert(0, f"transformers builds it from {row.min_transformers} on; on an older one pre-flight refuses it, "
                    "naming the release it needs and the installed one")  # fmt: skip
    said += [f"its row adds {' and '.join(entries)} to the plan: {why}" for why, entries in fixes.items()]
    return "; ".join(said) or "the derived policy reads its plan as transformers ships it"


def _policy_cell(row: PolicyRow, plugin: str) -> str:
    if not PLUGINS[plugin].shardformer:
        return "runs (derived table)"
    if row.policy_refused:
        return "refused: ColossalAI 0.5.0's policy fails with transformers 4.51.3 (see notes)"
    needs = [f"attn_implementation={row.attn_implementation}"] if row.attn_implementation else []
    needs += [f"{flag}={value}" for flag, value in row.shard_flags]
    with_ = f" with {', '.join(needs)}" if needs else ""
    tp = "tp" + (
        f" where config.json has {', '.join(f'{k}={v}' for k, v, _ in row.tp_requires)}" if row.tp_requires else ""
    )
    pp = "pp" if row.pp else "pp refused: not measured"
    return f"runs ({tp}; {pp}; measured at 2{with_}; no sequence parallelism)"


def _row_note(row: PolicyRow) -> str:
    fp32, bf16 = row.llama_terms_ratio_4_57 or row.llama_terms_ratio  # the adopted transformers 4.57.6's
    llama = f"{fp32:.2f} (fp32) and {bf16:.2f} (bf16) of what it keeps"
    tp = {}
    for key, value, why in row.tp_requires:  # one sentence per reason (GPT-2's two dropout fields share theirs)
        tp.setdefault(why, []).append(f"{key}={value}")
    needs = "; ".join(f"at tp_size > 1 it needs {' and '.join(kv)} in config.json: {why}" for why, kv in tp.items())
    # what tp needs of config.json is a paragraph of its own in the note's list item: a note stays a screen
    head = f"{row.policy_refused or row.note}" + (f".\n\n    {needs[0].upper()}{needs[1:]}" if needs else "")
    if row.layer_activations:
        return (
            f"{head}; the memory estimate counts the row's own activation terms for its "
            f"layer, within 2 % of what it keeps (Llama's terms would count {llama})"
        )
    return f"{head}; the memory estimate counts Llama's activation terms for its layer, {llama}" + (
        ", so it undercounts: leave headroom" if min(fp32, bf16) < 0.95 else ""
    )


def render() -> str:
    plugins = list(PLUGINS)
    head = ["`model_type`", "transformers class", "shardformer policy", *[f"`{p}`" for p in plugins]]
    lines = [
        "# Model families",
        "",
        f"<!-- generated by `{COMMAND}`: do not edit -->",
        "",
        INTRO,
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for model_type, family in sorted(FAMILIES.items()):
        policy = f"`{family.shardformer_policy.rsplit('.', 1)[-1]}`" if family.shardformer_policy else "none"
        policy = "derived `PlanPolicy`" if family.shardformer_policy == PLAN_POLICY else policy
        cells = [f"`{model_type}`", f"`{family.model_class}`", policy, *[_cell(family, p) for p in plugins]]
        lines.append("| " + " | ".join(cells) + " |")
    for model_type, row in sorted(POLICY_ROWS.items()):
        policy = f"`{row.shardformer_policy.rsplit('.', 1)[-1]}`"
        cells = [f"`{model_type}`", f"`{row.model_class}`", policy, *[_policy_cell(row, p) for p in plugins]]
        lines.append("| " + " | ".join(cells) + " |")
    for model_type, plan in sorted(PLAN_ROWS.items()):
        if model_type in FAMILIES:
            continue
        since = f" (transformers >= {plan.min_transformers})" if plan.min_transformers else ""
        cells = [f"`{model_type}`", f"`{plan.model_class}`{since}", "derived `PlanPolicy`"]
        cells += [_PLAN_CELL if PLUGINS[p].shardformer else "runs (derived table)" for p in plugins]
        lines.append("| " + " | ".join(cells) + " |")
    derived = ["any other decoder", "derived: `AutoModelForCausalLM`", "none", *[_cell(None, p) for p in plugins]]
    lines.append("| " + " | ".join(derived) + " |")
    notes = [(t, f.sp_note) for t, f in sorted(FAMILIES.items()) if f.sp_note]
    notes += [(t, _row_note(r)) for t, r in sorted(POLICY_ROWS.items())]
    notes += [(t, "derived policy: " + _plan_note(r)) for t, r in sorted(PLAN_ROWS.items())]
    if notes:
        # a note of two paragraphs ends with a blank line, so the next item is not read as its continuation
        lines += ["", "Notes:", ""] + [f"- `{t}`: {note}." + ("\n" if "\n\n" in note else "") for t, note in notes]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
