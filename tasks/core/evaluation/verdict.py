"""The publish gate's verdict on the held-out metrics, and how the metrics are reported (the
evaluation table artifact, the model card's model-index).

    python -c "from tasks.core.evaluation.verdict import gate_verdict; from tasks.core.config.outputs import GateConfig; \
print(gate_verdict(GateConfig(sft_loss_must_improve=False, generation_must_stop=False), {'base': {'perplexity': 9.0}, 'cpt': {'perplexity': 3.0}, 'perplexity_change_pct': -66.7}, None))"

Pure: the metrics come from `tasks.core.evaluation.heldout` (evaluate_cpt, evaluate_sft). A
mixture's CPT metrics carry `sources` ({name: base vs CPT on that source's held-out records}), and
so does a stage with held-out-only sources (cpt.eval.heldout_sources, marked `held_out_only`);
`gate.cpt_max_ppl_increase_pct` as a mapping is then a limit per source (the forgetting check:
a replayed general source may not get worse by more than its limit), every source it does not
name held to 0 (no worse than the base), as the number's default holds the pooled set.
"""

from __future__ import annotations

import math
from typing import Any

from tasks.core.config.outputs import GateConfig
from tasks.core.evaluation.benchmark import gate_checks as benchmark_checks
from tasks.core.evaluation.generation import stop_problem


def _per_source(limits: dict[str, float], cpt: dict[str, Any] | None, check) -> None:
    """One check per source of the mixture: its held-out perplexity against the base's, within its limit."""
    per = (cpt or {}).get("sources") or {}
    if not cpt or not per:
        what = (
            "no CPT evaluation was recorded (cpt.eval has no held-out set)"
            if not cpt
            else "the CPT evaluation has no per-source metrics (one source)"
        )
        check(
            "cpt_perplexity",
            False,
            f"{what}; gate.cpt_max_ppl_increase_pct names sources {sorted(limits)}",
            limit_pct=limits,
        )
        return
    for name in [*per, *(n for n in limits if n not in per)]:
        limit = float(limits.get(name, 0.0))
        field = (
            f"gate.cpt_max_ppl_increase_pct.{name}"
            if name in limits
            else "gate.cpt_max_ppl_increase_pct (a source it does not name: 0)"
        )
        m = per.get(name)
        if m is None or m.get("base") is None:
            why = (m or {}).get("skipped") or "it was not evaluated"
            check(
                f"cpt_perplexity:{name}",
                False,
                f"source {name!r}: no held-out perplexity ({why}); raise cpt.eval.heldout_fraction",
                source=name,
                limit_pct=limit,
            )
            continue
        before, after, change = m["base"]["perplexity"], m["cpt"]["perplexity"], m["perplexity_change_pct"]
        check(
            f"cpt_perplexity:{name}",
            math.isfinite(after) and change <= limit,
            f"source {name!r}: CPT held-out perplexity {after:.4g} vs base {before:.4g} ({change:+.2f}%, allowed at "
            f"most {limit:+g}% by {field})",
            source=name,
            before=before,
            after=after,
            change_pct=change,
            limit_pct=limit,
        )


def _dpo_checks(gate: GateConfig, dpo: dict[str, Any] | None, check) -> None:
    """The dpo phase's limits over evaluate_dpo's figures: accuracy, margin, the chosen replies' likelihood."""
    limits = [
        (name, limit)
        for name, limit in (
            ("dpo_min_accuracy", gate.dpo_min_accuracy),
            ("dpo_min_margin", gate.dpo_min_margin),
            ("dpo_max_chosen_logp_drop", gate.dpo_max_chosen_logp_drop),
        )
        if limit is not None
    ]
    if limits and not dpo:
        check(
            "dpo", False, f"no DPO evaluation was recorded (dpo.eval has no held-out pairs); gate.{limits[0][0]} is set"
        )
        return
    for name, limit in limits:
        d, s = dpo["dpo"], dpo["sft"]
        if name == "dpo_min_accuracy":
            check(
                "dpo_accuracy",
                d["accuracy"] >= limit,
                f"DPO held-out preference accuracy {d['accuracy']:.3f} (at least {limit:g} by gate.{name})",
                after=d["accuracy"],
                limit=limit,
            )
        elif name == "dpo_min_margin":
            check(
                "dpo_margin",
                math.isfinite(d["margin"]) and d["margin"] > limit,
                f"DPO held-out reward margin {d['margin']:+.4f} (must be above {limit:g} by gate.{name})",
                after=d["margin"],
                limit=limit,
            )
        else:
            drop = s["chosen_logp_per_token"] - d["chosen_logp_per_token"]
            check(
                "dpo_chosen_logp",
                math.isfinite(drop) and drop <= limit,
                f"chosen replies' held-out log-likelihood per token {d['chosen_logp_per_token']:.4f} vs SFT "
                f"{s['chosen_logp_per_token']:.4f} (a drop of {drop:.4f} nats, at most {limit:g} by gate.{name})",
                before=s["chosen_logp_per_token"],
                after=d["chosen_logp_per_token"],
                limit=limit,
            )


