"""KV tiers rendered as vLLM 0.32 expects them: MultiConnector with NIXL first, the store's client file and objects."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import validate
from pdserve_operator.render import render
from pdserve_operator.render.kvcache import kv_store_status

GIB = 1 << 30


def pds(kv_cache: dict[str, Any] | None = None, **pools: Any) -> PDService:
    engine: dict[str, Any] = {"image": "vllm/vllm-openai:v0.32.0"}
    if kv_cache is not None:
        engine["kvCache"] = kv_cache
    spec = {"model": {"name": "served", "uri": "hf://org/model"}, "engine": engine, **pools}
    return PDService.model_validate({"metadata": {"name": "svc", "namespace": "ns", "uid": "u-1"}, "spec": spec})


def objects(service: PDService) -> list[dict[str, Any]]:
    return render(validate(service))


def find(rendered: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [obj] = [o for o in rendered if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def engine(rendered: list[dict[str, Any]], role: str) -> dict[str, Any]:
    container: dict[str, Any] = find(rendered, "StatefulSet", f"svc-{role}")["spec"]["template"]["spec"]["containers"][
        0
    ]
    return container


def transfer_config(rendered: list[dict[str, Any]], role: str) -> dict[str, Any]:
    args = engine(rendered, role)["args"]
    config: dict[str, Any] = json.loads(args[args.index("--kv-transfer-config") + 1])
    return config


def test_without_tiers_the_engines_keep_nixl_alone() -> None:
    rendered = objects(pds())
    assert transfer_config(rendered, "prefill")["kv_connector"] == "NixlConnector"
    assert not [o for o in rendered if "kvstore" in o["metadata"]["name"]]


def test_offload_is_composed_with_nixl_never_the_offloading_flag() -> None:
    rendered = objects(pds({"offload": {"cpuBytes": "8Gi", "evictionPolicy": "arc"}}))
    for role, nixl_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        config = transfer_config(rendered, role)
        assert config["kv_connector"] == "MultiConnector" and config["kv_role"] == nixl_role
        nixl, offload = config["kv_connector_extra_config"]["connectors"]
        # NIXL first: a request carrying prefill's kv_transfer_params is pulled, not looked up in a tier.
        assert nixl["kv_connector"] == "NixlConnector" and nixl["kv_role"] == nixl_role
        # The engine id is the MultiConnector's, which vLLM hands to each child; a child's own one crashes vLLM 0.32.
        assert config["engine_id"] == "$(POD_NAME)-$(POD_UID)" and "engine_id" not in nixl
        assert nixl["kv_connector_extra_config"]["kv_lease_duration"]
        assert offload == {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 8 * GIB, "eviction_policy": "arc"},
        }
        assert not [arg for arg in engine(rendered, role)["args"] if arg.startswith("--kv-offloading")]


def test_a_pool_overrides_the_engines_offload_field_by_field() -> None:
    rendered = objects(
        pds(
            {"offload": {"cpuBytes": "8Gi", "evictionPolicy": "arc"}},
            decode={"kvCache": {"offload": {"cpuBytes": "0"}}},
        )
    )
    assert transfer_config(rendered, "decode")["kv_connector"] == "NixlConnector"
    rendered = objects(
        pds({"offload": {"evictionPolicy": "arc"}}, prefill={"kvCache": {"offload": {"cpuBytes": "2Gi"}}})
    )
    [_, offload] = transfer_config(rendered, "prefill")["kv_connector_extra_config"]["connectors"]
    assert offload["kv_connector_extra_config"] == {"cpu_bytes_to_use": 2 * GIB, "eviction_policy": "arc"}
    assert transfer_config(rendered, "decode")["kv_connector"] == "NixlConnector"


def test_a_deployed_store_gives_engines_its_address_and_no_memory_of_their_own() -> None:
    rendered = objects(pds({"store": {"backend": "mooncake", "mooncake": {"capacityBytes": "4Gi"}}}))
    prefill, decode = transfer_config(rendered, "prefill"), transfer_config(rendered, "decode")
    store_prefill = prefill["kv_connector_extra_config"]["connectors"][-1]
    store_decode = decode["kv_connector_extra_config"]["connectors"][-1]
    assert store_prefill["kv_connector"] == store_decode["kv_connector"] == "MooncakeStoreConnector"
    # Prefill writes, decode only reads.
    assert (store_prefill["kv_role"], store_decode["kv_role"]) == ("kv_both", "kv_consumer")
    prefix = store_prefill["kv_connector_extra_config"]["cache_prefix"]
    assert prefix.startswith("pdserve/ns/svc/") and prefix == store_decode["kv_connector_extra_config"]["cache_prefix"]

    client = json.loads(find(rendered, "ConfigMap", "svc-kvstore-client")["data"]["mooncake.json"])
    assert client == {
        "device_name": "",
        "global_segment_size": 0,
        "local_buffer_size": GIB,
        "master_server_address": "svc-kvstore.ns.svc:50051",
        "metadata_server": "http://svc-kvstore.ns.svc:8080/metadata",
        "mode": "standalone-store",
        "protocol": "rdma",
    }
    container = engine(rendered, "decode")
    assert {"name": "MOONCAKE_CONFIG_PATH", "value": "/etc/pdserve/kvstore/mooncake.json"} in container["env"]
    assert {"name": "kvstore", "mountPath": "/etc/pdserve/kvstore", "readOnly": True} in container["volumeMounts"]

    deploy = find(rendered, "Deployment", "svc-kvstore")
    master, store = deploy["spec"]["template"]["spec"]["containers"]
    assert master["command"] == ["mooncake_master"] and master["readinessProbe"]["httpGet"]["path"] == "/health"
    assert (
        f"--global_segment_size={4 * GIB}" in store["args"]
        and store["readinessProbe"]["httpGet"]["port"] == "store-http"
    )
    service = find(rendered, "Service", "svc-kvstore")
    assert {port["port"] for port in service["spec"]["ports"]} == {50051, 8080, 9003}
    # The config the engines mount is applied before the engines that mount it.
    names = [o["metadata"]["name"] for o in rendered]
    assert names.index("svc-kvstore-client") < names.index("svc-prefill")


def _container_ports(obj: dict[str, Any]) -> set[int]:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    return {p["containerPort"] for c in pod.get("containers", []) for p in c.get("ports", [])}


def test_the_store_pod_takes_no_port_another_pdserve_pod_listens_on() -> None:
    """mooncake_master and mooncake_client bind their HTTP servers on every address (MASTER_METADATA_CONTAINER_PORT):
    on a shared host network a port also used by the router or an engine is taken by whichever starts first (the
    master once took the router's 8080 and never became ready)."""
    rendered = objects(pds({"store": {"backend": "mooncake"}}))
    store = find(rendered, "Deployment", "svc-kvstore")
    others = set().union(*(_container_ports(o) for o in rendered if o is not store))
    assert others and not _container_ports(store) & others


def test_an_external_master_deploys_nothing_and_is_not_probed() -> None:
    service = pds({"store": {"backend": "mooncake", "mooncake": {"masterAddress": "10.0.0.9:7000", "protocol": "tcp"}}})
    rendered = objects(service)
    assert not [o for o in rendered if o["kind"] in ("Deployment", "Service") and "kvstore" in o["metadata"]["name"]]
    client = json.loads(find(rendered, "ConfigMap", "svc-kvstore-client")["data"]["mooncake.json"])
    assert client["master_server_address"] == "10.0.0.9:7000"
    assert client["metadata_server"] == "http://10.0.0.9:8080/metadata" and client["protocol"] == "tcp"
    _, spec = validate(service).require()
    status = kv_store_status(service, spec, None)
    assert status is not None and status["managed"] is False and "ready" not in status


@pytest.mark.parametrize(("ready", "expected"), [(None, False), (0, False), (1, True)])
def test_status_reports_the_deployed_store_ready_when_its_pod_is(ready: int | None, expected: bool) -> None:
    service = pds({"store": {"backend": "mooncake"}})
    _, spec = validate(service).require()
    deployment = None if ready is None else {"status": {"readyReplicas": ready}}
    status = kv_store_status(service, spec, deployment)
    assert status is not None and status["ready"] is expected and status["masterAddress"] == "svc-kvstore.ns.svc:50051"
    assert bool(status["message"]) is not expected


def test_tiers_on_engines_without_gpus_are_refused_with_the_pool_named() -> None:
    service = pds(
        {"offload": {"cpuBytes": "1Gi"}, "store": {"backend": "mooncake"}},
        decode={"gpusPerPod": 0},
        placement={"rdma": "off"},
    )
    messages = [str(problem) for problem in validate(service).problems]
    assert any(m.startswith("spec.decode.gpusPerPod") and "OffloadingConnector" in m for m in messages)
    assert any(m.startswith("spec.decode.gpusPerPod") and "MooncakeStoreConnector" in m for m in messages)
