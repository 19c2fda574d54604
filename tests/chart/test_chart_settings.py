"""The Helm chart against the operator's settings table (`pdserve.api.settings.OperatorSettings`).

For every setting the chart sets: values.yaml holds the table's default (or the chart's own, where the table says
the chart derives it), values.schema.json types it as the table does and never accepts a value the operator
refuses, and a non-default value reaches the operator as that flag (`helm template`, offline).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.optioning import Setting, settings_of
from pdserve.api.settings import OperatorSettings
from pdserve_dev.testing.helm import template

CHART = Path(__file__).resolve().parents[2] / "charts" / "pdserve"
CHARTED = [row for row in settings_of(OperatorSettings) if row.chart is not None]
SCHEMA_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}

# A value other than the default for each charted setting, valid for the chart and the operator.
SAMPLES: dict[str, Any] = {
    "namespaces": ["team-a", "team-b"],
    "lease_name": "my-lease",
    "model_host_paths": ["/mnt/models", "/data/llm"],
    "prometheus_url": "http://prometheus.monitoring.svc:9090",
}
# What the chart needs besides the value for it to reach the flag (its own rules, not the operator's).
NEEDS: dict[str, dict[str, Any]] = {
    "namespaces": {"watch.mode": "namespaced"},
    "leader_elect": {"operator.replicas": 1},
}


def at(document: dict[str, Any], dotted: str) -> Any:
    node: Any = document
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"{dotted}: no {part!r}"
        node = node[part]
    return node


def schema_of(dotted: str) -> dict[str, Any]:
    node: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    for part in dotted.split("."):
        node = node["properties"][part]
    return node


def sample(row: Setting) -> Any:
    if row.name in SAMPLES:
        return SAMPLES[row.name]
    if row.switch:
        return not row.default
    if row.choices:
        return next(choice for choice in row.choices if choice != row.default)
    assert isinstance(row.default, int | float), f"give {row.name} a sample value"
    return row.default + (10 if row.kind is int else 1)  # ports move clear of each other; renew stays < lease


def flag_values(args: list[str], flag: str) -> list[str]:
    return [arg.split("=", 1)[1] for arg in args if arg.startswith(f"{flag}=")]


@pytest.mark.parametrize("row", CHARTED, ids=lambda row: row.name)
def test_values_yaml_holds_the_tables_default(row: Setting) -> None:
    assert row.chart is not None
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    default = list(row.chart_value) if row.multiple else row.chart_value
    assert at(values, row.chart) == default


@pytest.mark.parametrize("row", CHARTED, ids=lambda row: row.name)
def test_the_schema_types_it_as_the_table_does(row: Setting) -> None:
    assert row.chart is not None
    schema = schema_of(row.chart)
    if row.multiple:
        assert schema["type"] == "array" and schema["items"]["type"] == "string"
        return
    assert schema["type"] == SCHEMA_TYPES[row.kind]
    if row.choices:
        assert set(schema["enum"]) <= set(row.choices)  # the chart never passes a value the operator refuses
    if row.minimum is not None:
        lowest = schema.get("minimum", schema.get("exclusiveMinimum"))
        assert lowest is not None and lowest >= row.minimum


@pytest.mark.parametrize("row", CHARTED, ids=lambda row: row.name)
def test_a_chart_value_reaches_the_operator_as_its_flag(row: Setting) -> None:
    assert row.chart is not None
    value = sample(row)
    objects = template(CHART, values={row.chart: value, **NEEDS.get(row.name, {})})
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    args: list[str] = container["args"]
    if row.switch:
        assert (row.flag if value else row.negative_flag) in args
        assert (row.negative_flag if value else row.flag) not in args
    elif row.multiple:
        assert flag_values(args, row.flag) == value
    elif isinstance(value, int | float):
        assert [float(v) for v in flag_values(args, row.flag)] == [float(value)]
    else:
        assert flag_values(args, row.flag) == [value]
