"""Router mode gateway: the InferencePool, the picker in place of the router, the PD sidecar on decode pods."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.validation import validate
from pdserve.cli.manifests import dump_stream
from pdserve_dev.testing.examples import POLICY
from pdserve_operator.render import render

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = Path(__file__).resolve().parent / "golden"
EXAMPLE = ROOT / "examples" / "gateway" / "pdservice.yaml"


def objects(**router: Any) -> list[dict[str, Any]]:
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["router"].update(router)
    return render(validate(document, POLICY))


def find(rendered: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in rendered if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, (kind, name)
    return matches[0]


def test_gateway_example_matches_golden() -> None:
    golden = GOLDEN / "gateway.yaml"
    text = dump_stream(objects())
    if os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), "gateway.yaml is missing: run with PDSERVE_UPDATE_GOLDEN=1 and review the new file"
    assert text == golden.read_text(), "render changed; see the diff and update gateway.yaml"


def test_the_pool_selects_current_decode_pods_on_the_sidecar_port_and_names_the_picker() -> None:
    rendered = objects(gateway={"failureMode": "FailOpen", "sidecarPort": 8300, "pickerPort": 9100})
    pool = find(rendered, "InferencePool", "llama")
    decode = find(rendered, "StatefulSet", "llama-decode")
    pod_labels = decode["spec"]["template"]["metadata"]["labels"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert "pdserve.io/kv-compat" in pool["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPorts"] == [{"number": 8300}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "", "kind": "Service", "name": "llama-router", "port": {"number": 9100}, "failureMode": "FailOpen",
    }  # fmt: skip
    service = find(rendered, "Service", "llama-router")
    grpc = [port for port in service["spec"]["ports"] if port["port"] == 9100]
    assert grpc and grpc[0]["appProtocol"] == "kubernetes.io/h2c"
    assert pool["metadata"].get("ownerReferences") == decode["metadata"].get("ownerReferences")


def test_the_picker_runs_in_the_routers_deployment_with_the_routers_role() -> None:
    gateway, plain = objects(), objects(mode="router")
    deployment = find(gateway, "Deployment", "llama-router")
    container, relay = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["pdserve", "picker"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    # The gateway's port is the relay's; the picker listens pod-locally beside it.
    assert relay["command"] == ["pdserve-picker-relay"]
    assert relay["ports"] == [{"name": "grpc", "containerPort": 9002, "protocol": "TCP"}]
    assert relay["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert relay["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    assert relay["args"] == ["--listen=:9002", "--picker-link=:9004", "--picker-grpc=:9003"]
    assert relay["securityContext"]["runAsNonRoot"] is True
    # Least privilege: exactly the router's Role (list/watch EndpointSlices), nothing for the gateway path.
    assert find(gateway, "Role", "llama-router") == find(plain, "Role", "llama-router")
    assert container["args"][-6:] == ["--grpc-port", "9003", "--link-port", "9004", "--target-port", "8100"]
    # The config is the router's, unchanged: the picker discovers and scores engines exactly as the router does.
    assert find(gateway, "ConfigMap", "llama-router") == find(plain, "ConfigMap", "llama-router")


@pytest.mark.parametrize(
    ("picker_port", "router_port", "expected"), [(9002, 8080, (9003, 9004)), (9003, 9004, (9005, 9006))]
)
def test_the_pickers_pod_local_ports_take_no_port_of_its_pod(
    picker_port: int, router_port: int, expected: tuple[int, int]
) -> None:
    rendered = objects(port=router_port, gateway={"pickerPort": picker_port})
    containers = find(rendered, "Deployment", "llama-router")["spec"]["template"]["spec"]["containers"]
    declared = {port["containerPort"] for container in containers for port in container["ports"]}
    args = containers[0]["args"]
    local = (int(args[args.index("--grpc-port") + 1]), int(args[args.index("--link-port") + 1]))
    assert local == expected
    assert not declared & set(local)


def test_decode_pods_get_the_sidecar_and_prefill_pods_do_not() -> None:
    rendered = objects()
    decode = find(rendered, "StatefulSet", "llama-decode")["spec"]["template"]["spec"]["containers"]
    prefill = find(rendered, "StatefulSet", "llama-prefill")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in decode] == ["vllm", "pd-sidecar"]
    assert [c["name"] for c in prefill] == ["vllm"]
    sidecar = decode[1]
    assert sidecar["command"] == ["pdserve", "sidecar"]
    assert sidecar["args"][:4] == ["--port", "8100", "--decode", "http://$(POD_IP):8000"]
    assert sidecar["args"][4:] == ["--kv-side-channel-port", "5600"]
    assert sidecar["securityContext"]["runAsNonRoot"] is True


def test_router_mode_renders_no_pool_and_no_sidecar() -> None:
    rendered = objects(mode="router")
    assert not [o for o in rendered if o["kind"] == "InferencePool"]
    decode = find(rendered, "StatefulSet", "llama-decode")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in decode] == ["vllm"]
