"""The record every derivation check returns, and the ledger that builds it.

Kept free of SymPy and mpmath so that light modules (the FLOP formula the benchmark imports) stay light.
A check is a list of claims (each must hold) and negative controls (each is a plausible wrong formula
that the *same* check must reject). A module passes only if every claim holds, and its controls count
as rejected only if every one of them is rejected.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class CheckResult:
    """What one derivation module reports to the runner (and, as JSON, to the site)."""

    identity: str
    method: str
    sizes: str
    passed: bool
    negative_control_rejected: bool
    details: list[str] = field(default_factory=list)
    module: str = ""
    negative_control: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


class Ledger:
    """Collects the claims and negative controls of one check, with a line of detail each."""

    def __init__(self) -> None:
        self.claims: list[tuple[str, bool]] = []
        self.controls: list[tuple[str, bool]] = []

    @staticmethod
    def _evaluate(name: str, outcome) -> tuple[str, bool]:
        """`outcome` is a bool or a zero-argument callable; a callable that raises counts as False
        (a formula that cannot be evaluated neither proves nor survives anything)."""
        if callable(outcome):
            try:
                outcome = outcome()
            except Exception as exc:  # noqa: BLE001 - reported in the details
                return f"{name} (raised {type(exc).__name__}: {exc})", False
        return name, bool(outcome)

    def claim(self, name: str, holds) -> bool:
        """Something the identity says; it must hold."""
        entry = self._evaluate(name, holds)
        self.claims.append(entry)
        return entry[1]

    def control(self, name: str, rejected) -> bool:
        """A wrong formula run through the same check; `rejected` must come out True."""
        entry = self._evaluate(name, rejected)
        self.controls.append(entry)
        return entry[1]

    def result(self, *, identity: str, method: str, sizes: str, negative_control: str,
               module: str) -> CheckResult:
        details = [("ok        " if ok else "FAILED    ") + name for name, ok in self.claims]
        details += [("rejected  " if ok else "ACCEPTED  ") + "control: " + name
                    for name, ok in self.controls]
        return CheckResult(
            identity=identity,
            method=method,
            sizes=sizes,
            # A check with nothing in it proves nothing, so an empty ledger fails.
            passed=bool(self.claims) and all(ok for _, ok in self.claims),
            negative_control_rejected=bool(self.controls) and all(ok for _, ok in self.controls),
            details=details,
            module=module,
            negative_control=negative_control,
        )


