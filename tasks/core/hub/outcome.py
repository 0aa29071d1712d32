"""What the model card says of how the run ended: the gate's verdict, the evaluations that did not run, and
how far the usage snippet may claim that a reply stops.

    python -c "from tasks.core.hub.outcome import gate_verdict_text; print(gate_verdict_text({}))"

Read from the stage rows (`results`: this run's StageResults, or run.json's rows as `cpt-to-sft card`
reads them) and the recorded metrics, never recomputed: a re-rendered card says the same. The gate's
row holds its verdict (`tasks.core.evaluation.verdict.gate_verdict`: every check with its message and
limit); an evaluation stage not completed or skipped is listed with why (not configured, failed with
its cause, preempted, or never reached).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.core.evaluation.verdict import metrics_table
from tasks.core.run.stages import ROWS

# What the snippet says of where a reply ends when the generation check's record says nothing.
UNMEASURED_STOP = "A reply ends at an eos token of generation_config.json, or after max_new_tokens."


def stop_claim(metrics: dict[str, Any] | None) -> str:
    """The snippet's word on whether a reply stops: what the generation check measured (evaluate_sft's
    greedy replies to held-out prompts), never more; unmeasured, only what generate() does."""
    gen = ((metrics or {}).get("sft") or {}).get("generation") or {}
    if not gen.get("prompts"):
        return f"{UNMEASURED_STOP} Whether replies stop was not measured (the generation check did not run)."
    stopped, prompts, limit = gen.get("stopped", 0), gen["prompts"], gen.get("max_new_tokens")
    if stopped >= prompts:
        return (
            f"In the generation check all {prompts} greedy replies to held-out prompts stopped at an eos token of "
            f"generation_config.json within {limit} new tokens."
        )
    return (
        f"In the generation check only {stopped} of {prompts} greedy replies to held-out prompts stopped at an eos "
        f"token within {limit} new tokens: a reply may run on to max_new_tokens (see the evaluation below)."
    )


# The stages whose measurements the card reports, and what each measures: one not run is listed as such.
EVALUATIONS = {
    ROWS.evaluate_cpt.name: "held-out perplexity, base vs CPT",
    ROWS.evaluate_sft.name: "held-out loss on assistant tokens, pre-SFT vs SFT, and the generation check",
    ROWS.benchmark.name: "lm-eval benchmarks, base vs export",
}
# A row of the dpo phase: listed only for a run whose records have it (a run without dpo never had it to run).
DPO_EVALUATION = {
    ROWS.evaluate_dpo.name: "held-out preference accuracy, reward margin and chosen log-likelihood, SFT vs DPO"
}
RAN = ("completed", "skipped")  # a stage that measured now, or whose recorded measurement stands


def _row(results: Mapping[str, Any] | None, stage: str) -> tuple[str, dict[str, Any]]:
    """(status, detail) of a stage in `results` (StageResult-like rows: `.status`, `.detail`; or run.json's dicts)."""
    r = (results or {}).get(stage)
    if r is None:
        return "not-run", {}
    if isinstance(r, Mapping):
        return str(r.get("status")), dict(r.get("detail") or {})
    return str(r.status), dict(r.detail or {})


def _why_not(status: str, detail: dict[str, Any]) -> str:
    if status == "not-configured":
        return f"not configured ({detail.get('reason') or 'nothing to measure'})"
    if status in ("failed", "preempted"):
        return f"{status}: {str(detail.get('error') or 'see run.json')[:300]}"
    return "not run: the run ended before it"


def gate_verdict_text(results: Mapping[str, Any] | None) -> tuple[str, list[str]]:
    """(the gate's verdict in a few words, one line per check): passed, failed with the failing limits,
    disabled, or not run, from the gate stage's row (its detail is the verdict, tasks/core/evaluation/verdict.py)."""
    if results is None:
        return "not recorded", []
    status, verdict = _row(results, ROWS.gate.name)
    checks = verdict.get("checks") or []
    lines = [f"{'pass' if c.get('ok') else 'FAIL'} `{c.get('check')}`: {c.get('message')}" for c in checks]
    if status == "passed":
        return f"**passed**: every one of its {len(checks)} checks held", lines
    if status == "failed-gate":
        reasons = verdict.get("reasons") or []
        return f"**failed** ({len(reasons)} of {len(checks)} checks): the push was held back", lines
    if status == "disabled":
        failed = sum(1 for c in checks if not c.get("ok"))
        said = f"**disabled** (`gate.enabled: false`): nothing was held back; {failed} of {len(checks)} checks failed"
        return said, lines
    return f"**not run** ({_why_not(status, verdict)})", lines


def not_run_lines(results: Mapping[str, Any] | None) -> list[str]:
    """One line per evaluation the run did not measure (and why), from its stage rows; [] when every one ran
    or the rows were not given."""
    if results is None:
        return []
    out = []
    for stage, what in _evaluations(results).items():
        status, detail = _row(results, stage)
        if status not in RAN:
            out.append(f"`{stage}` ({what}): {_why_not(status, detail)}")
    return out


def _evaluations(results: Mapping[str, Any] | None) -> dict[str, str]:
    return {**EVALUATIONS, **(DPO_EVALUATION if ROWS.evaluate_dpo.name in (results or {}) else {})}


def evaluation_section(metrics: dict[str, Any] | None, results: Mapping[str, Any] | None) -> str:
    """The held-out table with the gate's word per row, the gate's verdict and each check, and what did not run."""
    verdict = _row(results, ROWS.gate.name)[1] if results is not None else None
    m = metrics or {}
    table = metrics_table(m.get("cpt"), m.get("sft"), verdict or None, m.get("dpo"))
    parts = []
    if table:
        parts.append(
            "\n".join(
                ["| metric | before | after | change | gate |", "|---|---|---|---|---|"]
                + [
                    f"| {r['metric']} | {r['before']} | {r['after']} | {r['change']} | {r.get('gate') or '-'} |"
                    for r in table
                ]
            )
        )
    else:
        parts.append("No held-out evaluation was recorded.")
    said, checks = gate_verdict_text(results)
    parts.append(
        f"**Gate before the push:** {said}." + ("\n\n" + "\n".join(f"- {c}" for c in checks) if checks else "")
    )
    missing = not_run_lines(results)
    if missing:
        parts.append("**Evaluations not run:**\n\n" + "\n".join(f"- {m}" for m in missing))
    elif results is not None:
        parts.append("Every evaluation ran: " + ", ".join(f"`{s}`" for s in _evaluations(results)) + ".")
    return "\n\n".join(parts)
