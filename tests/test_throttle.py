"""The bandwidth-limiting proxy (support/servers/throttle.py) between the real s3fs client and the
real SeaweedFS server: the rate it enforces, changed while a transfer runs, paused, killed.

    .venv/bin/python -m pytest -q -s tests/test_throttle.py      # ~20 s; -s prints the rates
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from support.servers.throttle import MB
from tasks.core.storage.fs import filesystem

pytest_plugins = ["tests.conftest_servers"]
pytestmark = pytest.mark.integration


def _timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def test_proxy_enforces_its_rate_both_ways(throttled_s3, s3_root):
    fs, root = filesystem(s3_root)
    fs.pipe_file(f"{root}/warm", b"x")  # connection set-up and bucket lookup, outside the timing
    rate = 2 * MB
    throttled_s3.set_rate(rate)
    body = os.urandom(4 * MB)
    up_before = throttled_s3.bytes_up
    up = len(body) / _timed(lambda: fs.pipe_file(f"{root}/blob", body))
    got: list[bytes] = []
    down = len(body) / _timed(lambda: got.append(fs.cat_file(f"{root}/blob")))
    print(f"\nproxy at {rate / MB:.1f} MB/s: upload {up / MB:.2f} MB/s, download {down / MB:.2f} MB/s")
    assert got[0] == body  # bytes pass unchanged (the server also checked the CRC32)
    assert throttled_s3.bytes_up - up_before >= len(body)
    assert 0.6 * rate <= up <= 1.4 * rate, f"upload ran at {up / MB:.2f} MB/s through a {rate / MB:.1f} MB/s proxy"
    assert 0.6 * rate <= down <= 1.4 * rate, (
        f"download ran at {down / MB:.2f} MB/s through a {rate / MB:.1f} MB/s proxy"
    )


def test_rate_change_pause_and_kill_while_transferring(throttled_s3, s3_root):
    fs, root = filesystem(s3_root)
    fs.pipe_file(f"{root}/warm", b"x")
    throttled_s3.set_rate(1 * MB)
    body = os.urandom(6 * MB)
    outcome: dict[str, float] = {}

    def upload() -> None:
        outcome["s"] = _timed(lambda: fs.pipe_file(f"{root}/big", body))

    t = threading.Thread(target=upload)
    t.start()
    time.sleep(1.0)
    throttled_s3.set_rate(6 * MB)  # ~1 MB sent at 1 MB/s, the other ~5 MB at 6 MB/s: ~2 s in all
    t.join(30)
    print(f"\n6 MB: 1 s at 1 MB/s, then 6 MB/s: {outcome['s']:.2f} s (6.0 s at 1 MB/s throughout)")
    assert not t.is_alive() and outcome["s"] < 4.0, outcome

    throttled_s3.pause()
    sent = throttled_s3.bytes_up
    t = threading.Thread(target=upload)
    t.start()
    time.sleep(1.5)
    assert t.is_alive() and throttled_s3.bytes_up == sent, "bytes passed a paused proxy"
    throttled_s3.resume()
    t.join(30)
    assert not t.is_alive() and fs.cat_file(f"{root}/big") == body

    throttled_s3.set_rate(0.5 * MB)
    errors: list[BaseException] = []

    def doomed() -> None:
        try:
            fs.pipe_file(f"{root}/doomed", os.urandom(4 * MB))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=doomed)
    t.start()
    time.sleep(1.0)
    throttled_s3.kill()
    t.join(60)
    assert not t.is_alive() and errors, "an upload through a killed proxy must fail"
    deadline = time.monotonic() + 5
    while throttled_s3.open_connections and time.monotonic() < deadline:
        time.sleep(0.05)  # the pump threads notice the reset on their own
    assert throttled_s3.open_connections == 0
