"""Real-protocol servers owned by the tests, bound to 127.0.0.1 on free ports: SeaweedFS (`weed
mini`, S3) and a Hugging Face Hub-protocol server (Starlette + uvicorn, files on disk)."""

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def patched_env(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (str) or unset (None) environment variables, restoring the previous values after."""
    saved = {k: os.environ.get(k) for k in values}

    def apply(vals: Mapping[str, str | None]) -> None:
        for k, v in vals.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    apply(values)
    try:
        yield
    finally:
        apply(saved)
