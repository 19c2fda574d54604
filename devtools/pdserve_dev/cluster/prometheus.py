"""A real Prometheus server beside the local cluster: discovers pdserve's engine and router pods and scrapes them.

Tests, the demo and the autoscaler's benchmark read metrics the way users' clusters do: PromQL against a
Prometheus that found the pods through the Kubernetes API, never a hand-made list. What it does:

- **Where**: it runs in the cluster's network namespace (it is started by whoever runs the cluster, which already
  lives there), on 127.0.0.1 with a free port, its TSDB in `<cluster workdir>/prometheus/data`, its log in
  `<cluster workdir>/logs/prometheus.log` and its PID in the cluster's `pids/`, so `down` and the cluster's
  teardown stop it like every other component (first, since it started last).
- **Discovery**: `kubernetes_sd_configs` role `pod` against the local API server, through a kubeconfig of its own
  identity (`pdserve-dev:prometheus`) bound to a read-only ClusterRole (`rbac_objects`): the rights the chart
  will give a Prometheus, no more. Role `pod` rather than `endpointslice` because an engine that is not Ready
  (starting, or failing its probe) still serves `/metrics`, and the autoscaler must see it.
- **What is scraped** (job `pdserve-pods`): pods carrying `pdserve.io/role` (everything the renderer makes:
  prefill and decode engines, routers), engines on their container port named `http` (vLLM serves `/metrics`
  there) and routers on their port named `metrics` (a router never serves metrics to its clients), unless the pod
  has finished (Succeeded/Failed).
- **Target labels** (`TARGET_LABELS`): `namespace`, `pod`, `pool` (the pod's `pdserve.io/role`: prefill, decode,
  router) and `pdservice` (its `app.kubernetes.io/instance`, the PDService's name). Not `role`: the router's own
  per-endpoint metrics already carry a `role` label (the engine's role), which a target label of that name would
  rename to `exported_role`. Queries should select on these labels, not on `job`, so they also work with the
  chart's PodMonitor (whose job label differs).
- **Rules**: `rule_files` reads `<root>/rules/*.yaml`; `add_rule_file` writes one (e.g. the chart's alerts, which
  the monitoring tests load to see them evaluated) and `reload` makes Prometheus read it: rule files, unlike
  file_sd targets, are only read at start and on reload.
- **Static targets** (job given per target): processes outside the cluster, such as the operator run as a host
  process, are added with `add_static_target`, which writes a `file_sd` file; Prometheus notices it within a
  second or two, no reload needed.
- **Liveness of series**: a deleted pod leaves discovery, Prometheus writes staleness markers for its series at
  once, and instant queries stop returning them (the autoscaler's "only live pods count").

Scrape and evaluation interval 1 s: tests and the demo want answers within seconds, and a local cluster holds few
targets. The first scrape still lands 5-10 s after start (discovery batches updates every 5 s).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import yaml

from pdserve_dev.cluster.certs import CLIENTS
from pdserve_dev.testing.net import http_ok

COMPONENT = "prometheus"
"""Process name in the cluster's `pids/` and `logs/`."""

POD_JOB = "pdserve-pods"
"""The job that scrapes engine and router pods."""

SCRAPE_INTERVAL = "1s"

TARGET_LABELS: dict[str, str] = {
    "namespace": "__meta_kubernetes_namespace",
    "pod": "__meta_kubernetes_pod_name",
    "pool": "__meta_kubernetes_pod_label_pdserve_io_role",
    "pdservice": "__meta_kubernetes_pod_label_app_kubernetes_io_instance",
}
"""Label on every series of a pdserve pod -> the discovery meta label it is copied from."""

METRICS_PORT_NAMES: dict[str, str] = {"prefill": "http", "decode": "http", "router": "metrics"}
"""The container port scraped, by the pod's role: the engines' serving port, the router's own metrics port (the
names the renderer gives them)."""

