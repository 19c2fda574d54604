"""The defaults table and `effective()`: every absent field gets the table's value, written values are kept, derived
defaults follow the fields they derive from, and the CRD and the router config read the same table."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import FrozenInstanceError, dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.api import defaults
from pdserve.api.crdgen import openapi_schema, reachable_models
from pdserve.api.defaulting import (
    UNSET,
    default,
    default_of,
    documented_defaults,
    resolve,
    unset_fields,
    view,
    view_of,
)
from pdserve.api.defaults import (
    UCX_RDMA_TRANSPORTS,
    UCX_TCP_TRANSPORTS,
    EffectiveAutoscaling,
    EffectiveEngine,
    EffectivePool,
    EffectiveRouter,
    EffectiveRouting,
    EffectiveSpec,
    effective,
)
from pdserve.api.router_config import EndpointSelector, RouterConfig, RoutingPolicyConfig
from pdserve.api.v1alpha1 import ApiModel, EngineSpec, PDServiceSpec, PoolSpec, RdmaSpec


def spec(**fields: Any) -> PDServiceSpec:
    return PDServiceSpec.model_validate(
        {"model": {"name": "m", "uri": "hf://org/m"}, "engine": {"image": "vllm:1"}, **fields}
    )


def views(obj: object, path: str = "") -> Iterator[tuple[str, object]]:
    """(path, view) for `obj` and every view below it."""
    yield path, obj
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from views(value, f"{path}.{f.name}" if path else f.name)


def test_every_absent_field_has_the_table_value() -> None:
    resolved = effective(spec())
    checked = 0
    for path, node in views(resolved):
        for f in dataclasses.fields(node):  # type: ignore[arg-type]
            try:
                expected = default_of(type(node), f.name)
            except LookupError:
                continue
            assert getattr(node, f.name) == expected, f"{path}.{f.name}"
            checked += 1
    assert checked >= 40, "the table lost entries"
    assert unset_fields(resolved) == []


def test_the_documented_values() -> None:
    """docs/api.md quotes these; a change here is a change of behaviour for every stored object without the field."""
    resolved = effective(spec())
    assert (resolved.engine.port, resolved.engine.side_channel_port, resolved.engine.block_size) == (8000, 5600, 16)
    assert resolved.engine.kv_lease_seconds == 30 and resolved.engine.shm_size == "16Gi"
    assert resolved.placement.gpu_resource_name == "nvidia.com/gpu" and resolved.placement.rdma == "required"
    assert (resolved.prefill.rdma.resource_name, resolved.prefill.rdma.count) == ("rdma/ib", 1)
    assert resolved.placement.colocation == "preferred" and resolved.placement.spread_key == "kubernetes.io/hostname"
    assert (resolved.router.replicas, resolved.router.port) == (2, 8080)
    assert resolved.router.routing.disaggregation_threshold == 256
    assert (resolved.prefill.autoscaling.min_replicas, resolved.prefill.autoscaling.max_replicas) == (1, 8)
    assert resolved.engine.ucx.transports == UCX_RDMA_TRANSPORTS == "rc,cuda_copy,cuda_ipc"
    assert [t.model_dump(exclude_none=True) for t in resolved.placement.tolerations] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert resolved.router.resources.as_dict() == {
        "requests": {"cpu": "1", "memory": "512Mi"},
        "limits": {"memory": "2Gi"},
    }


def test_written_values_are_kept_even_when_falsy() -> None:
    resolved = effective(
        spec(
            prefill={"replicas": 0, "maxUnavailable": 0, "tolerations": []},
            placement={"tolerations": [], "rdma": "off"},
            router={"replicas": 0, "routing": {"disaggregationThreshold": 0, "prefixAware": False}},
            engine={"image": "vllm:1", "port": 9000, "ucx": {"transports": "tcp"}},
        )
    )
    assert resolved.prefill.replicas == 0 and resolved.prefill.max_unavailable == 0
    assert resolved.placement.tolerations == (), "an explicit empty list is not absent"
    assert resolved.router.replicas == 0
    assert resolved.router.routing.disaggregation_threshold == 0 and resolved.router.routing.prefix_aware is False
    assert resolved.router.routing.fallback_to_decode is True
    assert resolved.engine.port == 9000 and resolved.engine.ucx.transports == "tcp"


def test_an_empty_string_is_absent_for_a_defaulted_field() -> None:
    resolved = effective(spec(engine={"image": "vllm:1", "ucx": {"transports": "", "netDevices": ""}}))
    assert resolved.engine.ucx.transports == UCX_RDMA_TRANSPORTS
    assert resolved.engine.ucx.net_devices is None


def test_derived_defaults_follow_their_inputs() -> None:
    resolved = effective(
        spec(
            prefill={
                "tensorParallelSize": 2,
                "dataParallelSize": 2,
                "autoscaling": {"enabled": True, "minReplicas": 3},
            },
            decode={"tensorParallelSize": 4, "gpusPerPod": 8, "autoscaling": {"targetMilliseconds": 25}},
            placement={"rdma": "off"},
            slo={"ttftMilliseconds": 500, "itlMilliseconds": 40},
        )
    )
    assert resolved.prefill.gpus_per_pod == 4, "tensorParallelSize x dataParallelSize"
    assert resolved.decode.gpus_per_pod == 8, "a written gpusPerPod wins"
    assert resolved.engine.ucx.transports == UCX_TCP_TRANSPORTS
    assert resolved.prefill.replicas == 3, "an autoscaled pool starts at minReplicas"
    assert resolved.decode.replicas == 1
    assert resolved.prefill.autoscaling.target_milliseconds == 500, "prefill follows the TTFT objective"
    assert resolved.decode.autoscaling.target_milliseconds == 25, "a written target wins over spec.slo"
    assert effective(spec(placement={"rdma": "preferred"})).engine.ucx.transports == UCX_RDMA_TRANSPORTS


@pytest.mark.parametrize(
    ("pool", "desired"),
    [
        ({"replicas": 20, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}}, 5),
        ({"replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 2}}, 2),
        ({"autoscaling": {"enabled": True, "minReplicas": 3}}, 3),
        ({"replicas": 20, "autoscaling": {"enabled": False, "maxReplicas": 5}}, 20),
        ({"replicas": 20, "autoscaling": {"maxReplicas": 5}}, 20),
        ({}, 1),
    ],
)
def test_one_function_applies_the_autoscaling_bounds(pool: dict[str, Any], desired: int) -> None:
    assert effective(spec(decode=pool)).decode.desired_replicas == desired


def test_clamp() -> None:
    bounds = EffectiveAutoscaling(enabled=True, min_replicas=2, max_replicas=4)
    assert [bounds.clamp(n) for n in (0, 2, 3, 4, 9)] == [2, 2, 3, 4, 4]


def test_the_view_is_frozen_and_read_only() -> None:
    resolved = effective(spec(prefill={"nodeSelector": {"a": "b"}, "args": ["--x"]}))
    with pytest.raises(FrozenInstanceError):
        resolved.engine.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        resolved.prefill.node_selector["c"] = "d"  # type: ignore[index]
    assert resolved.prefill.args == ("--x",)


def test_a_view_must_mirror_its_model() -> None:
    """A field added to a model without its line in the table fails when the table is imported."""

    class Thing(ApiModel):
        a: int | None = None
        b: int | None = None

    with pytest.raises(TypeError, match=r"missing \['b'\]"):

        @view(Thing)
        @dataclass(frozen=True, kw_only=True)
        class EffectiveThing:
            a: int = default(1)

    assert view_of(Thing) is None


def test_every_model_of_the_spec_has_a_view() -> None:
    leaves = {"EnvVar", "Toleration"}  # copied into pod templates verbatim: no defaults of their own
    missing = {name for name, model in reachable_models(PDServiceSpec).items() if view_of(model) is None}
    assert missing == leaves


def test_resolving_an_absent_object_gives_its_defaults() -> None:
    assert resolve(defaults.EffectiveRdma, None) == resolve(defaults.EffectiveRdma, RdmaSpec())
    assert resolve(EffectivePool, None).autoscaling.max_replicas == 8
    assert resolve(EffectivePool, None).gpus_per_pod is UNSET, "derived fields wait for effective()"


def test_the_crd_descriptions_state_the_table_defaults() -> None:
    """Every default of the table ends its field's description in the CRD (what `kubectl explain` prints)."""
    stated = 0
    for model in reachable_models(PDServiceSpec).values():
        properties = openapi_schema(model)["properties"]
        for name, text in documented_defaults(model).items():
            description = properties[model.model_fields[name].alias or name]["description"]
            assert description.endswith(f" Default {text}."), (model.__name__, name, description)
            assert description.count("Default") == 1, description
            stated += 1
    assert stated >= 40
    engine = openapi_schema(EngineSpec)["properties"]
    assert engine["port"]["description"] == "Engine HTTP port. Default 8000."
    assert openapi_schema(PoolSpec)["properties"]["gpusPerPod"]["description"].endswith(
        "Default tensorParallelSize x dataParallelSize."
    )


