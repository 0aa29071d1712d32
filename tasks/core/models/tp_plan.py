"""Tensor parallelism from the model's own plan: the families hybrid_parallel shards with the derived policy.

    python -c "from tasks.core.models.tp_plan import PLAN_ROWS; print(sorted(PLAN_ROWS))"

transformers ships a tensor-parallel plan with each dense decoder: `config.base_model_tp_plan` (module
patterns under the base model, `layers.*.self_attn.q_proj: colwise`) and the causal-LM class's `_tp_plan`
(`lm_head`). The project's derived policy (`tasks.engine.plan_policy.PlanPolicy`, passed to
HybridParallelPlugin as its `custom_policy`) reads that plan off the built model and only swaps modules:
colwise -> ColossalAI's `Linear1D_Col`, rowwise -> `Linear1D_Row`, the input embedding ->
`VocabParallelEmbedding1D`, the head -> `VocabParallelLMHead1D` gathering its output (tied or not, as
ColossalAI's Llama policy does); it replaces no forward and imports no ColossalAI modeling module, so it
does not depend on the transformers version ColossalAI's modeling code was written for.

A family runs with it only from a row here (`PLAN_ROWS`, registry data like the policy rows): the row
completes or corrects what the plan does not say, each with why (`fixes`): Qwen3's and Gemma 3's
`q_norm`/`k_norm`, replicated but applied to each rank's heads, need their gradients summed over the tp
group (5.x plans say `replicated_with_grad_allreduce`, 4.x plans say nothing, and the first loss matches
either way); StarCoder2's 4.51 plan makes `mlp.c_proj` colwise where it is rowwise; Gemma 3's
`base_model_prefix` names no attribute of Gemma3ForCausalLM (`base_prefix`). Both the 4.x and the 5.x style
names are read (`STYLES`); a style the policy cannot map (MoE experts, MLA, `local*`, sequence-parallel
styles) is refused by pre-flight with its name (`plan_problem`), as are heads or KV heads that tp does not
divide, a plan entry that matches no module (a prefix that names nothing would otherwise leave every weight
whole and "train at tp" unsplit), and a split module narrower than tp (ColossalAI's Linear1D_Col returns
such a module unsplit). `*_rep` styles (OLMo 2's q/k/v before its full-width q_norm, Phi-3's fused
qkv_proj and gate_up_proj) split the weights and gather the output: memory is saved, the attention (and
Phi-3's MLP) is computed whole on every rank (`whole_activations`). A family newer than some installed
transformers (SmolLM3, OLMo 3) carries the first release that builds it (`min_transformers`): on an older one
pre-flight says that release and the installed one (`too_old`), not that the model_type is unknown.

Pure data and pure functions, except `plan_problem`/`read_plan`, which build the model on the meta device
(torch and transformers imported then, as `tasks.core.models.derive` does).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from tasks.core.models.family_spec import ActivationTerm

PLAN_POLICY = "tasks.engine.plan_policy.PlanPolicy"

# plan style (4.x and 5.x names) -> what the derived policy does with the module:
#   col: Linear1D_Col, output split (heads divided per rank); col_gather: Linear1D_Col gathering its output
#   (weights split, the next op sees the whole width); row: Linear1D_Row on a split input; row_whole: Linear1D_Row
#   splitting a whole input itself; grad_allreduce: replicated, its gradient summed over the tp group (it acts on
#   each rank's heads); embedding: VocabParallelEmbedding1D
STYLES: dict[str, str] = {
    "colwise": "col",
    "rowwise": "row",
    "colwise_rep": "col_gather",  # 4.x
    "colwise_gather_output": "col_gather",  # 5.x
    "rowwise_rep": "row_whole",  # 4.x
    "rowwise_split_input": "row_whole",  # 5.x
    "replicated_with_grad_allreduce": "grad_allreduce",  # 5.x (4.x plans leave these out: the rows add them)
    "embedding_rowwise": "embedding",  # 5.x
}
# styles it refuses, by the start of their name, and why
REFUSED_STYLES: tuple[tuple[str, str], ...] = (
    ("local", "a local (DTensor-free) style keeps each rank's shard as the module's whole tensor"),
    ("sequence_parallel", "sequence parallelism is not run with the derived policy"),
    ("gather", "a gather style gathers a module's output that the derived policy keeps split"),
    ("packed", "a packed (fused experts) weight"),
    ("moe", "MoE experts (without expert parallelism every rank would need every expert)"),
    ("ep_", "expert parallelism"),
    ("grouped_gemm", "MoE experts"),
    ("isolated", "MoE experts"),
    ("mla", "multi-head latent attention's low-rank projections"),
    ("kv_replicated", "KV heads replicated over the tp ranks"),
)
_LINEAR_KINDS = ("col", "col_gather", "row", "row_whole")
HEAD_NAMES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


@dataclass(frozen=True)
class PlanRow:
    """What the plan of a family does not say, for the derived policy."""

    model_class: str
    # where the base model's plan applies, when the class's base_model_prefix names no attribute of the model
    base_prefix: str = ""
    # (pattern under the base model, style, why): entries the plan lacks or gets wrong; style "" drops one
    fixes: tuple[tuple[str, str, str], ...] = ()
    note: str = ""
    # the first transformers release that builds the family ("" = every release the project runs on): on an older
    # one its model_type is unknown to transformers, and pre-flight says which release it needs (`too_old`)
    min_transformers: str = ""


_QK_NORM = (
    "the norm is replicated but normalizes each rank's column-split heads, so each rank's gradient is a part of "
    "the whole: summed over the tp group it is the unsharded model's (58-90 % off otherwise, the first loss "
    "matching); 5.x plans name it replicated_with_grad_allreduce, 4.x plans leave it out"
)
_QK_NORM_FIXES = (
    ("layers.*.self_attn.q_norm", "replicated_with_grad_allreduce", _QK_NORM),
    ("layers.*.self_attn.k_norm", "replicated_with_grad_allreduce", _QK_NORM),
)
_REP = (
    "split weights, whole compute: its plan's `*_rep` styles split the weights and gather the output, so memory is "
    "saved but each rank computes the {what} whole"
)
_C_PROJ = (
    "transformers 4.51.3's plan says colwise for the MLP's output projection, whose input c_fc has already split: "
    "Linear1D_Col then gets a split input (AssertionError in the first forward); it is rowwise (fixed in 5.x)"
)
PLAN_ROWS: dict[str, PlanRow] = {
    "qwen3": PlanRow("Qwen3ForCausalLM", fixes=_QK_NORM_FIXES),
    "gemma3_text": PlanRow(
        "Gemma3ForCausalLM", base_prefix="model", fixes=_QK_NORM_FIXES,
        note="Gemma3ForCausalLM.base_model_prefix is 'language_model', which names no attribute of the model: its "
        "plan applies under `model`, and the embedding's sqrt(hidden) scale is kept on the vocabulary-parallel "
        "embedding",
    ),
    "phi3": PlanRow("Phi3ForCausalLM", note=_REP.format(what="attention and the MLP (fused qkv_proj, gate_up_proj)")),
    "olmo2": PlanRow("Olmo2ForCausalLM", note=_REP.format(what="attention (its q_norm and k_norm are full-width)")),
    "gemma2": PlanRow("Gemma2ForCausalLM"),
    "granite": PlanRow("GraniteForCausalLM"),
    "olmo": PlanRow("OlmoForCausalLM"),
    "helium": PlanRow("HeliumForCausalLM"),
    "starcoder2": PlanRow(
        "Starcoder2ForCausalLM",
        fixes=(("layers.*.mlp.c_proj", "rowwise", _C_PROJ),),
    ),
    # SmolLM3's NoPE layers (config.no_rope_layers: 0 = the layer skips the rotary embedding) and its optional
    # sliding window change the attention's arithmetic, not its modules: the plan splits it as Llama's
    "smollm3": PlanRow(
        "SmolLM3ForCausalLM", min_transformers="4.53.0",
        note="its NoPE layers (no_rope_layers) skip the rotary embedding and keep Llama's modules, so its plan "
        "(colwise q/k/v, gate and up; rowwise o and down) splits every layer alike",
    ),
    # OLMo 3 is OLMo 2's layout (q_norm and k_norm over the whole q and k width, hence the *_rep attention) with
    # sliding-window layers (config.layer_types) that differ in their mask and rotary embedding only
    "olmo3": PlanRow(
        "Olmo3ForCausalLM", min_transformers="4.57.0",
        note=_REP.format(what="attention (its q_norm and k_norm are full-width, as OLMo 2's)") + "; its "
        "sliding-window layers (layer_types) differ from the full-attention ones in their mask and rotary embedding "
        "only",
    ),
}  # fmt: skip


def _release(text: str) -> tuple[int, ...]:
    """'4.57.0.dev0' -> (4, 57, 0), '4.57.0rc1' -> (4, 57, 0): the numeric release of a version string."""
    found = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    return tuple(int(n) for n in found.groups() if n is not None) if found else ()


def installed_transformers() -> str:
    """The installed transformers' version, read without importing it (this module is pure data)."""
    try:
        return version("transformers")
    except PackageNotFoundError:
        return "(not installed)"


