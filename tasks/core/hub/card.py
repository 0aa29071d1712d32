"""The model card (README.md) of an export: what an anchor model card carries, from recorded facts only.

    python -c "from tasks.core.hub.card import usage_snippet; print(usage_snippet('org/name'))"

Everything in it is read from the run's records, never recomputed: hyperparameters from the
config, steps/tokens/losses from each stage's final checkpoint (`train_state.json`), the kernels
and activation checkpointing that ran from that checkpoint's manifest, data sha256
and split sizes from the split records, evaluation from run.json's metrics, the gate's verdict and
the evaluations that did not run from the stage rows (this run's results, or run.json's), framework
versions and the weight proof from the export manifest. The usage snippet claims that a reply stops
only as far as the generation check measured it (`stop_claim`). A re-push of a finished run renders
the same card.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tasks.core.config.context import changes_text
from tasks.core.config.kernels import describe
from tasks.core.config.phases import PHASES
from tasks.core.config.preference import PreferenceFields
from tasks.core.config.schema import RunConfig
from tasks.core.config.sequence import sp_factor
from tasks.core.evaluation.benchmark import card_results as benchmark_card_results
from tasks.core.evaluation.verdict import eval_results_for_card
from tasks.core.hub.card_data import data_section
from tasks.core.hub.metadata import with_front_matter
from tasks.core.hub.outcome import UNMEASURED_STOP, evaluation_section, gate_verdict_text, stop_claim
from tasks.core.hub.repo import HUB_ID, hub_dataset_id, is_hub_id
from tasks.core.run.manifest import MANIFEST
from tasks.core.run.preemptions import log_rel as preemption_log
from tasks.core.run.preemptions import parse as parse_preemptions
from tasks.core.run.segments import describe as describe_layout
from tasks.core.run.stages import BASE, TRAIN_STATE, TRAINING, exported_phase, split_rel, step_medians, step_peak

POSITION_FIELDS = ("max_position_embeddings", "rope_theta", "rope_scaling")
CARD = "README.md"  # the model card: export/README.md, the file the push uploads
# The torch dtype a snippet loads an export of each `export.dtype` in (the export's own).
TORCH_DTYPES = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}


def base_facts(cfg: RunConfig, read_text: Callable[[str], str] | None = None) -> dict[str, Any]:
    """What the card says the base model is, from base/'s load record (its manifest) and config.json:
    from the Hub, its repo id and the commit load_from_hf pinned; from a local or fsspec folder, the
    Hub id only where `base_model.hub_id` says it (a folder's name, or the `_name_or_path` its
    config.json claims, is no Hub id a push may publish as the base), else the folder's name alone;
    and always base/'s manifest digest."""
    uri = cfg.base_model.uri
    hub_id = uri if is_hub_id(uri) else cfg.base_model.hub_id
    name = Path(uri.rstrip("/")).name
    out: dict[str, Any] = {"name": hub_id or name, "hub_id": hub_id, "revision": None, "digest": None}
    if read_text is None:
        return out
    try:
        blob = read_text(f"{BASE}/{MANIFEST}")
        out["digest"] = hashlib.sha256(blob.encode()).hexdigest()
        meta = json.loads(blob).get("meta") or {}
        if meta.get("source") == "hub":
            out.update(name=meta.get("repo_id"), hub_id=meta.get("repo_id"), revision=meta.get("commit_sha"))
        elif meta.get("source") == "path":
            out.update(name=name, hub_id=cfg.base_model.hub_id)
    except Exception:
        pass
    try:
        config = json.loads(read_text(f"{BASE}/config.json"))
        out["config"] = {k: config.get(k) for k in POSITION_FIELDS}  # what cpt.context changes, as the base had it
        claimed = config.get("_name_or_path")
        if out["hub_id"] is None and isinstance(claimed, str) and HUB_ID.match(claimed) and claimed != name:
            out["claimed"] = (
                claimed  # said in the card's text as the folder's claim (a local path never), not as base_model
            )
    except Exception:
        pass
    return out


