"""The preemption-notice registry: one `NoticeSource` row per way a machine says it will be taken away.

    python -c "from tasks.core.config.notices import NOTICES; print({n: (s.grace_s, s.summary) for n, s in NOTICES.items()})"

A stage lists the sources it listens to in `<phase>.elastic.notices` (tasks/core/config/elastic.py),
each with a grace budget: the seconds between the notice and the machine's end. Two kinds of row:

- a signal row (`signal`): the scheduler signals the ranks (SIGTERM from Kubernetes or a flow
  process that is being stopped; SIGUSR1 from Slurm's `--signal=USR1@<seconds>`). The launcher
  forwards the signal to the ranks instead of tearing them down (tasks/core/launch/proctree.py
  `forward_notices`); each rank's handler (tasks/engine/notice.py) records the notice.
- a polled row (`poll`): a rank asks every `poll_s` seconds; `poll(fetch, endpoint)` is pure
  logic over an injected `fetch(method, url, headers) -> (status, body)`, so the same code runs
  against a cloud's instance-metadata endpoint and the local test double
  (support/servers/metadata.py), and returns the notice's text or None.

Adding a source is one row here; the engine and the launcher read `signal` and `poll`, never a name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

# (method, url, headers) -> (HTTP status, body text); raises OSError when the endpoint cannot be reached.
Fetch = Callable[[str, str, dict[str, str]], tuple[int, str]]
# The link-local address every one of the three clouds serves its instance metadata on.
METADATA = "http://169.254.169.254"


@dataclass(frozen=True)
class NoticeSource:
    name: str
    summary: str  # one line for the config reference
    grace_s: float  # the budget the platform documents, used when the config gives none
    signal: str | None = None  # a signal row: the signal's name (SIGTERM, SIGUSR1)
    poll: Callable[[Fetch, str], str | None] | None = None  # a polled row
    endpoint: str | None = None  # a polled row's default endpoint (None: the config must name one)


def _aws(fetch: Fetch, base: str) -> str | None:
    """EC2 spot interruption (IMDSv2): a session token by PUT, then spot/instance-action, 404 until
    an interruption is scheduled, then {"action": "terminate"|"stop"|"hibernate", "time": ...}."""
    status, token = fetch("PUT", f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    if status != 200:
        raise OSError(f"{base}/latest/api/token answered {status} (IMDSv2 token)")
    status, body = fetch(
        "GET", f"{base}/latest/meta-data/spot/instance-action", {"X-aws-ec2-metadata-token": token.strip()}
    )
    if status == 404:
        return None
    if status != 200:
        raise OSError(f"{base}/latest/meta-data/spot/instance-action answered {status}")
    action = json.loads(body)
    return f"aws spot {action.get('action')} at {action.get('time')}"


def _gcp(fetch: Fetch, base: str) -> str | None:
    """GCE preemptible/spot VM: instance/preempted is FALSE until the preemption, then TRUE."""
    status, body = fetch("GET", f"{base}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
    if status != 200:
        raise OSError(f"{base}/computeMetadata/v1/instance/preempted answered {status}")
    return "gcp instance preempted" if body.strip().upper() == "TRUE" else None


def _azure(fetch: Fetch, base: str) -> str | None:
    """Azure Scheduled Events: a `Preempt` event (Spot eviction) among the scheduled ones."""
    status, body = fetch("GET", f"{base}/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"})
    if status != 200:
        raise OSError(f"{base}/metadata/scheduledevents answered {status}")
    for event in json.loads(body).get("Events") or []:
        if event.get("EventType") == "Preempt":
            return f"azure Preempt event {event.get('EventId')} not before {event.get('NotBefore')}"
    return None


def _file(fetch: Fetch, path: str) -> str | None:
    """A file whose appearance is the notice (a node agent, a cron job, a person): read, never run."""
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as fh:
        text = fh.read(200).strip()
    return f"notice file {path}" + (f": {text}" if text else "")


NOTICES: dict[str, NoticeSource] = {
    "sigterm": NoticeSource(
        "sigterm",
        "SIGTERM to the flow or a rank (Kubernetes terminationGracePeriodSeconds, a stopping worker)",
        grace_s=30.0,
        signal="SIGTERM",
    ),
    "slurm": NoticeSource(
        "slurm", "SIGUSR1 from Slurm's --signal=USR1@<seconds> (sbatch) or scancel --signal=USR1", 60.0, "SIGUSR1"
    ),
    "aws": NoticeSource(
        "aws", "EC2 spot instance-action (IMDSv2), two minutes' notice", 120.0, poll=_aws, endpoint=METADATA
    ),
    "gcp": NoticeSource("gcp", "GCE instance/preempted (Metadata-Flavor: Google)", 30.0, poll=_gcp, endpoint=METADATA),
    "azure": NoticeSource(
        "azure", "Azure Scheduled Events, a Preempt event (Metadata: true)", 30.0, poll=_azure, endpoint=METADATA
    ),
    "file": NoticeSource("file", "a file appearing at `endpoint` (a path)", 30.0, poll=_file),
}


def register(spec: NoticeSource) -> None:
    """Add a row (a test's dummy source, a site's own scheduler)."""
    NOTICES[spec.name] = spec


def signal_names(sources: list[str]) -> list[str]:
    """The signals the listed sources are delivered by, once each, in order."""
    out: list[str] = []
    for name in sources:
        sig = NOTICES[name].signal
        if sig and sig not in out:
            out.append(sig)
    return out


# torchrun's agent turns the signals it handles into a shutdown that sends the same signal to every
# rank and waits `--shutdown-timeout` seconds before SIGKILL (torch.distributed.run; PET_* are its
# flags as environment variables). By default it handles SIGTERM, SIGINT, SIGHUP and SIGQUIT and
# waits 30 s, and SIGUSR1 ends it outright.
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def torchrun_env(notices: tuple) -> dict[str, str]:
    """The environment that makes torchrun pass a notice's signal on to the ranks and wait for them
    up to the longest grace budget of `notices` (`<phase>.elastic.notices` entries); {} without notices."""
    if not notices:
        return {}
    sigs = [*TORCHRUN_SIGNALS, *(s for s in signal_names([n.source for n in notices]) if s not in TORCHRUN_SIGNALS)]
    grace = max(n.grace for n in notices)
    return {"PET_SIGNALS_TO_HANDLE": ",".join(sigs), "PET_SHUTDOWN_TIMEOUT": str(int(-(-grace // 1)))}


# A save that would not end before the machine does is not started: the newest committed checkpoint
# stands, and no torn directory is left for the next attempt to clear.
SAVE_MARGIN = 1.2


def worth_saving(grace_left_s: float, last_save_s: float | None) -> bool:
    """Whether a checkpoint save fits in what is left of the grace budget, judged by how long this
    launch's last save took (no save yet: try, a save in flight is never torn, only left unfinished)."""
    return last_save_s is None or grace_left_s > SAVE_MARGIN * last_save_s
