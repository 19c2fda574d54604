"""The chart's security guards, offline (`helm lint --strict`, `helm template`), as an administrator meets them:
the values that would weaken the cluster are not schema-valid unless an `unsafe.*` switch says so (issue 18.10,
18.11).

- `operator.allowModelHostPaths`: never `/`, a system folder, a folder in one, or a folder holding one (`/var`,
  `/var/lib`, `/opt`); no switch turns this off (the operator refuses such a prefix at start either way).
- `operator.podSecurityContext` / `securityContext`: Pod Security `restricted` plus a read-only root filesystem,
  unless `unsafe.allowPrivileged`.
- `operator.extraArgs`: no flag the chart sets from a value, no `--kubeconfig`, no short option, unless
  `unsafe.allowOwnedArgs`.
- `watch.namespaces`: no `kube-*` namespace unless `unsafe.allowSystemNamespaces`.

`test_chart_cluster.py` checks against the API server that the values refused here are exactly those the Pod
Security admission warns about, and what the operator's ServiceAccount may do in kube-system in each mode.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api import hostpaths
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.helm import HelmError, lint, template, template_text
from pdserve_operator.cli import operator as operator_command

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdserve"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
NAMESPACED = {"watch": {"mode": "namespaced", "namespaces": ["team-a"]}}


def refused(values: dict[str, Any], *needles: str) -> str:
    """`helm lint --strict` must fail on `values` and name every needle; returns its output. (`helm template` and
    `helm install` run the same schema check: `test_template_refuses_what_lint_refuses`.)"""
    result = lint(CHART, values=values)
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"helm lint accepted {values}"
    for needle in needles:
        assert needle in output, (needle, output)
    return output


def accepted(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The objects `helm template` renders from `values` (it fails on a value the schema refuses)."""
    return template(CHART, values=values)


def test_template_refuses_what_lint_refuses() -> None:
    for values in (
        {"operator.allowModelHostPaths": ["/var"]},
        {"operator.securityContext.privileged": True},
        {"operator.extraArgs": ["--all-namespaces"]},
        {"watch": {"mode": "namespaced", "namespaces": ["kube-system"]}},
    ):
        with pytest.raises(HelmError, match="values don't meet the specifications of the schema"):
            template(CHART, values=values)


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


# ------------------------------------------------------------------------------------------- node paths (18.10)


@pytest.mark.parametrize(
    "prefix",
    [
        "/var",  # holds /var/lib/kubelet
        "/var/lib",
        "/opt",  # holds /opt/cni
        "/",
        "/var/lib/kubernetes",
        "/var/lib/rancher/k3s",
        "/opt/cni/bin",
        "/etc/models",
        "/mnt/../etc",
        "/mnt/models/",
    ],
)
def test_schema_refuses_host_path_prefixes_that_touch_system_folders(prefix: str) -> None:
    refused({"operator.allowModelHostPaths": ["/mnt/models", prefix]}, "/operator/allowModelHostPaths/1")


def test_no_unsafe_switch_admits_a_system_host_path() -> None:
    """The operator refuses such a prefix at start whatever the chart says; the chart never renders one."""
    every = {"allowPrivileged": True, "allowOwnedArgs": True, "allowSystemNamespaces": True}
    refused({"unsafe": every, "operator.allowModelHostPaths": ["/var"]}, "allowModelHostPaths")


def test_schema_admits_dedicated_model_folders() -> None:
    prefixes = ["/mnt/models", "/var/lib/models", "/opt/models", "/data/llm"]
    args = operator_container(accepted({"operator.allowModelHostPaths": prefixes}))["args"]
    assert [a for a in args if a.startswith("--allow-model-host-paths")] == [
        f"--allow-model-host-paths={p}" for p in prefixes
    ]


def test_schema_host_path_rules_are_the_api_rules() -> None:
    """The schema's patterns are generated from the one table (`hostpaths`), not written by hand."""
    items = SCHEMA["properties"]["operator"]["properties"]["allowModelHostPaths"]["items"]
    assert {"not": {"pattern": hostpaths.touching_pattern()}} in items["allOf"]
    assert {"not": {"pattern": hostpaths.UNNORMALISED}} in items["allOf"]


# ------------------------------------------------------------------------------------ security contexts (18.11)

# (value path, value): each breaks Pod Security `restricted` or the chart's read-only root filesystem.
WEAKER_SECURITY: list[tuple[str, Any]] = [
    ("operator.securityContext.privileged", True),
    ("operator.securityContext.runAsUser", 0),
    ("operator.podSecurityContext.runAsUser", 0),
    ("operator.securityContext.runAsNonRoot", False),
    ("operator.podSecurityContext.runAsNonRoot", False),
    ("operator.securityContext.allowPrivilegeEscalation", True),
    ("operator.securityContext.readOnlyRootFilesystem", False),
    ("operator.securityContext.capabilities", {"add": ["SYS_ADMIN"]}),
    ("operator.securityContext.capabilities", {"drop": ["NET_RAW"]}),
    ("operator.securityContext.seccompProfile", {"type": "Unconfined"}),
    ("operator.podSecurityContext.seccompProfile", {"type": "Unconfined"}),
    ("operator.securityContext.appArmorProfile", {"type": "Unconfined"}),
    ("operator.securityContext.seLinuxOptions", {"type": "spc_t"}),
    ("operator.securityContext.procMount", "Unmasked"),
    ("operator.podSecurityContext.sysctls", [{"name": "kernel.msgmax", "value": "65536"}]),
    ("operator.securityContext.windowsOptions", {"hostProcess": True}),
    ("operator.podSecurityContext.runAsGroup", 0),
]


