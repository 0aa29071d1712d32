"""Unit tier: integrity rules applied before anything trains: one model-folder rule for verify,
export, push and pre-flight; run paths that would feed a run its own files; base-model links
leaving their folder; errors that cannot heal are not retried; the Hub token asked, naming its source.

    .venv/bin/python -m pytest -q tests/test_integrity_preflight.py

Real files and the real `cpt-to-sft verify`; the Hub tests (integration) talk to the test Hub server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main
from tasks.core.preflight.checks import preflight_report
from tasks.core.run.manifest import write_manifest
from tests.test_preflight import Case, fake_model, make_manifest, no_launch  # noqa: F401  (no_launch: autouse, no process may start)

pytest_plugins = ["tests.conftest_servers"]


def hf_folder(d: Path, extra: dict[str, bytes] | None = None) -> Path:
    """A model folder as unshard/export leave it (config, one weight file, tokenizer), manifest last;
    `extra` files are written after the manifest (unlisted)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "model.safetensors").write_bytes(b"weights" * 16)
    (d / "tokenizer.json").write_text("{}")
    write_manifest(d, kind="hf-export")
    for name, blob in (extra or {}).items():
        (d / name).write_bytes(blob)
    return d


# ---- (2) one set of folder rules ----------------------------------------------------------------
def test_verify_refuses_a_stray_safetensors_the_manifest_does_not_list(tmp_path, capsys):
    hf_folder(tmp_path / "run" / "export")
    assert main(["verify", "--no-fingerprint", str(tmp_path / "run")]) == 0
    assert "1 of 1 artifacts verify" in capsys.readouterr().out
    (tmp_path / "run" / "export" / "model-extra.safetensors").write_bytes(b"not a weight")
    assert main(["verify", "--no-fingerprint", str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    assert (
        "holds model-extra.safetensors: a .safetensors file that is not a weight shard" in out
        and "0 of 1 artifacts verify" in out
    ), out


def test_verify_refuses_an_adapter_beside_merged_weights(tmp_path, capsys):
    hf_folder(tmp_path / "export", extra={"adapter_config.json": b"{}"})
    assert main(["verify", "--no-fingerprint", str(tmp_path / "export")]) == 1
    assert "holds adapter_config.json: adapter files beside merged weights" in capsys.readouterr().out


def test_a_plugin_checkpoint_is_not_judged_as_a_model_folder(tmp_path, capsys):
    art = tmp_path / "cpt" / "step-000001"
    (art / "model").mkdir(parents=True)
    (art / "model" / "pytorch_model-00001.safetensors").write_bytes(b"shard")
    write_manifest(art, kind="checkpoint")
    assert main(["verify", "--no-fingerprint", str(art)]) == 0, capsys.readouterr().out


def test_push_and_verify_share_the_rule(tmp_path):
    from tasks.core.run.manifest import read_manifest
    from tasks.stages.push import files_to_push

    d = hf_folder(tmp_path / "export", extra={"adapter_model.safetensors": b"lora"})
    write_manifest(d, kind="hf-export")  # now listed: the push would send it
    with pytest.raises(RuntimeError, match=r"adapter_model\.safetensors: adapter files beside merged weights"):
        files_to_push(d, read_manifest(d))


def test_preflight_refuses_a_stray_safetensors_in_an_existing_artifact(tmp_path):
    case = Case(tmp_path)
    hf_folder(case.run_root / "export", extra={"model-extra.safetensors": b"x"})
    report = case.report()
    msgs = [m for f, m in report.problems if f.endswith("/run/export/.cpt-to-sft/manifest.json")]
    assert any("holds model-extra.safetensors" in m for m in msgs), report.text()


# ---- (7) the Hub token asked in pre-flight, naming its source ----------------------------------
def _hub_case(tmp_path: Path) -> Case:
    case = Case(tmp_path)
    case.raw["hub"] = {"repo_id": "my-org/tiny"}
    return case


def _report(case: Case, token):
    from tasks.core.preflight.checks import load_for_check
    from tests.conftest import write_config

    cfg = load_for_check(write_config(case.tmp / "config.yaml", case.raw))
    return preflight_report(cfg, machine=case.machine, token_present=token is not None, hub_token=token)


@pytest.mark.integration
def test_preflight_refuses_a_token_the_hub_rejects_naming_its_source(hub_env, tmp_path, monkeypatch):
    from tasks.flowkit.preflight import check
    from tests.conftest import write_config

    wrong = "hf_WRONGwrongWRONG0123456789"
    monkeypatch.setenv("HF_TOKEN", wrong)
    case = _hub_case(tmp_path)
    report = check(write_config(tmp_path / "c.yaml", case.raw))
    msgs = [m for f, m in report.problems if f == "hub"]
    assert msgs and "refuses the token from HF_TOKEN (the environment) (HTTP 401" in msgs[0], report.text()
    assert hub_env.endpoint in msgs[0] and wrong not in report.text()

    monkeypatch.setenv("HF_TOKEN", hub_env.token)
    report = check(write_config(tmp_path / "c.yaml", case.raw))
    assert report.ok, report.text()
    assert any("accepts the token from HF_TOKEN (the environment) (user test-user" in c for c in report.checked), (
        report.text()
    )
    assert hub_env.token not in report.text()


@pytest.mark.integration
def test_the_secret_block_and_the_saved_login_are_named_as_sources(hub_env, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from tasks.core.hub.repo import find_hub_token

    monkeypatch.delenv("HF_TOKEN", raising=False)
    case = _hub_case(tmp_path)
    from_block = find_hub_token(lambda: "hf_stale_secret_value")
    assert from_block.source == "the Prefect Secret block 'hf-token'" and "hf_stale" not in repr(from_block)
    report = _report(case, from_block)
    assert any(
        f == "hub" and "refuses the token from the Prefect Secret block 'hf-token'" in m for f, m in report.problems
    ), report.text()

    saved = tmp_path / "hf-home" / "token"
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text("hf_stale_login_value")
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(saved))
    from_login = find_hub_token(lambda: None)
    assert from_login.source == f"the token `hf auth login` saved ({saved})"
    report = _report(case, from_login)
    assert any(
        f == "hub" and f"refuses the token from the token `hf auth login` saved ({saved})" in m
        for f, m in report.problems
    ), report.text()
    assert "hf_stale_login_value" not in report.text()


def test_an_unreachable_hub_is_a_warning_not_a_refusal(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from tasks.core.hub.repo import HubToken

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    report = _report(_hub_case(tmp_path), HubToken("hf_x", "HF_TOKEN (the environment)"))
    assert report.ok, report.text()
    assert any("was not verified: http://127.0.0.1:9 did not answer whoami" in w for w in report.warnings), (
        report.text()
    )


# ---- (6) errors that cannot heal are not retried -----------------------------------------------
def _http_error(status: int):
    import requests
    from huggingface_hub.errors import HfHubHTTPError

    response = requests.Response()
    response.status_code = status
    return HfHubHTTPError(f"{status} Client Error", response=response)


def test_errors_that_cannot_heal_are_not_retried():
    from safetensors import SafetensorError

    from tasks.core.errors import ConfigError
    from tasks.core.hub.repo import HubRefusal, HubTokenRefused
    from tasks.flowkit.retry import cannot_heal

    for status in (401, 403, 404):
        assert cannot_heal(_http_error(status)), status
    assert cannot_heal(SafetensorError("Error while deserializing header: HeaderTooLarge"))
    assert cannot_heal(ConfigError([("base_model.uri", "x")]))
    mismatch = "Error(s) in loading state_dict for LlamaForCausalLM:\n\tsize mismatch for model.norm.weight: copying"
    assert cannot_heal(RuntimeError(mismatch)) and not cannot_heal(RuntimeError("CUDA error: launch failure"))
    assert cannot_heal(HubRefusal("push_to_hub: no Hub token")) and cannot_heal(HubTokenRefused("refused"))
    try:  # a loader that wraps the malformed header still meets it on every try
        try:
            raise SafetensorError("HeaderTooLarge")
        except SafetensorError as inner:
            raise OSError("Unable to load weights") from inner
    except OSError as wrapped:
        assert cannot_heal(wrapped)
    for healable in (
        _http_error(500),
        _http_error(429),
        ConnectionError("reset by peer"),
        TimeoutError("read timed out"),
        OSError("No space left"),
    ):
        assert not cannot_heal(healable), healable


# ---- (6) paths: the run never reads its own output; base-model files are the model's own ------
def _corpus_dir(case: Case) -> Path:
    corpus = case.tmp / "corpus"
    corpus.mkdir()
    (corpus / "part-0.jsonl").write_text(json.dumps({"text": "some words of the corpus"}) + "\n")
    case.raw["cpt"]["data"]["uri"] = str(corpus)
    return corpus


def test_a_run_root_inside_a_data_directory_is_refused_naming_both(tmp_path):
    case = Case(tmp_path)
    corpus = _corpus_dir(case)
    case.raw["run_root"] = str(corpus / "runs" / "demo")
    report = case.report()
    msgs = [m for f, m in report.problems if f == "run_root"]
    assert msgs and f"run_root {corpus}/runs/demo is inside the data source cpt.data.uri = {corpus}" in msgs[0], (
        report.text()
    )


def test_a_staging_dir_inside_a_data_directory_is_refused(tmp_path):
    case = Case(tmp_path)
    corpus = _corpus_dir(case)
    case.raw["staging_dir"] = str(corpus / "staging")
    report = case.report()
    assert any(
        f == "staging_dir" and f"inside the data source cpt.data.uri = {corpus}" in m for f, m in report.problems
    ), report.text()


def test_a_data_source_inside_the_run_root_is_refused(tmp_path):
    case = Case(tmp_path)
    held = case.run_root / "data" / "sft" / "heldout.jsonl"  # a previous run's own held-out split
    held.parent.mkdir(parents=True)
    held.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n"
    )
    case.raw["sft"]["data"]["uri"] = str(held)
    report = case.report()
    assert any(
        f == "sft.data.uri" and f"{held} is inside run_root = {case.run_root}" in m for f, m in report.problems
    ), report.text()


def test_separate_paths_pass(tmp_path):
    case = Case(tmp_path)
    _corpus_dir(case)
    report = case.report()
    assert report.ok, report.text()
    assert any("do not contain one another" in c for c in report.checked) and any(
        "every file resolves inside its directory" in c for c in report.checked
    )


def test_a_base_model_file_linking_outside_its_directory_is_refused_naming_link_and_target(tmp_path):
    case = Case(tmp_path)
    elsewhere = tmp_path / "elsewhere" / "weights.safetensors"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"\xff" * 64)  # what load_from_hf would copy through the link
    link = case.model / "model.safetensors"
    link.unlink()
    link.symlink_to(elsewhere)
    report = case.report()
    msgs = [m for f, m in report.problems if f == "base_model.uri"]
    assert msgs and f"{link} is a link to {elsewhere}, outside the model directory" in msgs[0], report.text()

    link.unlink()
    link.symlink_to(tmp_path / "gone.safetensors")
    assert any(
        f"{link} is a link to {tmp_path / 'gone.safetensors'}, which does not exist" in m
        for _, m in case.report().problems
    )


def test_a_hub_cache_snapshot_linking_into_its_blobs_is_accepted(tmp_path):
    case = Case(tmp_path)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = fake_model(repo / "snapshots" / ("a" * 40))
    blob = repo / "blobs" / ("b" * 64)
    blob.parent.mkdir(parents=True)
    blob.write_bytes((snapshot / "model.safetensors").read_bytes())  # a safetensors file with no tensors
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs") / blob.name)
    case.raw["base_model"]["uri"] = str(snapshot)
    report = case.report()
    assert report.ok, report.text()


@pytest.mark.integration
def test_a_malformed_safetensors_header_is_not_retried_by_load(prefect_harness, tiny_model_dir, tmp_path):
    """The real load stage on a base model whose weights file has a header length past its end:
    one attempt, not three with 15 s between them."""
    import shutil
    import time

    from tasks.core.config.load import load_config
    from tasks.flowkit.retry import cannot_heal
    from tasks.stages.load import load_from_hf
    from tests.conftest import tiny_config_raw, write_config

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")  # "header too large"
    cfg = load_config(write_config(tmp_path / "c.yaml", tiny_config_raw(model, tmp_path / "run")))
    started = time.monotonic()
    state = load_from_hf(cfg, return_state=True)
    assert state.is_failed()
    assert time.monotonic() - started < 14, "a malformed safetensors file was retried"
    with pytest.raises(Exception) as info:
        state.result()
    assert "header too large" in str(info.value) and cannot_heal(info.value), repr(info.value)
    assert "model.safetensors claims a 1,099,511,627,776-byte header" in str(info.value)  # the file named
