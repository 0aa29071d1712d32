"""Hugging Face Hub helpers shared by load, push and pre-flight (pure: no Prefect).

    python -c "from tasks.core.hub.repo import is_hub_id; print(is_hub_id('org/name'))"

The token is looked up in one order everywhere (load, push, pre-flight): HF_TOKEN in the
environment, then the caller's secret lookup (the Prefect Secret block `hf-token`, passed in by
the task side so this module stays free of Prefect), then the token `hf auth login` /
`huggingface_hub.login` saved under HF_HOME (`huggingface_hub.get_token()`). It is never logged
or returned anywhere but to the Hub client.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from tasks.core.config.paths import resolve_local

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SECRET_BLOCK = "hf-token"  # the Prefect Secret block the task side reads


def is_hub_id(uri: str) -> bool:
    """`org/name` that is not an existing local path nor a URI."""
    return bool(HUB_ID.match(uri)) and "://" not in uri and not Path(resolve_local(uri)).exists()


def hub_dataset_id(uri: str) -> str | None:
    """`hf://datasets/org/name/...` is a Hub dataset a model card can name; other URIs are not."""
    prefix = "hf://datasets/"
    if uri.startswith(prefix):
        parts = uri[len(prefix):].split("/")
        if len(parts) >= 2 and parts[0] and parts[1]:
            return f"{parts[0]}/{parts[1].split('@')[0]}"
    return None


def stored_token() -> str | None:
    """The token `hf auth login` saved under HF_HOME, or None (huggingface_hub's own lookup)."""
    try:
        from huggingface_hub import get_token

        return get_token() or None
    except Exception:  # an unreadable token file is the same as no saved login
        return None


def hub_token(secret: Callable[[], str | None] | None = None) -> str | None:
    """HF_TOKEN from the environment, else `secret()` (the Secret block), else the saved login, else None."""
    token = os.environ.get("HF_TOKEN")
    if token:
        return token
    if secret is not None:
        try:
            value = secret()
        except Exception:  # no Secret block (or no Prefect API) means no token there, the same as an unset HF_TOKEN
            value = None
        if value:
            return str(value)
    return stored_token()