def _base_metadata(base: dict[str, Any]) -> dict[str, Any]:
    """The card's `base_model` metadata: a Hub id from the load record or `base_model.hub_id` (and
    the pinned commit), else none; the base artifact's manifest digest either way."""
    meta = {"base_model": base["hub_id"]} if base.get("hub_id") else {}
    if base.get("hub_id") and base.get("revision"):
        meta["base_model_revision"] = base["revision"]
    if base.get("digest"):
        meta["base_model_manifest_digest"] = base["digest"]
    return meta


def train_facts(
    cfg: RunConfig, results: dict[str, Any], read_text: Callable[[str], str] | None = None
) -> dict[str, dict]:
    """Per training stage: steps, final loss, tokens seen and the data split, from this run's
    results or the final checkpoint's `train_state.json` and the stage's split record; the kernels
    and activation checkpointing that ran, from that checkpoint's manifest."""
    facts = {}
    for phase in cfg.phases:
        steps = cfg.phase(phase).max_steps
        fact: dict[str, Any] = {
            "steps": steps,
            "final_loss": None,
            "tokens_seen": None,
            "split": None,
            "medians": {},
            "kernels": None,
            "activation_checkpointing": None,
            "lora": None,
            "peak_mem": None,
        }
        r = results.get(f"train_{phase}")
        if r is not None and r.detail.get("final_loss") is not None:
            fact["final_loss"] = float(r.detail["final_loss"])
        if r is not None and r.detail.get("peak_mem_bytes") is not None:  # the largest of every rank's, and whose
            fact["peak_mem"] = (int(r.detail["peak_mem_bytes"]), r.detail.get("peak_mem_rank"))
        if read_text is not None:
            try:
                state = json.loads(read_text(f"{TRAINING[phase].step(steps)}/{TRAIN_STATE}"))
                losses = state.get("losses") or []
                if fact["final_loss"] is None and losses:
                    fact["final_loss"] = float(losses[-1])
                fact["tokens_seen"] = state.get("tokens_seen")
                fact["medians"] = step_medians(state)
                fact["peak_mem"] = step_peak(state) or fact["peak_mem"]
                fact["segments"] = state.get(
                    "segments"
                )  # the layout of each stretch of steps (tasks/core/run/segments.py)
            except Exception:
                pass
            try:
                fact["split"] = json.loads(read_text(split_rel(phase)))
            except Exception:
                pass
            try:
                meta = json.loads(read_text(f"{TRAINING[phase].step(steps)}/{MANIFEST}")).get("meta") or {}
                fact["kernels"], fact["activation_checkpointing"] = (
                    meta.get("kernels"),
                    meta.get("activation_checkpointing"),
                )
                fact["lora"] = meta.get("lora")  # config and trainable/total parameters of a LoRA stage
            except Exception:
                pass
        # each preemption of the stage (tasks/core/run/preemptions.py): this run's row, else the stage's log
        r_pre = (r.detail.get("preemptions") if r is not None else None) or None
        if r_pre is None and read_text is not None:
            try:
                r_pre = parse_preemptions(read_text(preemption_log(TRAINING[phase].checkpoints)))
            except Exception:
                r_pre = None
        fact["preemptions"] = r_pre or []
        facts[phase] = fact
    return facts


def preemption_cell(facts: dict[str, dict], phase: str) -> str:
    """How often the stage was preempted; each: when, the step checkpointed, steps lost, notice to
    commit against the grace, restart to first step."""
    records = facts.get(phase, {}).get("preemptions") or []
    if not records:
        return "none"
    return "<br>".join(
        f"{p.get('at')}: step {p.get('checkpoint_step')} checkpointed, {p.get('steps_lost')} lost, "
        f"{_secs(p.get('notice_to_commit_s'))} notice to commit (grace {_secs(p.get('grace_s'))}), "
        f"{_secs(p.get('restart_to_first_step_s'))} restart to first step"
        for p in records
    )


def _secs(x: Any) -> str:
    return f"{float(x):.1f} s" if isinstance(x, (int, float)) else "n/a"


def _median(facts: dict[str, dict], phase: str, key: str) -> float | None:
    return (facts.get(phase, {}).get("medians") or {}).get(key)