def test_model_descriptions_never_state_a_default() -> None:
    """The table is the only place a default is written: a description that says one would drift from it."""
    offenders = [
        f"{model.__name__}.{name}"
        for model in reachable_models(PDServiceSpec).values()
        for name, info in model.model_fields.items()
        if re.search(r"\bdefault", info.description or "", re.IGNORECASE)
    ]
    assert offenders == []


def test_router_config_defaults_are_the_spec_defaults() -> None:
    config = RouterConfig(served_model_name="m", decode=EndpointSelector(namespace="n", label_selector="pool=d"))
    policy = RoutingPolicyConfig()
    assert config.port == EffectiveRouter.port == 8080
    assert policy.disaggregation_threshold_tokens == EffectiveRouting.disaggregation_threshold
    assert policy.prefix_aware is EffectiveRouting.prefix_aware
    assert policy.fallback_to_decode is EffectiveRouting.fallback_to_decode
    assert policy.block_size_tokens == EffectiveEngine.block_size


def test_effective_spec_pool() -> None:
    resolved: EffectiveSpec = effective(spec(prefill={"replicas": 3}))
    assert resolved.pool("prefill").replicas == 3 and resolved.pool("decode").replicas == 1


_pool = st.fixed_dictionaries(
    {},
    optional={
        "replicas": st.integers(0, 4),
        "tensorParallelSize": st.integers(1, 4),
        "gpusPerPod": st.integers(0, 8),
        "autoscaling": st.fixed_dictionaries(
            {}, optional={"enabled": st.booleans(), "minReplicas": st.integers(0, 3), "maxReplicas": st.integers(3, 9)}
        ),
    },
)


@settings(max_examples=100, deadline=None)
@given(
    fields=st.fixed_dictionaries(
        {},
        optional={
            "prefill": _pool,
            "decode": _pool,
            "placement": st.fixed_dictionaries(
                {}, optional={"rdma": st.sampled_from(["required", "preferred", "off"])}
            ),
            "slo": st.fixed_dictionaries({}, optional={"ttftMilliseconds": st.floats(1, 1e4)}),
            "router": st.fixed_dictionaries({}, optional={"routing": st.just({})}),
        },
    )
)
def test_no_field_is_left_unresolved(fields: dict[str, Any]) -> None:
    resolved = effective(spec(**fields))
    assert unset_fields(resolved) == []
    for pool in (resolved.prefill, resolved.decode):
        scaling = pool.autoscaling
        if scaling.enabled and scaling.min_replicas <= scaling.max_replicas:
            assert scaling.min_replicas <= pool.desired_replicas <= scaling.max_replicas