def too_old(model_type: str | None) -> str:
    """Why the installed transformers cannot build this plan row's family ("" when it can, or the family has no
    minimum): the release that added it and the installed one."""
    row = PLAN_ROWS.get(model_type or "")
    if row is None or not row.min_transformers:
        return ""
    installed = installed_transformers()
    if _release(installed) and _release(installed) >= _release(row.min_transformers):
        return ""
    return (
        f"config.json model_type={model_type!r} ({row.model_class}) needs transformers >= {row.min_transformers}, the "
        f"first release that builds it, and the installed transformers is {installed}; install a transformers >= "
        f"{row.min_transformers} that the project runs on (docs/versions.md), or use a base model of a family the "
        "installed one builds"
    )


def style_kind(style: str) -> tuple[str, str]:
    """(kind, "") for a style the derived policy maps, ("", why) for one it refuses."""
    if style in STYLES:
        return STYLES[style], ""
    for start, why in REFUSED_STYLES:
        if style.startswith(start):
            return "", why
    return "", "a style the derived policy does not know"


def merged_plan(
    row: PlanRow, base_plan: Mapping[str, str], head_plan: Mapping[str, str], base_prefix: str
) -> dict[str, str]:
    """{module pattern under the causal LM: style}: the base model's plan (under `base_prefix`) with the row's
    fixes, then the head's. Pure."""
    base = dict(base_plan)
    for pattern, style, _ in row.fixes:
        if style:
            base[pattern] = style
        else:
            base.pop(pattern, None)
    pre = f"{base_prefix}." if base_prefix else ""
    return {**{pre + k: v for k, v in base.items()}, **dict(head_plan)}


