"""Containers run with the most restrictive security context their workload accepts, and the Pod Security
Standard levels in docs/security-model.md are what a real API server's PodSecurity admission says.

Engines: no privilege escalation, the runtime's default seccomp profile, every capability dropped; IPC_LOCK added
back only where RDMA memory registration may happen (placement.rdma required or preferred). vLLM's official image
runs as root and writes its caches under /root, so non-root engines are the author's choice (engine.runAsUser).
The router runs as 65532 with a read-only root file system, as the pdserve image is built.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.api.policy import DEFAULT_POLICY, Policy
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import validate
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_operator.render import render

RESTRICTED_ENGINE = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def objects(policy: Policy = DEFAULT_POLICY, **spec: Any) -> list[dict[str, Any]]:
    base: dict[str, Any] = {
        "model": {"name": "served", "uri": "hf://org/model"},
        "engine": {"image": "vllm/vllm-openai:v0.32.0"},
    }
    base.update(spec)
    document = {"metadata": {"name": "svc", "namespace": "ns"}, "spec": base}
    return render(validate(PDService.model_validate(document), policy))


def pod_specs(rendered: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The pod template of every workload, by object name."""
    return {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]
        for o in rendered
        if o["kind"] in ("StatefulSet", "Deployment")
    }


def engine_contexts(rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pods = pod_specs(rendered)
    return [pods[f"svc-{role}"]["containers"][0]["securityContext"] for role in ("prefill", "decode")]


def test_engines_without_rdma_drop_every_capability() -> None:
    for context in engine_contexts(objects(placement={"rdma": "off"})):
        assert context == RESTRICTED_ENGINE


@pytest.mark.parametrize("rdma", ["required", "preferred"])
def test_engines_with_rdma_add_only_ipc_lock(rdma: str) -> None:
    for context in engine_contexts(objects(placement={"rdma": rdma})):
        assert context == {**RESTRICTED_ENGINE, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}


def test_engines_run_as_non_root_when_asked() -> None:
    for context in engine_contexts(objects(engine={"image": "my/vllm:nonroot", "runAsUser": 1000})):
        assert context["runAsNonRoot"] is True and context["runAsUser"] == 1000


def test_non_root_engines_get_a_writable_home() -> None:
    """vLLM keeps its caches under ~/.cache; a UID the image does not know would get HOME=/ (unwritable)."""
    for role, pod in pod_specs(objects(engine={"image": "vllm/vllm-openai:v0.32.0", "runAsUser": 2000})).items():
        if role == "svc-router":
            continue
        [container] = pod["containers"]
        assert {"name": "HOME", "value": "/home/vllm"} in container["env"]
        assert {"name": "home", "mountPath": "/home/vllm"} in container["volumeMounts"]
        assert {"name": "home", "emptyDir": {}} in pod["volumes"]
    # The image's own user keeps the image's HOME; a HOME the author sets wins.
    for pod in pod_specs(objects()).values():
        assert not any(v["name"] == "home" for v in pod["volumes"])
    engine = {"image": "vllm/vllm-openai:v0.32.0", "runAsUser": 2000, "env": [{"name": "HOME", "value": "/data"}]}
    [container] = pod_specs(objects(engine=engine))["svc-decode"]["containers"]
    assert [v for v in container["env"] if v["name"] == "HOME"] == [{"name": "HOME", "value": "/data"}]


def test_root_user_is_not_a_choice() -> None:
    problems = validate(
        {
            "metadata": {"name": "svc"},
            "spec": {"model": {"name": "m", "uri": "hf://o/m"}, "engine": {"image": "i", "runAsUser": 0}},
        }
    ).problems
    assert [p.field for p in problems] == ["spec.engine.runAsUser"]


def test_router_is_restricted() -> None:
    router = pod_specs(objects())["svc-router"]["containers"][0]["securityContext"]
    assert router == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


# --------------------------------------------------------------------------------- PodSecurity admission, real

# (mode, spec, policy, the strictest level whose admission admits every pod of it)
MODES: list[tuple[str, dict[str, Any], Policy, str]] = [
    (
        "rdma off, non-root engines",
        {"placement": {"rdma": "off"}, "engine": {"image": "i", "runAsUser": 1000}},
        Policy(),
        "restricted",
    ),
    ("rdma off, root engines", {"placement": {"rdma": "off"}}, Policy(), "baseline"),
    (
        "rdma required",
        {"placement": {"rdma": "required"}, "engine": {"image": "i", "runAsUser": 1000}},
        Policy(),
        "privileged",
    ),
    ("rdma preferred", {"placement": {"rdma": "preferred"}}, Policy(), "privileged"),
    (
        "rdma off, weights on the node",
        {"placement": {"rdma": "off"}, "model": {"name": "m", "uri": "/mnt/models/m"}},
        Policy.allowing(model_host_paths=["/mnt/models"]),
        "privileged",
    ),
]
LEVELS = ["restricted", "baseline", "privileged"]


@pytest.fixture(scope="module")
def level_namespaces(cluster: ClusterHelper) -> dict[str, str]:
    namespaces = {}
    for level in LEVELS:
        namespace = cluster.create_namespace(f"pss-{level}")
        cluster.kubectl("label", "namespace", namespace, f"pod-security.kubernetes.io/enforce={level}")
        namespaces[level] = namespace
    return namespaces


def admitted(cluster: ClusterHelper, namespace: str, name: str, pod_spec: dict[str, Any]) -> tuple[bool, str]:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": pod_spec}
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
    return result.returncode == 0, result.stdout + result.stderr


@pytest.mark.cluster
@pytest.mark.parametrize(("mode", "spec", "policy", "level"), MODES, ids=[m[0] for m in MODES])
def test_pod_security_level_of_each_mode(  # noqa: PLR0917 - pytest passes fixtures and parameters positionally
    cluster: ClusterHelper,
    level_namespaces: dict[str, str],
    mode: str,
    spec: dict[str, Any],
    policy: Policy,
    level: str,
) -> None:
    engines = {name: pod for name, pod in pod_specs(objects(policy, **spec)).items() if name != "svc-router"}
    for name, pod in engines.items():
        ok, output = admitted(cluster, level_namespaces[level], name, pod)
        assert ok, f"{mode}: {name} refused at {level}: {output}"
        stricter = LEVELS[LEVELS.index(level) - 1] if level != "restricted" else None
        if stricter is not None:
            ok, output = admitted(cluster, level_namespaces[stricter], name, pod)
            assert not ok and "violates PodSecurity" in output, f"{mode}: {name} admitted at {stricter}"


@pytest.mark.cluster
def test_router_pods_are_admitted_as_restricted(cluster: ClusterHelper, level_namespaces: dict[str, str]) -> None:
    pod = pod_specs(objects())["svc-router"]
    # The ServiceAccount is another rendered object; Pod Security does not look at it.
    pod = {key: value for key, value in pod.items() if key != "serviceAccountName"}
    ok, output = admitted(cluster, level_namespaces["restricted"], "router", pod)
    assert ok, output
