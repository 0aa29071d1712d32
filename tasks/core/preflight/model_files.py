"""Pre-flight checks of the base model's own files: each JSON file parses (and tokenizer.json
loads as a tokenizer), each safetensors header is bounded and consistent with the file, every file
is what its name says, and LoRA's targets exist in the model.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check

A local base model is read here (a Hub model's tokenizer.json and generation_config.json are not
downloaded for this: load_from_hf meets them); the LoRA targets are resolved against the module
table the family registry derives from config.json (`tasks.core.models.lora_targets`), the table
the engine checks again on the real model.
"""

from __future__ import annotations

from pathlib import Path

from tasks.core.preflight.report import CheckContext


def check_model_files(ctx: CheckContext) -> None:
    """A broken tokenizer or config file is refused naming the file and the parse error; a file
    that is not what its name says (tokenizer.model that is a GGUF file, weights no loader reads, a
    stray shard) is named, and load_from_hf leaves it out of base/ (so of every later folder and the push)."""
    if ctx.model is None or ctx.model.source != "local":
        return
    from tasks.core.models.folder import JSON_FILES, json_file_problem, misnamed, safetensors_problems

    root = Path(ctx.model.where)
    bad = 0
    for name in JSON_FILES:
        path = root / name
        if path.is_file() and (why := json_file_problem(path)):
            bad += 1
            ctx.problem(
                "base_model.uri",
                f"{path} {why}; every stage reads it: restore the file from the model's source (re-download or "
                "re-convert it)",
            )
    try:
        broken_weights = safetensors_problems(root)
    except OSError as exc:
        broken_weights = {}
        ctx.warn(f"base model {root}: its safetensors headers could not be read ({exc})")
    for name, why in broken_weights.items():
        bad += 1
        ctx.problem(
            "base_model.uri",
            f"{root / name} {why}; load_from_hf would fail on it: restore the file from the model's source",
        )
    try:
        left_out = misnamed(root)
    except OSError as exc:
        ctx.warn(f"base model {root}: its files could not be read to check what they are ({exc})")
        return
    for name, why in left_out.items():
        ctx.warn(
            f"base_model.uri: {root / name} is {why}: load_from_hf leaves it out of base/, so it is never copied into "
            "cpt/hf/ or export/ nor pushed; delete or rename it to silence this"
        )
    if not bad:
        present = [n for n in JSON_FILES if (root / n).is_file()]
        ctx.ok(
            f"base model files: {', '.join(present)} parse; the safetensors headers are whole"
            + ("" if left_out else "; every file is what its name says")
        )


def check_model_claims(ctx: CheckContext) -> None:
    """config.json's sizes against what the weight files' headers hold (`tasks.core.models.claims`),
    before any other check reads them: a size that is not a whole number >= 1, more layers or a wider
    dimension than the files hold, a registered family's parameter count far beyond theirs. On a refusal
    the checks that build from config.json's sizes (the tensor table, the derived model, the estimates)
    do not run: pre-flight's time stays bounded by the files whatever config.json claims. And every
    weight is a float the run trains from. A Hub model's or an fsspec folder's weights are judged by their
    headers, read with ranged reads (`claims.hub_held_weights`, `claims.fs_held_weights`); load_from_hf
    judges the files it fetched again."""
    if ctx.model is None:
        return
    from tasks.core.models import claims

    m = ctx.model
    where = f"{m.where}/config.json"
    unbounded = False
    if m.source != "local":  # the Hub, or an fsspec folder: headers through ranged reads
        held = claims.HeldWeights()
        if not claims.size_problems(m.config, where):
            repo, _, revision = m.where.rpartition("@")
            try:
                held = (
                    claims.hub_held_weights(repo, revision, m.files)
                    if m.source == "hub"
                    else claims.fs_held_weights(m.where, m.files)
                )
            except Exception as exc:  # network, HTTP, filesystem and header errors all mean: not compared here
                ctx.warn(
                    f"base model {m.where}: config.json's sizes not compared with its weights, whose safetensors "
                    f"headers could not be read ({type(exc).__name__}: {exc}); load_from_hf compares them"
                )
        refused = claims.claim_problems(m.config, held, where)
        for msg in claims.weight_dtype_problems(held, m.where):
            ctx.problem("base_model.uri", msg)
    else:
        from tasks.core.models.folder import safetensors_problems

        root = Path(m.where)
        try:
            held, broken = claims.held_weights(root), safetensors_problems(root)
        except OSError as exc:
            ctx.warn(f"base model {root}: its safetensors headers could not be read ({exc})")
            held, broken = claims.HeldWeights(), {}
        refused = claims.claim_problems(m.config, held, where, claims.weight_file_bytes(root))
        if broken and refused:  # a file check_model_files named holds tensors unread: its sizes only, said alone
            unbounded, refused = True, claims.size_problems(m.config, where)
        for msg in claims.weight_dtype_problems(held, root):
            ctx.problem("base_model.uri", msg)
        if held.tensors and not refused:
            prefix, layers = held.layers()
            ctx.ok(
                f"base model {root}: config.json's sizes are within its weight files ({layers} layers under "
                f"{prefix or '(none)'}, {held.parameters:,} parameters in {len(held.tensors)} tensors)"
            )
    for _, msg in refused:
        ctx.problem("base_model.uri", msg)
    if refused or unbounded:  # nothing below may build from these sizes
        ctx.model = None
        ctx.warn(
            "base model checks that read config.json's sizes (family, shapes, layout, estimates) not run: "
            "config.json was refused (see problems)"
        )


def check_lora_targets(ctx: CheckContext) -> None:
    """Each `<phase>.lora.target_modules` entry (sft, dpo) adapts a linear or embedding module of the base
    model (DPO's base, sft/hf, has the base's modules): peft drops an entry that matches nothing (training
    fewer modules than the config says) and fails inside a rank on one that matches a module it cannot wrap."""
    loras = {p: s.lora for p, s in ctx.cfg.phases.items() if s.lora is not None}
    if not loras or ctx.model is None:
        return
    from tasks.core.errors import ConversionError
    from tasks.core.models import lora_targets as lt

    try:
        modules = lt.model_modules(ctx.model.config)
    except (ConversionError, KeyError, TypeError, ValueError):
        return  # an unknown family or missing dims: check_model_family names it
    head = lt.output_embedding(ctx.model.config)
    for phase, lora in loras.items():
        problems = lt.problems(lora.target_modules, modules, ctx.model.where, head)
        for msg in problems:
            ctx.problem(lt.field(phase), msg)
        if not problems:
            r = lt.resolve(lora.target_modules, modules, head)
            ctx.ok(
                f"LoRA targets {lora.targets_text()} ({phase}.lora): adapt {len(r.adapted)} modules of the base "
                f"model ({', '.join(r.names)})"
            )
