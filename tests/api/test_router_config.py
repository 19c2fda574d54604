"""The router configuration model: camelCase YAML, defaults, validation of discovery inputs."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from pdserve.api.router_config import RouterConfig

KUBERNETES_YAML = """
servedModelName: llama
port: 8080
discovery: kubernetes
prefill:
  namespace: llm
  labelSelector: app.kubernetes.io/instance=llama,pdserve.io/role=prefill,pdserve.io/kv-compat
decode:
  namespace: llm
  labelSelector: app.kubernetes.io/instance=llama,pdserve.io/role=decode,pdserve.io/kv-compat
  portName: http
  statefulset: llama-decode
kvCompatLabel: pdserve.io/kv-compat
topologyLabels: [pdserve.io/rack]
discoveryConfigMap: {namespace: llm, name: llama-router-discovery}
kvSideChannelPorts: [5600, 5601]
policy: {disaggregationThresholdTokens: 512, prefixAware: true, blockSizeTokens: 16, fallbackToDecode: false}
circuitBreaker: {failureThreshold: 5}
"""


def test_the_rendered_shape_loads() -> None:
    config = RouterConfig.model_validate(yaml.safe_load(KUBERNETES_YAML))
    assert config.decode is not None and config.decode.label_selector.endswith(
        "pdserve.io/role=decode,pdserve.io/kv-compat"
    )
    assert config.discovery_config_map is not None and config.discovery_config_map.name == "llama-router-discovery"
    assert config.decode.statefulset == "llama-decode"
    assert config.kv_side_channel_ports == [5600, 5601]
    assert config.policy.disaggregation_threshold_tokens == 512
    assert config.policy.fallback_to_decode is False
    assert config.circuit_breaker.failure_threshold == 5
    assert config.read_timeout_seconds == 120.0


def test_a_dump_round_trips() -> None:
    config = RouterConfig.model_validate(yaml.safe_load(KUBERNETES_YAML))
    dumped = config.model_dump(by_alias=True, mode="json")
    assert "servedModelName" in dumped and "circuitBreaker" in dumped
    assert RouterConfig.model_validate(dumped) == config


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"servedModelName": "m"}, "needs a decode selector"),
        # Pods are gone from discovery: the old fields are refused by name, not ignored.
        ({"servedModelName": "m", "decode": {"namespace": "n", "serviceName": "d"}}, "labelSelector"),
        (
            {"servedModelName": "m", "decode": {"namespace": "n", "labelSelector": "a", "podLabelSelector": "b"}},
            "podLabelSelector",
        ),
        ({"servedModelName": "m", "decode": {"namespace": "n", "labelSelector": ""}}, "at least 1 character"),
        ({"servedModelName": "m", "discovery": "static"}, "at least one staticDecode"),
        ({"servedModelName": "m", "discovery": "static", "staticDecode": ["ftp://x"]}, "must start with http"),
        ({"servedModelName": "m", "discovery": "static", "staticDecode": ["http://x"], "bogus": 1}, "Extra inputs"),
        ({"servedModelName": "m", "discovery": "dns", "staticDecode": ["http://x"]}, "discovery"),
        (
            {"servedModelName": "m", "discovery": "static", "staticDecode": ["http://x"], "maxRequestBodyBytes": 5},
            "greater than or equal",
        ),
        (
            {
                "servedModelName": "m",
                "discovery": "static",
                "staticDecode": ["http://x"],
                "policy": {"blockSizeTokens": 0},
            },
            "greater than or equal",
        ),
    ],
)
def test_invalid_configs_are_rejected_with_a_reason(document: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RouterConfig.model_validate(document)


def test_breaker_health_path_must_be_absolute() -> None:
    import pydantic

    from pdserve.api.router_config import CircuitBreakerConfig

    with pytest.raises(pydantic.ValidationError, match=r"healthPath|health_path"):
        CircuitBreakerConfig.model_validate({"healthPath": "health"})
    assert CircuitBreakerConfig.model_validate({"healthPath": "/ping"}).health_path == "/ping"
