"""Replay traces (loading, slicing, compression, rate scaling, the synthetic shape) and Prometheus' quantile."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from pdserve_dev.replay import histogram
from pdserve_dev.replay.histogram import Histogram
from pdserve_dev.replay.trace import Request, load_azure, shape, synthetic, windows

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:50.0000000,100,10
2023-11-16 18:15:46.5000000,2000,20
2023-11-16 18:16:10.2500000,0,5
2023-11-16 18:17:46.5000000,300,30
"""


def test_load_azure_sorts_and_starts_at_zero(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(CSV)
    trace = load_azure(path)
    assert [r.arrival for r in trace] == pytest.approx([0.0, 3.5, 23.75, 120.0])
    assert [(r.prompt, r.output) for r in trace] == [(2000, 20), (100, 10), (1, 5), (300, 30)]


def test_load_azure_reads_a_gzipped_trace(tmp_path: Path) -> None:
    plain, packed = tmp_path / "trace.csv", tmp_path / "trace.csv.gz"
    plain.write_text(CSV)
    packed.write_bytes(gzip.compress(CSV.encode()))
    assert load_azure(packed) == load_azure(plain)


TRACE = [Request(float(t), 100 + t, 1 + t % 7) for t in range(0, 600, 2)]


def test_slice_and_compression() -> None:
    out = shape(TRACE, start_s=100.0, duration_s=200.0, compression=4.0)
    assert len(out) == 100
    assert out[0].arrival == 0.0 and out[-1].arrival == pytest.approx(198 / 4)
    assert (out[0].prompt, out[-1].prompt) == (200, 398)


@pytest.mark.parametrize("scale", [3.0, 2.5])
def test_rate_scaling_keeps_the_shape(scale: float) -> None:
    out = shape(TRACE, rate_scale=scale, jitter_s=10.0, mix_s=20.0, seed=3)
    assert len(out) == pytest.approx(scale * len(TRACE), rel=0.05)
    assert out == sorted(out, key=lambda r: r.arrival)
    # Every minute of the trace still carries its share of the traffic (companions stay within 10 s).
    for start in range(0, 540, 60):
        original = sum(1 for r in TRACE if start <= r.arrival < start + 60)
        scaled = sum(1 for r in out if start <= r.arrival < start + 60)
        assert scaled == pytest.approx(scale * original, rel=0.25)
    # Companions take lengths from requests within 20 s of their original (prompt encodes the arrival here).
    assert all(abs((r.prompt - 100) - r.arrival) <= 20.0 + 10.0 for r in out)


def test_synthetic_shape() -> None:
    lengths = [Request(0.0, 500, 50)]
    out = synthetic(duration_s=1000.0, base_rate=20.0, lengths=lengths, seed=4)

    def rate(start: float, end: float) -> float:
        return sum(1 for r in out if start <= r.arrival < end) / (end - start)

    assert rate(0, 150) == pytest.approx(20.0, rel=0.15)
    assert rate(150, 300) == pytest.approx(40.0, rel=0.15)  # the step
    assert rate(800, 850) == pytest.approx(50.0, rel=0.15)  # the burst
    assert rate(850, 1000) == pytest.approx(20.0, rel=0.15)
    assert rate(300, 320) > rate(430, 450)  # the ramp down


def test_windows_find_the_busiest_minute() -> None:
    trace = [Request(1.0, 100, 10), Request(61.0, 100, 10), Request(62.0, 300, 30), Request(63.0, 500, 50)]
    first, second = windows(trace, 60.0, percentile=90)
    assert first.requests_per_s == pytest.approx(1 / 60)
    assert second.prompt_tokens_per_s == pytest.approx(900 / 60)
    assert second.output_tokens_per_s == pytest.approx(90 / 60)
    assert second.prompt_tokens_quantile == 500


QUANTILES = [
    # (counts per bucket for bounds (1, 2, 4) and +Inf, q, Prometheus' answer)
    ([0, 10, 0, 0], 0.5, 1.5),  # interpolated inside (1, 2]
    ([10, 0, 0, 0], 0.9, 0.9),  # the first bucket starts at 0
    ([5, 5, 0, 0], 0.75, 1.5),
    ([0, 0, 0, 4], 0.5, 4.0),  # in +Inf: the largest finite bound
    ([0, 0, 0, 0], 0.9, None),  # no observations: no answer (PromQL's NaN)
]


@pytest.mark.parametrize(("counts", "q", "expected"), QUANTILES)
def test_quantile_is_prometheus_histogram_quantile(counts: list[int], q: float, expected: float | None) -> None:
    assert histogram.quantile(q, (1.0, 2.0, 4.0), counts) == (expected if expected is None else pytest.approx(expected))


def test_histogram_windows_and_merges() -> None:
    h = Histogram((1.0, 2.0))
    h.observe(0.5)
    before = h.snapshot()
    h.observe(1.5, times=3)
    h.observe(9.0)
    assert histogram.window(h.snapshot(), before) == [0, 3, 1]
    assert histogram.merge([[1, 0, 0], [0, 3, 1]], 3) == [1, 3, 1]
