"""The local Prometheus' configuration, RBAC and static targets, offline (no binaries, no cluster)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve_dev.cluster import build, certs, versions
from pdserve_dev.cluster import prometheus as prom
from pdserve_dev.cluster.cluster import ClusterState, cluster_status


def _job(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(job for job in config["scrape_configs"] if job["job_name"] == name)


def _relabel(rules: list[dict[str, Any]], meta: dict[str, str]) -> dict[str, str] | None:
    """Apply keep/drop/replace rules the way Prometheus does for these simple cases (anchored regexes).

    A model for fast table tests; the cluster tests check the same rules on Prometheus itself."""
    labels = dict(meta)
    for rule in rules:
        value = ";".join(labels.get(name, "") for name in rule["source_labels"])
        matched = re.fullmatch(rule.get("regex", "(.*)"), value) is not None
        action = rule.get("action", "replace")
        if action == "keep" and not matched:
            return None
        if action == "drop" and matched:
            return None
        if action == "replace" and matched and value:
            labels[rule["target_label"]] = value
    return {k: v for k, v in labels.items() if not k.startswith("__")}


POD_META = {
    "__meta_kubernetes_namespace": "team-a",
    "__meta_kubernetes_pod_name": "llama-decode-1",
    "__meta_kubernetes_pod_label_pdserve_io_role": "decode",
    "__meta_kubernetes_pod_label_app_kubernetes_io_instance": "llama",
    "__meta_kubernetes_pod_container_port_name": "http",
    "__meta_kubernetes_pod_phase": "Running",
}


def test_config_scrapes_every_second_through_the_kubeconfig(tmp_path: Path) -> None:
    config = prom.render_config(tmp_path / "prometheus.kubeconfig", tmp_path / "file_sd")
    assert config["global"] == {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    pods = _job(config, prom.POD_JOB)
    kubeconfig = str(tmp_path / "prometheus.kubeconfig")
    assert pods["kubernetes_sd_configs"] == [{"role": "pod", "kubeconfig_file": kubeconfig}]
    static = _job(config, "static")
    assert static["file_sd_configs"][0]["files"] == [str(tmp_path / "file_sd" / "*.json")]


def test_pdserve_pods_get_namespace_pod_pool_and_pdservice_labels() -> None:
    rules = prom.pod_relabel_configs()
    assert _relabel(rules, POD_META) == {
        "namespace": "team-a",
        "pod": "llama-decode-1",
        "pool": "decode",
        "pdservice": "llama",
    }
    # Not `role`: the router's per-endpoint metrics carry their own `role` label, which a target label of that
    # name would rename to exported_role.
    assert "role" not in prom.TARGET_LABELS


@pytest.mark.parametrize(
    "change",
    [
        {"__meta_kubernetes_pod_label_pdserve_io_role": ""},  # not a pdserve pod
        {"__meta_kubernetes_pod_container_port_name": "nixl"},  # the side channel, not the metrics port
        {"__meta_kubernetes_pod_phase": "Succeeded"},
        {"__meta_kubernetes_pod_phase": "Failed"},
        # A router serves no metrics on its client port.
        {"__meta_kubernetes_pod_label_pdserve_io_role": "router", "__meta_kubernetes_pod_container_port_name": "http"},
    ],
    ids=["other-pod", "other-port", "succeeded", "failed", "router-client-port"],
)
def test_other_pods_ports_and_finished_pods_are_not_scraped(change: dict[str, str]) -> None:
    assert _relabel(prom.pod_relabel_configs(), {**POD_META, **change}) is None


def test_routers_are_scraped_on_their_metrics_port() -> None:
    meta = {**POD_META, "__meta_kubernetes_pod_label_pdserve_io_role": "router"}
    labels = _relabel(prom.pod_relabel_configs(), {**meta, "__meta_kubernetes_pod_container_port_name": "metrics"})
    assert labels is not None and labels["pool"] == "router"


def test_pending_and_not_ready_pods_are_scraped() -> None:
    # An engine failing its readiness probe still serves /metrics, and the autoscaler must see it.
    assert _relabel(prom.pod_relabel_configs(), {**POD_META, "__meta_kubernetes_pod_phase": "Pending"}) is not None


def test_rbac_is_read_only_and_bound_to_the_client_certificate_user() -> None:
    role, binding = prom.rbac_objects()
    assert {verb for rule in role["rules"] for verb in rule["verbs"]} == {"get", "list", "watch"}
    assert any("pods" in rule["resources"] for rule in role["rules"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    [subject] = binding["subjects"]
    identity = next(c for c in certs.CLIENTS if c.file_stem == "prometheus")
    assert subject == {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": identity.user}
    assert identity.groups == ()  # no system:masters: only what the ClusterRole grants


def test_static_targets_are_file_sd_groups_carrying_their_job(tmp_path: Path) -> None:
    path = prom.add_static_target(tmp_path, "pdserve-operator", "127.0.0.1:9000", {"instance": "op-a"})
    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:9000"], "labels": {"instance": "op-a", "job": "pdserve-operator"}}
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["pdserve-operator.json"]  # no temporary file left behind
    prom.add_static_target(tmp_path, "pdserve-operator", "127.0.0.1:9001")
    assert json.loads(path.read_text())[0]["targets"] == ["127.0.0.1:9001"]
    prom.remove_static_target(tmp_path, "pdserve-operator")
    prom.remove_static_target(tmp_path, "pdserve-operator")
    assert list(tmp_path.iterdir()) == []
    for bad in ("", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="plain file name"):
            prom.add_static_target(tmp_path, bad, "127.0.0.1:9000")


def test_rule_files_are_read_from_the_rules_folder_written_atomically(tmp_path: Path) -> None:
    assert "rule_files" not in prom.render_config(tmp_path / "k", tmp_path / "file_sd")
    rules = tmp_path / "rules"
    assert prom.render_config(tmp_path / "k", tmp_path / "file_sd", rules)["rule_files"] == [str(rules / "*.yaml")]
    path = prom.add_rule_file(rules, "pdserve-alerts", "groups: []\n")
    assert path == rules / "pdserve-alerts.yaml" and path.read_text() == "groups: []\n"
    assert [p.name for p in rules.iterdir()] == ["pdserve-alerts.yaml"]  # no temporary file left behind
    prom.remove_rule_file(rules, "pdserve-alerts")
    prom.remove_rule_file(rules, "pdserve-alerts")
    assert list(rules.iterdir()) == []
    for bad in ("", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="plain file name"):
            prom.add_rule_file(rules, bad, "groups: []\n")


def test_write_config_wipes_the_rule_files_of_an_earlier_run(tmp_path: Path) -> None:
    paths = prom.PrometheusPaths(tmp_path)
    prom.add_rule_file(paths.rules, "stale", "groups: []\n")
    prom.write_config(paths, tmp_path / "prometheus.kubeconfig")
    assert paths.rules.is_dir() and list(paths.rules.iterdir()) == []
    assert yaml.safe_load(paths.config.read_text())["rule_files"] == [str(paths.rules / "*.yaml")]


def test_command_line_binds_loopback_and_keeps_data_in_the_cluster_workdir(tmp_path: Path) -> None:
    paths = prom.PrometheusPaths(tmp_path)
    argv = prom.argv(Path("/bin/prometheus"), paths, 9091)
    assert "--web.listen-address=127.0.0.1:9091" in argv
    assert f"--storage.tsdb.path={tmp_path / 'prometheus' / 'data'}" in argv
    assert paths.log == tmp_path / "logs" / "prometheus.log"


def test_status_reports_a_recorded_prometheus_that_no_longer_runs(tmp_path: Path) -> None:
    state = ClusterState(
        workdir=str(tmp_path),
        server="https://127.0.0.1:1",
        kubeconfig=str(tmp_path / "kubeconfig"),
        topology="minimal",
        process_node=False,
        bin_dir=str(tmp_path),
        etcd_port=1,
        etcd_peer_port=2,
        apiserver_port=1,
        controller_manager_port=3,
        scheduler_port=4,
        network={},
        started_ticks=0,
        prometheus_port=1,
    )
    state.save()
    certs.generate_pki(tmp_path / "pki", "198.19.128.1")
    info = cluster_status(tmp_path)
    assert info["running"] is False
    assert info["prometheus"] == {"url": "http://127.0.0.1:1", "ready": False}


def test_state_files_written_before_prometheus_existed_still_load(tmp_path: Path) -> None:
    older = {
        "workdir": str(tmp_path),
        "server": "https://127.0.0.1:1",
        "kubeconfig": "k",
        "topology": "minimal",
        "process_node": False,
        "bin_dir": "b",
        "etcd_port": 1,
        "etcd_peer_port": 2,
        "apiserver_port": 3,
        "controller_manager_port": 4,
        "scheduler_port": 5,
        "network": {},
        "started_ticks": 0,
        "startup_seconds": 1.0,
    }
    (tmp_path / "state.json").write_text(json.dumps(older))
    state = ClusterState.load(tmp_path)
    assert state is not None and state.prometheus_url is None


def test_prometheus_has_its_own_cache_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A Prometheus bump must not rebuild Kubernetes (12 minutes cold), nor a Kubernetes bump Prometheus.
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    k8s, prometheus = versions.cache_key(), versions.cache_key(versions.PROMETHEUS)
    assert prometheus.startswith(versions.PROMETHEUS_VERSION + "-")
    monkeypatch.setattr(versions, "PROMETHEUS_VERSION", "v3.15.0")
    assert versions.cache_key() == k8s
    assert versions.cache_key(versions.PROMETHEUS) != prometheus
    monkeypatch.undo()
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(versions, "ETCD_VERSION", "v3.6.15")
    assert versions.cache_key(versions.PROMETHEUS) == prometheus
    monkeypatch.undo()
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert build.bin_dir(toolset=versions.PROMETHEUS) == tmp_path / "prometheus" / prometheus / "bin"
    assert build.missing_binaries(build.PROMETHEUS_BINARIES) == ["prometheus"]
    with pytest.raises(build.BuildError, match=re.escape(str(tmp_path / "prometheus"))):
        build.binary("promtool")


def test_prometheus_module_version_follows_the_release() -> None:
    assert versions.prometheus_module_version("v3.16.0") == "v0.316.0"
    assert versions.prometheus_module_version("v3.5.1") == "v0.305.1"
    assert versions.prometheus_module_version("v2.53.4") == "v0.253.4"
    with pytest.raises(ValueError, match=r"like v3\.16\.0"):
        versions.prometheus_module_version("v3.16")
