"""load_from_hf and push_to_hub against the test-owned Hub-protocol server (real HTTP, the real
huggingface_hub client via HF_ENDPOINT), including dropped connections and token hygiene.

    .venv/bin/python -m pytest -q tests/test_hub.py        # ~1 min (one Prefect test server)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import yaml

from tasks.core.config.load import parse_config
from tasks.core.run.manifest import MANIFEST, PROVENANCE_DIR, read_manifest, sha256_file, write_manifest
from tasks.flowkit.stage import StageResult

pytest_plugins = ["tests.conftest_servers"]
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
KB = 1 << 10


def config(run_root: Path, base: str = "org/base-model", **hub) -> object:
    raw = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    raw.update(run_root=str(run_root), name="hub-test")
    raw["base_model"]["uri"] = base
    if hub:
        raw["hub"] = {"private": True, **hub}
    return parse_config(raw)


def fake_export(run_root: Path, seed: int = 0, stray: str | None = None) -> dict:
    """An export artifact as the export stage leaves it: two weight shards (one multipart-sized)
    and their index, config, tokenizer, and the provenance subfolder (verification record,
    fingerprint), manifest last. `stray` adds a non-weight .safetensors file of that name."""
    d = run_root / "export"
    if d.exists():
        shutil.rmtree(d)
    (d / PROVENANCE_DIR).mkdir(parents=True)
    block = hashlib.sha256(f"export-{seed}".encode()).digest() * 64
    shards = {
        "model-00001-of-00002.safetensors": block * ((1536 * KB) // len(block)),
        "model-00002-of-00002.safetensors": block[:700] * 3,
    }
    for name, blob in shards.items():  # > the server's 1 MiB multipart threshold, and a small one
        (d / name).write_bytes(blob)
    index = {
        "metadata": {"total_size": sum(map(len, shards.values()))},
        "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"},
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))
    if stray:
        (d / stray).write_bytes(b"not a weight" * 10)
    verification = {
        "dtype": "bf16",
        "tensors": 12,
        "fingerprint_max_abs_diff": 0.01,
        "fingerprint_max_abs_logit": 10.0,
        "fingerprint_rel_diff": 0.001,
        "fingerprint_rtol": 0.04,
        "top1_agreement": 1.0,
        "fingerprint_match": True,
        "weights_bitwise": {"tensors": 12},
        "stop_tokens": {"base_eos_token_id": [1], "eos_token_id": [1, 4], "added": [{"id": 4, "token": "<|im_end|>"}]},
    }
    (d / PROVENANCE_DIR / "verification.json").write_text(json.dumps(verification))
    (d / PROVENANCE_DIR / "fingerprint.npy").write_bytes(block[:96] + bytes([seed]))
    return write_manifest(
        d,
        kind="hf-export",
        meta={
            "dtype": "bf16",
            "verification": verification,
            "versions": {"torch": "2.x", "colossalai": "0.5.0", "transformers": "4.x"},
        },
    )


RESULTS = {
    "train_cpt": StageResult("train_cpt", "completed", detail={"final_loss": 2.5}),
    "train_sft": StageResult("train_sft", "completed", detail={"final_loss": 1.25}),
}


def hub_tree(api, repo_id: str, revision: str = "main") -> dict[str, object]:
    return {f.path: f for f in api.list_repo_tree(repo_id, recursive=True, revision=revision) if hasattr(f, "size")}


def assert_repo_holds_export(api, repo_id: str, export_dir: Path, manifest: dict, revision: str = "main") -> None:
    from huggingface_hub import hf_hub_download

    tree = hub_tree(api, repo_id, revision)
    # The model files, the card, and the provenance subfolder with the manifest itself.
    assert set(manifest["files"]) | {"README.md", ".gitattributes", MANIFEST} == set(tree)
    index = json.loads((export_dir / "model.safetensors.index.json").read_text())
    assert sorted(n for n in tree if n.endswith(".safetensors")) == sorted(set(index["weight_map"].values()))
    assert sha256_file(Path(hf_hub_download(repo_id, MANIFEST, revision=revision))) == sha256_file(
        export_dir / MANIFEST
    )
    for name, entry in manifest["files"].items():
        remote = tree[name]
        assert remote.size == entry["size"], name
        if remote.lfs is not None:
            assert remote.lfs.sha256 == entry["sha256"], name
        else:
            local = hf_hub_download(repo_id, name, revision=revision)
            assert sha256_file(Path(local)) == entry["sha256"], name


@pytest.fixture
def token_env(hub_env, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", hub_env.token)
    return hub_env


def test_model_card_metadata_and_body(tmp_path):
    from huggingface_hub import ModelCard

    from tasks.stages.push import model_card, train_facts

    cfg = config(tmp_path, repo_id="org/card", license="apache-2.0", tags=["tiny"])
    manifest = fake_export(tmp_path)
    text = model_card(cfg, manifest, train_facts(cfg, RESULTS))
    card = ModelCard(text)
    assert card.data.base_model == "org/base-model" and card.data.library_name == "transformers"
    assert card.data.license == "apache-2.0" and {"cpt-to-sft", "colossalai", "tiny"} <= set(card.data.tags)
    assert card.data.datasets is None  # local data files are not Hub datasets
    for words in (
        "hybrid_parallel",
        "tp=2",
        "low_level_zero",
        "zero=2",
        "2.5000",
        "1.2500",
        "passed",
        "tolerance 0.04",
        "bitwise",
        "AdamW lr 0.003",
        "| seq_len | 64 | 128 |",
        "colossalai 0.5.0",
        "`<|im_end|>` (4)",
        'model_id = "org/card"',
        "apply_chat_template",
    ):
        assert words in text, words
    # A re-run whose training stages were skipped renders the same card (losses from the checkpoints).
    ckpt = tmp_path / "cpt" / f"step-{cfg.cpt.max_steps:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "train_state.json").write_text(json.dumps({"losses": [3.0, 2.5]}))
    ckpt = tmp_path / "sft" / f"step-{cfg.sft.max_steps:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "train_state.json").write_text(json.dumps({"losses": [2.0, 1.25]}))
    skipped = {k: StageResult(k, "skipped") for k in RESULTS}
    assert model_card(cfg, manifest, train_facts(cfg, skipped, lambda rel: (tmp_path / rel).read_text())) == text


def test_load_from_hf_pins_the_commit_and_records_it(token_env, prefect_harness, tiny_model_dir, tmp_path):
    from huggingface_hub import CommitOperationAdd, HfApi

    from tasks.stages.load import load_from_hf

    hub = token_env
    api = HfApi(token=hub.token)
    api.create_repo("org/tiny-base", private=True, exist_ok=True)
    files = sorted(p for p in tiny_model_dir.rglob("*") if p.is_file())
    first = api.create_commit(
        "org/tiny-base",
        [CommitOperationAdd(p.relative_to(tiny_model_dir).as_posix(), str(p)) for p in files],
        commit_message="tiny base",
    )
    marker = b'{"_from_model_config": true, "marker": "later"}'
    api.create_commit(
        "org/tiny-base", [CommitOperationAdd("generation_config.json", marker)], commit_message="later change"
    )

    # Pinned to the first commit: the later change must not leak in.
    cfg = config(tmp_path / "run", base="org/tiny-base")
    cfg = cfg.model_copy(update={"base_model": cfg.base_model.model_copy(update={"revision": first.oid})})
    result = load_from_hf(cfg)
    assert result.status == "completed"
    base = tmp_path / "run" / "base"
    manifest = read_manifest(base)
    assert manifest["meta"]["repo_id"] == "org/tiny-base" and manifest["meta"]["commit_sha"] == first.oid
    assert manifest["meta"]["revision"] == first.oid and manifest["meta"]["endpoint"] == hub.endpoint
    for p in files:
        if p.name.endswith(".safetensors") or p.name.endswith(".json"):
            assert sha256_file(base / p.relative_to(tiny_model_dir)) == sha256_file(p), p.name
    assert not (base / ".cache").exists() and manifest["fingerprint"]

    # A branch name resolves to its current commit, which is what gets downloaded and recorded.
    head = api.repo_info("org/tiny-base").sha
    load_from_hf(config(tmp_path / "run2", base="org/tiny-base"))
    manifest = read_manifest(tmp_path / "run2" / "base")
    assert head != first.oid and manifest["meta"]["commit_sha"] == head and manifest["meta"]["revision"] == "main"
    assert (tmp_path / "run2" / "base" / "generation_config.json").read_bytes() == marker


def test_push_makes_one_commit_and_a_repush_uploads_nothing(token_env, prefect_harness, tmp_path):
    from huggingface_hub import HfApi, ModelCard

    from tasks.stages.export import write_card
    from tasks.stages.push import push_to_hub

    hub = token_env
    fake_export(tmp_path / "run")
    cfg = config(
        tmp_path / "run", repo_id="org/pushed", license="apache-2.0", tags=["tiny"], commit_message="release 1"
    )
    # The run writes the card into the export (a view its manifest lists); the push sends that file.
    assert write_card(cfg, RESULTS) == (str(tmp_path / "run" / "export" / "README.md"), True)
    manifest = read_manifest(tmp_path / "run" / "export")
    assert "README.md" in manifest["files"] and manifest["views"] == ["README.md"]
    before = hub.stats()
    result = push_to_hub(cfg, RESULTS)
    after = hub.stats()
    api = HfApi(token=hub.token)
    commits = api.list_repo_commits("org/pushed")
    assert [c.title for c in commits] == ["release 1", "initial commit"]
    assert after["commits"] - before["commits"] == 1
    assert (
        result.detail["commit_url"] == f"{hub.endpoint}/org/pushed/commit/{commits[0].commit_id}"
        and result.detail["changed"]
    )
    assert_repo_holds_export(api, "org/pushed", tmp_path / "run" / "export", manifest)
    card = ModelCard.load("org/pushed", token=hub.token)
    assert card.data.license == "apache-2.0" and card.data.base_model == "org/base-model" and "tiny" in card.data.tags
    assert "1.2500" in card.text and hub.token not in card.content

    # Unchanged export: the LFS objects are known, nothing is sent, no commit is made.
    again = push_to_hub(cfg, RESULTS)
    final = hub.stats()
    assert final["lfs_bytes_received"] == after["lfs_bytes_received"] and final["commits"] == after["commits"]
    assert final["batch_objects_existing"] - after["batch_objects_existing"] == 3  # two shards and the fingerprint
    assert again.detail["changed"] is False and again.detail["commit_oid"] == commits[0].commit_id
    assert len(api.list_repo_commits("org/pushed")) == 2

    # Another branch and message: main stays where it was.
    cfg_dev = config(tmp_path / "run", repo_id="org/pushed", revision="dev", commit_message="to dev")
    fake_export(tmp_path / "run", seed=1)
    dev = push_to_hub(cfg_dev, RESULTS)
    assert api.list_repo_commits("org/pushed", revision="dev")[0].title == "to dev"
    assert api.repo_info("org/pushed").sha == commits[0].commit_id
    assert dev.detail["revision"] == "dev" and dev.detail["commit_url"].endswith(
        api.repo_info("org/pushed", revision="dev").sha
    )


def test_dropped_lfs_upload_is_retried_into_exactly_one_commit(token_env, prefect_harness, tmp_path):
    from huggingface_hub import HfApi

    from tasks.stages.push import push_to_hub

    hub = token_env
    manifest = fake_export(tmp_path / "run", seed=7)
    cfg = config(tmp_path / "run", repo_id="org/flaky", commit_message="flaky push")
    # One part upload is cut mid-body (the client's HTTP retry resends it), and the multipart
    # completion is cut once (create_commit fails: the task retries and re-uploads).
    hub.set_faults(lfs_put=1, lfs_complete=1)
    before = hub.stats()
    result = push_to_hub.with_options(retry_delay_seconds=0)(cfg, RESULTS)
    stats = hub.stats()
    assert stats["dropped"] - before["dropped"] == 2 and stats["faults"] == {"lfs_put": 0, "lfs_complete": 0}
    api = HfApi(token=hub.token)
    assert [c.title for c in api.list_repo_commits("org/flaky")] == ["flaky push", "initial commit"]
    assert result.detail["changed"] and stats["commits"] - before["commits"] == 1
    assert_repo_holds_export(api, "org/flaky", tmp_path / "run" / "export", manifest)


def test_push_that_cannot_finish_leaves_the_repo_as_it_was(token_env, prefect_harness, tmp_path):
    from huggingface_hub import HfApi

    from tasks.stages.push import push_to_hub

    hub = token_env
    first = fake_export(tmp_path / "run", seed=1)
    cfg = config(tmp_path / "run", repo_id="org/stuck", commit_message="v1")
    push_to_hub(cfg, RESULTS)
    api = HfApi(token=hub.token)
    head = api.repo_info("org/stuck").sha
    tree = {p: (f.size, f.blob_id) for p, f in hub_tree(api, "org/stuck").items()}

    fake_export(tmp_path / "run", seed=2)  # new weights
    hub.set_faults(lfs_complete=100)
    try:
        with pytest.raises(RuntimeError):  # huggingface_hub: "Error while uploading 'model.safetensors' to the Hub."
            push_to_hub.with_options(retries=1, retry_delay_seconds=0)(
                config(tmp_path / "run", repo_id="org/stuck", commit_message="v2"), RESULTS
            )
    finally:
        hub.set_faults()
    assert api.repo_info("org/stuck").sha == head
    assert [c.title for c in api.list_repo_commits("org/stuck")] == ["v1", "initial commit"]
    assert {p: (f.size, f.blob_id) for p, f in hub_tree(api, "org/stuck").items()} == tree
    assert (
        hub_tree(api, "org/stuck")["model-00001-of-00002.safetensors"].lfs.sha256
        == first["files"]["model-00001-of-00002.safetensors"]["sha256"]
    )


def test_missing_token_is_a_clear_error(hub_env, prefect_harness, tmp_path):
    from tasks.stages.push import push_to_hub

    fake_export(tmp_path / "run")
    cfg = config(tmp_path / "run", repo_id="org/no-token")
    with pytest.raises(RuntimeError, match="HF_TOKEN"):
        push_to_hub.with_options(retries=0)(cfg, RESULTS)


def test_provenance_is_a_config_choice_and_a_stray_safetensors_is_refused(token_env, prefect_harness, tmp_path):
    from huggingface_hub import CommitOperationAdd, HfApi

    from tasks.stages.push import push_to_hub

    hub = token_env
    manifest = fake_export(tmp_path / "run", seed=3)
    push_to_hub(config(tmp_path / "run", repo_id="org/no-provenance", push_provenance=False), RESULTS)
    tree = hub_tree(HfApi(token=hub.token), "org/no-provenance")
    model_files = {n for n in manifest["files"] if not n.startswith(PROVENANCE_DIR + "/")}
    assert set(tree) == model_files | {"README.md", ".gitattributes"}, sorted(tree)

    # The old layout's fingerprint.safetensors beside the weights is never pushed.
    fake_export(tmp_path / "run", seed=4, stray="fingerprint.safetensors")
    with pytest.raises(
        RuntimeError, match=r"fingerprint\.safetensors: a \.safetensors file that is not a weight shard"
    ):
        push_to_hub.with_options(retries=0)(config(tmp_path / "run", repo_id="org/stray"), RESULTS)
    assert not HfApi(token=hub.token).repo_exists("org/stray")

    # A repo an earlier (old-layout) push left a fingerprint.safetensors and a single shard in:
    # the new commit removes them, so the repo holds no *.safetensors but the index's shards.
    api = HfApi(token=hub.token)
    api.create_repo("org/old-layout", private=True)
    api.create_commit(
        "org/old-layout",
        [CommitOperationAdd(n, b"old " + n.encode()) for n in ("fingerprint.safetensors", "model.safetensors")],
        commit_message="old",
    )
    manifest = fake_export(tmp_path / "run", seed=6)
    push_to_hub(config(tmp_path / "run", repo_id="org/old-layout"), RESULTS)
    assert_repo_holds_export(api, "org/old-layout", tmp_path / "run" / "export", manifest)


def test_a_refused_token_fails_the_push_at_once_naming_its_source(hub_env, prefect_harness, tmp_path, monkeypatch):
    """A 401 cannot heal: the push's retries (3 x 20 s) are not spent on it, and the error names the
    token's source, never its value."""
    from tasks.core.hub.repo import HubTokenRefused
    from tasks.stages.push import push_to_hub

    wrong = "hf_WRONGwrongWRONG0123456789"
    monkeypatch.setenv("HF_TOKEN", wrong)
    fake_export(tmp_path / "run", seed=7)
    started = time.monotonic()
    with pytest.raises(
        HubTokenRefused, match=r"refuses the token from HF_TOKEN \(the environment\) \(HTTP 401"
    ) as info:
        push_to_hub(config(tmp_path / "run", repo_id="org/refused"), RESULTS)  # the task's own retries=3
    assert time.monotonic() - started < 15, "a refused token was retried"
    assert wrong not in str(info.value) and hub_env.endpoint in str(info.value)
    # Nor is a folder the model-folder rule refuses retried.
    monkeypatch.setenv("HF_TOKEN", hub_env.token)
    fake_export(tmp_path / "run", seed=8, stray="model-extra.safetensors")
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"holds model-extra\.safetensors: a \.safetensors file that is not a weight shard"
    ):
        push_to_hub(config(tmp_path / "run", repo_id="org/refused"), RESULTS)
    assert time.monotonic() - started < 15, "a refused folder was retried"