def _kernels(facts: dict[str, dict], phase: str) -> str:
    recorded = facts.get(phase, {}).get("kernels")
    return "n/a" if recorded is None else describe(recorded).replace("|", "/")


def _tuning(cfg: RunConfig, facts: dict[str, dict], phase: str) -> str:
    """Full, or LoRA with its rank, alpha, target modules and the share of parameters it trained."""
    lora = cfg.phase(phase).lora
    if lora is None:
        return "full"
    share = (facts.get(phase, {}).get("lora") or {}).get("trainable_pct")
    trained = f"; {share:.3g} % of parameters trained" if share is not None else ""
    adapted = (facts.get(phase, {}).get("lora") or {}).get(
        "adapted_modules"
    )  # what peft adapted, recorded by the engine
    return f"LoRA r={lora.r}, alpha={lora.alpha:g} on {', '.join(adapted) if adapted else lora.targets_text()}{trained}"


def _context(cfg: RunConfig, base: dict[str, Any], phase: str) -> str:
    """The tokens a sequence held, and for CPT the RoPE and position settings it changed from the base's."""
    trained = f"{cfg.phase(phase).seq_len:,} tokens"
    if PHASES[phase].context_refused:  # it starts from cpt/hf
        return f"{trained}; RoPE and positions as CPT left them (cpt/hf)"
    before = base.get("config") or {}
    changed = changes_text(before, cfg.cpt.context)
    if changed:
        return f"{trained}; " + "; ".join(changed)
    kept = ", ".join(f"{k} {before[k]}" for k in POSITION_FIELDS if before.get(k) is not None)
    return f"{trained}; RoPE and positions the base's" + (f" ({kept})" if kept else "")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def _peak(facts: dict[str, dict], phase: str) -> str:
    peak = facts.get(phase, {}).get("peak_mem")
    return "n/a" if not peak else f"{peak[0] / 2**30:.2f} GiB" + (f" (rank {peak[1]})" if peak[1] is not None else "")


def _comment(text: str, width: int = 100) -> str:
    import textwrap

    return "\n".join(f"# {line}" for line in textwrap.wrap(text, width - 2))


def usage_snippet(model_id: str, dtype: str = "bf16", stops: str = UNMEASURED_STOP) -> str:
    """Load in the export's own dtype, apply the chat template, generate: the tests run exactly this
    against the export. `stops`: what the comment says of where a reply ends (`stop_claim`)."""
    return f'''```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_id = "{model_id}"
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModelForCausalLM.from_pretrained(model_id, dtype={TORCH_DTYPES[dtype]})
messages = [{{"role": "user", "content": "Hello! Who are you?"}}]
input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
{_comment(stops)}
output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=64, do_sample=False)
print(tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True))
```'''


def _layout(cfg: RunConfig, phase: str) -> str:
    phase_cfg = cfg.phase(phase)
    p = phase_cfg.plugin
    return (
        f"`{p.name}` tp={p.tp_size} pp={p.pp_size} zero={p.zero_stage} {p.precision}, "
        f"{phase_cfg.launch.nnodes}×{phase_cfg.launch.nproc_per_node} ranks"
    )


def _segments(facts: dict[str, dict], phase: str) -> str | None:
    """A stage that continued under another layout: each segment's layout and first step."""
    segs = facts.get(phase, {}).get("segments") or []
    if len(segs) < 2:
        return None
    return "<br>".join(f"from step {seg['from_step']}: `{describe_layout(seg)}`" for seg in segs)


