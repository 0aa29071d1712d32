"""Hugging Face Hub helpers shared by load, push and pre-flight (pure: no Prefect).

    python -c "from tasks.core.hub.repo import is_hub_id; print(is_hub_id('org/name'))"

The token is looked up in one order everywhere (load, push, pre-flight): HF_TOKEN in the
environment, then the caller's secret lookup (the Prefect Secret block `hf-token`, passed in by
the task side so this module stays free of Prefect), then the token `hf auth login` /
`huggingface_hub.login` saved under HF_HOME (`huggingface_hub.get_token()`). It is never logged
or returned anywhere but to the Hub client; messages name its source (`HubToken.source`) instead.
Pre-flight asks the Hub `whoami` with it, so a refused token stops the run before training.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tasks.core.config.paths import resolve_local

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$", re.ASCII)  # the Hub's ids are ASCII (hub/metadata.py)
SECRET_BLOCK = "hf-token"  # the Prefect Secret block the task side reads


def is_hub_id(uri: str) -> bool:
    """`org/name` that is not an existing local path nor a URI."""
    return bool(HUB_ID.match(uri)) and "://" not in uri and not Path(resolve_local(uri)).exists()


def hub_dataset_id(uri: str) -> str | None:
    """`hf://datasets/org/name/...` is a Hub dataset a model card can name; other URIs are not."""
    prefix = "hf://datasets/"
    if uri.startswith(prefix):
        parts = uri[len(prefix) :].split("/")
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


@dataclass(frozen=True)
class HubToken:
    """A token and where it was found; the value never shows in a repr, a log or a message."""

    value: str = field(repr=False)
    source: str


def saved_login_source() -> str:
    from huggingface_hub import constants

    return f"the token `hf auth login` saved ({constants.HF_TOKEN_PATH})"


def find_hub_token(secret: Callable[[], str | None] | None = None) -> HubToken | None:
    """HF_TOKEN from the environment, else `secret()` (the Secret block), else the saved login, else None."""
    token = os.environ.get("HF_TOKEN")
    if token:
        return HubToken(token, "HF_TOKEN (the environment)")
    if secret is not None:
        try:
            value = secret()
        except Exception:  # no Secret block (or no Prefect API) means no token there, the same as an unset HF_TOKEN
            value = None
        if value:
            return HubToken(str(value), f"the Prefect Secret block '{SECRET_BLOCK}'")
    saved = stored_token()
    return HubToken(saved, saved_login_source()) if saved else None


def hub_token(secret: Callable[[], str | None] | None = None) -> str | None:
    """The value of `find_hub_token`, or None."""
    found = find_hub_token(secret)
    return found.value if found else None


REFUSED_STATUS = (401, 403)


@dataclass(frozen=True)
class WhoAmI:
    """The Hub's answer to `whoami`: `user` when the token is accepted, else `status` (an HTTP
    code, or None when the Hub did not answer) and `reason`."""

    endpoint: str
    user: str | None = None
    status: int | None = None
    reason: str = ""

    @property
    def refused(self) -> bool:
        return self.status in REFUSED_STATUS


def whoami(token: HubToken, endpoint: str | None = None, timeout: float = 10.0) -> WhoAmI:
    """Ask `endpoint` (HF_ENDPOINT by default) who the token belongs to (`/api/whoami-v2`, what
    `hf auth whoami` asks), bounded by `timeout`: an unreachable Hub must not stall pre-flight."""
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session

    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    try:
        r = get_session().get(f"{endpoint}/api/whoami-v2", headers=build_hf_headers(token=token.value), timeout=timeout)
    except (
        Exception
    ) as exc:  # connection refused, DNS, timeout: the Hub did not answer, which says nothing of the token
        return WhoAmI(endpoint, reason=f"{type(exc).__name__}: {str(exc)[:200]}")
    if r.status_code == 200:
        try:
            return WhoAmI(endpoint, user=str(r.json().get("name") or "?"))
        except ValueError:
            return WhoAmI(endpoint, status=200, reason="the answer is not JSON")
    try:
        reason = str(r.json().get("error") or "")[:200]
    except ValueError:
        reason = r.text[:200]
    return WhoAmI(endpoint, status=r.status_code, reason=reason)


class HubRefusal(RuntimeError):
    """A Hub stage refused its input (no token, a folder breaking the model-folder rule): the
    message names the cause and the fix; a retry would meet it again, so none is made."""


class HubTokenRefused(HubRefusal):
    """The Hub refused the token (401/403): the message names its source; no retry can heal it."""


def refused_token_message(token: HubToken, endpoint: str, status: int | None, reason: str = "") -> str:
    """One sentence naming the token's source (never its value) and the fix."""
    return (
        f"the Hub at {endpoint} refuses the token from {token.source} (HTTP {status}{': ' + reason if reason else ''}); "
        "replace that token with a valid one that can write the repo (a token from "
        "https://huggingface.co/settings/tokens, "
        "or from the Hub HF_ENDPOINT names), or remove it so the next source in the lookup order (HF_TOKEN, the "
        "Secret block "
        f"'{SECRET_BLOCK}', the saved `hf auth login`) is used"
    )
