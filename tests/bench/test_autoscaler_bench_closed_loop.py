"""The closed loop's parts that need no cluster: the slice it replays, the scalers, the PDService it applies and the
agreement it is judged by (`bench/autoscaler_bench.py --cluster`; the loop itself runs on demand: it takes the
machine's CPUs for minutes, docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pdserve.api.validation import validate
from pdserve_dev.replay.engines import Job
from pdserve_dev.replay.live import BREAKDOWN, LiveConfig, TickLog, manifest, startup_delays
from pdserve_dev.replay.scalers import PdserveScaler
from pdserve_dev.replay.trace import Request, windows
from pdserve_dev.testing.load import Answer
from pdserve_operator.render.router import admission

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """bench/autoscaler_bench.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("autoscaler_bench_under_test", ROOT / "bench" / "autoscaler_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _result(attainment: float, prefill: int, decode: int, threshold: int) -> dict[str, Any]:
    return {
        "attainment": attainment,
        "max_replicas": {"prefill": prefill, "decode": decode},
        "threshold": {"min": 256, "mean": 256.0, "max": threshold, "changes": int(threshold > 256)},
    }


def test_the_code_slice_is_bursty_and_cut_to_what_the_live_engines_serve(bench: ModuleType) -> None:
    requests = bench.live_requests(bench.LIVE_SLICES["code"])
    assert 200 < len(requests) < 400
    assert max(r.prompt for r in requests) <= 12_000 and max(r.output for r in requests) <= 2_000
    rates = [w.requests_per_s for w in windows(requests, 10.0)]
    mean = sum(rates) / len(rates)
    # Silent stretches and bursts well above the mean: what static provisioning and an autoscaler differ on.
    assert min(rates) == 0.0 and max(rates) >= 2 * mean, rates


def test_the_closed_loop_agrees_only_within_three_points_and_in_direction(bench: ModuleType) -> None:
    replayed = _result(0.95, 3, 1, 512)
    same = bench.check_agreement(replayed, _result(0.925, 4, 1, 1024), (1, 1))
    assert all(line.startswith("PASS") for line in same), same
    apart = bench.check_agreement(replayed, _result(0.915, 3, 1, 512), (1, 1))
    assert [line.split()[:2] for line in apart if line.startswith("FAIL")] == [["FAIL", "attainment"]]
    other_way = bench.check_agreement(replayed, _result(0.95, 1, 2, 256), (1, 1))
    assert [line.split()[1] for line in other_way if line.startswith("FAIL")] == ["prefill", "decode", "threshold"]


def test_only_pdserve_threshold_may_move_the_threshold(bench: ModuleType) -> None:
    model = bench.model_config(bench.LIVE_SLO, 2.0, 5.0)
    bounds = bench.PolicyConfig(prefill=bench.PoolBounds(1, 5), decode=bench.PoolBounds(1, 2))
    scalers = {
        name: bench.make_scaler(name, model, bounds, (4, 1), warmup_s=10.0, window_s=6.0) for name in bench.POLICIES
    }
    assert {name: s.name for name, s in scalers.items()} == {name: name for name in bench.POLICIES}
    pdserve = {name: s for name, s in scalers.items() if isinstance(s, PdserveScaler)}
    assert set(pdserve) == {"pdserve", "pdserve-threshold", "pdserve-on-arrival"}
    limits = {name: s.autoscaler.config.threshold_limits for name, s in pdserve.items()}
    assert limits["pdserve-threshold"].maximum == bench.THRESHOLD_MAX
    assert all(
        limits[name].maximum == limits[name].minimum == bench.THRESHOLD for name in ("pdserve", "pdserve-on-arrival")
    )


def test_the_live_pdservice_lets_the_autoscaler_choose_the_threshold_within_its_bounds() -> None:
    chosen = validate(manifest(LiveConfig(ttft_s=0.3, itl_s=0.04, threshold_bounds=(256, 2048))))
    fixed = validate(manifest(LiveConfig(ttft_s=0.3, itl_s=0.04)))
    assert chosen.problems == () and fixed.problems == ()
    assert chosen.spec is not None and chosen.spec.disaggregation_threshold_bounds() == (256, 256, 2048)
    assert fixed.spec is not None and fixed.spec.disaggregation_threshold_bounds() == (256, 256, 256)


def test_the_live_router_queues_with_the_budgets_the_replay_models(bench: ModuleType) -> None:
    pds, spec = validate(manifest(LiveConfig(ttft_s=0.3, itl_s=0.04))).require()
    rendered = admission(pds, spec)
    assert (rendered.prefill_budget_tokens, rendered.decode_budget_sequences) == (
        bench.LATE_BINDING.prefill_tokens,
        bench.LATE_BINDING.decode_sequences,
    )


def test_attainment_is_reported_per_window_of_arrivals(bench: ModuleType) -> None:
    arrivals = [(0.5, True), (3.0, False), (9.9, True), (10.0, False), (35.0, True)]
    assert bench.attainment_by_window(arrivals, 10.0) == [2 / 3, 0.0, 1.0, 1.0]
    assert bench.attainment_by_window([], 10.0) == []


def test_start_up_delays_are_measured_per_added_pod() -> None:
    existing = [(0.0, 1, 1), (1.0, 3, 1), (2.0, 3, 2), (3.0, 3, 2), (4.0, 2, 2)]
    ready = [(0.0, 1, 1), (1.0, 1, 1), (2.0, 2, 1), (3.0, 3, 1), (4.0, 2, 1)]
    # Prefill's 2nd and 3rd pods were Ready 1 s and 2 s after they were seen; decode's 2nd never was.
    assert startup_delays(existing, ready) == [1.0, 2.0]
    # The router's view is sampled on its own clock: its times decide, not the pods' samples' indices.
    existing = [(0.0, 1, 1), (1.0, 1, 1), (2.0, 1, 1), (3.0, 1, 1), (4.0, 2, 1), (5.0, 2, 1)]
    routed = [(0.0, 1, 1), (4.6, 2, 1)]
    assert startup_delays(existing, routed) == [0.6]


def test_the_replays_hops_are_read_from_its_requests_times(bench: ModuleType) -> None:
    pd, local = Job(Request(1.0, 4000, 10), "pd"), Job(Request(2.0, 100, 10), "decode-only")
    pd.dispatched, pd.prefill_arrival, pd.prefill_done = 1.1, 1.12, 1.4
    pd.decode_arrival, pd.admitted, pd.pull_done, pd.first_token = 1.45, 1.45, 1.46, 1.5
    pd.client_s = 0.01
    local.decode_arrival, local.first_token = 2.0, 2.05
    hops = bench.replay_latencies([pd, local])
    # The queue wait is both routes' (the router's histogram has no route): 0.1 s and 0 s, mean 0.05 s.
    assert hops["router queue wait"][1:] == (pytest.approx(0.1), pytest.approx(0.05))
    assert hops["prefill engine TTFT (queue + prefill)"][0] == pytest.approx(0.28)
    assert hops["KV transfer"][0] == pytest.approx(0.01)
    assert hops["router TTFT, PD route"][0] == pytest.approx(0.5)
    assert hops["client TTFT, PD route"][0] == pytest.approx(0.51)
    assert hops["router TTFT, decode only"][0] == pytest.approx(0.05)
    assert set(hops) <= {name for name, _, _ in BREAKDOWN} | set(bench.client_latencies([]))


def test_the_closed_loops_client_ttft_is_read_per_route(bench: ModuleType) -> None:
    answers = [
        Answer(0.0, 0.2, 1.0, 10, "pd"),
        Answer(0.0, 0.4, 1.0, 10, "pd"),
        Answer(0.0, 0.03, 0.5, 10, "decode-only"),
    ]
    spread = bench.client_latencies(answers)
    assert spread["client TTFT, PD route"] == (pytest.approx(0.4), pytest.approx(0.4), pytest.approx(0.3))
    assert spread["client TTFT, decode only"][2] == pytest.approx(0.03)


def test_each_requests_outcome_is_set_beside_its_replay(bench: ModuleType) -> None:
    requests = [Request(0.0, 3000, 10), Request(0.5, 100, 10)]
    answers = [Answer(10.5, 0.03, 0.3, 10, "decode-only"), Answer(10.0, 0.4, 1.0, 10, "pd")]
    replayed = [Job(requests[1], "decode-only"), Job(requests[0], "pd")]
    replayed[0].first_token, replayed[1].first_token = 0.52, 0.2
    rows = bench.per_request(requests, answers, replayed)
    assert [row[:3] for row in rows] == [[0.0, 3000, 10], [0.5, 100, 10]]
    assert [row[3] for row in rows] == [0.4, 0.03], "answers are matched in the order they were sent"
    assert [row[6] for row in rows] == [0.2, 0.02]
    assert [row[8] for row in rows] == ["pd", "decode-only"]
    # A failed request leaves one answer fewer: no cluster column rather than a wrong one.
    assert all(row[3] is None for row in bench.per_request(requests, answers[:1], replayed))


def test_the_replay_takes_the_operators_tick_phase_and_control_delay(bench: ModuleType) -> None:
    # Ticks from before the load (negative times) do not count; the phase is the first tick after time 0.
    ticks = [-0.7, 1.3, 3.3, 5.31]
    assert bench.tick_phase(ticks, 2.0) == pytest.approx(1.3)
    assert bench.tick_phase([2.5], 2.0) == pytest.approx(0.5)
    assert bench.tick_phase([], 2.0) is None
    # The router's first value is where it started; each change after it is timed from the last tick before it.
    used = [(0.0, 256), (3.6, 512), (5.9, 1024)]
    assert bench.control_delay(ticks, used) == pytest.approx((0.3 + 0.59) / 2)
    assert bench.control_delay(ticks, used[:1]) == 0.0


def operator_exposition(tick: float | None, reasons: dict[str, float], prefill_ttft: float | None = None) -> str:
    """The operator's /metrics as prometheus_client writes them, with the autoscaler series TickLog reads."""
    registry = CollectorRegistry()
    labels = ["namespace", "pdservice"]
    stamp = Gauge("pdserve_autoscaler_last_tick_timestamp_seconds", "tick", labels, registry=registry)
    counted = Counter("pdserve_autoscaler_threshold_decisions", "decisions", [*labels, "reason"], registry=registry)
    latency = Gauge("pdserve_autoscaler_observed_latency_seconds", "latency", [*labels, "kind"], registry=registry)
    if tick is not None:
        stamp.labels("replay", "live").set(tick)
    for reason, count in reasons.items():
        counted.labels("replay", "live", reason).inc(count)
    if prefill_ttft is not None:
        latency.labels("replay", "live", "prefill_ttft").set(prefill_ttft)
    return generate_latest(registry).decode()


def test_the_operators_ticks_are_read_from_its_metrics() -> None:
    log = TickLog()
    log.see(operator_exposition(1000.5, {"Configured": 3.0}), 1000.0)
    log.see(operator_exposition(1000.5, {"Configured": 3.0}), 1000.0)  # no new tick between two reads
    log.see(operator_exposition(1002.5, {"Configured": 3.0, "PrefillShort": 1.0}), 1000.0)
    log.see(operator_exposition(1004.5, {"Configured": 4.0, "PrefillShort": 1.0}, prefill_ttft=0.4), 1000.0)
    log.see(operator_exposition(None, {}), 1000.0)  # the loop's series gone: no tick
    assert [(tick.at, tick.reason) for tick in log.ticks] == [
        (0.5, "Configured"),
        (2.5, "PrefillShort"),
        (4.5, "Configured"),
    ]
    assert [tick.seen for tick in log.ticks] == [{}, {}, {"observed_latency_seconds:prefill_ttft": 0.4}]


def test_the_replay_reads_data_as_old_as_the_operators_last_scrape(bench: ModuleType) -> None:
    # Ticks at 1000.3 + 2k (Unix), the prefill engine scraped at ...0.8 every second: each tick reads data 0.5 s old.
    ticks = [0.3, 2.3]
    assert bench.metrics_lag(ticks, 1000.0, {"prefill": 1131.8, "router": 1131.1}, 1.0) == pytest.approx(0.5)
    assert bench.metrics_lag(ticks, 1000.0, {"prefill": 1131.2}, 1.0) == pytest.approx(0.1)
    # Nothing to go by: half a scrape interval (the mean over a random phase).
    assert bench.metrics_lag([], 1000.0, {"prefill": 1131.8}, 1.0) == 0.5
    assert bench.metrics_lag(ticks, 1000.0, {}, 2.0) == 1.0