def test_a_token_saved_by_login_is_used_by_push_and_preflight(hub_env, prefect_harness, tmp_path, monkeypatch):
    """`hf auth login` writes the token under HF_HOME (a temporary one here); no HF_TOKEN, no Secret."""
    import huggingface_hub
    import huggingface_hub.hf_api

    # login() asks whoami through huggingface_hub's module-level HfApi, whose endpoint was fixed
    # when huggingface_hub was first imported: point it at the test Hub like HF_ENDPOINT is.
    monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", hub_env.endpoint)
    from tasks.flowkit.preflight import hub_token_found
    from tasks.flowkit.stage import token
    from tasks.stages.push import push_to_hub

    hub = hub_env
    assert hub_token_found(consult_secret=False) is None and token() is None
    huggingface_hub.login(token=hub.token, add_to_git_credential=False)
    assert (Path(huggingface_hub.constants.HF_HOME) / "token").is_file()
    assert hub_token_found(consult_secret=False) is not None and token() == hub.token
    manifest = fake_export(tmp_path / "run", seed=5)
    result = push_to_hub.with_options(retries=0)(config(tmp_path / "run", repo_id="org/logged-in"), RESULTS)
    assert result.detail["changed"]
    assert_repo_holds_export(
        huggingface_hub.HfApi(token=hub.token), "org/logged-in", tmp_path / "run" / "export", manifest
    )


