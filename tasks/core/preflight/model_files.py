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


def check_lora_targets(ctx: CheckContext) -> None:
    """Each `sft.lora.target_modules` entry adapts a linear or embedding module of the base model:
    peft drops an entry that matches nothing (training fewer modules than the config says) and
    fails inside a rank on one that matches a module it cannot wrap."""
    lora = ctx.cfg.sft.lora
    if lora is None or ctx.model is None:
        return
    from tasks.core.errors import ConversionError
    from tasks.core.models import lora_targets as lt

    try:
        modules = lt.model_modules(ctx.model.config)
    except (ConversionError, KeyError, TypeError, ValueError):
        return  # an unknown family or missing dims: check_model_family names it
    head = lt.output_embedding(ctx.model.config)
    problems = lt.problems(lora.target_modules, modules, ctx.model.where, head)
    for msg in problems:
        ctx.problem(lt.FIELD, msg)
    if not problems:
        r = lt.resolve(lora.target_modules, modules, head)
        ctx.ok(
            f"LoRA targets {lora.targets_text()}: adapt {len(r.adapted)} modules of the base model ({', '.join(r.names)})"
        )