def _batch(cfg: RunConfig, phase: str) -> str:
    phase_cfg = cfg.phase(phase)
    p = phase_cfg.plugin
    dp = max(phase_cfg.launch.world_size // (p.tp_size * p.pp_size * sp_factor(p)), 1)  # a sequence group reads one row
    n = phase_cfg.micro_batch_size * phase_cfg.grad_accum_steps * dp
    per = PHASES[phase].rows_per_record
    # a pair phase's micro_batch_size counts records (pairs), each its chosen and its rejected sequence
    unit = "sequences" if per == 1 else f"{PHASES[phase].record_noun} ({n * per} sequences)"
    return f"{phase_cfg.micro_batch_size} × {phase_cfg.grad_accum_steps} accum × {dp} dp = {n} {unit}"


def _schedule(cfg: RunConfig, phase: str) -> str:
    phase_cfg = cfg.phase(phase)
    return (
        f"AdamW lr {phase_cfg.lr:g} → {phase_cfg.min_lr:g} {phase_cfg.lr_schedule}, warm-up {phase_cfg.warmup_steps}, "
        f"weight decay {phase_cfg.weight_decay:g}, betas {tuple(phase_cfg.betas)}, clip {phase_cfg.plugin.max_norm:g}"
    )


def _num(x: Any, fmt: str = "{:,}") -> str:
    return "n/a" if x is None else fmt.format(x)


def model_card(
    cfg: RunConfig,
    export_manifest: dict[str, Any],
    facts: dict[str, dict],
    metrics: dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
    results: Mapping[str, Any] | None = None,
) -> str:
    """README.md: ModelCardData metadata (with a model-index of the held-out metrics, and the base
    model: `base_facts`) plus training hyperparameters, data, evaluation, versions, verification
    and usage. `results`: the stage rows (this run's StageResults, or run.json's), for the gate's
    verdict and the evaluations that did not run; None says neither."""
    hub = cfg.hub
    base = base or base_facts(cfg)
    meta = export_manifest.get("meta") or {}
    v = meta.get("verification") or {}
    title = hub.repo_id if hub else cfg.name
    versions = meta.get("versions") or {}
    version_line = ", ".join(f"{k} {val}" for k, val in versions.items() if val) or "not recorded"
    usage_id = hub.repo_id if hub else f"path/to/{cfg.name}/export"
    body = f"""
# {title}

Continued pre-training (CPT) then supervised fine-tuning (SFT){_then(cfg)} of {_base_line(base)} with cpt-to-sft on
ColossalAI, run `{cfg.name}`. Gate before the push: {gate_verdict_text(results)[0]}.

## Usage

{usage_snippet(usage_id, cfg.export.dtype, stop_claim(metrics))}

{_stop_line(v)}

## Training hyperparameters

{chr(10).join(_training_table(cfg, facts, base))}

## Data

{chr(10).join(data_section(cfg, facts))}

## Evaluation (held-out)

{evaluation_section(metrics, results)}

## Framework versions

{version_line}

## Export

`{cfg.export.dtype}` safetensors. Provenance is in `{MANIFEST.split("/")[0]}/`: `{MANIFEST.split("/")[1]}` lists every file
with its sha256, `verification.json` holds the checks below.

**Verification:** {_verification(v)}
{_adapter_paragraph(cfg, v.get("adapter") or {})}"""
    return with_front_matter(_card_data(cfg, base, metrics), body)


def _then(cfg: RunConfig) -> str:
    """The phases after SFT the run trained (a run without them reads as before)."""
    later = [p for p in cfg.phases if PHASES[p].optional]
    return "".join(
        f" then {PHASES[p].title} on preference pairs" if PHASES[p].record == "pair" else f" then {PHASES[p].title}"
        for p in later
    )


def _card_data(cfg: RunConfig, base: dict[str, Any], metrics: dict[str, Any] | None):
    """The card's metadata (huggingface_hub's ModelCardData): the base, the datasets on the Hub,
    license and tags, and the model-index of the held-out and benchmark results."""
    from huggingface_hub import ModelCardData

    hub = cfg.hub
    eval_results = eval_results_for_card(metrics or {}) + benchmark_card_results((metrics or {}).get("benchmark"))
    datasets = sorted({d for u in (*cfg.cpt.data.uris, *cfg.sft.data.uris) if (d := hub_dataset_id(u))})
    return ModelCardData(
        **_base_metadata(base),
        datasets=datasets or None,
        library_name="transformers",
        license=hub.license if hub and hub.license else None,
        tags=["cpt-to-sft", "colossalai", *(hub.tags if hub else ())],
        pipeline_tag="text-generation",
        # huggingface_hub requires model_name whenever eval_results are given.
        model_name=(hub.repo_id.split("/")[-1] if hub else cfg.name) if eval_results else None,
        eval_results=eval_results or None,
    )


def _training_table(cfg: RunConfig, facts: dict[str, dict], base: dict[str, Any]) -> list[str]:
    """The hyperparameters and what training measured, one row per fact, a column per phase the run
    trains (CPT, SFT, and DPO where configured)."""
    phases = list(cfg.phases)
    train = ["| | " + " | ".join(PHASES[p].title for p in phases) + " |", "|" + "---|" * (len(phases) + 1)]
    rows = {
        "plugin and parallel layout": lambda s: _segments(facts, s) or _layout(cfg, s),
        "steps": lambda s: str(facts.get(s, {}).get("steps")),
        "learning rate schedule": lambda s: _schedule(cfg, s),
        "batch per step": lambda s: _batch(cfg, s),
        "seq_len": lambda s: str(cfg.phase(s).seq_len),
        "context length trained": lambda s: _context(cfg, base, s),
        "tokens seen": lambda s: _num(facts.get(s, {}).get("tokens_seen")),
        "final training loss": lambda s: _num(facts.get(s, {}).get("final_loss"), "{:.4f}"),
        "batching": lambda s: cfg.phase(s).batching if PHASES[s].rows else "full blocks",
        "median real tokens/s": lambda s: _num(_median(facts, s, "tokens_per_s"), "{:.1f}"),
        "median padding (share of computed tokens)": lambda s: _pct(_median(facts, s, "padding_frac")),
        "median MFU": lambda s: _pct(_median(facts, s, "mfu")),
        "peak memory (largest rank)": lambda s: _peak(facts, s),
        "kernels": lambda s: _kernels(facts, s),
        "activation checkpointing": lambda s: {True: "on", False: "off"}.get(
            facts.get(s, {}).get("activation_checkpointing"), "n/a"
        ),
        "fine-tuning": lambda s: _tuning(cfg, facts, s),
        **_preference_rows(cfg),
        "seed": lambda s: str(cfg.phase(s).seed),
        "preemptions": lambda s: preemption_cell(facts, s),
    }
    return train + [f"| {name} | " + " | ".join(fn(p) for p in phases) + " |" for name, fn in rows.items()]


def _preference_rows(cfg: RunConfig) -> dict[str, Callable[[str], str]]:
    """The preference loss's settings (beta, loss, label_smoothing), rows only where the run trains a
    phase that has them, so that a run without one keeps the table it always had; n/a in the columns
    of the phases without them."""
    if not any(isinstance(section, PreferenceFields) for section in cfg.phases.values()):
        return {}

    def cell(fmt: Callable[[PreferenceFields], str]) -> Callable[[str], str]:
        return lambda s: fmt(section) if isinstance(section := cfg.phase(s), PreferenceFields) else "n/a"

    return {
        "beta": cell(lambda p: f"{p.beta:g}"),
        "preference loss": cell(lambda p: f"`{p.loss}`"),
        "label_smoothing": cell(lambda p: f"{p.label_smoothing:g}"),
    }


def _verification(v: dict[str, Any]) -> str:
    """The export's weight proof: bitwise against the SFT checkpoint, and the logits check."""
    if not v:
        return "not recorded in the export manifest."
    proof = v.get("weights_bitwise") or {}
    return (
        f"{'passed' if v.get('fingerprint_match') else 'FAILED'}: every one of the {proof.get('tensors', v.get('tensors'))} "
        "exported "
        f"`{v.get('dtype')}` tensors is bitwise the SFT checkpoint's tensor cast to `{v.get('dtype')}`; loaded "
        "with `transformers`, "
        f"the logits on a fixed probe batch are within {v.get('fingerprint_rel_diff', float('nan')):.3g} of their "
        "magnitude "
        f"(tolerance {v.get('fingerprint_rtol')}) of the checkpoint's, top-1 agreement {v.get('top1_agreement', float('nan')):.3f}."
    )


def _stop_line(v: dict[str, Any]) -> str:
    """Where generation stops: the export's eos_token_id, the base's plus the end-of-turn tokens added."""
    stop = v.get("stop_tokens") or {}
    if not stop:
        return ""
    added = ", ".join(f"`{a['token']}` ({a['id']})" for a in stop.get("added", []))
    return (
        f"`eos_token_id` is {stop.get('eos_token_id')}: the base model's {stop.get('base_eos_token_id')}"
        + (f" plus the chat template's end-of-turn {added}" if added else "")
        + "."
    )


def _base_line(base: dict[str, Any]) -> str:
    if base.get("hub_id"):
        rev = f" at commit `{base['revision'][:12]}`" if base.get("revision") else ""
        return f"[`{base['hub_id']}`](https://huggingface.co/{base['hub_id']}){rev}"
    digest = f" (base artifact's manifest digest `{base['digest'][:16]}`)" if base.get("digest") else ""
    claim = f", whose config.json names `{base['claimed']}`" if base.get("claimed") else ""
    return f"the model folder `{base.get('name')}`{claim}{digest}"


def _adapter_where(cfg: RunConfig) -> str:
    hub = cfg.hub
    return (
        f"[`{hub.adapter_repo_id}`](https://huggingface.co/{hub.adapter_repo_id})"
        if hub.adapter_repo_id
        else "the `adapter/` folder of this repo"
    )


def _adapter_paragraph(cfg: RunConfig, proof: dict[str, Any]) -> str:
    if cfg.hub is None or not cfg.hub.push_adapter:
        return ""
    rel = proof.get("fingerprint_rel_diff")
    return f"""
## LoRA adapter

The weights above already hold the adapter, merged in fp32. The adapter alone (peft's layout) is in
{_adapter_where(cfg)}: apply it to the CPT model of run `{cfg.name}` (its `cpt/hf` artifact), never to
these merged weights. Its `base_model_name_or_path` is that artifact's path on the machine that ran
the training (a local reference: the CPT model is not on the Hub).
{f"peft with the adapter on that base gives this model's logits within {rel:.3g} of their magnitude." if rel is not None else ""}
"""


def adapter_card(cfg: RunConfig, adapter_manifest: dict[str, Any]) -> str:
    """README.md of an adapter pushed to a repo of its own: what it is, the base it needs, the merged model."""
    from huggingface_hub import ModelCardData

    meta = adapter_manifest.get("meta") or {}
    v, base = meta.get("verification") or {}, meta.get("base") or {}
    phase = exported_phase(cfg.phases)  # its adapter: sft's on cpt/hf, or dpo's on sft/hf
    lora, base_rel = cfg.phase(phase).lora, TRAINING[phase].source
    adapted = v.get("target_modules")  # what adapter_config.json says peft adapted: names, or the regex
    targets = adapted if isinstance(adapted, str) else ", ".join(adapted or []) or lora.targets_text()
    data = ModelCardData(
        library_name="peft",
        tags=["cpt-to-sft", "lora", *(cfg.hub.tags if cfg.hub else ())],
        license=cfg.hub.license if cfg.hub and cfg.hub.license else None,
    )
    body = f"""
# {cfg.hub.adapter_repo_id}

The LoRA adapter (r={lora.r}, alpha={lora.alpha:g} on {targets}) of run `{cfg.name}`; the model with it merged
in is [`{cfg.hub.repo_id}`](https://huggingface.co/{cfg.hub.repo_id}).

Its base is the model the run's {PHASES[phase].title} started from (`{base_rel}`, manifest digest `{str(base.get("digest"))[:16]}`), which is not on the Hub:
`base_model_name_or_path` is `{base.get("name_or_path")}`, a local reference on the machine that trained it.

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM

base = AutoModelForCausalLM.from_pretrained("path/to/{base_rel}")
model = PeftModel.from_pretrained(base, "{cfg.hub.adapter_repo_id}")
```

**Verification:** peft with this adapter on that base gives the merged model's logits within
{v.get("fingerprint_rel_diff", float("nan")):.3g} of their magnitude (tolerance {v.get("fingerprint_rtol")}), top-1 agreement {v.get("top1_agreement", float("nan")):.3f}.
"""
    return with_front_matter(data, body)