def gate_verdict(
    gate: GateConfig,
    cpt: dict[str, Any] | None,
    sft: dict[str, Any] | None,
    bench: dict[str, Any] | None = None,
    dpo: dict[str, Any] | None = None,
    trains_dpo: bool = False,
) -> dict[str, Any]:
    """{"enabled", "passed", "reasons", "checks"}: every configured check, each with its numbers.

    A disabled gate passes but still lists what each check found. `dpo`: evaluate_dpo's metrics, checked
    when the run trains the dpo phase (`trains_dpo`); a run without it has today's checks only.
    """
    checks: list[dict[str, Any]] = []

    def check(name: str, ok: bool, message: str, **numbers: Any) -> None:
        checks.append({"check": name, "ok": bool(ok), "message": message, **numbers})

    if isinstance(gate.cpt_max_ppl_increase_pct, dict):
        _per_source(gate.cpt_max_ppl_increase_pct, cpt, check)
    elif gate.cpt_max_ppl_increase_pct is not None:
        limit = gate.cpt_max_ppl_increase_pct
        if not cpt:
            check(
                "cpt_perplexity",
                False,
                "no CPT evaluation was recorded (cpt.eval has no held-out set)",
                limit_pct=limit,
            )
        else:
            before, after, change = cpt["base"]["perplexity"], cpt["cpt"]["perplexity"], cpt["perplexity_change_pct"]
            ok = math.isfinite(after) and change <= limit
            check(
                "cpt_perplexity",
                ok,
                f"CPT held-out perplexity {after:.4g} vs base {before:.4g} ({change:+.2f}%, allowed at most "
                f"{limit:+g}%)",
                before=before,
                after=after,
                change_pct=change,
                limit_pct=limit,
            )
    if gate.sft_loss_must_improve:
        if not sft:
            check("sft_loss", False, "no SFT evaluation was recorded (sft.eval has no held-out set)")
        else:
            before, after = sft["pre_sft"]["loss"], sft["sft"]["loss"]
            check(
                "sft_loss",
                after < before,
                f"SFT held-out loss on assistant tokens {after:.4f} vs pre-SFT {before:.4f} (must be lower)",
                before=before,
                after=after,
            )
    if gate.generation_must_stop:
        gen = (sft or {}).get("generation")
        if not gen:
            check("generation_stops", False, "no generation check was recorded (sft.eval has no held-out set)")
        else:
            stops = stop_problem(gen["stopped"], gen["prompts"], gen["max_new_tokens"])
            msg = (
                stops
                if gen["stopped"] < gen["prompts"]
                else f"{gen['stopped']} of {gen['prompts']} greedy generations stopped within "
                f"{gen['max_new_tokens']} tokens"
            )
            check(
                "generation_stops",
                gen["passed"],
                "; ".join([msg, *(p for p in gen["problems"] if p != stops)]),  # each reason once
                stopped=gen["stopped"],
                prompts=gen["prompts"],
            )
    benchmark_checks(gate.benchmarks, bench, check)
    if trains_dpo:
        _dpo_checks(gate, dpo, check)
    failed = [c["message"] for c in checks if not c["ok"]]
    return {
        "enabled": gate.enabled,
        "passed": (not failed) or not gate.enabled,
        "reasons": failed if gate.enabled else [],
        "checks": checks,
    }


# ------------------------------------------------------------------------------------------------
# Reporting


def _fmt(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, float) else ("" if x is None else str(x))


def metrics_table(
    cpt: dict | None, sft: dict | None, verdict: dict | None, dpo: dict | None = None
) -> list[dict[str, str]]:
    """Rows for the Prefect table artifact: one per metric, before/after and the gate's word."""
    by_check = {c["check"]: c for c in (verdict or {}).get("checks", [])}

    def verdict_of(name: str) -> str:
        c = by_check.get(name)
        return "" if c is None else ("pass" if c["ok"] else "FAIL")

    rows = []
    if cpt:
        rows.append(
            {
                "metric": "CPT held-out perplexity",
                "before": f"base {_fmt(cpt['base']['perplexity'])}",
                "after": f"CPT {_fmt(cpt['cpt']['perplexity'])}",
                "change": f"{cpt['perplexity_change_pct']:+.2f}%",
                "gate": verdict_of("cpt_perplexity"),
            }
        )
        rows.append(
            {
                "metric": "CPT held-out loss",
                "before": f"base {_fmt(cpt['base']['loss'])}",
                "after": f"CPT {_fmt(cpt['cpt']['loss'])}",
                "change": f"{cpt['cpt']['loss'] - cpt['base']['loss']:+.4f}",
                "gate": "",
            }
        )
        for name, m in (cpt.get("sources") or {}).items():
            metric = f"CPT held-out perplexity: {name}" + (
                " (held out only, never trained on)" if m.get("held_out_only") else ""
            )
            if m.get("base") is None:
                rows.append(
                    {
                        "metric": metric,
                        "before": "",
                        "after": "",
                        "change": m.get("skipped", ""),
                        "gate": verdict_of(f"cpt_perplexity:{name}"),
                    }
                )
                continue
            rows.append(
                {
                    "metric": metric,
                    "before": f"base {_fmt(m['base']['perplexity'])}",
                    "after": f"CPT {_fmt(m['cpt']['perplexity'])}",
                    "change": f"{m['perplexity_change_pct']:+.2f}%",
                    "gate": verdict_of(f"cpt_perplexity:{name}"),
                }
            )
    if sft:
        rows.append(
            {
                "metric": "SFT held-out loss (assistant tokens)",
                "before": f"pre-SFT {_fmt(sft['pre_sft']['loss'])}",
                "after": f"SFT {_fmt(sft['sft']['loss'])}",
                "change": f"{sft['loss_change']:+.4f}",
                "gate": verdict_of("sft_loss"),
            }
        )
        gen = sft.get("generation")
        if gen:
            rows.append(
                {
                    "metric": "generations that stop",
                    "before": "",
                    "after": f"{gen['stopped']} / {gen['prompts']}",
                    "change": "; ".join(gen["problems"]),
                    "gate": verdict_of("generation_stops"),
                }
            )
    if dpo:
        for metric, key, check in (
            ("DPO held-out preference accuracy", "accuracy", "dpo_accuracy"),
            ("DPO held-out reward margin", "margin", "dpo_margin"),
            ("chosen replies' log-likelihood per token", "chosen_logp_per_token", "dpo_chosen_logp"),
        ):
            before, after = dpo["sft"][key], dpo["dpo"][key]
            rows.append(
                {
                    "metric": metric,
                    "before": f"SFT {_fmt(before)}",
                    "after": f"DPO {_fmt(after)}",
                    "change": f"{after - before:+.4f}",
                    "gate": verdict_of(check),
                }
            )
    return rows


