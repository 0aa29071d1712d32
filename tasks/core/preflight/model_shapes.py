"""Pre-flight's look at the shape of the base model's folder (`tasks.core.models.shapes`): a
multimodal `text_config` checkpoint, an index naming a missing shard and a weight whose safetensors
header shape is not the one config.json gives it are refused, several eos ids are checked against
the vocabulary, and where the chat template comes from is said.

    python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check

A GGUF-only folder is refused where the weights are looked for (`check_base_model`, and reading a
folder with no config.json), naming the GGUF file and the conversion. A Hub model is judged by
its config.json and file list; a local one also by its index, generation config and templates.
"""

from __future__ import annotations

from pathlib import Path

from tasks.core.preflight.report import CheckContext


def check_model_shapes(ctx: CheckContext) -> None:
    if ctx.model is None:
        return
    from tasks.core.models import shapes

    m = ctx.model
    if shapes.text_model_type(m.config):
        ctx.problem("base_model.uri", shapes.text_config_refusal(m.where, m.config))
        return
    root = Path(m.where) if m.source == "local" else None
    said = []
    if root is not None:
        if why := shapes.index_problem(root, m.files):
            ctx.problem("base_model.uri", why)
        elif "model.safetensors.index.json" in m.files:
            said.append("weights sharded as model.safetensors.index.json names them, every shard present")
        try:
            mismatched = shapes.weight_shape_problems(root, m.config)
        except OSError as exc:  # the header check warns about an unreadable file
            mismatched = []
            said.append(f"weight shapes not read ({exc})")
        for why in mismatched:
            ctx.problem("base_model.uri", why)
        if not mismatched:
            said.append("every weight's shape is the one config.json gives it")
        gen = shapes.read_json(root / "generation_config.json") if "generation_config.json" in m.files else None
        eos = {"config.json": m.config, "generation_config.json": gen}
        for msg in shapes.eos_problems(m.where, eos, m.config.get("vocab_size")):
            ctx.problem("base_model.uri", msg)
        several = [n for n, d in eos.items() if isinstance((d or {}).get("eos_token_id"), list)]
        if several:
            said.append(f"several eos ids in {' and '.join(several)}, kept by the export")
    notes, warnings = shapes.template_files(m.files, m.tokenizer_config, root)
    for w in warnings:
        ctx.warn(w)
    if said or notes:
        ctx.ok("base model folder: " + "; ".join(said + notes))
