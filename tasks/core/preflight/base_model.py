"""Pre-flight's checks of the base model itself, from its metadata alone: its weights' format, the
code it names, its positions against each phase's seq_len, its chat template and its family.

    python -m tasks.core.models.demo --out build/demo-inputs/tiny-llama   # the demo's base model, once
    python -c "from tasks.core.preflight.checks import load_for_check, preflight_report; \
r = preflight_report(load_for_check('examples/tiny-cpu.yaml')); print([c for c in r.checked if 'base model' in c or 'family' in c])"

Each concern one check, run in `tasks.core.preflight.checks.CHECKS` order: `check_base_model`
(safetensors, pickle only with allow_pickle, GGUF refused; remote code only with
trust_remote_code, and then stripped), `check_sequence_length` (seq_len within
max_position_embeddings, the base's or cpt.context's), `check_chat_template` (SFT renders chats
with it), `check_model_family` (a registry row or a derivable tensor table, which the unshard and
the export convert by). Nothing here reads weights or runs the folder's code.
"""

from __future__ import annotations

from pathlib import Path

from tasks.core.config.context import changes_text, position_limit
from tasks.core.preflight.report import CheckContext

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")


def check_base_model(ctx: CheckContext) -> None:
    """Weights are safetensors (pickle only with allow_pickle); remote code only when allowed."""
    if ctx.model is None:
        return
    from tasks.core.models.folder import (
        PICKLE_INDEX_NAME,
        PICKLE_WEIGHTS_NAME,
    )  # the names alone: the converter imports torch

    b, files = ctx.cfg.base_model, ctx.model.files
    safetensors = [n for n in files if n.endswith(".safetensors")]
    pickles = [n for n in files if n.endswith(PICKLE_SUFFIXES)]
    if not safetensors and pickles and not b.allow_pickle:
        ctx.problem(
            "base_model.allow_pickle",
            f"{ctx.model.where} has only pickle weights ({', '.join(pickles[:3])}); pickle files can run code when "
            "loaded. "
            "Convert them to safetensors, or set base_model.allow_pickle: true if you trust the source",
        )
    elif not safetensors and not pickles:
        from tasks.core.models.shapes import gguf_files, gguf_refusal  # GGUF-only: the conversion that runs it

        local = Path(ctx.model.where) if ctx.model.source == "local" else None
        ctx.problem(
            "base_model.uri",
            gguf_refusal(ctx.model.where, files, local)
            if gguf_files(files)
            else f"{ctx.model.where} has no weight files (*.safetensors)",
        )
    elif not safetensors and not ({PICKLE_WEIGHTS_NAME, PICKLE_INDEX_NAME} & set(files)):
        ctx.problem(
            "base_model.uri",
            f"{ctx.model.where} has pickle files ({', '.join(pickles[:3])}) but no {PICKLE_WEIGHTS_NAME} or "
            f"{PICKLE_INDEX_NAME}, "
            "the HF layouts load_from_hf converts; rename them to the HF layout or provide safetensors",
        )
    elif not safetensors:
        ctx.warn(
            f"base_model.allow_pickle: {ctx.model.where} has only pickle weights ({', '.join(pickles[:3])}); "
            "load_from_hf converts them once to safetensors "
            "with torch.load(weights_only=True), which refuses any pickle that would run code, and every later stage "
            "reads the safetensors (the manifest records the conversion)"
        )
    else:
        ctx.ok(
            f"base model {ctx.model.where}: {len(safetensors)} safetensors file(s)"
            + (f"; {len(pickles)} pickle file(s) ignored" if pickles and not b.allow_pickle else "")
        )
    code = _model_code(ctx)
    model_type = ctx.model.config.get("model_type")
    if code and not b.trust_remote_code:
        ctx.problem(
            "base_model.trust_remote_code",
            f"{ctx.model.where} names its own Python code ({'; '.join(code)}); this project never runs a model "
            f"folder's code nor carries it on: review the repo, and if transformers' own {model_type!r} class is the "
            "model, set base_model.trust_remote_code: true (load_from_hf then removes every auto_map, with a logged "
            "line, and copies no .py file), or remove the auto_map entries; else use a model transformers supports "
            "natively",
        )
    elif code:
        from tasks.core.models.families import FAMILIES

        if isinstance(model_type, str) and model_type in FAMILIES:
            _warn_code_stripped(ctx, code, model_type)
        # else whether transformers has a class of its own is check_model_family's to say, once
    elif b.trust_remote_code:
        ctx.warn(
            "base_model.trust_remote_code is true, but the model names no code of its own (no auto_map); no model "
            "folder's code runs here either way"
        )
    else:
        ctx.ok("base model: no remote code (no auto_map, no .py files)")


def _warn_code_stripped(ctx: CheckContext, code: list[str], model_type: str) -> None:
    ctx.warn(
        f"base_model.trust_remote_code: {ctx.model.where} names its own Python code ({'; '.join(code)}); "
        f"load_from_hf removes every auto_map from base/ and copies no .py file, so no model code runs and none "
        f"reaches cpt/hf/, the export or the Hub: the model loads as transformers' own {model_type!r} class"
    )