def _dataset_name(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[-1]


def eval_results_for_card(metrics: dict[str, Any], model_name: str | None = None) -> list:
    """huggingface_hub EvalResults for the card's `model-index` (pass `model_name` to ModelCardData
    too: it is required with eval_results). `metrics` is run.json's "evaluation" section
    ({"cpt": ..., "sft": ...}); missing parts are left out."""
    from huggingface_hub import EvalResult

    out = []

    def add(ds: tuple[str, str], metric_type: str, value: float, name: str) -> None:
        out.append(
            EvalResult(
                task_type="text-generation",
                dataset_type=ds[0],
                dataset_name=ds[1],
                dataset_split="heldout",
                metric_type=metric_type,
                metric_value=value,
                metric_name=name,
            )
        )

    sft, cpt, dpo = metrics.get("sft"), metrics.get("cpt"), metrics.get("dpo")
    if dpo:
        ds = _split_dataset(dpo, "DPO")
        add(ds, "accuracy", round(dpo["dpo"]["accuracy"], 4), "held-out preference accuracy (DPO vs the SFT model)")
        add(ds, "reward_margin", round(dpo["dpo"]["margin"], 6), "held-out mean reward margin")
        add(
            ds,
            "loss",
            round(dpo["dpo"]["chosen_logp_per_token"], 6),
            "held-out chosen replies' log-likelihood per token",
        )
        add(
            ds,
            "loss",
            round(dpo["sft"]["chosen_logp_per_token"], 6),
            "held-out chosen replies' log-likelihood per token, before DPO",
        )
    if sft:
        ds = _split_dataset(sft, "SFT")
        add(ds, "loss", round(sft["sft"]["loss"], 6), "held-out loss on assistant tokens")
        add(ds, "loss", round(sft["pre_sft"]["loss"], 6), "held-out loss on assistant tokens, before SFT")
        gen = sft.get("generation")
        if gen:
            add(
                ds,
                "stop_rate",
                round(gen["stopped"] / max(gen["prompts"], 1), 4),
                f"greedy replies ending at an eos token within {gen['max_new_tokens']} tokens",
            )
    if cpt:
        ds = _split_dataset(cpt, "CPT")
        add(ds, "perplexity", round(cpt["cpt"]["perplexity"], 4), "held-out perplexity after CPT (before SFT)")
        add(ds, "perplexity", round(cpt["base"]["perplexity"], 4), "held-out perplexity of the base model")
        for name, m in (cpt.get("sources") or {}).items():
            if m.get("base") is not None:
                src = (
                    name,
                    f"CPT held-out of source {name}" + (" (never trained on)" if m.get("held_out_only") else ""),
                )
                add(
                    src,
                    "perplexity",
                    round(m["cpt"]["perplexity"], 4),
                    f"held-out perplexity of source {name} after CPT",
                )
                add(
                    src,
                    "perplexity",
                    round(m["base"]["perplexity"], 4),
                    f"held-out perplexity of source {name}, base model",
                )
    return out


def _split_dataset(m: dict, phase: str) -> tuple[str, str]:
    split = m.get("split") or {}
    source = split.get("heldout_uri") or split.get("data_uri")
    source = source if isinstance(source, str) else phase.lower()  # a list of uris or a mixture: named after the stage
    how = f"{split['fraction']:g} hash split of " if split.get("method") == "hash-fraction" else ""
    return _dataset_name(source), f"{phase} held-out ({how}{_dataset_name(source)})"
