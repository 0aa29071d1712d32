"""The model card is part of the export: a view its manifest lists, outside what the export is.

    PYTHONPATH=$PWD python -m pytest -q tests/test_card.py

Unit tier. The demo run's own card (written by the flow, loaded by its snippet in the export's
dtype, rendered again by `cpt-to-sft card`) is checked in tests/test_flow_e2e.py.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from huggingface_hub import ModelCard
from pydantic import ValidationError

from tasks.core.hub.card import CARD, base_facts, model_card, train_facts, usage_snippet
from tasks.core.models.folder import folder_problems
from tasks.core.run.digest import content_digest
from tasks.core.run.manifest import MANIFEST, amend_views, read_manifest, verify_artifact, write_manifest
from tasks.flowkit.stage import StageResult
from tests.test_hub import RESULTS, config, fake_export


def test_a_card_is_a_view_listed_by_the_manifest_and_outside_the_content_digest(tmp_path):
    fake_export(tmp_path / "run")
    export = tmp_path / "run" / "export"
    before = read_manifest(export)
    assert amend_views(export, {CARD: b"# card 1\n"}) is True
    after = verify_artifact(export)  # listed with its size and sha256, and on disk
    assert after["files"][CARD] == {"size": 9, "sha256": hashlib.sha256(b"# card 1\n").hexdigest()} and after[
        "views"
    ] == [CARD]
    assert content_digest(after) == content_digest(before)  # the export is what it was: nothing made from it re-runs
    assert folder_problems(export) == []  # the model-folder rule takes a README
    digest = hashlib.sha256((export / MANIFEST).read_bytes()).hexdigest()
    assert amend_views(export, {CARD: b"# card 1\n"}) is False  # the same card: the manifest is not rewritten
    assert hashlib.sha256((export / MANIFEST).read_bytes()).hexdigest() == digest
    assert amend_views(export, {CARD: b"# card 2, with the evaluation\n"}) is True
    assert (export / CARD).read_bytes() == b"# card 2, with the evaluation\n" and verify_artifact(export)["files"][
        CARD
    ]["size"] == 30
    # A README the build itself wrote (not a view) is content, as any other file.
    write_manifest(export, kind="hf-export")
    assert content_digest(read_manifest(export)) != content_digest(before)


def test_the_card_names_a_real_base_and_loads_in_the_exports_own_dtype(tmp_path):
    run = tmp_path / "run"
    manifest = fake_export(run)
    base = run / "base"
    base.mkdir()
    (base / "config.json").write_text(
        json.dumps({"_name_or_path": "HuggingFaceTB/SmolLM2-135M", "model_type": "llama"})
    )
    write_manifest(base, kind="hf-model", meta={"source": "path", "uri": "/models/smollm2"})
    cfg = config(run, base="/models/smollm2").model_copy(
        update={"export": config(run).export.model_copy(update={"dtype": "fp32"})}
    )
    facts = base_facts(cfg, lambda rel: (run / rel).read_text())
    assert facts == {
        "name": "smollm2",
        "hub_id": None,
        "revision": None,
        "digest": hashlib.sha256((base / MANIFEST).read_bytes()).hexdigest(),
        "config": {"max_position_embeddings": None, "rope_theta": None, "rope_scaling": None},
        "claimed": "HuggingFaceTB/SmolLM2-135M",
    }
    text = model_card(cfg, manifest, train_facts(cfg, RESULTS), base=facts)
    card = ModelCard(text)
    # A local folder: its name (or what its config.json claims) is no Hub id a push may publish as the base.
    assert card.data.base_model is None and card.data.base_model_manifest_digest == facts["digest"]
    assert ", dtype=torch.float32)" in text and "bfloat16" not in text.split("## Usage")[1].split("```\n")[0]
    assert (
        "the model folder `smollm2`, whose config.json names `HuggingFaceTB/SmolLM2-135M` (base artifact's manifest "
        f"digest `{facts['digest'][:16]}`)" in text
    )
    # From the Hub: its id and the commit load_from_hf pinned.
    write_manifest(
        base,
        kind="hf-model",
        meta={"source": "hub", "repo_id": "org/base-model", "revision": "main", "commit_sha": "c0ffee" * 6 + "abcd"},
    )
    hub = base_facts(config(run), lambda rel: (run / rel).read_text())
    card = ModelCard(model_card(config(run), manifest, train_facts(config(run), RESULTS), base=hub))
    assert card.data.base_model == "org/base-model" and card.data.base_model_revision == "c0ffee" * 6 + "abcd"
    # A _name_or_path that is a path of the machine that saved it is not said at all.
    (base / "config.json").write_text(json.dumps({"_name_or_path": "/home/me/models/smollm2", "model_type": "llama"}))
    assert "claimed" not in base_facts(cfg, lambda rel: (run / rel).read_text())
    # A local folder whose Hub id the config says (base_model.hub_id): that id, with no commit it cannot know.
    write_manifest(base, kind="hf-model", meta={"source": "path", "uri": "/models/smollm2"})
    told = config(run, base="/models/smollm2").model_copy(
        update={"base_model": cfg.base_model.model_copy(update={"hub_id": "HuggingFaceTB/SmolLM2-135M"})}
    )
    facts = base_facts(told, lambda rel: (run / rel).read_text())
    card = ModelCard(model_card(told, manifest, train_facts(told, RESULTS), base=facts))
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M" and not hasattr(card.data, "base_model_revision")
    assert "[`HuggingFaceTB/SmolLM2-135M`](https://huggingface.co/HuggingFaceTB/SmolLM2-135M)" in card.text
    with pytest.raises(ValidationError, match="base_model.hub_id"):  # the setting takes a Hub id, not a folder name
        config(run, base="/models/smollm2").model_validate(
            {**told.model_dump(), "base_model": {"uri": "/models/smollm2", "hub_id": "smollm2"}}
        )
    assert ", dtype=torch.bfloat16)" in usage_snippet("x", "bf16") and ", dtype=torch.float16)" in usage_snippet(
        "x", "fp16"
    )


def test_the_card_gives_the_largest_peak_memory_of_any_rank(tmp_path):
    run = tmp_path / "run"
    manifest = fake_export(run)
    cfg = config(run)
    for phase, peaks, ranks in (("cpt", [3 * 2**30, 5 * 2**30, 4 * 2**30], [0, 1, 1]), ("sft", [2**30], [0])):
        ckpt = run / phase / f"step-{cfg.phase(phase).max_steps:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "train_state.json").write_text(
            json.dumps({"losses": [2.0], "step_metrics": {"peak_mem_bytes": peaks, "peak_mem_rank": ranks}})
        )
    text = model_card(cfg, manifest, train_facts(cfg, RESULTS, lambda rel: (run / rel).read_text()))
    assert "| peak memory (largest rank) | 5.00 GiB (rank 1) | 1.00 GiB (rank 0) |" in text, text


def _metrics(stopped: int, prompts: int = 4) -> dict:
    """run.json's evaluation: CPT perplexity, SFT loss and a generation check in which `stopped` replies stopped."""
    stop = [] if stopped == prompts else [f"{prompts - stopped} of {prompts} greedy generations did not stop"]
    return {
        "cpt": {
            "base": {"perplexity": 9.0, "loss": 2.2},
            "cpt": {"perplexity": 6.0, "loss": 1.8},
            "perplexity_change_pct": -33.3,
        },
        "sft": {
            "pre_sft": {"loss": 1.5},
            "sft": {"loss": 1.1},
            "loss_change": -0.4,
            "generation": {
                "stopped": stopped,
                "prompts": prompts,
                "max_new_tokens": 64,
                "passed": not stop,
                "problems": stop,
            },
        },
    }


