"""The preemption-notice registry: one `NoticeSource` row per way a machine says it will be taken away.

    python -c "from tasks.core.config.notices import NOTICES; print({n: (s.grace_s, s.summary) for n, s in NOTICES.items()})"

A stage lists the sources it listens to in `<phase>.elastic.notices` (tasks/core/config/elastic.py),
each with a grace budget: the seconds between the notice and the machine's end. Two kinds of row:

- a signal row (`signal`): the scheduler signals the ranks (SIGTERM from Kubernetes or a flow
  process that is being stopped; SIGUSR1 from Slurm's `--signal=USR1@<seconds>`). The launcher
  forwards the signal to the ranks instead of tearing them down (tasks/core/launch/proctree.py
  `forward_notices`); each rank's handler (tasks/core/launch/notice_watch.py) records the notice.
- a polled row (`poll`): a rank asks every `poll_s` seconds; `poll(fetch, endpoint)` is pure
  logic over an injected `fetch(method, url, headers) -> (status, body)`, so the same code runs
  against a cloud's instance-metadata endpoint and the local test double
  (support/servers/metadata.py), and returns the notice's text or None. Its `endpoint_kind` says
  what `endpoint` names: an http(s) URL (the clouds) or a file path (`file`).

Adding a source is one row here; the engine and the launcher read `signal` and `poll`, never a name.

Everything a notice says is untrusted (a file anyone can write, an answer from the network): it is
read bounded (`NOTICE_BYTES`, each poll within `POLL_DEADLINE_S`, a file only when it is a regular
one, opened without blocking) and reaches the log as printable characters only (`printable`).

`sigterm` is on by default (`<phase>.elastic.sigterm`): a machine's shutdown (a spot VM's, a
Kubernetes eviction, Slurm's preemption) sends SIGTERM to every process, and a training stage then
keeps the step in flight. Two SIGTERMs are not notices: the launcher's own teardown (it writes the
file named by `TEARDOWN_ENV` first, and a rank that finds it ends at once, `torn_down`) and a cancel
from Prefect (the flow process reads the flow run's state, tasks/flowkit/notices.py).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

# (method, url, headers) -> (HTTP status, body text); raises OSError when the endpoint cannot be reached.
Fetch = Callable[[str, str, dict[str, str]], tuple[int, str]]
# The link-local address every one of the three clouds serves its instance metadata on.
METADATA = "http://169.254.169.254"
# What a notice may say: the bytes read of a notice file or an answer, the characters logged.
NOTICE_BYTES = 4096
NOTICE_CHARS = 200
# The seconds one poll (every request of it, the answer read whole) may take: a metadata service
# answers in milliseconds, and one that trickles its answer must not hold the poller.
POLL_DEADLINE_S = 5.0
# Set by the launcher for the ranks: the path of the file it writes before it tears the stage down.
TEARDOWN_ENV = "CPT_TO_SFT_TEARDOWN"


@dataclass(frozen=True)
class NoticeSource:
    name: str
    summary: str  # one line for the config reference
    grace_s: float  # the budget the platform documents, used when the config gives none
    signal: str | None = None  # a signal row: the signal's name (SIGTERM, SIGUSR1)
    poll: Callable[[Fetch, str], str | None] | None = None  # a polled row
    endpoint: str | None = None  # a polled row's default endpoint (None: the config must name one)
    endpoint_kind: str = "url"  # a polled row's endpoint: "url" (http or https) or "path" (a file's)


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


def printable(text: str, limit: int = NOTICE_CHARS) -> str:
    """`text` as one line of printable characters (NULs, control bytes and line breaks dropped or
    made spaces), at most `limit` of them: what a log line, a Prefect log row and a terminal take."""
    kept = "".join(c if c.isprintable() else " " if c.isspace() else "" for c in text)
    return " ".join(kept.split())[:limit]


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a stat mode names, in words: 'a regular file', 'a FIFO', 'a character device', ..."""
    return next((word for test, word in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode) else "no file")


def _file(fetch: Fetch, path: str) -> str | None:
    """A file whose appearance is the notice (a node agent, a cron job, a person): read, never run.
    Anything at the path is the notice; only a regular file's first line is read, at most
    NOTICE_BYTES of it, opened without blocking (a FIFO or a device is never read)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return f"notice file {path} ({file_kind(st.st_mode)}, not read)"
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for something else since the stat
            return f"notice file {path} (not a regular file, not read)"
        data = os.read(fd, NOTICE_BYTES)
    finally:
        os.close(fd)
    text = printable(data.decode(errors="replace").split("\n", 1)[0])
    return f"notice file {path}" + (f": {text}" if text else "")


def endpoint_problem(kind: str, endpoint: str) -> str | None:
    """What is wrong with a polled source's endpoint in itself (no file system asked), or None."""
    if kind == "url":
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return (
                f"{endpoint!r} is not an http(s) URL: give the metadata service's base URL, e.g. {METADATA} "
                "(or leave `endpoint` out for that default)"
            )
        return None
    if "://" in endpoint or not os.path.isabs(endpoint):
        return (
            f"{endpoint!r} is not an absolute file path: give the path where the notice file will appear, e.g. "
            "/run/spot/notice (the ranks do not run in this directory)"
        )
    return None


def file_endpoint_problem(path: str) -> str | None:
    """A `file` endpoint as the file system has it now (lstat: nothing is opened or followed), or None:
    it must name a path where nothing is yet (a notice already in, or another file, would be read as
    one at once) and whose parent, where it exists, is a directory."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        parent = os.path.dirname(path)
        if os.path.lexists(parent) and not os.path.isdir(parent):
            return f"{parent} is not a directory: name a path under a directory where the notice file will appear"
        return None
    except OSError as exc:
        return f"{path} cannot be looked at ({exc.strerror}): name a path this user can see"
    kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else file_kind(st.st_mode)
    if kind == "a regular file":
        return (
            f"{path} already exists: it would be read as a notice at once; remove it if it is a stale notice, "
            "or name a path where nothing is yet"
        )
    return f"{path} is {kind}, not a file path: name a path where a notice file will appear (nothing there yet)"


def torn_down() -> bool:
    """Whether the launcher is tearing this rank's stage down (the file named by TEARDOWN_ENV exists):
    its SIGTERM then ends the rank as it always did, and is no notice."""
    marker = os.environ.get(TEARDOWN_ENV)
    return bool(marker) and os.path.lexists(marker)


NOTICES: dict[str, NoticeSource] = {
    "sigterm": NoticeSource(
        "sigterm",
        "SIGTERM to the flow or a rank, on by default (a machine's shutdown, Kubernetes terminationGracePeriodSeconds)",
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
    "file": NoticeSource(
        "file", "a file appearing at `endpoint` (an absolute path)", 30.0, poll=_file, endpoint_kind="path"
    ),
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
