"""The chaos table's rows: the contract's JSON keys, the base floors judged from what clients saw, the ratio of
the worst TTFT to the steady state's p50."""

from __future__ import annotations

from pdserve_dev.chaos.outcome import Outcome, document, table
from pdserve_dev.testing.mixed_load import LoadResults

CONTRACT = ["name", "sent", "succeeded", "failed_told", "lost", "duplicated_tokens", "worst_ttft_ms"]


def test_a_clean_run_passes_and_its_ratio_compares_the_worst_ttft_with_the_steady_p50() -> None:
    results = LoadResults(sent=10, succeeded=10, worst_ttft_seconds=0.9)
    # Three first tokens before the fault (at t=100), one slow one after it.
    results.ttfts = [(90.0, 0.1), (95.0, 0.2), (99.0, 0.3), (101.0, 0.9)]
    outcome = Outcome.of("scale-down-decode", results, fault_at=100.0)
    assert outcome.missed == []
    assert outcome.steady_p50_ttft_ms == 200.0
    assert outcome.worst_ttft_ms == 900.0
    assert outcome.ratio == 4.5
    row = outcome.contract()
    assert list(row)[: len(CONTRACT)] == CONTRACT
    assert row["worst_over_steady_p50"] == 4.5 and row["passed"] is True
    assert document([outcome], "quick") == {"mode": "quick", "scenarios": [row]}
    assert "| scale-down-decode | 10 | 10 | 0 | 0 | 0 | 900 ms | 200 ms | x4.5 | pass |" in table([outcome])


def test_lost_requests_bad_tokens_and_requests_that_never_ended_miss_the_base_floors() -> None:
    results = LoadResults(sent=10, succeeded=6, failed_told=1, lost=1, bad_tokens=1)
    outcome = Outcome.of("decode-killed", results, fault_at=None)
    assert outcome.missed == [
        "lost == 0 (lost 1)",
        "duplicated_tokens == 0 (1)",
        "every request ended (1 never did)",
    ]
    assert outcome.steady_p50_ttft_ms is None and outcome.ratio is None
    assert "MISSED: lost == 0 (lost 1)" in table([outcome])


def test_a_floor_a_scenario_requires_is_recorded_only_when_it_does_not_hold() -> None:
    outcome = Outcome("rolling-update")
    outcome.require(True, "never shown")
    outcome.require(False, "no kv-compat mismatched pull (2)")
    assert outcome.missed == ["no kv-compat mismatched pull (2)"]
    assert outcome.contract()["passed"] is False