def pattern_re(pattern: str) -> re.Pattern[str]:
    """A plan pattern as a regex over module names ('*' = one layer index)."""
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")


def resolve(plan: Mapping[str, str], module_names: list[str]) -> tuple[dict[str, str], list[str]]:
    """({module name: style} for every module a plan entry matches, [entries that match none]). Pure."""
    matched: dict[str, str] = {}
    unmatched = []
    for pattern, style in plan.items():
        rx = pattern_re(pattern)
        hits = [n for n in module_names if rx.match(n)]
        if not hits:
            unmatched.append(pattern)
        matched.update(dict.fromkeys(hits, style))
    return matched, unmatched


def plan_for(model: Any, row: PlanRow) -> dict[str, str]:
    """The merged plan of a built causal LM: the config's base plan (the class attribute where the instance's
    is empty) and the causal-LM class's `_tp_plan` (the class attribute: 4.51's and 4.57's post_init leave the
    instance's without `lm_head`)."""
    config = model.config
    base_plan = getattr(config, "base_model_tp_plan", None) or getattr(type(config), "base_model_tp_plan", None) or {}
    head_plan = getattr(type(model), "_tp_plan", None) or {}
    prefix = row.base_prefix or getattr(model, "base_model_prefix", "")
    return merged_plan(row, base_plan, head_plan, prefix)


