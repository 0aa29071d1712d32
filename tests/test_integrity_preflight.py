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
from tasks.core.run.manifest import write_manifest
from tests.test_preflight import Case, fake_model, make_manifest, no_launch  # noqa: F401  (no_launch: autouse, no process may start)


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
    assert "holds model-extra.safetensors: a .safetensors file that is not a weight shard" in out and "0 of 1 artifacts verify" in out, out


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
    from tasks.push import files_to_push

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
