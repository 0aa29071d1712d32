"""Fault injection for the resume tests: make a rank die or a training launch fail at an exact point.

Set `CPT_TO_SFT_FAULT` in the environment of the engine (the Prefect train task passes it on):

    CPT_TO_SFT_FAULT='kill@step=3'                 torchrun ... -m tasks.engine train --config job.json

Grammar: one or more specs separated by ';', each `ACTION@TRIGGER[@OPTION...]`:

    ACTION   kill   the chosen rank SIGKILLs itself (no cleanup, no flush beyond its own stdout)
             fail   every rank raises RuntimeError("injected failure ...") (exit status 1)
             term   the chosen rank sends itself SIGTERM, usr1 SIGUSR1: a preemption notice where the
                    stage listens for one (`<phase>.elastic.notices`, tasks/core/launch/notice_watch.py)
             shutdown  the chosen rank (default rank 0) sends SIGTERM to every process of the run at
                    once, as a machine's shutdown does: the flow process (torchrun's parent, local
                    launches), torchrun and every rank, itself included
             hold   every rank (or rank=R) waits, up to HOLD_S, until a notice reaches it: a test that
                    sends the notice from outside (`scancel --signal=USR1`) gets it mid-training
                    however fast the steps are (step triggers only)
    TRIGGER  step=K          at the start of step K+1 of `train`, i.e. after step K finished and
                             the checkpoint of step K (if K is a checkpoint step) was committed
             save=K:PART     inside the save of the checkpoint of step K, right before PART, one of
                             model, optimizer, lr_scheduler, rng, fingerprint, state, manifest, rename
                             (everything before PART is on disk in `.step-K.tmp`; the manifest is
                             written at `manifest`, the directory renamed at `rename`)
             phase=P         at the start of the `train` verb of phase P (cpt, sft or dpo)
    OPTION   phase=P         only in phase P (for step/save triggers)
             rank=R          the rank that acts for `kill` (default: rank 1, or 0 with one rank;
                             rank 0 for the manifest and rename parts, which only rank 0 runs)

Examples: `kill@step=3@phase=cpt`, `kill@save=6:optimizer`, `kill@save=6:manifest`,
`fail@phase=sft`, `fail@step=4@phase=sft`.

Each spec fires ONCE per checkpoint directory: before acting, the acting rank records it in
`<stage_dir>/.faults/<digest of the spec>`, so a retry of the same phase (same environment)
resumes instead of failing again. Delete that directory to re-arm.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tasks.core.config.phases import PHASES
from tasks.core.run.events import ERROR
from tasks.engine import rankio

ENV = "CPT_TO_SFT_FAULT"
SAVE_PARTS = ("model", "optimizer", "lr_scheduler", "rng", "fingerprint", "state", "manifest", "rename")
_RANK0_PARTS = ("manifest", "rename")
_SIGNALS = {"term": signal.SIGTERM, "usr1": signal.SIGUSR1}  # a notice, sent to the acting rank itself
_ACTIONS = ("kill", "fail", "hold", "shutdown", *_SIGNALS)
# A hold whose notice never comes ends and training goes on: the test then fails on what it asserts, not on a hang.
HOLD_S = 300.0


@dataclass(frozen=True)
class Fault:
    spec: str
    action: str  # kill | fail | hold | term | usr1
    trigger: str  # step | save | phase
    step: int | None = None
    part: str | None = None  # of a save (SAVE_PARTS)
    phase: str | None = None  # cpt, sft or dpo: the training phase it fires in (None: any)
    rank: int | None = None

    def acting_rank(self, world_size: int) -> int:
        if self.rank is not None:
            return self.rank
        if self.action == "shutdown" or (self.trigger == "save" and self.part in _RANK0_PARTS):
            return 0
        return 1 if world_size > 1 else 0


def parse(value: str | None) -> list[Fault]:
    """Parse the env value; a malformed spec is an error naming it (a silent typo would make a test pass)."""
    out: list[Fault] = []
    for spec in (value or "").split(";"):
        spec = spec.strip()
        if not spec:
            continue
        parts = spec.split("@")
        action = parts[0]
        if action not in _ACTIONS or len(parts) < 2:
            raise ValueError(
                f"{ENV}={value!r}: spec {spec!r} must start with kill@, fail@, hold@, shutdown@, term@ or usr1@ (see "
                "tasks/engine/faults.py)"
            )
        fields: dict = {"spec": spec, "action": action}
        for i, part in enumerate(parts[1:]):
            key, eq, val = part.partition("=")
            if not eq or not val:
                raise ValueError(f"{ENV}: {part!r} in {spec!r} is not key=value")
            if i == 0:
                if key == "step":
                    fields.update(trigger="step", step=_int(val, spec))
                elif key == "save":
                    k, colon, part = val.partition(":")
                    if not colon or part not in SAVE_PARTS:
                        raise ValueError(
                            f"{ENV}: {spec!r}: save trigger is save=K:PART with PART one of {', '.join(SAVE_PARTS)}"
                        )
                    fields.update(trigger="save", step=_int(k, spec), part=part)
                elif key == "phase":
                    fields.update(trigger="phase", phase=_phase(val, spec))
                else:
                    raise ValueError(f"{ENV}: {spec!r}: trigger must be step=K, save=K:PART or phase=P, got {key!r}")
            elif key == "phase":
                fields["phase"] = _phase(val, spec)
            elif key == "rank":
                fields["rank"] = _int(val, spec)
            else:
                raise ValueError(f"{ENV}: {spec!r}: unknown option {key!r} (phase=P or rank=R)")
        if action == "hold" and fields.get("trigger") != "step":
            raise ValueError(f"{ENV}: {spec!r}: hold takes a step=K trigger (it waits between steps)")
        out.append(Fault(**fields))
    return out


def _int(val: str, spec: str) -> int:
    try:
        n = int(val)
    except ValueError:
        raise ValueError(f"{ENV}: {spec!r}: {val!r} is not an integer") from None
    if n < 0:
        raise ValueError(f"{ENV}: {spec!r}: {n} must be >= 0")
    return n


def _phase(val: str, spec: str) -> str:
    if val not in PHASES:
        raise ValueError(f"{ENV}: {spec!r}: phase must be {' or '.join(PHASES)}, got {val!r}")
    return val


class Injector:
    """Holds the parsed faults of this process; the engine calls the three hooks below."""

    def __init__(self, phase: str, stage_dir: str | Path, rank: int, world_size: int, value: str | None = None):
        self.phase, self.rank, self.world_size = phase, rank, world_size
        self.marks = Path(stage_dir) / ".faults"
        raw = os.environ.get(ENV) if value is None else value
        self.faults = [f for f in parse(raw) if f.phase in (None, phase)]
        # Which faults already fired in an earlier attempt, read once now: the engine builds the
        # Injector before the process-group rendezvous, so every rank sees the same answer even
        # when another rank of this attempt records a fault first.
        self.fired = {f.spec for f in self.faults if self._mark_path(f).exists()}

    def _mark_path(self, f: Fault) -> Path:
        return self.marks / hashlib.sha256(f.spec.encode()).hexdigest()[:16]

    def at_start(self) -> None:
        self._fire([f for f in self.faults if f.trigger == "phase"], "at the start of training")

    def after_step(self, step: int, noticed: Callable[[], bool] = lambda: False) -> None:
        due = [f for f in self.faults if f.trigger == "step" and f.step == step]
        for f in due:
            if f.action == "hold" and f.spec not in self.fired and f.rank in (None, self.rank):
                self._mark(self._mark_path(f), f)
                rankio.say(f"injected hold {f.spec!r} ({ENV}): rank {self.rank} waits for a notice after step {step}")
                deadline = time.monotonic() + HOLD_S
                while not noticed() and time.monotonic() < deadline:
                    time.sleep(0.05)
        self._fire([f for f in due if f.action != "hold"], f"after step {step}")

    def before_save_part(self, step: int, part: str) -> None:
        self._fire(
            [f for f in self.faults if f.trigger == "save" and f.step == step and f.part == part],
            f"in the save of step {step}, before {part}",
        )

    def _fire(self, faults: list[Fault], where: str) -> None:
        for f in faults:
            if f.spec in self.fired:
                continue
            mark = self._mark_path(f)
            if f.action == "fail":
                self._mark(mark, f)
                raise RuntimeError(f"injected failure {f.spec!r} ({ENV}) {where} of phase {self.phase}")
            if self.rank == f.acting_rank(self.world_size) and f.action == "shutdown":
                self._mark(mark, f)
                rankio.say(f"injected shutdown {f.spec!r} ({ENV}): SIGTERM to every process of the run {where}")
                _shutdown()
            elif self.rank == f.acting_rank(self.world_size) and f.action in _SIGNALS:
                self._mark(mark, f)
                rankio.say(f"injected notice {f.spec!r} ({ENV}): rank {self.rank} signals itself {where}")
                os.kill(os.getpid(), _SIGNALS[f.action])
            elif self.rank == f.acting_rank(self.world_size):
                self._mark(mark, f)
                # At error level: a SIGKILLed rank says nothing else, and this line is the cause.
                rankio.say(
                    f"injected fault {f.spec!r} ({ENV}): rank {self.rank} SIGKILLs itself {where} of phase {self.phase}",
                    ERROR,
                )
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    def _mark(self, mark: Path, f: Fault) -> None:
        mark.parent.mkdir(parents=True, exist_ok=True)
        with open(mark, "w") as fh:
            fh.write(f.spec + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def _shutdown() -> None:
    """SIGTERM, in one loop, to torchrun (this rank's parent), its parent (the flow process of a local
    launch) and every rank torchrun started, this one last."""
    import psutil

    agent = psutil.Process(os.getppid())
    procs = [p for p in (agent.parent(), agent, *agent.children()) if p is not None and p.pid != os.getpid()]
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    os.kill(os.getpid(), signal.SIGTERM)