def check_plan(model: Any, row: PlanRow, tp: int) -> tuple[dict[str, str], list[str]]:
    """({module name: style}, problems) of a built causal LM at tp. Each problem is a sentence."""
    names = [n for n, _ in model.named_modules() if n]
    matched, unmatched = resolve(plan_for(model, row), names)
    problems = [
        f"its plan entry {p!r} matches no module of {type(model).__name__} (a plan that splits nothing would "
        "train every weight whole on every rank)"
        for p in unmatched
    ]
    modules = dict(model.named_modules())
    for style in sorted(set(matched.values())):
        kind, why = style_kind(style)
        if not kind:
            problems.append(f"its plan's style {style!r} is not one the derived policy maps ({why})")
    for name, style in matched.items():
        kind = STYLES.get(style, "")
        mod = modules[name]
        width = getattr(mod, "out_features", None) if kind.startswith("col") else getattr(mod, "in_features", None)
        if kind in _LINEAR_KINDS and not (isinstance(width, int) and width >= tp and width % tp == 0):
            side = "output" if kind.startswith("col") else "input"
            problems.append(
                f"{name} ({type(mod).__name__}, {side} width {width}) cannot be split {tp} ways (ColossalAI leaves "
                "a linear narrower than tp whole)"
            )
            break
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if any(STYLES.get(s) == "col" for s in matched.values()):
        for field, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
            if isinstance(value, int) and value % tp:
                problems.append(f"config.json's {field}={value} is not divisible by tp_size={tp}")
    if getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0):
        problems.append("it is a MoE model (experts would be held whole on every rank)")
    if getattr(config, "kv_lora_rank", None):
        problems.append("it uses multi-head latent attention")
    return matched, problems


def plan_problem(model_config: Mapping[str, Any], tp: int) -> str:
    """Why the derived policy cannot shard this config.json at tp ("" when it can): builds the model on the
    meta device (torch and transformers imported)."""
    from tasks.core.errors import ConversionError
    from tasks.core.models.derive import build_meta_model

    row = PLAN_ROWS.get(str(model_config.get("model_type")))
    if row is None:
        return "its family has no row in tasks/core/models/tp_plan.py PLAN_ROWS"
    raw = {k: v for k, v in model_config.items() if k not in ("auto_map", "transformers_version", "_name_or_path")}
    try:
        _, model = build_meta_model(model_config.get("model_type"), raw, "")
    except ConversionError as exc:
        return str(exc)
    _, problems = check_plan(model, row, tp)
    return "; ".join(problems)


def plan_split(model_type: str | None) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(column-split, row-split) module suffixes under a decoder layer of a plan row's family, from the plan
    the installed transformers ships with the row's fixes (the memory estimate's `tp_column`/`tp_row`);
    None without a row."""
    row = PLAN_ROWS.get(model_type or "")
    if row is None:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    plan = merged_plan(row, getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None) or {}, {}, "")
    col = tuple(p.split("*.", 1)[-1] for p, s in plan.items() if STYLES.get(s, "").startswith("col"))
    rows = tuple(p.split("*.", 1)[-1] for p, s in plan.items() if STYLES.get(s, "").startswith("row"))
    return col, rows


def gathers_attention(model_type: str | None, plan: Mapping[str, str] | None = None) -> tuple[bool, bool]:
    """(attention computed whole, MLP computed whole) on every tp rank: the plan gathers the output of the
    attention's (the MLP's) column-split projections (`*_rep` styles)."""
    if plan is None:
        row = PLAN_ROWS.get(model_type or "")
        if row is None:
            return False, False
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        plan = merged_plan(row, getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None) or {}, {}, "")
    gathered = [p for p, s in plan.items() if STYLES.get(s) == "col_gather"]
    return any("attn" in p for p in gathered), any("mlp" in p for p in gathered)


def whole_activations(terms: tuple[ActivationTerm, ...], attention: bool, mlp: bool) -> tuple[ActivationTerm, ...]:
    """The layer's activation terms with those a gathering plan computes whole on every rank marked `whole`:
    the attention's (q, kv, heads, qkv wide) and the MLP's (inter wide)."""
    dims = ({"q", "kv", "heads", "qkv"} if attention else set()) | ({"inter", "inter2"} if mlp else set())
    return tuple(replace(t, whole=True) if t.dim in dims else t for t in terms)
