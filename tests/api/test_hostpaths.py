"""Model weights from a node path: off unless an administrator allows a prefix, never a system path.

A PDService author chooses the engine image, so a hostPath mount is the node's file system in the author's hands:
`/var/lib/kubelet` holds every pod's Secrets and the kubelet's credentials. The CRD refuses un-normalised and
system paths itself (rules.py); the allow-list is the operator's (and `pdserve validate`'s) policy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from pdserve.api import hostpaths
from pdserve.api.policy import Policy, PolicyError
from pdserve.api.validation import validate

MODELS = Policy.allowing(model_host_paths=["/mnt/models"])
ROOT = Path(__file__).resolve().parents[2]


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
    assert problems and any("system folder" in message for message in problems), problems


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


@pytest.mark.parametrize(
    ("prefix", "named"),
    [
        ("/var", "/var/lib/calico"),  # and /var/lib/kubelet, /var/log, ...
        ("/var/lib", "/var/lib/calico"),
        ("/opt", "/opt/cni"),
        ("/var/lib/kubernetes", "/var/lib/kubernetes"),
        ("/var/lib/rancher/k3s", "/var/lib/rancher"),
        ("/opt/cni/bin", "/opt/cni"),
        ("/var/snap/microk8s", "/var/snap"),
    ],
)
def test_an_administrator_cannot_allow_a_folder_that_holds_a_system_folder(prefix: str, named: str) -> None:
    """Issue 18.10: `/var` (and `/var/lib`, `/opt`) was accepted, and then `/var/lib/kubernetes`,
    `/var/lib/rancher/k3s` and `/opt/cni/bin` rendered as hostPath mounts."""
    with pytest.raises(PolicyError) as error:
        Policy.allowing(model_host_paths=["/mnt/models", prefix])
    assert named in str(error.value) and "docs/security.md" in str(error.value)


@pytest.mark.parametrize("prefix", ["/mnt/models", "/var/lib/models", "/opt/models", "/data/llm", "/srv/weights"])
def test_dedicated_model_folders_are_allowed(prefix: str) -> None:
    assert Policy.allowing(model_host_paths=[prefix]).allows_model_host_path(f"{prefix}/llama")


@pytest.mark.parametrize("uri", ["/var/lib/kubernetes/pki", "/var/lib/rancher/k3s/server", "/opt/cni/bin", "/opt"])
def test_distribution_and_network_plugin_state_is_refused_whatever_the_policy(uri: str) -> None:
    """Even under a policy built without `allowing` (a prefix that holds the folder), the rules refuse the path."""
    problems = uri_problems(uri, Policy(model_host_paths=("/var", "/opt")))
    assert any("system folder" in message for message in problems), problems


def _sample_paths() -> set[str]:
    """Every system folder, the folders above and below it, its look-alike siblings, and ordinary folders."""
    paths = {"/", "/mnt", "/mnt/models", "/data", "/var/lib/models", "/opt/models", "/srv", "/optx", "/varx/lib"}
    for system in hostpaths.SYSTEM_PATHS:
        parts = system.split("/")
        paths |= {"/".join(parts[:depth]) or "/" for depth in range(1, len(parts) + 1)}
        paths |= {system + "/x", system + "x", system + "-x", system + "x/y"}
    return paths


def test_the_chart_pattern_refuses_exactly_what_the_rules_refuse() -> None:
    """`touching_pattern` (the chart schema's copy of the rule, RE2 syntax) agrees with `touches_system_path` on
    every path of a sample built from the table itself."""
    pattern = re.compile(hostpaths.touching_pattern())
    disagree = [p for p in sorted(_sample_paths()) if bool(pattern.search(p)) != hostpaths.touches_system_path(p)]
    assert disagree == []


def test_security_doc_lists_every_system_folder() -> None:
    doc = (ROOT / "docs" / "security.md").read_text()
    missing = [f.path for f in hostpaths.SYSTEM_FOLDERS if f"| `{f.path}` | {f.holds} |" not in doc]
    assert missing == []


def test_hostpath_facts() -> None:
    assert hostpaths.is_normalised("/mnt/models/llama-3.1")
    assert not hostpaths.is_normalised("/mnt/models/../x")
    assert hostpaths.touches_system_path("/var")
    assert hostpaths.touches_system_path("/opt") and not hostpaths.touches_system_path("/opt/models")
    assert hostpaths.touches_system_path("/var/lib/kubelet/pods/x")
    assert not hostpaths.touches_system_path("/var/models")
    assert hostpaths.under("/mnt/models/x", "/mnt/models") and not hostpaths.under("/mnt/modelsx", "/mnt/models")
