"""What the router discovers engines through (`render.discovery`): per-kv-compat Services across a rollout, the
discovery ConfigMap, the router's Role and the side-channel ports. Pure: objects from a spec and `Observed`."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from pdserve.api.defaults import effective
from pdserve.api.kvcompat import KV_COMPAT_LABEL, kv_compat_hash
from pdserve.api.router_config import NodeTopology, OwnedServices, RouterConfig
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import validate
from pdserve_operator.render import NOTHING_OBSERVED, Observed, render

RACK = "pdserve.io/rack"
OLD, STRANGE = "0123456789ab", "Not-A-Hash"


def pds(name: str = "svc", **spec: Any) -> PDService:
    base: dict[str, Any] = {
        "model": {"name": "served", "uri": "hf://org/model"},
        "engine": {"image": "vllm/vllm-openai:v0.32.0"},
    }
    base.update(spec)
    return PDService.model_validate({"metadata": {"name": name, "namespace": "ns", "uid": "u-1"}, "spec": base})


def current(service: PDService) -> str:
    return kv_compat_hash(effective(service.spec))


def objects_of(kind: str, objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def router_config(objects: list[dict[str, Any]], name: str = "svc") -> RouterConfig:
    text = objects_of("ConfigMap", objects)[f"{name}-router"]["data"]["router.yaml"]
    return RouterConfig.model_validate(yaml.safe_load(text))


def test_a_service_per_kv_compat_value_present_among_a_pools_pods() -> None:
    """Mid-rollout: decode pods still carry the old value, prefill pods are all new. Decode gets a Service for
    both values, prefill only for the current one (the old one's Service is pruned once its last pod is gone);
    a value that is not a hash (a hand-edited label) is never built into a name or a selector."""
    service = pds()
    now = current(service)
    observed = Observed(kv_compat={"decode": frozenset({OLD, now, STRANGE}), "prefill": frozenset({now})})
    services = objects_of("Service", render(validate(service), observed))
    assert sorted(services) == sorted(
        ["svc-prefill", f"svc-prefill-{now}", "svc-decode", f"svc-decode-{now}", f"svc-decode-{OLD}", "svc-router"]
    )
    old = services[f"svc-decode-{OLD}"]
    # The EndpointSlice controller copies these labels onto the slices: the value is what the router pairs by,
    # instance and role what its label selector picks.
    assert old["metadata"]["labels"][KV_COMPAT_LABEL] == OLD
    assert old["metadata"]["labels"]["app.kubernetes.io/instance"] == "svc"
    assert old["metadata"]["labels"]["pdserve.io/role"] == "decode"
    assert old["spec"]["selector"] == {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": "svc",
        "pdserve.io/role": "decode",
        KV_COMPAT_LABEL: OLD,
    }
    assert old["spec"]["clusterIP"] == "None"
    # HTTP and the KV event sockets: what the router reads from the slices.
    assert [p["name"] for p in old["spec"]["ports"]] == ["http", "kv-events-0", "kv-replay-0"]
    # The pools' own Services carry no value: the router's selector (which requires one) never picks them.
    assert KV_COMPAT_LABEL not in services["svc-decode"]["metadata"]["labels"]
    # Nothing observed (a new PDService, `pdserve render`): the current value only.
    fresh = objects_of("Service", render(validate(service)))
    assert f"svc-decode-{now}" in fresh and f"svc-decode-{OLD}" not in fresh


def test_kv_compat_service_names_fit_for_the_longest_pdservice_name() -> None:
    name = "a" * 40
    service = pds(name)
    for obj in render(validate(service), Observed(kv_compat={"prefill": frozenset({OLD})})):
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]


def test_the_router_selects_the_slices_of_its_pools_kv_compat_services() -> None:
    config = router_config(render(validate(pds())))
    assert config.prefill is not None and config.decode is not None
    for selector, role in ((config.prefill, "prefill"), (config.decode, "decode")):
        assert selector.namespace == "ns"
        assert selector.label_selector == f"app.kubernetes.io/instance=svc,pdserve.io/role={role},{KV_COMPAT_LABEL}"
        assert selector.port_name == "http"
    assert config.kv_compat_label == KV_COMPAT_LABEL


@pytest.mark.parametrize(
    ("topology_key", "published"),
    [
        (None, False),  # the router scores on the slices' zones
        ("topology.kubernetes.io/zone", False),  # a slice endpoint carries its zone
        ("kubernetes.io/hostname", False),  # and its node
        (RACK, True),  # a node label only the operator reads
        ("nvidia.com/gpu.clique", True),
    ],
)
def test_node_labels_are_published_only_when_slices_lack_them(topology_key: str | None, published: bool) -> None:
    placement = {"topologyKey": topology_key} if topology_key else {}
    label = topology_key or "topology.kubernetes.io/zone"
    objects = render(validate(pds(placement=placement)), Observed(node_labels={"n1": {label: "r1"}}))
    config = router_config(objects)
    assert config.topology_labels == [label]
    # The router reads its one discovery ConfigMap in every case (the Services it may trust are there too).
    assert config.discovery_config_map is not None
    assert (config.discovery_config_map.namespace, config.discovery_config_map.name) == ("ns", "svc-router-discovery")
    role = objects_of("Role", objects)["svc-router"]
    slices = {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}
    one_config_map = {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": ["svc-router-discovery", "svc-router-control"],
        "verbs": ["list", "watch"],
    }
    assert role["rules"] == [slices, one_config_map]
    nodes = json.loads(objects_of("ConfigMap", objects)["svc-router-discovery"]["data"]["nodes.json"])["nodes"]
    assert nodes == ({"n1": {label: "r1"}} if published else {})


def test_the_discovery_config_map_lists_the_observed_nodes_labels_sorted() -> None:
    service = pds(placement={"topologyKey": RACK})
    observed = Observed(
        node_labels={
            "n2": {RACK: "r2", "kubernetes.io/hostname": "n2", "secret.example/label": "x"},
            "n1": {RACK: "r1"},
            "n3": {"topology.kubernetes.io/zone": "z"},  # no rack label: not listed
        }
    )
    [config_map] = [o for o in render(validate(service), observed) if o["metadata"]["name"] == "svc-router-discovery"]
    text = config_map["data"]["nodes.json"]
    assert json.loads(text) == {"nodes": {"n1": {RACK: "r1"}, "n2": {RACK: "r2"}}}  # only the topology label
    assert NodeTopology.model_validate_json(text).nodes["n2"] == {RACK: "r2"}  # what the router parses
    assert list(json.loads(text)["nodes"]) == ["n1", "n2"]
    assert config_map["metadata"]["labels"]["pdserve.io/role"] == "router"
    reordered = Observed(node_labels=dict(reversed(list(observed.node_labels.items()))))
    assert render(validate(service), observed) == render(validate(service), reordered)  # same bytes, no re-apply
    empty = [o for o in render(validate(service)) if o["metadata"]["name"] == "svc-router-discovery"]
    assert json.loads(empty[0]["data"]["nodes.json"]) == {"nodes": {}}


def test_the_router_is_told_only_the_rendered_services_the_operator_controls() -> None:
    """`services.json`: the per-kv-compat Services rendered now that the operator's cache holds as its own (with
    their UIDs); nothing before they exist, not the pools' plain headless Services, not a Service no longer
    rendered; and each pool's StatefulSet, whose member pods alone the router takes."""
    service = pds()
    value = kv_compat_hash(effective(service.spec))
    prefill, decode = f"svc-prefill-{value}", f"svc-decode-{value}"

    def owned(observed: Observed) -> dict[str, str]:
        config_map = objects_of("ConfigMap", render(validate(service), observed))["svc-router-discovery"]
        parsed: dict[str, str] = OwnedServices.model_validate_json(config_map["data"]["services.json"]).services
        return parsed

    assert owned(NOTHING_OBSERVED) == {}  # before the Services exist: the next pass lists them
    known = {prefill: "u-p", decode: "u-d", "svc-prefill": "u-plain", "svc-decode-000000000000": "u-gone"}
    assert owned(Observed(services=known)) == {decode: "u-d", prefill: "u-p"}
    config = router_config(render(validate(service)))
    assert config.prefill is not None and config.decode is not None
    assert (config.prefill.statefulset, config.decode.statefulset) == ("svc-prefill", "svc-decode")


@pytest.mark.parametrize(
    ("spec", "ports"),
    [
        ({}, [5600]),
        ({"engine": {"image": "i", "sideChannelPort": 7000}}, [7000]),
        # vLLM 0.32: one handshake listener per data-parallel rank, at the base port plus the rank (not TP).
        (
            {"prefill": {"dataParallelSize": 4, "tensorParallelSize": 2}, "decode": {"tensorParallelSize": 2}},
            [5600, 5601, 5602, 5603],
        ),
        ({"decode": {"dataParallelSize": 2}}, [5600]),  # only prefill answers name a remote_port
    ],
)
def test_kv_side_channel_ports_follow_the_prefill_layout(spec: dict[str, Any], ports: list[int]) -> None:
    assert router_config(render(validate(pds(**spec)))).kv_side_channel_ports == ports
