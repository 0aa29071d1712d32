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
    assert "torch_dtype=torch.float32" in text and "bfloat16" not in text.split("## Usage")[1].split("```\n")[0]
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
    assert "torch_dtype=torch.bfloat16" in usage_snippet("x", "bf16") and "torch_dtype=torch.float16" in usage_snippet(
        "x", "fp16"
    )


def test_the_card_gives_the_largest_peak_memory_of_any_rank(tmp_path):
    run = tmp_path / "run"
    manifest = fake_export(run)
    cfg = config(run)
    for stage, peaks, ranks in (("cpt", [3 * 2**30, 5 * 2**30, 4 * 2**30], [0, 1, 1]), ("sft", [2**30], [0])):
        ckpt = run / stage / f"step-{cfg.phase(stage).max_steps:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "train_state.json").write_text(
            json.dumps({"losses": [2.0], "step_metrics": {"peak_mem_bytes": peaks, "peak_mem_rank": ranks}})
        )
    text = model_card(cfg, manifest, train_facts(cfg, RESULTS, lambda rel: (run / rel).read_text()))
    assert "| peak memory (largest rank) | 5.00 GiB (rank 1) | 1.00 GiB (rank 0) |" in text, text
