"""Root conftest: the session-scoped `cluster` fixture for tests marked `@pytest.mark.cluster`.

The fixture starts one LocalCluster for the whole session (default topology, plus the process node when
its module is installed), building the binaries first if they are not cached. Environment knobs:

- PDSERVE_CLUSTER_KUBECONFIG=path: use an already running cluster instead (e.g. one from
  `pdserve dev cluster up`) for fast local iteration; nothing is started or stopped then.
- PDSERVE_CLUSTER_TOPOLOGY=default|minimal|large|none: the simulated GPU nodes.
- PDSERVE_CLUSTER_PROCESS_NODE=0|1: force the process node off or on.

The session-scoped `prometheus` fixture (a `pdserve_dev.testing.prometheus.PrometheusHelper`) starts the
cluster's Prometheus the first time a test asks for it; it stops with the cluster. With a reused cluster it
attaches to `$PDSERVE_PROMETHEUS_URL` or to the Prometheus of `pdserve dev cluster up --prometheus` (starting one
there if that cluster has none).

Run only the quick tier with `pytest -m "not cluster"`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve_dev.cluster import build, netns
from pdserve_dev.cluster.build import CLUSTER_BINARIES, PROMETHEUS_BINARIES
from pdserve_dev.cluster.cluster import PROCESS_NODE_MODULE, LocalCluster
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.prometheus import PrometheusHelper


def pytest_configure(config: pytest.Config) -> None:
    """Run the whole session in a private network namespace holding only loopback (pdserve_dev.cluster.netns):
    nothing a test starts can reach beyond this machine, and the cluster's pod addresses exist only there.
    Without root the session stays where it is and the cluster falls back to loopback pod addresses."""
    # A reused cluster (PDSERVE_CLUSTER_KUBECONFIG) lives in the caller's namespace: stay there with it.
    stay = os.environ.get("PDSERVE_TEST_HOST_NETWORK") or os.environ.get("PDSERVE_CLUSTER_KUBECONFIG")
    if netns.should_isolate() and not stay:
        params = config.invocation_params
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.stop_global_capturing()  # give the new process the real stdout/stderr back
        os.chdir(params.dir)
        netns.exec_in_fresh([sys.executable, "-m", "pytest", *params.args])


def _want_process_node() -> bool:
    forced = os.environ.get("PDSERVE_CLUSTER_PROCESS_NODE")
    if forced is not None:
        return forced.strip().lower() not in ("0", "false", "no", "")
    return importlib.util.find_spec(f"{PROCESS_NODE_MODULE}.__main__") is not None


_build_errors: list[str] = []
_prometheus_build_errors: list[str] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    # Build missing binaries here, before any test starts: a cold build takes 10-20 minutes, far beyond the
    # per-test timeout that would otherwise cover the fixture's setup.
    wants_cluster = any(item.get_closest_marker("cluster") for item in session.items)
    # Cluster tests start Prometheus too (the `prometheus` fixture, the teardown tests): build it with the cluster.
    wants_prometheus = wants_cluster or any("prometheus" in getattr(item, "fixturenames", ()) for item in session.items)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def log(message: str) -> None:
        if reporter is not None:
            reporter.write_line(message)

    if wants_cluster and not os.environ.get("PDSERVE_CLUSTER_KUBECONFIG") and build.missing_binaries(CLUSTER_BINARIES):
        try:
            build.ensure_binaries(CLUSTER_BINARIES, log=log)
        except build.BuildError as exc:
            # Let the other tests run; every cluster test then fails with this message.
            _build_errors.append(str(exc))
            log(f"Could not build the cluster binaries: {exc}")
    if wants_prometheus and build.missing_binaries(PROMETHEUS_BINARIES):
        try:
            build.ensure_binaries(PROMETHEUS_BINARIES, log=log)
        except build.BuildError as exc:
            _prometheus_build_errors.append(str(exc))
            log(f"Could not build Prometheus: {exc}")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the lanes of scripts/test.sh select by this marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `own_cluster` every `cluster` test that does not use the session's cluster (it starts one of its own, as
    the chaos benchmark and the demo do, or needs only the built binaries), so it can run beside the session's."""
    for item in items:
        if item.get_closest_marker("cluster") and "cluster" not in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.own_cluster)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # The cluster costs ~15 s and two busy cores: a test must opt in with the marker, so that
    # `pytest -m "not cluster"` is guaranteed never to start it.
    if "cluster" in getattr(item, "fixturenames", ()) and item.get_closest_marker("cluster") is None:
        pytest.fail(f"{item.nodeid} uses the `cluster` fixture but is not marked @pytest.mark.cluster")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHelper]:
    """A running cluster for the session, stopped at the end (also on failure or Ctrl-C)."""
    if _build_errors:
        pytest.fail(f"Could not build the cluster binaries: {_build_errors[0]}", pytrace=False)
    reuse = os.environ.get("PDSERVE_CLUSTER_KUBECONFIG")
    if reuse:
        yield ClusterHelper(kubeconfig=Path(reuse).expanduser().resolve())
        return
    workdir = tmp_path_factory.mktemp("cluster", numbered=True)
    local = LocalCluster(
        workdir,
        topology=os.environ.get("PDSERVE_CLUSTER_TOPOLOGY", "default"),
        process_node=_want_process_node(),
        log=print,
    )
    with local:
        yield ClusterHelper.from_cluster(local)


@pytest.fixture(scope="session")
def prometheus(cluster: ClusterHelper) -> PrometheusHelper:
    """The session cluster's real Prometheus, started on first use; it stops with the cluster."""
    if _prometheus_build_errors:
        pytest.fail(f"Could not build Prometheus: {_prometheus_build_errors[0]}", pytrace=False)
    if cluster.local is None:
        return PrometheusHelper.from_environment(cluster.kubeconfig)
    return PrometheusHelper.for_cluster(cluster.local)