# ---- token hygiene over a whole (small) flow run -----------------------------------------------
def _flow():
    from prefect import flow

    from tasks.core.config.load import load_config
    from tasks.stages.load import load_from_hf
    from tasks.stages.push import push_to_hub

    @flow(name="hub-round-trip")
    def hub_round_trip(config_path: str) -> dict:
        cfg = load_config(config_path)
        base = load_from_hf(cfg)
        return push_to_hub(cfg, {"load_from_hf": base, **RESULTS}).detail

    return hub_round_trip


async def _everything_recorded(flow_run_id) -> tuple[list[str], list[str]]:
    """Every log line, artifact and run record of the flow run, as text."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )

    async with get_client() as client:
        logs, offset = [], 0
        while True:
            page = await client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=offset
            )
            logs += page
            offset += len(page)
            if len(page) < 200:
                break
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        flow_run = await client.read_flow_run(flow_run_id)
        task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    records = (
        [a.model_dump_json() for a in artifacts]
        + [flow_run.model_dump_json()]
        + [t.model_dump_json() for t in task_runs]
    )
    return [f"{log.name} {log.message}" for log in logs], records


def test_token_never_reaches_logs_artifacts_or_the_repo(hub_env, prefect_harness, tiny_model_dir, tmp_path):
    from huggingface_hub import CommitOperationAdd, HfApi
    from prefect.blocks.system import Secret
    from prefect.logging.handlers import APILogHandler

    hub = hub_env
    token = hub.token
    api = HfApi(token=token)
    api.create_repo("org/hygiene-base", private=True, exist_ok=True)
    files = sorted(p for p in tiny_model_dir.rglob("*") if p.is_file())
    api.create_commit(
        "org/hygiene-base",
        [CommitOperationAdd(p.relative_to(tiny_model_dir).as_posix(), str(p)) for p in files],
        commit_message="base",
    )

    run_root = tmp_path / "run"
    fake_export(run_root)
    raw = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    raw.update(
        run_root=str(run_root),
        name="hygiene",
        hub={"repo_id": "org/hygiene", "private": True, "commit_message": "hygiene"},
    )
    raw["base_model"]["uri"] = "org/hygiene-base"
    cfg_path = tmp_path / "hygiene.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))

    Secret(value=token).save("hf-token", overwrite=True)  # the only place the token lives
    try:
        state = _flow()(str(cfg_path), return_state=True)
    finally:
        Secret.delete("hf-token")
    assert state.is_completed(), state
    detail = state.result()
    assert detail["changed"] and detail["commit_url"].startswith(f"{hub.endpoint}/org/hygiene/commit/")

    APILogHandler().flush()
    deadline = time.monotonic() + 30
    while True:
        logs, records = asyncio.run(_everything_recorded(state.state_details.flow_run_id))
        if any("push_to_hub: committed" in line for line in logs) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert any("push_to_hub: committed" in line for line in logs), logs[-5:]
    assert any("hub-commit" in r for r in records)  # the link artifact was read back
    for text in logs + records:
        assert token not in text, text[:200]
    # Nor in what the run wrote: the base manifest, the card and every file on the Hub.
    assert token not in (run_root / "base" / MANIFEST).read_text()
    for path, f in hub_tree(api, "org/hygiene").items():
        if f.lfs is None:
            assert token.encode() not in Path(api.hf_hub_download("org/hygiene", path)).read_bytes(), path
