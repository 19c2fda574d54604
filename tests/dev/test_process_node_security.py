"""A container's securityContext as the process node applies it (pure: dicts in, launch settings out)."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve_dev.process_node.podenv import ContainerConfigError
from pdserve_dev.process_node.security import CAPABILITIES, DEFAULT_CAPABILITIES, container_security, parse_user

Obj = dict[str, Any]

CHART_CONTAINER = {
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _pod(pod_context: Obj | None = None, **container_context: Any) -> tuple[Obj, Obj]:
    container: Obj = {"name": "c", "image": "x"}
    if container_context:
        container["securityContext"] = container_context
    pod: Obj = {"metadata": {"name": "p"}, "spec": {"containers": [container]}}
    if pod_context is not None:
        pod["spec"]["securityContext"] = pod_context
    return pod, container


def test_the_charts_operator_runs_as_its_user_without_capabilities_on_a_read_only_root() -> None:
    pod, container = _pod({"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532}, **CHART_CONTAINER)
    security = container_security(pod, container, image_user="65532:65532")
    assert (security.uid, security.gid, security.groups) == (65532, 65532, ())
    assert security.capabilities == ()
    assert security.no_new_privs and security.read_only_root
    assert security.not_emulated == ("seccompProfile RuntimeDefault",)


def _identity(pod: Obj, container: Obj, image_user: str | None = None) -> tuple[int, int]:
    security = container_security(pod, container, image_user)
    return security.uid, security.gid


def test_the_image_user_applies_unless_run_as_user_is_given() -> None:
    assert _identity(*_pod(), image_user="65532:65533") == (65532, 65533)
    assert _identity(*_pod(), image_user="7") == (7, 0)
    assert _identity(*_pod()) == (0, 0)
    # runAsUser without runAsGroup: the image's group is not used for another uid (gid 0, as runtimes do).
    assert _identity(*_pod({"runAsUser": 1000}), image_user="65532:65533") == (1000, 0)
    assert _identity(*_pod({"runAsUser": 1000, "runAsGroup": 5}, runAsUser=2000)) == (2000, 5)


def test_run_as_non_root_refuses_root_with_the_kubelets_messages() -> None:
    pod, container = _pod(runAsNonRoot=True)
    with pytest.raises(ContainerConfigError, match="runAsNonRoot and image will run as root"):
        container_security(pod, container)
    pod, container = _pod({"runAsNonRoot": True}, runAsUser=0)
    with pytest.raises(ContainerConfigError, match="runAsUser breaks non-root policy"):
        container_security(pod, container, image_user="65532")
    pod, container = _pod({"runAsNonRoot": True})
    assert container_security(pod, container, image_user="65532").uid == 65532


def test_capabilities_are_the_default_set_plus_add_minus_drop() -> None:
    pod, container = _pod()
    assert set(container_security(pod, container).capabilities or ()) == {CAPABILITIES[c] for c in DEFAULT_CAPABILITIES}
    pod, container = _pod(capabilities={"add": ["IPC_LOCK"], "drop": ["CAP_NET_RAW"]})
    kept = set(container_security(pod, container).capabilities or ())
    assert CAPABILITIES["IPC_LOCK"] in kept and CAPABILITIES["NET_RAW"] not in kept
    pod, container = _pod(capabilities={"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]})
    assert container_security(pod, container).capabilities == (CAPABILITIES["NET_BIND_SERVICE"],)
    pod, container = _pod(privileged=True)
    assert container_security(pod, container).capabilities is None
    pod, container = _pod(capabilities={"add": ["NOT_A_CAP"]})
    with pytest.raises(ContainerConfigError, match="NOT_A_CAP"):
        container_security(pod, container)


def test_what_cannot_be_emulated_is_reported_not_ignored() -> None:
    pod, container = _pod(
        {"sysctls": [{"name": "net.core.somaxconn", "value": "1024"}], "seccompProfile": {"type": "Unconfined"}},
        runAsUser=1000,
        capabilities={"add": ["IPC_LOCK"]},
        appArmorProfile={"type": "RuntimeDefault"},
        procMount="Unmasked",
    )
    reported = container_security(pod, container).not_emulated
    assert reported == (
        "capabilities.add ['IPC_LOCK'] for non-root user 1000",
        "appArmorProfile RuntimeDefault",
        "procMount Unmasked",
        "sysctls",
    )


def test_fs_group_and_supplemental_groups_join_the_groups() -> None:
    pod, container = _pod({"runAsUser": 10, "supplementalGroups": [7, 8], "fsGroup": 9})
    assert container_security(pod, container).groups == (7, 8, 9)


def test_image_users_must_be_numeric() -> None:
    assert parse_user("65532:65532") == (65532, 65532)
    assert parse_user(None) == (None, None)
    with pytest.raises(ContainerConfigError, match="not numeric"):
        parse_user("nonroot")
