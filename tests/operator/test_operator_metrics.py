"""The operator's metrics are owned by whoever runs it: nothing at import time, one registry per OperatorMetrics."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from prometheus_client import generate_latest

from pdserve_dev.testing.metrics import samples
from pdserve_operator.metrics import OperatorMetrics

# Contract: the names dashboards and alerts use (docs/operator.md); unchanged by the move into OperatorMetrics.
NAMES = {
    "pdserve_operator_reconciles_total",
    "pdserve_operator_reconcile_errors_total",
    "pdserve_operator_reconcile_duration_seconds_count",
    "pdserve_operator_api_requests_total",
    "pdserve_operator_writes_total",
    "pdserve_operator_lease_writes_total",
    "pdserve_operator_leader",
    "pdserve_operator_queue_depth",
    "pdserve_operator_cached_objects",
}


def test_importing_the_operator_creates_no_metrics_pools_or_threads() -> None:
    # In a fresh interpreter: import every module, then look for what only a runner may create.
    script = textwrap.dedent(
        """
        import concurrent.futures, importlib, pkgutil, threading
        import prometheus_client
        import pdserve_operator
        found = []
        for info in pkgutil.walk_packages(pdserve_operator.__path__, "pdserve_operator."):
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                if isinstance(value, (concurrent.futures.Executor, prometheus_client.metrics.MetricWrapperBase)):
                    found.append(f"{info.name}.{name}")
        found += [f.name for f in prometheus_client.REGISTRY.collect() if f.name.startswith("pdserve")]
        print(found, threading.active_count())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["[]", "1"], result.stdout + result.stderr


def test_each_instance_has_its_own_registry_with_the_contract_names() -> None:
    first, second = OperatorMetrics(), OperatorMetrics()  # the module-global version raised "Duplicated timeseries"
    first.reconciles.labels("noop").inc()
    first.reconcile_seconds.observe(0.01)
    for gauge in (first.leader, first.queue_depth, first.cached_objects):
        gauge.set(1)
    first.api_requests.labels("PATCH", "Service", "200").inc()
    first.writes.labels("apply", "Service").inc()
    first.lease_writes.inc()
    first.reconcile_errors.inc()
    exposed = {key.partition("{")[0] for key in samples(generate_latest(first.registry).decode())}
    assert exposed >= NAMES
    assert (
        samples(generate_latest(second.registry).decode()).get('pdserve_operator_reconciles_total{result="noop"}')
        is None
    )


def test_process_metrics_are_opt_in() -> None:
    names = {
        key.partition("{")[0]
        for key in samples(generate_latest(OperatorMetrics(process_metrics=True).registry).decode())
    }
    assert "process_resident_memory_bytes" in names or "python_info" in names
    assert "python_info" not in samples(generate_latest(OperatorMetrics().registry).decode())
