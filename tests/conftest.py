"""Shared test set-up. Tiers are markers: `distributed` (torchrun, 2 CPU ranks), `integration`
(Prefect flows, real servers), `e2e` (the whole flow), `gpu` (CUDA only, skipped without it).

    .venv/bin/python -m pytest -q tests                 # the fast unit tier
    .venv/bin/python -m pytest -q -m "" tests           # every tier

Session fixtures built once, because a flow run costs a minute or more on 2 cores:
- `demo_run`: ONE finished tiny demo run (the whole flow on `tiny_config_raw`, tracked to the
  session's MLflow server). Read-only by convention: a test that writes into a run root takes
  `demo_run_copy` (a copy under its tmp_path, with a config pointing at the copy).
- `mlflow_server`: one real `mlflow server` for the session.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
# One intra-op thread in every test process and what it starts (in-process evaluation, export checks,
# the forgetting test's training): two xdist workers and torchrun's ranks (one thread each already)
# share two cores, where a second OpenMP thread only spins against them. Measured beside the running
# suite: 80 training steps of the demo model, 19.4 CPU-s with two threads, 2.8 CPU-s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# ... and in every process a test starts: `support` (its servers, `python -m support.servers.x`) is not
# installed with the project, so it is found in the checkout.
if str(REPO) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
from support.servers import prefect_quiet
from support.tiny import tiny_config_raw, tiny_model, write_config

# Every Prefect server a test starts inherits these (the harness, flow CLIs' embedded servers).
prefect_quiet.apply(os.environ)


# Session fixtures worth one build per pytest-xdist worker at most: the tests that use them run on
# one worker (an xdist group each), so each is built once however many workers there are.
_SHARED_SESSION = {
    "slurm_cluster": "slurm",  # one cluster on fixed ports per machine
    "demo_run": "demo-run",  # the whole flow, ~50 s
    "demo_run_copy": "demo-run",
    "mlflow_server": "demo-run",  # tens of seconds to start; the demo run tracks to it
}


_HEAVY = {"distributed", "integration", "e2e"}


def _xdist_group(item) -> str | None:
    """The xdist group of a test: the shared session fixture it uses, else its file when it uses a
    module-scoped fixture (built once per module and worker), else None: any worker may take it."""
    defs = getattr(item, "_fixtureinfo", None)
    names = set(defs.names_closure) if defs else set()
    for fixture, group in _SHARED_SESSION.items():
        if fixture in names:
            return group
    for fixturedefs in defs.name2fixturedefs.values() if defs else ():
        if any(d.scope == "module" and d.baseid == item.nodeid.split("::")[0] for d in fixturedefs):
            return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks into the node ids
def pytest_collection_modifyitems(config, items):
    import torch

    # Files with launches, flows or servers first (a file stays contiguous, so its module fixtures
    # are built once): under xdist the long tests start early and the unit tier fills the tail.
    heavy = {item.nodeid.split("::")[0] for item in items if _HEAVY & set(item.keywords)}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in heavy)
    for item in items:
        group = _xdist_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    # CPT_CPU_REPORT=<folder>: each test's CPU seconds, its own and its children's (support/cpu_report.py).
    from support import cpu_report

    cpu_report.register(config)


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, transformers, Prefect, every test module: about a
    million objects, alive until the worker exits), so the collector's full passes over a long
    worker (flows, conversions and evaluations run in this process) scan only what tests allocate."""
    import gc

    gc.freeze()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def prefect_harness():
    """One ephemeral Prefect server (SQLite) for the whole session: Prefect's `prefect_test_harness`
    on an already migrated database (8 CPU-s to start instead of 14), without the two event services
    no test on it needs (support/servers/prefect_quiet.py `HARNESS_ONLY`), set in the environment
    only while it starts so that no other server a test starts inherits them."""
    from support.servers import patched_env
    from support.servers.prefect_home import seeded_harness

    with contextlib.ExitStack() as stack:
        with patched_env(prefect_quiet.HARNESS_ONLY):
            stack.enter_context(seeded_harness(server_startup_timeout=120))
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The demo's tiny random Llama + tokenizer, built offline once per session."""
    return tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def prepare_cpt(config: Path):
    """load_from_hf then prepare_cpt, the real stage tasks in a flow of their own (no pre-flight, lease or
    run.json): what the prepare-stage tests re-run over one run root to see what is reused or rebuilt."""
    from prefect import flow

    from tasks.core.config.load import load_config
    from tasks.flowkit.stage import outcome
    from tasks.stages.load import load_from_hf
    from tasks.stages.prepare_data import prepare_data

    @flow(name="prepare-cpt-test")
    def prep(path: str):
        cfg = load_config(path)
        base = outcome(load_from_hf(cfg, return_state=True))
        return outcome(prepare_data(cfg, "cpt", base, return_state=True))

    return prep(str(config))


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real `mlflow server` (SQLite, local artifacts) for the session: it takes tens of
    seconds to start on 2 busy cores. Tests that kill a server start their own."""
    from support.servers.mlflow import MlflowServer

    with MlflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


@pytest.fixture(scope="session")
def eos_doc_end_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The demo model with generation_config eos = <|end_of_text|> (1) only: like a pre-trained
    base fine-tuned with ChatML, whose template ends a turn with <|im_end|>, so the export must
    add that stop token."""
    out = tmp_path_factory.mktemp("base") / "tiny-llama-eos"
    shutil.copytree(tiny_model_dir, out)
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = 1
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


