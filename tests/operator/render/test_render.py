"""Behaviour of the renderer that users and the router rely on, asserted object by object."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from pdserve.api.defaults import effective
from pdserve.api.kvcompat import KV_COMPAT_LABEL, kv_compat_hash
from pdserve.api.policy import Policy
from pdserve.api.router_config import RouterConfig, RouterControl
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import InvalidSpecError, validate
from pdserve_operator.render import Observed, render


def pds(**spec: Any) -> PDService:
    base: dict[str, Any] = {
        "model": {"name": "served", "uri": "hf://org/model"},
        "engine": {"image": "vllm/vllm-openai:v0.32.0"},
    }
    base.update(spec)
    return PDService.model_validate({"metadata": {"name": "svc", "namespace": "ns", "uid": "u-1"}, "spec": base})


def by_kind(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [obj] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def engine_container(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    sts = by_kind(objects, "StatefulSet", f"svc-{role}")
    container: dict[str, Any] = sts["spec"]["template"]["spec"]["containers"][0]
    return container


def arg_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_object_inventory_and_order() -> None:
    checked = validate(pds())
    kinds = [(o["kind"], o["metadata"]["name"]) for o in render(checked)]
    compat = kv_compat_hash(effective(checked.require()[0].spec))
    assert kinds == [
        ("ServiceAccount", "svc-router"),
        ("Role", "svc-router"),
        ("RoleBinding", "svc-router"),
        ("ConfigMap", "svc-router"),
        ("ConfigMap", "svc-router-discovery"),
        ("Service", "svc-prefill"),
        ("Service", f"svc-prefill-{compat}"),
        ("StatefulSet", "svc-prefill"),
        ("PodDisruptionBudget", "svc-prefill"),
        ("Service", "svc-decode"),
        ("Service", f"svc-decode-{compat}"),
        ("StatefulSet", "svc-decode"),
        ("PodDisruptionBudget", "svc-decode"),
        ("Service", "svc-router"),
        ("Deployment", "svc-router"),
        ("PodDisruptionBudget", "svc-router"),
    ]


def test_every_object_is_owned() -> None:
    for obj in render(validate(pds())):
        meta = obj["metadata"]
        assert meta["namespace"] == "ns"
        assert meta["labels"]["app.kubernetes.io/instance"] == "svc"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "pdserve-operator"
        assert meta["labels"]["pdserve.io/role"] in {"prefill", "decode", "router"}
        [owner] = meta["ownerReferences"]
        assert owner == {
            "apiVersion": "pdserve.io/v1alpha1",
            "kind": "PDService",
            "name": "svc",
            "uid": "u-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }


@pytest.mark.parametrize(("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_engine_command_line(role: str, kv_role: str) -> None:
    objects = render(validate(pds(prefill={"tensorParallelSize": 2}, decode={"tensorParallelSize": 4})))
    container = engine_container(objects, role)
    assert container["command"] == ["vllm", "serve"]
    args = container["args"]
    assert args[0] == "org/model"
    assert arg_value(args, "--served-model-name") == "served"
    assert arg_value(args, "--port") == "8000"
    assert arg_value(args, "--tensor-parallel-size") == ("2" if role == "prefill" else "4")
    config = json.loads(arg_value(args, "--kv-transfer-config"))
    assert config["kv_connector"] == "NixlConnector"
    assert config["kv_role"] == kv_role
    # Unique per pod incarnation (KNOWLEDGE.md, stale NIXL peers): name and UID from the downward API.
    assert config["engine_id"] == "$(POD_NAME)-$(POD_UID)"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("VLLM_NIXL_SIDE_CHANNEL_HOST"), "$(POD_IP) must be defined first"
    resources = container["resources"]
    gpus = "2" if role == "prefill" else "4"
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == gpus
    assert resources["limits"]["rdma/ib"] == "1"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


@pytest.mark.parametrize(
    ("engine", "prefill_timeout", "decode_timeout"),
    [
        ({}, 120, 120),  # the default drain
        ({"drainSeconds": 10, "kvLeaseSeconds": 45}, 45, 10),  # prefill serves the KV it handed out: the lease
        ({"drainSeconds": 0}, 0, 0),  # asked for vLLM's abort-at-once
    ],
)
def test_engines_drain_on_termination(engine: dict[str, Any], prefill_timeout: int, decode_timeout: int) -> None:
    spec = pds(engine={"image": "vllm/vllm-openai:v0.32.0", **engine})
    objects = render(validate(spec))
    for role, timeout in (("prefill", prefill_timeout), ("decode", decode_timeout)):
        pod = by_kind(objects, "StatefulSet", f"svc-{role}")["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert arg_value(container["args"], "--shutdown-timeout") == str(timeout)
        # SIGTERM waits until the endpoint removal has reached the router...
        assert container["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}
        # ...and the kubelet's SIGKILL waits for the preStop hook, the whole drain and vLLM's own teardown.
        assert pod["terminationGracePeriodSeconds"] == 5 + timeout + 10


def test_kv_compat_label_same_on_both_pools_and_changes_with_image() -> None:
    first = render(validate(pds()))
    labels = [
        by_kind(first, "StatefulSet", f"svc-{r}")["spec"]["template"]["metadata"]["labels"]
        for r in ("prefill", "decode")
    ]
    assert labels[0][KV_COMPAT_LABEL] == labels[1][KV_COMPAT_LABEL] == kv_compat_hash(effective(pds().spec))
    second = render(validate(pds(engine={"image": "vllm/vllm-openai:v0.33.0"})))
    new = by_kind(second, "StatefulSet", "svc-decode")["spec"]["template"]["metadata"]["labels"][KV_COMPAT_LABEL]
    assert new != labels[0][KV_COMPAT_LABEL]
    # The label never enters the (immutable) selector.
    for sts in (o for o in second if o["kind"] == "StatefulSet"):
        assert KV_COMPAT_LABEL not in sts["spec"]["selector"]["matchLabels"]


def test_model_sources() -> None:
    pvc = render(validate(pds(model={"name": "m", "uri": "pvc://store/llama/v1"})))
    container = engine_container(pvc, "decode")
    assert container["args"][0] == "/models/store/llama/v1"
    volumes = by_kind(pvc, "StatefulSet", "svc-decode")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "store", "readOnly": True}} in volumes
    host = render(validate(pds(model={"name": "m", "uri": "/mnt/w"}), Policy.allowing(model_host_paths=["/mnt"])))
    assert engine_container(host, "prefill")["args"][0] == "/mnt/w"
    hf = render(validate(pds(model={"name": "m", "uri": "hf://org/model", "revision": "abc", "hfTokenSecret": "tok"})))
    container = engine_container(hf, "prefill")
    assert arg_value(container["args"], "--revision") == "abc"
    assert any(e["name"] == "HF_TOKEN" for e in container["env"])


def test_rdma_policies() -> None:
    required = engine_container(render(validate(pds())), "decode")
    assert "rdma/ib" in required["resources"]["limits"]
    assert {"name": "UCX_TLS", "value": "rc,cuda_copy,cuda_ipc"} in required["env"]
    off = render(validate(pds(placement={"rdma": "off"})))
    container = engine_container(off, "decode")
    assert "rdma/ib" not in container["resources"]["limits"]
    assert {"name": "UCX_TLS", "value": "tcp,cuda_copy"} in container["env"]
    preferred = render(validate(pds(placement={"rdma": "preferred", "rdmaNodeLabel": "example.com/ib"})))
    affinity = by_kind(preferred, "StatefulSet", "svc-prefill")["spec"]["template"]["spec"]["affinity"]
    term = affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["preference"]["matchExpressions"] == [{"key": "example.com/ib", "operator": "Exists"}]


def test_ucx_spec_overrides_ucx_default() -> None:
    container = engine_container(render(validate(pds(engine={"image": "i", "ucx": {"transports": "all"}}))), "decode")
    assert [e for e in container["env"] if e["name"] == "UCX_TLS"] == [{"name": "UCX_TLS", "value": "all"}]


def test_user_env_comes_after_pdserves_and_a_pool_overrides_the_engine() -> None:
    objects = render(
        validate(
            pds(
                engine={"image": "i", "env": [{"name": "A", "value": "engine"}, {"name": "B", "value": "b"}]},
                decode={"env": [{"name": "A", "value": "decode"}]},
            )
        )
    )
    env = engine_container(objects, "decode")["env"]
    names = [e["name"] for e in env]
    assert names[-2:] == ["A", "B"] and len(names) == len(set(names))
    assert {"name": "A", "value": "decode"} in env


def test_colocation() -> None:
    required = render(validate(pds(placement={"topologyKey": "pdserve.io/rack", "colocation": "required"})))
    for role in ("prefill", "decode"):
        affinity = by_kind(required, "StatefulSet", f"svc-{role}")["spec"]["template"]["spec"]["affinity"]
        [term] = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "pdserve.io/rack"
        assert term["labelSelector"]["matchLabels"] == {"app.kubernetes.io/instance": "svc"}
    preferred = render(validate(pds(placement={"topologyKey": "pdserve.io/rack"})))
    affinity = by_kind(preferred, "StatefulSet", "svc-decode")["spec"]["template"]["spec"]["affinity"]
    [term] = affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"]["pdserve.io/role"] == "prefill"
    none = render(validate(pds(placement={"topologyKey": "pdserve.io/rack", "colocation": "none"})))
    assert "affinity" not in by_kind(none, "StatefulSet", "svc-decode")["spec"]["template"]["spec"]


def test_router_objects() -> None:
    objects = render(validate(pds(router={"port": 9000, "replicas": 3, "routing": {"disaggregationThreshold": 100}})))
    config = RouterConfig.model_validate(
        yaml.safe_load(by_kind(objects, "ConfigMap", "svc-router")["data"]["router.yaml"])
    )
    assert config.served_model_name == "served"
    assert config.port == 9000
    assert config.policy.disaggregation_threshold_tokens == 100
    selector = "app.kubernetes.io/instance=svc,pdserve.io/role={},pdserve.io/kv-compat"
    assert config.prefill is not None and config.prefill.label_selector == selector.format("prefill")
    assert config.decode is not None and config.decode.label_selector == selector.format("decode")
    assert config.discovery_config_map is not None and config.discovery_config_map.name == "svc-router-discovery"
    assert config.kv_side_channel_ports == [5600]
    deployment = by_kind(objects, "Deployment", "svc-router")
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "svc-router"
    assert pod["containers"][0]["securityContext"]["runAsNonRoot"] is True
    role = by_kind(objects, "Role", "svc-router")
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["svc-router-discovery", "svc-router-control"],
            "verbs": ["list", "watch"],
        },
    ]
    # Late binding (issue 19): the budgets and the deadline come from the spec, the replicas from the Service.
    assert config.router_control is not None and config.router_control.name == "svc-router-control"
    admission = config.admission
    assert (admission.prefill_budget_tokens, admission.decode_budget_sequences) == (0, 0)  # lateBinding is off
    assert admission.peers is not None
    assert admission.peers.label_selector == "kubernetes.io/service-name=svc-router"
    assert admission.router_replicas == 1  # not the spec's 3: scaling the routers must not roll them
    tuned = render(
        validate(
            pds(
                prefill={"maxNumBatchedTokens": 4096},
                decode={"maxNumSeqs": 128},
                slo={"ttftMilliseconds": 800},
                router={"routing": {"lateBinding": True}},
            )
        )
    )
    admission = RouterConfig.model_validate(
        yaml.safe_load(by_kind(tuned, "ConfigMap", "svc-router")["data"]["router.yaml"])
    ).admission
    assert (admission.prefill_budget_tokens, admission.decode_budget_sequences) == (6144, 128)
    # The deadlines' TTFT target is published in the router control ConfigMap, which every replica applies at once.
    assert admission.ttft_target_seconds is None
    control = control_of(tuned)
    assert control is not None
    assert (control.ttft_target_seconds, control.disaggregation_threshold) == (0.8, None)  # the threshold is static

    def config_hash(objects: list[dict[str, Any]]) -> str:
        template = by_kind(objects, "Deployment", "svc-router")["spec"]["template"]
        return str(template["metadata"]["annotations"]["pdserve.io/config-hash"])

    # A routing change rolls the router through the config hash annotation; a change of the SLO does not.
    other = render(validate(pds(router={"port": 9000, "replicas": 3, "routing": {"disaggregationThreshold": 200}})))
    assert config_hash(other) != config_hash(objects)
    faster = render(
        validate(
            pds(
                prefill={"maxNumBatchedTokens": 4096},
                decode={"maxNumSeqs": 128},
                slo={"ttftMilliseconds": 400, "itlMilliseconds": 20},
                router={"routing": {"lateBinding": True}},
            )
        )
    )
    assert config_hash(faster) == config_hash(tuned)
    assert (control := control_of(faster)) is not None and control.ttft_target_seconds == 0.4


@pytest.mark.parametrize(("port", "metrics_port"), [(8080, 9090), (9090, 9091)])
def test_the_router_serves_metrics_on_a_port_of_its_own_that_clients_are_not_given(
    port: int, metrics_port: int
) -> None:
    objects = render(validate(pds(router={"port": port})))
    config = RouterConfig.model_validate(
        yaml.safe_load(by_kind(objects, "ConfigMap", "svc-router")["data"]["router.yaml"])
    )
    assert (config.port, config.metrics_port) == (port, metrics_port)
    [container] = by_kind(objects, "Deployment", "svc-router")["spec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": port, "metrics": metrics_port}
    # The Service (a LoadBalancer, when asked) publishes only the client port.
    service = by_kind(objects, "Service", "svc-router")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_autoscaling_clamps_replicas() -> None:
    objects = render(
        validate(pds(decode={"replicas": 20, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}}))
    )
    assert by_kind(objects, "StatefulSet", "svc-decode")["spec"]["replicas"] == 5
    objects = render(validate(pds(decode={"autoscaling": {"enabled": True, "minReplicas": 3}})))
    assert by_kind(objects, "StatefulSet", "svc-decode")["spec"]["replicas"] == 3


def control_of(objects: list[dict[str, Any]]) -> RouterControl | None:
    """The router control ConfigMap's content, None when none is rendered."""
    found = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "svc-router-control"]
    return RouterControl.model_validate_json(found[0]["data"]["control.json"]) if found else None