def _id(case: tuple[str, Any]) -> str:
    return f"{case[0].removeprefix('operator.')}={json.dumps(case[1])}"


@pytest.mark.parametrize("case", WEAKER_SECURITY, ids=_id)
def test_weaker_security_contexts_need_unsafe_allow_privileged(case: tuple[str, Any]) -> None:
    path, value = case
    field = path.split(".")[1]  # securityContext or podSecurityContext
    # The error names the value and the switch that would admit it.
    refused({path: value}, f"/operator/{field}", "/unsafe/allowPrivileged")
    # With the switch, the value reaches the Deployment unchanged.
    objects = accepted({path: value, "unsafe.allowPrivileged": True})
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    rendered = pod["securityContext"] if field == "podSecurityContext" else pod["containers"][0]["securityContext"]
    leaf = path.split(".")[2]
    if isinstance(value, dict):
        assert value.items() <= rendered[leaf].items()
    else:
        assert rendered[leaf] == value


BEYOND_POD_SECURITY = {"operator.securityContext.readOnlyRootFilesystem", "operator.podSecurityContext.runAsGroup"}
"""Refused although Pod Security `restricted` allows them: the chart's own hardening."""
API_REFUSES = {"operator.securityContext.windowsOptions", "operator.securityContext.procMount"}
"""The API server's validation refuses these on a Linux pod before Pod Security looks (hostProcess needs
hostNetwork; an Unmasked /proc needs a user namespace)."""
COMPANIONS: dict[str, dict[str, Any]] = {
    "operator.securityContext.privileged": {"operator.securityContext.allowPrivilegeEscalation": True},
}
"""What the API server requires beside a value (a privileged container cannot forbid privilege escalation)."""


@pytest.mark.cluster
@pytest.mark.slow
def test_the_schema_refuses_what_pod_security_restricted_refuses(cluster: ClusterHelper) -> None:
    """The API server's own Pod Security admission judges the rendered Deployment (server-side dry run in a
    namespace that warns at `restricted`): the defaults pass, and every value the schema refuses without
    `unsafe.allowPrivileged` is one it warns about (or refuses outright), but the chart's own extras."""
    namespace = cluster.create_namespace("chart-pss")
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/warn=restricted")
    try:

        def dry_run(values: dict[str, Any]) -> subprocess.CompletedProcess[str]:
            text = template_text(CHART, values=values, namespace=namespace, show_only=["templates/deployment.yaml"])
            return cluster.kubectl(
                "apply", "--dry-run=server", "--server-side", "-f", "-", input=text, check=False, timeout=60
            )

        default = dry_run({})
        assert default.returncode == 0 and "PodSecurity" not in default.stderr, default.stderr
        for path, value in WEAKER_SECURITY:
            result = dry_run({path: value, **COMPANIONS.get(path, {}), "unsafe.allowPrivileged": True})
            if path in BEYOND_POD_SECURITY:
                assert result.returncode == 0 and "PodSecurity" not in result.stderr, (path, result.stderr)
            elif path in API_REFUSES:
                assert result.returncode != 0 or "would violate PodSecurity" in result.stderr, (path, result.stderr)
            else:
                assert result.returncode == 0, (path, result.stderr)
                assert 'would violate PodSecurity "restricted' in result.stderr, (path, value, result.stderr)
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_removing_a_restrictive_setting_needs_unsafe_too() -> None:
    """A value set to null is dropped from the defaults (Helm's rule): the schema sees it missing."""
    refused({"operator.securityContext.allowPrivilegeEscalation": None}, "allowPrivilegeEscalation")
    refused({"operator.podSecurityContext.seccompProfile": None}, "seccompProfile")


def test_stricter_or_equal_security_contexts_stay_valid() -> None:
    accepted(
        {
            "operator.podSecurityContext.runAsUser": 1000,
            "operator.securityContext.capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
            "operator.securityContext.seccompProfile": {"type": "Localhost", "localhostProfile": "pdserve.json"},
        }
    )


# ----------------------------------------------------------------------------------------- extra flags (18.11)

FREE_OPERATOR_FLAGS = {
    "--identity",
    "--relist-seconds",
    "--watch-timeout",
    "--crash-recovery-seconds",
    "--prometheus-timeout",
    "--autoscaler-interval-seconds",
    "--autoscaler-window-seconds",
    "--help",
}
"""`pdserve operator` flags no chart value sets and that widen nothing: `operator.extraArgs` may carry them."""