IDENTITY = next(client.user for client in CLIENTS if client.file_stem == COMPONENT)
"""The user name in Prometheus' client certificate (`certs.CLIENTS`), bound to `CLUSTER_ROLE`."""

CLUSTER_ROLE = "pdserve-dev:prometheus"

READ_RESOURCES: dict[str, list[str]] = {
    "": ["pods", "services", "endpoints", "nodes", "namespaces"],
    "discovery.k8s.io": ["endpointslices"],
}
"""What Kubernetes service discovery may read: the resources of its roles pod, service, endpoints, node and
endpointslice (the same list prometheus-community's chart grants)."""


def pod_relabel_configs() -> list[dict[str, Any]]:
    """The relabelling of the `pdserve-pods` job (see the module docstring); the chart's PodMonitor mirrors it."""
    keep: list[dict[str, Any]] = [
        {"source_labels": [TARGET_LABELS["pool"]], "regex": ".+", "action": "keep"},
        {
            "source_labels": [TARGET_LABELS["pool"], "__meta_kubernetes_pod_container_port_name"],
            "separator": ";",
            "regex": "|".join(f"{role};{port}" for role, port in METRICS_PORT_NAMES.items()),
            "action": "keep",
        },
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Succeeded|Failed", "action": "drop"},
    ]
    copy = [{"source_labels": [meta], "target_label": label} for label, meta in TARGET_LABELS.items()]
    return keep + copy


def render_config(kubeconfig: Path, file_sd_dir: Path, rules_dir: Path | None = None) -> dict[str, Any]:
    """prometheus.yml: the pod job through `kubeconfig`, file-based static targets from `file_sd_dir`, and the rule
    files in `rules_dir` (none without it)."""
    rules = {"rule_files": [str(rules_dir / "*.yaml")]} if rules_dir is not None else {}
    return {
        "global": {
            "scrape_interval": SCRAPE_INTERVAL,
            # A scrape may not take longer than the interval; local targets answer in milliseconds.
            "scrape_timeout": SCRAPE_INTERVAL,
            "evaluation_interval": SCRAPE_INTERVAL,
        },
        **rules,
        "scrape_configs": [
            {
                "job_name": POD_JOB,
                "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kubeconfig)}],
                "relabel_configs": pod_relabel_configs(),
            },
            {
                # Each file names its own `job` label (Prometheus sets the job name only where a target has none).
                "job_name": "static",
                "file_sd_configs": [{"files": [str(file_sd_dir / "*.json")], "refresh_interval": "30s"}],
            },
        ],
    }


def rbac_objects() -> list[dict[str, Any]]:
    """A read-only ClusterRole for service discovery, bound to Prometheus' user."""
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": CLUSTER_ROLE},
            "rules": [
                {"apiGroups": [group], "resources": resources, "verbs": ["get", "list", "watch"]}
                for group, resources in READ_RESOURCES.items()
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": CLUSTER_ROLE},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": CLUSTER_ROLE},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": IDENTITY}],
        },
    ]


def apply_rbac(api: Any) -> None:
    """Create (or update) `rbac_objects()` through a `kubernetes.client.ApiClient`."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    rbac = client.RbacAuthorizationV1Api(api)
    role, binding = rbac_objects()
    # The client accepts plain dicts as bodies; its annotations name the generated model classes.
    try:
        rbac.create_cluster_role(cast(Any, role))
    except ApiException as exc:
        if exc.status != 409:
            raise
        rbac.replace_cluster_role(CLUSTER_ROLE, cast(Any, role))
    try:
        rbac.create_cluster_role_binding(cast(Any, binding))
    except ApiException as exc:
        if exc.status != 409:
            raise
        rbac.replace_cluster_role_binding(CLUSTER_ROLE, cast(Any, binding))


@dataclass(frozen=True)
class PrometheusPaths:
    """Where one cluster's Prometheus keeps its files (all under `<cluster workdir>/prometheus`)."""

    cluster_workdir: Path

    @property
    def root(self) -> Path:
        return self.cluster_workdir / "prometheus"

    @property
    def config(self) -> Path:
        return self.root / "prometheus.yml"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def file_sd(self) -> Path:
        return self.root / "file_sd"

    @property
    def rules(self) -> Path:
        return self.root / "rules"

    @property
    def log(self) -> Path:
        return self.cluster_workdir / "logs" / f"{COMPONENT}.log"