def test_the_router_control_configmap_publishes_the_threshold_while_the_autoscaler_may_choose_it() -> None:
    assert control_of(render(validate(pds()))) is None  # no bounds: routers keep their configured threshold
    fixed = pds(autoscaling={"disaggregationThreshold": {"minTokens": 256, "maxTokens": 256}})
    assert control_of(render(validate(fixed))) is None
    bounded = validate(
        pds(
            router={"routing": {"disaggregationThreshold": 128}},
            autoscaling={"disaggregationThreshold": {"minTokens": 256, "maxTokens": 2048}},
        )
    )
    objects = render(bounded)
    control = control_of(objects)
    # Nothing decided yet: the configured value, kept within the bounds; the router's own config is unchanged.
    assert control is not None and control.disaggregation_threshold == 256
    assert "not decided yet" in control.reason
    router = RouterConfig.model_validate(
        yaml.safe_load(by_kind(objects, "ConfigMap", "svc-router")["data"]["router.yaml"])
    )
    assert router.policy.disaggregation_threshold_tokens == 128
    decided = RouterControl(disaggregation_threshold=1024, reason="prefill short", decided_at="2026-12-03T00:00:00Z")
    assert control_of(render(bounded, Observed(router_control=decided))) == decided
    # Decided under wider bounds than the spec's now: never published outside them.
    wide = RouterControl(disaggregation_threshold=8192, reason="prefill short")
    clamped = control_of(render(bounded, Observed(router_control=wide)))
    assert clamped is not None and clamped.disaggregation_threshold == 2048
    assert clamped.reason == "prefill short (kept within [256, 2048])"


def test_invalid_spec_is_not_rendered() -> None:
    with pytest.raises(InvalidSpecError, match=r"spec\.prefill\.tensorParallelSize"):
        render(validate(pds(prefill={"tensorParallelSize": 2})))


def test_render_is_deterministic() -> None:
    assert render(validate(pds())) == render(validate(pds()))