def _owned_pattern() -> re.Pattern[str]:
    (clause,) = [c for c in SCHEMA["allOf"] if "allowOwnedArgs" in json.dumps(c)]
    pattern: str = clause["anyOf"][0]["properties"]["operator"]["properties"]["extraArgs"]["items"]["not"]["pattern"]
    return re.compile(pattern)


def _operator_flags() -> set[str]:
    return {opt for param in operator_command.params for opt in (*param.opts, *param.secondary_opts)} | {"--help"}


def _rendered_flags() -> set[str]:
    """Every flag the chart's Deployment passes, over values that switch each one on."""
    flags: set[str] = set()
    for values in (
        {"operator.prometheusUrl": "http://prometheus:9090", "operator.allowModelHostPaths": ["/mnt/models"]},
        {**NAMESPACED, "operator.replicas": 1, "operator.leaderElection.enabled": False},
    ):
        flags |= {arg.split("=", 1)[0] for arg in operator_container(template(CHART, values=values))["args"]}
    return flags


def test_every_operator_flag_is_either_owned_or_free() -> None:
    """A new `pdserve operator` flag fails here until it is classified: owned (the schema refuses it in
    extraArgs) or free. Every flag the chart renders is owned, and so are --kubeconfig and the short options."""
    pattern = _owned_pattern()
    flags = _operator_flags()
    owned = {flag for flag in flags if pattern.search(flag)}
    assert owned | FREE_OPERATOR_FLAGS == flags and not owned & FREE_OPERATOR_FLAGS, (owned, flags)
    assert _rendered_flags() <= owned
    assert {"--kubeconfig", "-n", "-A", "--namespace", "--all-namespaces", "--allow-model-host-paths"} <= owned


@pytest.mark.parametrize(
    "args",
    [
        ["--allow-model-host-paths=/var"],
        ["--allow-model-host-paths", "/var"],
        ["--namespace=kube-system"],
        ["-n", "kube-system"],
        ["-nkube-system"],
        ["--all-namespaces"],
        ["-A"],
        ["--kubeconfig=/tmp/other-cluster"],
        ["--bind=0.0.0.0"],
        ["--lease-namespace=kube-system"],
        ["--workers=64"],
        ["--no-leader-elect"],
    ],
    ids=" ".join,
)
def test_extra_args_reaching_owned_flags_need_unsafe_allow_owned_args(args: list[str]) -> None:
    refused({"operator.extraArgs": args}, "/operator/extraArgs/", "/unsafe/allowOwnedArgs")
    rendered = operator_container(accepted({"operator.extraArgs": args, "unsafe.allowOwnedArgs": True}))["args"]
    assert rendered[-len(args) :] == args


def test_every_rendered_flag_is_refused_in_extra_args_in_both_spellings() -> None:
    for flag in sorted(_rendered_flags()):
        for args in ([f"{flag}=x"], [flag]):
            assert lint(CHART, values={"operator.extraArgs": args}).returncode != 0, args


def test_free_flags_pass_in_extra_args() -> None:
    args = ["--relist-seconds=300", "--watch-timeout", "120", "--identity=blue", "--prometheus-timeout=3"]
    assert operator_container(accepted({"operator.extraArgs": args}))["args"][-len(args) :] == args


def test_the_operator_takes_no_abbreviated_flags() -> None:
    """Why the schema needs only whole flag names: click refuses a prefix such as `--allow-model` instead of
    expanding it (argparse would expand it). Run as a user would, in a subprocess."""
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "operator", "--all-namespaces", "--allow-model=/var"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "No such option '--allow-model'" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------- namespaces (18.11)


@pytest.mark.parametrize("system", ["kube-system", "kube-public", "kube-node-lease"])
def test_system_namespaces_need_unsafe_allow_system_namespaces(system: str) -> None:
    values = {"watch": {"mode": "namespaced", "namespaces": ["team-a", system]}}
    refused(values, "/watch/namespaces/1", "/unsafe/allowSystemNamespaces")
    args = operator_container(accepted({**values, "unsafe.allowSystemNamespaces": True}))["args"]
    assert f"--namespace={system}" in args


def test_every_unsafe_switch_lints_clean() -> None:
    every = {"allowPrivileged": True, "allowOwnedArgs": True, "allowSystemNamespaces": True}
    result = lint(CHART, values={"unsafe": every, "operator.securityContext.privileged": True})
    assert result.returncode == 0 and "[WARNING]" not in result.stdout, result.stdout + result.stderr


def test_unsafe_switches_are_off_by_default() -> None:
    unsafe = SCHEMA["properties"]["unsafe"]
    assert (
        set(unsafe["required"])
        == set(unsafe["properties"])
        == {
            "allowPrivileged",
            "allowOwnedArgs",
            "allowSystemNamespaces",
        }
    )
    assert yaml.safe_load((CHART / "values.yaml").read_text())["unsafe"] == dict.fromkeys(unsafe["required"], False)