def _comment(text: str) -> str:
    """What the usage snippet's comment says, its wrapped lines joined."""
    snippet = text.split("## Usage")[1].split("```\n")[0]
    return " ".join(line[2:] for line in snippet.splitlines() if line.startswith("# "))


def _gate(metrics: dict, **limits) -> dict:
    from tasks.core.config.outputs import GateConfig
    from tasks.core.evaluation.verdict import gate_verdict

    return gate_verdict(GateConfig(**limits), metrics["cpt"], metrics["sft"])


def test_the_card_says_the_gates_verdict_and_its_snippet_claims_only_the_measured_stop(tmp_path):
    from tasks.core.hub.card import UNMEASURED_STOP

    run = tmp_path / "run"
    manifest = fake_export(run)
    cfg = config(run)
    facts = train_facts(cfg, RESULTS)
    ran = {s: StageResult(s, "completed") for s in ("evaluate_cpt", "evaluate_sft", "benchmark")}
    # Every reply stopped, the gate passed: the snippet says what was measured, the card the verdict.
    good = _metrics(4)
    text = model_card(
        cfg, manifest, facts, good, results={**ran, "gate": StageResult("gate", "passed", detail=_gate(good))}
    )
    said = _comment(text)
    assert said.startswith("In the generation check all 4 greedy replies to held-out prompts stopped at an eos token")
    assert "Gate before the push: **passed**: every one of its 3 checks held." in text
    assert "- pass `generation_stops`: 4 of 4 greedy generations stopped within 64 tokens" in text
    assert "| generations that stop |  | 4 / 4 |  | pass |" in text and "Every evaluation ran" in text
    # One reply of four ran on: the snippet no longer promises a stop, the card names the failing limits.
    bad = _metrics(1)
    verdict = _gate(bad, cpt_max_ppl_increase_pct=-50.0)
    text = model_card(
        cfg, manifest, facts, bad, results={**ran, "gate": StageResult("gate", "failed-gate", detail=verdict)}
    )
    said = _comment(text)
    assert said.startswith("In the generation check only 1 of 4 greedy replies") and "so this stops" not in text
    assert "a reply may run on to max_new_tokens" in said
    assert "**Gate before the push:** **failed** (2 of 3 checks): the push was held back." in text
    assert "- FAIL `cpt_perplexity`: CPT held-out perplexity 6 vs base 9 (-33.30%, allowed at most -50%)" in text
    assert (
        "- FAIL `generation_stops`: 3 of 4 greedy generations did not stop at an eos token within max_new_tokens=64"
        in text
    )
    assert "| generations that stop |  | 1 / 4 | 3 of 4 greedy generations did not stop | FAIL |" in text
    # A disabled gate says it held nothing back, and what failed.
    off = {**_gate(bad), "enabled": False}
    text = model_card(cfg, manifest, facts, bad, results={**ran, "gate": StageResult("gate", "disabled", detail=off)})
    assert "**disabled** (`gate.enabled: false`): nothing was held back; 1 of 3 checks failed" in text
    # Without the records (a caller that passes none): no claim beyond what generate() does.
    text = model_card(cfg, manifest, facts)
    assert _comment(text).startswith(UNMEASURED_STOP) and "Gate before the push: not recorded." in text


