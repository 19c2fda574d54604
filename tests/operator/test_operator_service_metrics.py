"""Per-PDService series from the operator's cache: conditions and SLO targets, as dashboards and alerts read them."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve_dev.testing.metrics import series
from pdserve_operator.metrics import OperatorMetrics
from pdserve_operator.service_metrics import CONDITION, SLO_OBJECTIVE, SLO_TARGET, PDServiceCollector, slo_series
from pdserve_operator.store import Store


def pdservice(name: str, *, slo: Any = None, conditions: dict[str, str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"namespace": "team-a", "name": name, "resourceVersion": "1"},
        "spec": {"model": {"name": "m"}} | ({"slo": slo} if slo is not None else {}),
    }
    if conditions is not None:
        body["status"] = {"conditions": [{"type": t, "status": s, "reason": "R"} for t, s in conditions.items()]}
    return body


def exposed(store: Store, leader: bool = True) -> str:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(PDServiceCollector(store, lambda: leader))
    return generate_latest(registry).decode()


def test_each_condition_is_one_series_per_status_with_the_current_one_at_1() -> None:
    store = Store()
    store.put_owner(pdservice("chat", conditions={"Stalled": "True", "Ready": "False"}))
    text = exposed(store)
    stalled = {labels["status"]: value for labels, value in series(text, CONDITION, type="Stalled")}
    ready = {labels["status"]: value for labels, value in series(text, CONDITION, type="Ready")}
    assert stalled == {"True": 1.0, "False": 0.0, "Unknown": 0.0}
    assert ready == {"True": 0.0, "False": 1.0, "Unknown": 0.0}
    assert {(labels["namespace"], labels["pdservice"]) for labels, _ in series(text, CONDITION)} == {("team-a", "chat")}


def test_slo_targets_name_the_router_bucket_that_counts_as_within_target() -> None:
    store = Store()
    store.put_owner(pdservice("chat", slo={"ttftMilliseconds": 800, "itlMilliseconds": 50, "percentile": 99}))
    text = exposed(store)
    targets = {(labels["kind"], labels["le"]): value for labels, value in series(text, SLO_TARGET)}
    # 800 ms lies between the 0.75 and 1.0 buckets: the SLI reads the stricter one; 50 ms is a bound itself.
    assert targets == {("ttft", "0.75"): 0.8, ("itl", "0.05"): 0.05}
    assert series(text, SLO_OBJECTIVE) == [({"namespace": "team-a", "pdservice": "chat"}, 0.99)]


@pytest.mark.parametrize(
    ("slo", "targets", "objective"),
    [
        ({"ttftMilliseconds": 500}, [("ttft", "0.5", 0.5)], 0.9),  # percentile's default: p90
        ({"itlMilliseconds": 0.2, "percentile": 50}, [("itl", "0.001", 0.0002)], 0.5),  # below the first bound
        ({"ttftMilliseconds": 10_000_000}, [("ttft", "2560.0", 10_000.0)], 0.9),  # above the last bound
        ({"percentile": 95}, [], None),  # no target: no objective either
        (None, [], None),
    ],
)
def test_slo_series(slo: Any, targets: list[tuple[str, str, float]], objective: float | None) -> None:
    assert slo_series(slo) == (targets, objective)


def test_a_pdservice_whose_slo_does_not_parse_exports_conditions_but_no_targets() -> None:
    store = Store()
    store.put_owner(pdservice("bad", slo={"ttftMilliseconds": -1}, conditions={"Stalled": "True"}))
    store.put_owner(pdservice("good", slo={"ttftMilliseconds": 500}))
    text = exposed(store)
    assert [labels["pdservice"] for labels, _ in series(text, SLO_TARGET)] == ["good"]
    assert {labels["pdservice"] for labels, _ in series(text, CONDITION)} == {"bad"}


def test_only_the_leader_exports_and_a_deleted_pdservice_leaves() -> None:
    store = Store()
    store.put_owner(pdservice("chat", slo={"ttftMilliseconds": 500}, conditions={"Ready": "True"}))
    assert series(exposed(store, leader=False), CONDITION) == []
    assert series(exposed(store, leader=False), SLO_TARGET) == []
    assert len(series(exposed(store), CONDITION)) == 3
    store.delete_owner("team-a", "chat")
    assert series(exposed(store), CONDITION) == [] and series(exposed(store), SLO_TARGET) == []


def test_registering_reads_nothing_from_the_cache() -> None:
    """describe() gives the names; collect() (which reads the cache) runs only when scraped."""

    class Counting(Store):
        reads = 0

        def owners(self) -> list[tuple[tuple[str, str], dict[str, Any]]]:
            Counting.reads += 1
            return super().owners()

    metrics = OperatorMetrics()
    metrics.registry.register(PDServiceCollector(Counting(), lambda: True))
    assert Counting.reads == 0
    generate_latest(metrics.registry)
    assert Counting.reads == 1