DEMO_EXPERIMENT = "demo"  # the demo run's MLflow experiment: it holds that one run only


@dataclass(frozen=True)
class DemoRun:
    """A finished run: its root, the config file and raw config it ran with, the CLI's exit
    status, run.json, and what it printed on the console (Prefect's console handler, stdout, stderr)."""

    run_root: Path
    config: Path
    raw: dict
    rc: int
    summary: dict
    console: str = ""

    def copy_to(self, dest: Path) -> DemoRun:
        """A copy of the run root (files and mtimes preserved, no lease) at dest/run, and its
        config at dest/demo.yaml pointing at it, without tracking (a re-run over a copy must not
        add runs to the demo's MLflow experiment; tracking is in no artifact's digest)."""
        run_root = Path(dest) / "run"
        shutil.copytree(self.run_root, run_root, ignore=shutil.ignore_patterns(".lease.json"))
        raw = {**self.raw, "run_root": str(run_root)}
        raw.pop("tracking", None)
        return DemoRun(
            run_root,
            write_config(Path(dest) / "demo.yaml", raw),
            raw,
            self.rc,
            json.loads((run_root / "run.json").read_text()),
            self.console,
        )


@pytest.fixture(scope="session")
def demo_run(prefect_harness, mlflow_server, eos_doc_end_model, tmp_path_factory) -> DemoRun:
    """The whole flow once, through the CLI, on the tiny config (8 steps per stage, a checkpoint
    every 4) and the eos-doc-end demo model, tracked to the session's MLflow server. CPT also
    measures the sample general text as a held-out-only source (never trained on), so the run's
    metrics, run.json and card carry a perplexity per source, and extends the context (`cpt.context`)."""
    from flows.cli import flow_main as main

    tmp = tmp_path_factory.mktemp("demo-run")
    raw = tiny_config_raw(eos_doc_end_model, tmp / "run")
    raw["tracking"] = {"mlflow": {"uri": mlflow_server.uri, "experiment": DEMO_EXPERIMENT}}
    raw["cpt"]["eval"] = {
        "heldout_sources": [{"name": "general", "uri": str(REPO / "data" / "sample" / "general.jsonl")}]
    }
    # lm-eval on the shipped local tasks, base vs export (tests/test_benchmark_flow.py)
    raw["benchmark"] = {
        "tasks": [str(REPO / "data" / "sample" / "benchmarks" / f"{t}.yaml") for t in ("veyra_facts", "general_text")],
        "num_fewshot": 0,
    }
    # Every logits check of the run (load_from_hf, unshard, export) streams the model a layer at a
    # time (tasks/core/models/stream.py): the export test compares it with plain transformers.
    raw["verify_memory_gb"] = 1e-6
    # CPT extends the context (tests/test_long_context.py): 256 -> 512 positions, a Llama 3 RoPE
    # scaling and another base frequency, which cpt/hf and the export must carry to match the logits.
    raw["cpt"]["context"] = {
        "rope_theta": 20000.0,
        "max_position_embeddings": 512,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 2.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    }
    cfg = write_config(tmp / "demo.yaml", raw)
    with console_capture() as console:
        rc = main(["--config", str(cfg)])
    return DemoRun(tmp / "run", cfg, raw, rc, json.loads((tmp / "run" / "run.json").read_text()), console.getvalue())


@contextlib.contextmanager
def console_capture():
    """What this process shows on a console while the block runs: Prefect's console handlers
    (rich, as on a pipe: no colour, no wrapping) and stdout/stderr, into one buffer."""
    from prefect.logging.handlers import PrefectConsoleHandler

    buf = io.StringIO()
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    handlers = list({id(h): h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)}.values())
    saved = [(h, h.stream, h.console.file) for h in handlers]
    for h in handlers:
        h.stream = h.console.file = buf
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            yield buf
    finally:
        for h, stream, file in saved:
            h.stream, h.console.file = stream, file


@pytest.fixture
def demo_run_copy(demo_run, tmp_path) -> DemoRun:
    """A writable copy of the demo run under this test's tmp_path."""
    return demo_run.copy_to(tmp_path / "demo-copy")
