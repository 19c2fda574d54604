"""The chaos benchmark's quick run, as CI runs it: `bench/chaos.py --quick --json FILE` as a subprocess, then
issue 13's floors asserted from the JSON it wrote (not from its exit status alone, so a benchmark that stopped
judging would still fail here).

The benchmark starts its own local cluster (the process node running the engines, the router and the operator),
so this test needs the cluster binaries (the `cluster` marker builds them) but not the session's cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1500)]

SCENARIOS = [
    "scale-down-decode",
    "prefill-killed",
    "scale-down-prefill",
    "decode-scale-and-replace",
    "decode-killed",
    "rolling-update",
    "operator-restart",
    "apiserver-restart",
    "router-replica-killed",
    "prefill-killed-store",
]
KILLED = {"prefill-killed", "decode-killed"}
KEYS = ["name", "sent", "succeeded", "failed_told", "lost", "duplicated_tokens", "worst_ttft_ms"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("chaos") / "chaos.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=1400,
        check=False,
        cwd=ROOT,
    )
    print(proc.stdout[-6000:])
    assert out.exists(), f"no JSON written (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    scenarios: list[dict[str, Any]] = json.loads(out.read_text())["scenarios"]
    return proc, scenarios


def test_every_scenario_ran_and_reports_the_contract_keys(
    run: tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]],
) -> None:
    _, scenarios = run
    assert [s["name"] for s in scenarios] == SCENARIOS
    for scenario in scenarios:
        assert list(scenario)[: len(KEYS)] == KEYS
        assert scenario["sent"] > 0, scenario
        assert scenario["worst_ttft_ms"] > 0, scenario


def test_nothing_is_lost_and_no_stream_repeats_or_skips_a_token(
    run: tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]],
) -> None:
    _, scenarios = run
    for scenario in scenarios:
        assert scenario["lost"] == 0, scenario
        assert scenario["duplicated_tokens"] == 0, scenario
        # Every request ended one way or the other.
        ended = scenario["succeeded"] + scenario["failed_told"] + scenario["lost"] + scenario["duplicated_tokens"]
        assert ended == scenario["sent"], scenario


def test_only_a_killed_pod_fails_requests_and_only_streams_it_had_started(
    run: tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]],
) -> None:
    _, scenarios = run
    for scenario in scenarios:
        if scenario["name"] in KILLED:
            assert set(scenario["failure_kinds"]) <= {"stream-after-tokens"}, scenario
        else:
            assert scenario["failed_told"] == 0, scenario


def test_every_floor_holds_and_the_benchmark_says_so(
    run: tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]],
) -> None:
    proc, scenarios = run
    missed = {s["name"]: s["missed"] for s in scenarios if s["missed"]}
    assert not missed, f"{missed}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, proc.stderr[-3000:]
