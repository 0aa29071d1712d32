"""Prefect's retry condition for the stages that reach the network or copy large files (load_from_hf,
push_to_hub): retry what may heal (a dropped connection, a throttled store), never a refusal.

    python -c "from tasks.flowkit.retry import cannot_heal; print(cannot_heal(PermissionError(13, 'denied')))"
"""

from __future__ import annotations

from prefect import get_run_logger

from tasks.core.errors import ConfigError, Preempted
from tasks.core.hub.repo import HubRefusal
from tasks.core.storage.oserrors import DISK_ERRNOS
from tasks.flowkit.console_log import NOT_ON_CONSOLE

UNHEALING_STATUS = (
    401,
    403,
    404,
)  # a refused token, a missing right, a missing repo/revision/file: the same on every try


SIZE_MISMATCH = "size mismatch for "  # torch's load_state_dict: "size mismatch for KEY: copying a param with shape"


def cannot_heal(exc: BaseException) -> bool:
    """An error a retry meets again: a refusal (ConfigError, HubRefusal), the Hub answering
    401/403/404, a malformed safetensors file, a config.json transformers trips on (AttributeError,
    TypeError), weights whose shapes are another config.json's, a full, read-only or forbidden disk. Its causes count too (a loader may wrap the SafetensorError)."""
    from huggingface_hub.errors import HfHubHTTPError
    from safetensors import SafetensorError

    if isinstance(exc, (AttributeError, TypeError)):  # transformers tripping on the model's own config.json; the
        return True  # failure itself only: a library may raise a network error while handling one
    if isinstance(exc, RuntimeError) and SIZE_MISMATCH in str(exc):  # weights of another config.json (torch's
        return True  # load_state_dict sentence, which transformers raises again); pre-flight's shape check names most
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConfigError, SafetensorError, HubRefusal)):
            return True
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:  # a full or read-only disk does not heal in 15 s
            return True
        if isinstance(exc, HfHubHTTPError) and getattr(exc.response, "status_code", None) in UNHEALING_STATUS:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def transient(task, task_run, state) -> bool:
    """Prefect's retry condition for the Hub stages: retry downloads, copies and uploads (network,
    disk), never an error that cannot heal (`cannot_heal`)."""
    try:
        state.result()
    except Exception as exc:  # the failure itself is what is judged
        if isinstance(exc, Preempted):  # not failed: the flow retries the run by its preemption policy
            return False
        if not cannot_heal(exc):
            return True
        # Prefect 3.9 logs a failure's traceback only once the retries are spent, never when this
        # condition declines them: the task run's log keeps it here (the console has the cause).
        get_run_logger().error(
            "not retried, the same on every try: %s: %s", type(exc).__name__, exc, exc_info=exc, extra=NOT_ON_CONSOLE
        )
        return False
    return True
