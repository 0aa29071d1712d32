"""Shared test set-up. Tiers are markers: `distributed` (torchrun, 2 CPU ranks), `integration`
(Prefect flows, real servers), `e2e` (the whole flow), `gpu` (CUDA only, skipped without it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def prefect_harness():
    """One ephemeral Prefect server (SQLite) for the whole session; ~20 s to start."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The demo's tiny random Llama + tokenizer, built offline once per session."""
    from tasks.core.models.demo import DEFAULT_CORPUS, build_tiny_model, build_tokenizer

    out = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    build_tiny_model(out, build_tokenizer(DEFAULT_CORPUS, vocab_size=512))
    return out


def tiny_config_raw(model_dir: Path, run_root: Path, **stage_overrides) -> dict:
    """tiny-cpu.yaml pointed at a test model and run root, with fewer steps for speed."""
    import yaml

    raw = yaml.safe_load((REPO / "deployments" / "configs" / "tiny-cpu.yaml").read_text())
    raw["base_model"]["uri"] = str(model_dir)
    raw["run_root"] = str(run_root)
    for stage in ("cpt", "sft"):
        raw[stage].update(max_steps=8, checkpoint_every=4)
        raw[stage].update(stage_overrides.get(stage, {}))
    return raw


def write_config(path: Path, raw: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path