def test_a_card_of_an_interrupted_run_lists_the_evaluations_that_did_not_run(tmp_path):
    run = tmp_path / "run"
    manifest = fake_export(run)
    cfg = config(run)
    metrics = _metrics(4)
    # evaluate_sft failed, the benchmark and the gate never ran (run.json's rows, as `cpt-to-sft card` reads them).
    rows = {
        "evaluate_cpt": {"status": "completed", "detail": {}},
        "evaluate_sft": {"status": "failed", "detail": {"error": "StageFailed: out of memory"}},
    }
    text = model_card(cfg, manifest, train_facts(cfg, RESULTS), {"cpt": metrics["cpt"]}, results=rows)
    assert "Gate before the push: **not run** (not run: the run ended before it)." in text
    assert (
        "**Evaluations not run:**\n\n"
        "- `evaluate_sft` (held-out loss on assistant tokens, pre-SFT vs SFT, and the generation check): failed: "
        "StageFailed: out of memory\n"
        "- `benchmark` (lm-eval benchmarks, base vs export): not run: the run ended before it"
    ) in text
    assert "Whether replies stop was not measured (the generation check did not run)" in _comment(text)
    assert "CPT held-out perplexity" in text and "SFT held-out loss" not in text
    # A benchmark that is not configured is said so, not as a failure.
    rows.update(
        evaluate_sft={"status": "skipped", "detail": {}},
        benchmark={"status": "not-configured", "detail": {"reason": "benchmark.tasks is empty"}},
        gate={"status": "passed", "detail": _gate(metrics)},
    )
    text = model_card(cfg, manifest, train_facts(cfg, RESULTS), metrics, results=rows)
    assert "- `benchmark` (lm-eval benchmarks, base vs export): not configured (benchmark.tasks is empty)" in text
    assert "`evaluate_sft`" not in text.split("Evaluations not run")[1]