def _model_code(ctx: CheckContext) -> list[str]:
    """Where the base model names or holds its own code: every auto_map of its configs (nested ones
    included; a Hub model's config.json and tokenizer_config.json) and its .py files."""
    from tasks.core.models.folder import auto_map_entries, auto_map_paths, is_code

    m = ctx.model
    if m.source == "local":
        found = auto_map_entries(Path(m.where), m.files)
    else:
        found = [f"config.json {p}" for p in auto_map_paths(m.config)]
        found += [f"tokenizer_config.json {p}" for p in auto_map_paths(m.tokenizer_config or {})]
    py = [n for n in m.files if is_code(n)]
    return found + ([f"{len(py)} .py file(s): {', '.join(py[:3])}"] if py else [])


def check_sequence_length(ctx: CheckContext) -> None:
    """Each stage's seq_len against the positions the model it trains has: the base's, or
    cpt.context's max_position_embeddings, which cpt/hf and so SFT carry."""
    if ctx.model is None:
        return
    trained = ctx.cfg.cpt.context
    max_pos = position_limit(ctx.model.config, trained)
    if not isinstance(max_pos, int):
        ctx.warn("seq_len not checked: config.json has no max_position_embeddings")
        return
    whose = (
        "cpt.context.max_position_embeddings"
        if trained is not None and trained.max_position_embeddings is not None
        else "the base model's max_position_embeddings"
    )
    ok = True
    for name in ctx.cfg.phases:
        seq = getattr(ctx.cfg, name).seq_len
        if seq > max_pos:
            ok = False
            ctx.problem(
                f"{name}.seq_len",
                f"seq_len={seq} exceeds {whose}={max_pos}; use seq_len <= {max_pos}, or extend the context with "
                "cpt.context (max_position_embeddings and a rope_scaling or rope_theta: docs/long-context.md)",
            )
    if ok:
        changed = changes_text(ctx.model.config, trained)
        ctx.ok(
            f"seq_len cpt={ctx.cfg.cpt.seq_len}, sft={ctx.cfg.sft.seq_len} <= max_position_embeddings={max_pos}"
            + (f" (cpt.context: {'; '.join(changed)})" if changed else "")
        )


def check_chat_template(ctx: CheckContext) -> None:
    if ctx.model is None:
        return
    tc = ctx.model.tokenizer_config
    if tc is None and not ctx.model.chat_template_file:
        ctx.problem(
            "base_model.uri",
            f"{ctx.model.where} has no tokenizer_config.json: every stage needs the tokenizer saved beside the model",
        )
    elif not ((tc or {}).get("chat_template") or ctx.model.chat_template_file):
        ctx.problem(
            "base_model.uri",
            f"the tokenizer of {ctx.model.where} has no chat_template: SFT renders conversations with it; "
            "add chat_template to tokenizer_config.json (or a chat_template.jinja file)",
        )
    else:
        ctx.ok("tokenizer: chat template present")


def check_model_family(ctx: CheckContext) -> None:
    """The base model's family has a tensor table: its row in the registry, or one derived from the
    model the installed transformers builds on the meta device (which imports torch and transformers,
    so only for a model_type with no row). The unshard after CPT and the export convert checkpoints by
    it, so a family without one would fail only after CPT."""
    if ctx.model is None:
        return
    from tasks.core.errors import ConversionError
    from tasks.core.models.families import FAMILIES, family_config, supported
    from tasks.core.models.tp_plan import PLAN_POLICY, too_old

    model_type = ctx.model.config.get("model_type")
    if isinstance(model_type, str) and model_type in FAMILIES:
        policy = FAMILIES[model_type].shardformer_policy
        ctx.ok(
            f"model family {model_type}: in the registry, so the unshard and the export can convert it"
            + ("" if policy else "; no shardformer policy, so hybrid_parallel does not run it")
            + (
                "; hybrid_parallel runs it at tp with the derived policy from its own plan"
                if policy == PLAN_POLICY
                else ""
            )
        )
        return
    if why := too_old(model_type):  # a family a later transformers builds: the release it needs, not "unknown"
        ctx.problem("base_model.uri", f"{ctx.model.where}: {why}")
        return
    code = _model_code(ctx) if ctx.cfg.base_model.trust_remote_code else []
    try:
        family, _ = family_config(ctx.model.config)
    except ConversionError as exc:
        remote = (
            f"; base_model.trust_remote_code: true does not change that: the code {ctx.model.where} names "
            f"({'; '.join(code)}) is never run, so the model needs a class of the installed transformers"
            if code
            else ""
        )
        ctx.problem(
            "base_model.uri",
            f"{ctx.model.where}: {exc} (the registered families: {supported()}; or add the family's entry to "
            f"FAMILIES in tasks/core/models/families.py){remote}",
        )
        return
    if code:  # transformers builds it: the class it loads as
        _warn_code_stripped(ctx, code, model_type)
    ctx.ok(
        f"model family {model_type}: no row in the registry; its tensor table is derived from {family.model_class} "
        f"({family.config_class}) built on the meta device by the installed transformers (torch imported for it), "
        "so the unshard and the export can convert it (the memory estimate reads its activation terms off the layer's tensor names)"
        + (
            "; its plan row (tasks/core/models/tp_plan.py) gives hybrid_parallel the derived tensor-parallel policy, "
            "read from the model's own plan"
            if family.shardformer_policy == PLAN_POLICY
            else f"; its named row (tasks/core/models/policy_rows.py) gives hybrid_parallel ColossalAI's "
            f"{family.shardformer_policy.rsplit('.', 1)[-1]}"
            + (", which does not run with transformers 4.51.3" if family.policy_refused else "")
            if family.shardformer_policy
            else ""
        )
    )
