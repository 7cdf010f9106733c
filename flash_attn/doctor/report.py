"""What the doctor hands back: the facts it collected and one :class:`Finding` per problem."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SEVERITIES = ("error", "warning", "info")


@dataclass
class Finding:
    """One diagnosis: ``check`` is a stable id (the table in :mod:`flash_attn.doctor`)."""

    check: str
    severity: str  # "error" | "warning" | "info"
    summary: str
    detail: str = ""
    fix: str = ""


@dataclass
class Report:
    """The facts (plain JSON-able data from the probes) and the findings drawn from them."""

    facts: dict
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    def exit_status(self, strict: bool = False) -> int:
        """0 when healthy; 1 on an error (``strict``: on a warning too)."""
        return 1 if self.errors or (strict and self.warnings) else 0

    def to_json(self, strict: bool = False) -> dict:
        return {
            **self.facts,
            "findings": [asdict(f) for f in self.findings],
            "healthy": not self.errors,
            "exit_status": self.exit_status(strict),
        }
