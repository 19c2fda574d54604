"""One scenario's row of the chaos table, its floors, the table and the JSON document.

The JSON keys are issue 13's contract: `{"scenarios": [{name, sent, succeeded, failed_told, lost,
duplicated_tokens, worst_ttft_ms}, ...]}` (more keys may follow them: the steady-state p50, the floors missed,
the evidence). `duplicated_tokens` counts answers whose tokens were not exactly the ones asked for (duplicated
or missing: `MixedLoad`'s `bad_tokens`). The ratio the table prints is the worst TTFT a client saw during the
scenario against the p50 TTFT of the same load in its steady state before the fault, measured in the same run:
a figure that holds on a slower machine, where the absolute milliseconds do not.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from pdserve_dev.testing.mixed_load import LoadResults


@dataclass
class Outcome:
    name: str
    sent: int = 0
    succeeded: int = 0
    failed_told: int = 0
    lost: int = 0
    duplicated_tokens: int = 0
    worst_ttft_ms: float = 0.0
    steady_p50_ttft_ms: float | None = None
    missed: list[str] = field(default_factory=list)
    """The floors this scenario missed, each in words (empty: it passed)."""
    notes: list[str] = field(default_factory=list)
    """Evidence that the fault hit what it was meant to hit (work in hand, pods read, ...)."""
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    failure_kinds: dict[str, int] = field(default_factory=dict)
    """`MixedLoad`'s kinds of told failures (a stream told after its first tokens, before them, an HTTP error)."""

    @classmethod
    def of(cls, name: str, results: LoadResults, fault_at: float | None) -> Outcome:
        """The counts the clients saw, the worst TTFT and the steady p50 (streams whose first token came before
        `fault_at`); the base floors (nothing lost, no bad tokens, every request ended) already judged."""
        steady = [ttft for at, ttft in results.ttfts if fault_at is not None and at < fault_at]
        outcome = cls(
            name=name,
            sent=results.sent,
            succeeded=results.succeeded,
            failed_told=results.failed_told,
            lost=results.lost,
            duplicated_tokens=results.bad_tokens,
            worst_ttft_ms=round(results.worst_ttft_seconds * 1000, 1),
            steady_p50_ttft_ms=round(statistics.median(steady) * 1000, 1) if steady else None,
            problems=results.problems[:10],
            failure_kinds=dict(results.failure_kinds),
        )
        outcome.require(results.lost == 0, f"lost == 0 (lost {results.lost})")
        outcome.require(results.bad_tokens == 0, f"duplicated_tokens == 0 ({results.bad_tokens})")
        outcome.require(results.in_flight == 0, f"every request ended ({results.in_flight} never did)")
        return outcome

    def require(self, holds: bool, floor: str) -> None:
        """Record `floor` as missed unless it holds."""
        if not holds:
            self.missed.append(floor)

    @property
    def ratio(self) -> float | None:
        """Worst TTFT / steady-state p50 TTFT."""
        if not self.steady_p50_ttft_ms:
            return None
        return self.worst_ttft_ms / self.steady_p50_ttft_ms

    def contract(self) -> dict[str, Any]:
        """The JSON row: the contract's keys first, then the rest."""
        return {
            "name": self.name,
            "sent": self.sent,
            "succeeded": self.succeeded,
            "failed_told": self.failed_told,
            "lost": self.lost,
            "duplicated_tokens": self.duplicated_tokens,
            "worst_ttft_ms": self.worst_ttft_ms,
            "steady_p50_ttft_ms": self.steady_p50_ttft_ms,
            "worst_over_steady_p50": round(self.ratio, 2) if self.ratio is not None else None,
            "passed": not self.missed,
            "missed": self.missed,
            "failure_kinds": self.failure_kinds,
            "notes": self.notes,
            "seconds": round(self.seconds, 1),
        }


def document(outcomes: list[Outcome], mode: str) -> dict[str, Any]:
    return {"mode": mode, "scenarios": [outcome.contract() for outcome in outcomes]}


def table(outcomes: list[Outcome]) -> str:
    """The Markdown table the README carries."""
    lines = [
        "| scenario | sent | succeeded | failed (told) | lost | dup/missing tokens | worst TTFT | steady p50 TTFT "
        "| worst / p50 | floors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        p50 = f"{o.steady_p50_ttft_ms:.0f} ms" if o.steady_p50_ttft_ms is not None else "-"
        ratio = f"x{o.ratio:.1f}" if o.ratio is not None else "-"
        verdict = "pass" if not o.missed else "MISSED: " + "; ".join(o.missed)
        lines.append(
            f"| {o.name} | {o.sent} | {o.succeeded} | {o.failed_told} | {o.lost} | {o.duplicated_tokens} "
            f"| {o.worst_ttft_ms:.0f} ms | {p50} | {ratio} | {verdict} |"
        )
    return "\n".join(lines)
