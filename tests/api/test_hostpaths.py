"""Model weights from a node path: off unless an administrator allows a prefix, never a system path.

A PDService author chooses the engine image, so a hostPath mount is the node's file system in the author's hands:
`/var/lib/kubelet` holds every pod's Secrets and the kubelet's credentials. The CRD refuses un-normalised and
system paths itself (rules.py); the allow-list is the operator's (and `pdserve validate`'s) policy.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.api import hostpaths
from pdserve.api.policy import Policy, PolicyError
from pdserve.api.validation import validate

MODELS = Policy.allowing(model_host_paths=["/mnt/models"])


def pds(uri: str) -> dict[str, Any]:
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDService",
        "metadata": {"name": "svc"},
        "spec": {"model": {"name": "m", "uri": uri}, "engine": {"image": "vllm:1"}},
    }


def uri_problems(uri: str, policy: Policy = MODELS) -> list[str]:
    return [p.message for p in validate(pds(uri), policy).problems if p.field == "spec.model.uri"]


def test_node_paths_are_off_by_default() -> None:
    (message,) = uri_problems("/mnt/models/llama", Policy())
    assert "--allow-model-host-paths" in message
    assert validate(pds("/mnt/models/llama")).problems, "validate() without a policy allows no node path"


def test_an_allowed_prefix_admits_paths_under_it() -> None:
    assert uri_problems("/mnt/models/llama") == []
    assert uri_problems("/mnt/models") == []


@pytest.mark.parametrize("uri", ["/mnt/modelsx/llama", "/mnt/other", "/opt/models/llama", "/mnt"])
def test_paths_outside_the_allowed_prefixes_are_refused(uri: str) -> None:
    (message,) = uri_problems(uri)
    assert "/mnt/models" in message, "the message names what is allowed"


@pytest.mark.parametrize(
    "uri",
    [
        "/",
        "/etc",
        "/etc/kubernetes/pki",
        "/proc/1/root",
        "/sys/kernel",
        "/dev/nvidia0",
        "/var/lib/kubelet",
        "/var/lib/kubelet/pods",
        "/var/run/containerd",
        "/run/secrets",
        "/root",
        "/boot",
        "/var",  # holds /var/lib/kubelet
        "/var/lib",
        "/home/admin",
    ],
)
def test_system_paths_are_refused_even_when_allowed(uri: str) -> None:
    everything = Policy(model_host_paths=("/etc", "/proc", "/var", "/run", "/root", "/boot", "/home", "/sys", "/dev"))
    problems = uri_problems(uri, everything)
    assert problems and any("system path" in message for message in problems), problems


@pytest.mark.parametrize(
    "uri",
    ["/mnt/models/../../../etc", "/mnt/models/..", "/mnt/models/./llama", "/mnt//models/llama", "/mnt/models/llama/"],
)
def test_paths_must_be_normalised(uri: str) -> None:
    problems = uri_problems(uri, Policy(model_host_paths=("/mnt",)))
    assert any("normalised" in message for message in problems), problems


@pytest.mark.parametrize("prefix", ["/", "/etc", "/var/lib/kubelet/pods", "mnt/models", "/mnt/../etc", "/mnt//m", ""])
def test_an_administrator_cannot_allow_a_system_or_unnormalised_prefix(prefix: str) -> None:
    with pytest.raises(PolicyError):
        Policy.allowing(model_host_paths=[prefix])


def test_hostpath_facts() -> None:
    assert hostpaths.is_normalised("/mnt/models/llama-3.1")
    assert not hostpaths.is_normalised("/mnt/models/../x")
    assert hostpaths.touches_system_path("/var")
    assert hostpaths.touches_system_path("/var/lib/kubelet/pods/x")
    assert not hostpaths.touches_system_path("/var/models")
    assert hostpaths.under("/mnt/models/x", "/mnt/models") and not hostpaths.under("/mnt/modelsx", "/mnt/models")
