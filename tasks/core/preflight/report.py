"""The pre-flight report and what each check sees (pure: no I/O here).

python -m flows.cpt_to_sft --config examples/tiny-cpu.yaml --check
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tasks.core.config.schema import RunConfig
from tasks.core.errors import ConfigError
from tasks.core.hub.repo import HubToken
from tasks.core.preflight.model_info import Machine, ModelInfo

Problem = tuple[str, str]


@dataclass
class PreflightReport:
    checked: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def error(self) -> ConfigError:
        return ConfigError(self.problems, header="pre-flight failed, nothing was launched")

    def raise_for_problems(self) -> PreflightReport:
        if self.problems:
            raise self.error()
        return self

    def text(self) -> str:
        lines = (
            [str(self.error())]
            if self.problems
            else [f"pre-flight passed in {self.seconds:.2f} s ({len(self.checked)} checks)"]
        )
        if self.warnings:
            lines.append(f"warnings ({len(self.warnings)}):")
            lines += [f"  ! {w}" for w in self.warnings]
        lines.append("checked:" if self.ok else "checked (passed or not reached):")
        lines += [f"  ✓ {c}" for c in self.checked]
        return "\n".join(lines)


@dataclass
class CheckContext:
    cfg: RunConfig
    machine: Machine
    token_present: bool | None
    model: ModelInfo | None
    report: PreflightReport
    hub_token: HubToken | None = None  # the token push would use, for the whoami check (its value is never shown)

    def problem(self, where: str, msg: str) -> None:
        if (where, msg) not in self.report.problems:
            self.report.problems.append((where, msg))

    def ok(self, line: str) -> None:
        self.report.checked.append(line)

    def warn(self, line: str) -> None:
        self.report.warnings.append(line)
