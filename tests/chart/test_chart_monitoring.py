"""The chart's monitoring objects offline: the alerts pass `promtool check rules` and their unit tests
(`promtool test rules`), every alert carries a severity and runbook text and is documented, the dashboard is the
generated one and its PromQL parses, and the PodMonitor and ServiceMonitor give series the labels the dashboard and
the alerts select on (the same as the local cluster's Prometheus). `test_monitoring_cluster.py` runs every
expression against a real Prometheus."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve_dev import dashboard
from pdserve_dev.cluster.prometheus import METRICS_PORT_NAMES, TARGET_LABELS
from pdserve_dev.testing.helm import template
from pdserve_dev.testing.promtool import promtool

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdserve"
ALERT_TESTS = Path(__file__).parent / "data" / "alerts-test.yaml"
MONITORING = CHART / "ci" / "monitoring-values.yaml"


def rule_groups(**values: Any) -> list[dict[str, Any]]:
    """The rendered PrometheusRule's groups."""
    objects = template(CHART, values={"monitoring.prometheusRule.enabled": True, **values})
    [rule] = [o for o in objects if o["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def alerts(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def write_rules(path: Path, groups: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------------------- alerts


def test_rendered_rules_pass_promtool_check(tmp_path: Path) -> None:
    values = yaml.safe_load(MONITORING.read_text())["monitoring"]["prometheusRule"]
    groups = rule_groups(**{"monitoring.prometheusRule.additionalAlertLabels": values["additionalAlertLabels"]})
    result = promtool("check", "rules", str(write_rules(tmp_path / "alerts.yaml", groups)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_alert_unit_tests_pass(tmp_path: Path) -> None:
    """`promtool test rules` over the rendered rules, annotations dropped (the cases compare labels only)."""
    groups = rule_groups()
    for rule in alerts(groups):
        rule.pop("annotations")
    write_rules(tmp_path / "alerts.yaml", groups)
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    result = promtool("test", "rules", ALERT_TESTS.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_where_it_fires() -> None:
    cases = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fired = {check["alertname"] for case in cases for check in case.get("alert_rule_test", []) if check["exp_alerts"]}
    assert fired == {rule["alert"] for rule in alerts(rule_groups())}


def test_every_alert_has_a_severity_runbook_text_and_a_readme_entry() -> None:
    readme = (CHART / "README.md").read_text()
    for rule in alerts(rule_groups()):
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), rule["alert"]
        assert len(rule["annotations"]["runbook"]) > 100, rule["alert"]
        assert f"`{rule['alert']}`" in readme, f"{rule['alert']} is not in the chart README"


def test_additional_alert_labels_go_on_alerts_not_on_recording_rules() -> None:
    groups = rule_groups(**{"monitoring.prometheusRule.additionalAlertLabels": {"team": "serving"}})
    rules = [rule for group in groups for rule in group["rules"]]
    assert all(rule["labels"]["team"] == "serving" for rule in rules if "alert" in rule)
    assert all("labels" not in rule for rule in rules if "record" in rule)
    assert all(rule["labels"]["severity"] for rule in rules if "alert" in rule)  # merged, not replaced


# ------------------------------------------------------------------------------------------------------- dashboard


def test_dashboard_is_the_generated_one() -> None:
    """Edit `pdserve_dev/dashboard.py` and run `python -m pdserve_dev.dashboard`, never the JSON."""
    assert dashboard.CHART_COPY.read_text() == dashboard.render()


def test_dashboard_config_map_carries_the_json_and_the_sidecar_label() -> None:
    objects = template(CHART, values_files=[MONITORING])
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["pdserve.json"]) == dashboard.dashboard()


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    """promtool parses each query (panels and variables) with the variables filled in, as a recording rule."""
    queries = [expr for _, expr in dashboard.expressions(dashboard.dashboard())]
    queries += [query for _, query in dashboard.variable_queries()]
    rules = [{"record": f"dashboard:query_{i}:check", "expr": dashboard.promql(q)} for i, q in enumerate(queries)]
    result = promtool("check", "rules", str(write_rules(tmp_path / "dashboard.yaml", [{"name": "d", "rules": rules}])))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_layout_and_variables() -> None:
    board = dashboard.dashboard()
    panels = [p for row in board["panels"] for p in [row, *row.get("panels", [])]]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in panels)
    assert all(p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for p in panels if p["type"] != "row")
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "namespace", "pdservice", "pool"]


@pytest.mark.parametrize(("title", "expr"), dashboard.expressions(dashboard.dashboard()))
def test_every_pd_serving_query_selects_the_chosen_pdservices(title: str, expr: str) -> None:
    if "pdserve_operator_" in expr:
        return  # the operator's own series belong to no PDService
    assert 'namespace=~"$namespace"' in expr and 'pdservice=~"$pdservice"' in expr, title
    if "vllm:" in expr and "nixl" not in expr:
        assert 'pool=~"$pool"' in expr, title


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    exprs = " ".join(expr for _, expr in dashboard.expressions(dashboard.dashboard()))
    for needle in (
        "pdserve_router_time_to_first_token_seconds_bucket",  # TTFT quantiles
        "pdserve_router_inter_token_latency_seconds_bucket",  # ITL quantiles
        "pdserve_pdservice_slo_target_seconds",  # ... against the targets
        "pdserve_router_requests_total",  # request rates, route mix
        "vllm:generation_tokens_total",  # token rates
        'pool="prefill"} == 1) / count',  # P:D replica ratio
        "vllm:nixl_xfer_time_seconds_bucket",  # KV transfer time
        "vllm:nixl_num_failed_transfers_total",  # ... and failures
        "vllm:prefix_cache_hits_total",  # prefix hit rate
        "vllm:kv_cache_usage_perc",  # KV usage
        "pdserve_autoscaler_decisions_total",  # autoscaler decisions and reasons
        "pdserve_autoscaler_desired_replicas",
    ):
        assert needle in exprs, needle


# ---------------------------------------------------------------------------------------------------- scrape labels


def test_pod_monitor_gives_the_local_prometheus_target_labels() -> None:
    """The local cluster's `pdserve-pods` job and the chart's PodMonitor label series alike, so one dashboard and
    one set of alerts serve both. `namespace` and `pod` are labels the Prometheus Operator always sets."""
    objects = template(CHART, values={"monitoring.podMonitor.enabled": True})
    [monitor] = [o for o in objects if o["kind"] == "PodMonitor"]
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    expected = {label: [meta] for label, meta in TARGET_LABELS.items() if label not in ("namespace", "pod")}
    for endpoint in endpoints:
        copied = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"] if "targetLabel" in r}
        assert copied == expected
    # Each pool on the port the local cluster's job scrapes it on: engines on `http`, routers on `metrics`.
    kept = {
        endpoint["port"]: {rule["regex"] for rule in endpoint["relabelings"] if rule.get("action") == "keep"}
        for endpoint in endpoints
    }
    by_port: dict[str, set[str]] = {}
    for role, port in METRICS_PORT_NAMES.items():
        by_port.setdefault(port, set()).add(role)
    assert {port: {frozenset(regex.split("|")) for regex in regexes} for port, regexes in kept.items()} == {
        port: {frozenset(roles)} for port, roles in by_port.items()
    }


def test_service_monitor_honours_the_operators_pdservice_labels() -> None:
    objects = template(CHART, values={"monitoring.serviceMonitor.enabled": True})
    [monitor] = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
