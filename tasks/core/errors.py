"""Errors shown to users. `ValueError`-style, each naming the field or file and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """Every problem with a configuration, reported at once (torchtune's ConfigError idea).

    `problems` is a list of (field path, message) pairs; str() renders one line per problem.
    """

    def __init__(self, problems: list[tuple[str, str]], header: str = "invalid configuration"):
        self.problems = list(problems)
        self.header = header
        lines = [f"{header} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):"]
        lines += [f"  - {field}: {msg}" for field, msg in self.problems]
        super().__init__("\n".join(lines))

    def one_line(self) -> str:
        """Header and every problem on one line (a cause quoted in a stage row or a state message)."""
        return f"{self.header}: " + "; ".join(f"{field}: {msg}" for field, msg in self.problems)


class ManifestError(ValueError):
    """An artifact whose manifest is missing, malformed, or whose files fail verification."""


class ArtifactMissing(ManifestError):
    """No manifest at the artifact URI: by the manifest rule the artifact does not exist."""


class ConversionError(ValueError):
    """A checkpoint that cannot be converted to the HF layout (missing/extra/duplicated keys,
    wrong shapes or dtypes). The message names the key or file and the likely cause."""


class StageFailed(RuntimeError):
    """A launched stage (torchrun) exited non-zero. `cause` is one line, "rank N: <its first error
    line>"; the message starts with it and then holds every process's last lines."""

    def __init__(self, message: str, cause: str | None = None):
        super().__init__(message)
        self.cause = cause or (message.splitlines()[0] if message else "")

    def __reduce__(self):  # Prefect may pickle a task's exception; keep the cause
        return (type(self), (str(self), self.cause))


# The exit status of every rank of a training stage that stopped on a preemption notice after
# committing what it could (EX_TEMPFAIL: "try again later"); the launcher reports `Preempted`.
PREEMPTED_EXIT = 75


class Preempted(StageFailed):
    """A stage stopped on a preemption notice (tasks/core/launch/notice_watch.py). `record` is the engine's
    `@@preempted` event: source, grace_s, noticed_step, checkpoint (step and path of the newest
    committed checkpoint), steps_lost, notice_to_commit_s. A StageFailed, so a caller that knows
    nothing of preemption still stops; one that does catches this first and retries."""

    def __init__(self, message: str, cause: str | None = None, record: dict | None = None):
        super().__init__(message, cause)
        self.record = dict(record or {})

    def __reduce__(self):
        return (type(self), (str(self), self.cause, self.record))