def url_of(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def argv(binary: Path, paths: PrometheusPaths, port: int) -> list[str]:
    """The command line: loopback only, a short retention (a test cluster's data is throw-away)."""
    return [
        str(binary),
        f"--config.file={paths.config}",
        f"--storage.tsdb.path={paths.data}",
        "--storage.tsdb.retention.time=1d",
        f"--web.listen-address=127.0.0.1:{port}",
        # /-/reload and /-/quit: a test may reconfigure or stop it over HTTP (it is reachable from loopback only).
        "--web.enable-lifecycle",
        "--log.level=info",
    ]


def write_config(paths: PrometheusPaths, kubeconfig: Path) -> None:
    """Write prometheus.yml and create the data, file_sd and rules folders; the TSDB and rule files of an earlier
    run are wiped."""
    shutil.rmtree(paths.data, ignore_errors=True)
    shutil.rmtree(paths.rules, ignore_errors=True)
    for folder in (paths.file_sd, paths.data, paths.rules):
        folder.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(yaml.safe_dump(render_config(kubeconfig, paths.file_sd, paths.rules), sort_keys=False))


def ready(url: str, timeout: float = 2.0) -> bool:
    """True once Prometheus answers /-/ready (TSDB open, config loaded)."""
    return http_ok(f"{url}/-/ready", timeout)


def add_static_target(file_sd_dir: Path, job: str, address: str, labels: Mapping[str, str] | None = None) -> Path:
    """Have Prometheus scrape `address` (host:port, path /metrics) as job `job`; replaces that job's targets.

    Written to a temporary name first, then renamed, so Prometheus never reads a half-written file.
    """
    _plain_name(job, "job")
    group = [{"targets": [address], "labels": {**(labels or {}), "job": job}}]
    path = file_sd_dir / f"{job}.json"
    tmp = file_sd_dir / f".{job}.json.tmp"
    file_sd_dir.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(group, indent=2) + "\n")
    tmp.replace(path)
    return path


def _plain_name(name: str, what: str) -> None:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"A {what} name must be a plain file name, got {name!r}")


def add_rule_file(rules_dir: Path, name: str, text: str) -> Path:
    """Write rule file `<name>.yaml` (Prometheus' rule file format) atomically; `reload` makes Prometheus read it."""
    _plain_name(name, "rule file")
    rules_dir.mkdir(parents=True, exist_ok=True)
    path, tmp = rules_dir / f"{name}.yaml", rules_dir / f".{name}.yaml.tmp"
    tmp.write_text(text)
    tmp.replace(path)
    return path


def remove_rule_file(rules_dir: Path, name: str) -> None:
    """Delete rule file `<name>.yaml` (effective at the next `reload`)."""
    with contextlib.suppress(FileNotFoundError):
        (rules_dir / f"{name}.yaml").unlink()


def reload(url: str, timeout: float = 30.0) -> None:
    """POST /-/reload (the server runs with --web.enable-lifecycle): re-read the config and every rule file.
    Prometheus answers 500 with its error when a file does not load; that is raised here."""
    request = urllib.request.Request(f"{url}/-/reload", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            pass
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"Prometheus refused to reload: {exc.read().decode(errors='replace').strip()}") from exc


def remove_static_target(file_sd_dir: Path, job: str) -> None:
    """Stop scraping the static targets of `job` (their series go stale)."""
    with contextlib.suppress(FileNotFoundError):
        (file_sd_dir / f"{job}.json").unlink()