@pytest.mark.parametrize(
    "hub, field",
    [
        ({"license": "mit\x85---"}, "license"),  # NEL: YAML reads it as a line break
        ({"tags": ["ok", "a\x85b"]}, "tags"),
    ],
)
def test_no_config_value_changes_the_cards_front_matter(tmp_path, hub, field):
    """Pre-flight refuses these values (tests/test_preflight.py); the card refuses them too where no
    pre-flight ran (`cpt-to-sft card` on a recorded config), naming the field, never writing other metadata."""
    run = tmp_path / "run"
    manifest = fake_export(run)
    cfg = config(run, repo_id="org/card", **hub)
    with pytest.raises(ValueError, match=rf"{field} \(from hub\.{field}\)"):
        model_card(cfg, manifest, train_facts(cfg, RESULTS))
    # Markup, quotes, a '---' line and YAML syntax stay values: the front matter reads back as given.
    odd = "<script>x</script>\n---\nlicense: evil\n'\"#"
    cfg = config(run, repo_id="org/card", license=odd, tags=[odd, "- x"])
    card = ModelCard(model_card(cfg, manifest, train_facts(cfg, RESULTS)))
    assert card.data.license == odd and card.data.tags[-2:] == [odd, "- x"] and card.data.library_name == "transformers"


def test_hub_fields_the_hub_would_refuse_or_show_otherwise_are_named_with_the_fix():
    from tasks.core.hub.metadata import hub_field_problems, license_problem, repo_id_problem, tag_problems

    cyrillic, greek = "\u043erg/name", "\u03bfrg/name"  # о (Cyrillic), ο (Greek): each drawn as a Latin o
    for look_alike in (cyrillic, greek, "org/n\uff41me"):  # and a full-width a
        msg = repo_id_problem(look_alike)
        assert "takes ASCII characters only; it looks like 'org/name'" in msg, msg
    assert "U+043E CYRILLIC SMALL LETTER O" in repo_id_problem(cyrillic)
    assert repo_id_problem("org/name") is None and repo_id_problem("my-org/tiny_model.v2") is None
    for bad in ("org/na me", "org", "a/b/c", "org/x--y", "org/x.git", "-org/x"):
        assert "not a valid Hub repo id" in repo_id_problem(bad), bad
    assert license_problem("apache-2.0") is None and license_problem("other") is None
    assert "(did you mean 'apache-2.0'?)" in license_problem("Apache-2.0")
    assert "'other' for a license the Hub does not list" in license_problem("my licence\n<b>")
    assert tag_problems(["tiny", "text-generation", "base_model:org/x", "lang:en"]) == []
    (msg,) = tag_problems(["ok", "x\ny"])
    assert msg.startswith("tag 1 'x\\ny': a tag is 1 to 64 ASCII letters") and msg.endswith("e.g. 'x-y'")
    assert tag_problems(["t"] * 51) == ["51 tags; give at most 50"]
    from tasks.core.config.outputs import HubConfig

    hub = HubConfig(repo_id=cyrillic, adapter_repo_id="org/adapter", license="MIT", tags=("<i>x</i>",))
    assert [f for f, _ in hub_field_problems(hub, "\u0455mol/x")] == [
        "hub.repo_id",
        "base_model.hub_id",
        "hub.license",
        "hub.tags",
    ]


def test_a_run_that_trains_dpo_has_a_dpo_column_and_one_without_has_none(tmp_path):
    from tests.test_hub import REPO

    run = tmp_path / "run"
    manifest = fake_export(run)
    plain = config(run)
    dpo = plain.model_validate(
        {
            **plain.model_dump(),
            "dpo": {
                "data": {"uri": str(REPO / "data" / "sample" / "dpo.jsonl")},
                "plugin": {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
                "launch": {"nproc_per_node": 2},
                "max_steps": 4,
                "micro_batch_size": 2,
                "seq_len": 96,
                "lr": 1.0e-5,
                "beta": 0.25,
                "loss": "sigmoid",
                "label_smoothing": 0.1,
            },
        }
    )
    text = model_card(dpo, manifest, train_facts(dpo, RESULTS))
    assert "| | CPT | SFT | DPO |\n|---|---|---|---|\n" in text, text
    assert "| steps | 30 | 30 | 4 |" in text, text
    assert "| seq_len | 64 | 128 | 96 |" in text, text
    assert "| beta | n/a | n/a | 0.25 |" in text, text
    assert "| preference loss | n/a | n/a | `sigmoid` |" in text, text
    assert "| label_smoothing | n/a | n/a | 0.1 |" in text, text
    assert "AdamW lr 1e-05 " in text and "`low_level_zero` tp=1 pp=1 zero=2 fp32, 1×2 ranks |\n" in text, text
    assert "= 4 pairs (8 sequences) |\n" in text, text  # a micro-batch of 2 pairs on 2 dp ranks

    without = model_card(plain, manifest, train_facts(plain, RESULTS))
    assert "| | CPT | SFT |\n|---|---|---|\n" in without, without
    assert "DPO" not in without and "| beta |" not in without and "preference loss" not in without, without
