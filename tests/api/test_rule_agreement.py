"""One table of specs, two judges: `pdserve validate` (offline, as a subprocess) and the API server with the
generated CRD (`kubectl apply --dry-run=server`). They must agree on every case: both admit it, or both refuse it;
for a rule of `pdserve.api.rules` both name the same field with the same message.

Cases the offline check alone refuses are listed too (`python_only`): rules CEL cannot express or that would newly
refuse stored objects. For them the API server must admit, which keeps docs/api.md's split honest.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.rules import RULES, CrossFieldRule
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.examples import MODEL_HOST_PATHS

ROOT = Path(__file__).resolve().parents[2]
RULE = {rule.name: rule for rule in RULES}
ENV_FROM = {"fieldRef": {"fieldPath": "spec.nodeName"}}
EXAMPLES_HOST_PATHS = [arg for prefix in MODEL_HOST_PATHS for arg in ("--allow-model-host-paths", prefix)]


@dataclass(frozen=True)
class Case:
    """A spec (the minimal example with `patch` applied at dotted paths under spec) and who must refuse it."""

    name: str
    patch: dict[str, Any]
    breaks: tuple[tuple[str, str], ...] = ()
    """(rule name, path of the object it applies to) for every table rule the spec breaks."""
    schema: bool = False
    """The OpenAPI schema (and so pydantic) refuses it."""
    python_only: bool = False
    """Only `pdserve validate` refuses it."""
    manifest: dict[str, Any] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
        doc["metadata"]["name"] = self.name
        for dotted, value in self.patch.items():
            node = doc["spec"]
            *parents, leaf = dotted.split(".")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = copy.deepcopy(value)
        object.__setattr__(self, "manifest", doc)

    @property
    def admitted(self) -> bool:
        return not (self.breaks or self.schema or self.python_only)

    def expected_rule_problems(self) -> set[tuple[str, str]]:
        return {(f"{at}.{RULE[name].field}", RULE[name].message) for name, at in self.breaks}


CASES = [
    # Inside every rule, including the boundaries the defaults table decides.
    Case("minimal", {}),
    Case("env-empty-value-beside-value-from", {"engine.env": [{"name": "E", "value": "", "valueFrom": ENV_FROM}]}),
    Case("toleration-exists-without-key", {"placement.tolerations": [{"operator": "Exists"}]}),
    Case("toleration-exists-empty-value", {"placement.tolerations": [{"key": "k", "operator": "Exists", "value": ""}]}),
    Case(
        "toleration-seconds-no-execute",
        {"router.tolerations": [{"key": "k", "value": "v", "effect": "NoExecute", "tolerationSeconds": 0}]},
    ),
    Case("revision-on-hf", {"model.revision": "main"}),
    Case("bounds-equal", {"decode.autoscaling": {"minReplicas": 3, "maxReplicas": 3}}),
    Case("bounds-min-at-default-max", {"prefill.autoscaling": {"minReplicas": 8}}),
    Case("ratio-equal", {"autoscaling": {"prefillToDecodeRatio": {"min": 0.5, "max": 0.5}}}),
    Case("ratio-min-only", {"autoscaling": {"prefillToDecodeRatio": {"min": 2}}}),
    Case(
        "store-deployed", {"engine.kvCache": {"store": {"backend": "mooncake", "mooncake": {"capacityBytes": "4Gi"}}}}
    ),
    Case(
        "store-external",
        {
            "engine.kvCache": {
                "offload": {"cpuBytes": "8Gi"},
                "store": {
                    "backend": "mooncake",
                    "mooncake": {"masterAddress": "m:50051", "metadataServer": "P2PHANDSHAKE"},
                },
            }
        },
    ),
    Case("colocation-none-without-key", {"placement": {"colocation": "none"}}),
    Case("colocation-default-without-key", {"placement": {"spreadKey": "topology.kubernetes.io/zone"}}),
    Case("colocation-required-with-key", {"placement": {"colocation": "required", "topologyKey": "pdserve.io/rack"}}),
    Case("tp-equal", {"prefill.tensorParallelSize": 2, "decode.tensorParallelSize": 2}),
    Case("node-path-allowed", {"model": {"name": "m", "uri": "/mnt/models/llama"}}),
    Case("node-path-dotted-names", {"model": {"name": "m", "uri": "/mnt/models/..llama/.cache"}}),
    Case("node-path-mentioning-a-system-path", {"model": {"name": "m", "uri": "/mnt/models/var/lib/kubelet"}}),
    Case(
        "tp-larger-prefill-mla",
        {"prefill.tensorParallelSize": 4, "decode.tensorParallelSize": 2, "engine.attention": "mla"},
    ),
    # Each table rule broken.
    Case(
        "env-value-and-value-from",
        {"prefill.env": [{"name": "A", "value": "1", "valueFrom": ENV_FROM}]},
        breaks=(("env-value-or-value-from", "spec.prefill.env[0]"),),
    ),
    Case(
        "toleration-empty-key-equal",
        {"decode.tolerations": [{"effect": "NoSchedule"}]},
        breaks=(("toleration-empty-key-needs-exists", "spec.decode.tolerations[0]"),),
    ),
    Case(
        "toleration-exists-with-value",
        {"placement.tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
        breaks=(("toleration-exists-has-no-value", "spec.placement.tolerations[0]"),),
    ),
    Case(
        "toleration-seconds-no-schedule",
        {"router.tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 5}]},
        breaks=(("toleration-seconds-needs-no-execute", "spec.router.tolerations[0]"),),
    ),
    Case(
        "revision-on-pvc",
        {"model": {"name": "m", "uri": "pvc://claim/m", "revision": "main"}},
        breaks=(("revision-needs-hf", "spec.model"),),
    ),
    Case(
        "node-path-dot-dot",
        {"model": {"name": "m", "uri": "/mnt/models/../../../etc"}},
        breaks=(("model-node-path-normalised", "spec.model"),),
    ),
    Case(
        "node-path-double-slash",
        {"model": {"name": "m", "uri": "/mnt//models"}},
        breaks=(("model-node-path-normalised", "spec.model"),),
    ),
    Case(
        "node-path-trailing-slash",
        {"model": {"name": "m", "uri": "/mnt/models/"}},
        breaks=(("model-node-path-normalised", "spec.model"),),
    ),
    Case(
        "node-path-root", {"model": {"name": "m", "uri": "/"}}, breaks=(("model-node-path-not-system", "spec.model"),)
    ),
    Case(
        "node-path-kubelet",
        {"model": {"name": "m", "uri": "/var/lib/kubelet/pods"}},
        breaks=(("model-node-path-not-system", "spec.model"),),
    ),
    Case(
        "node-path-above-kubelet",
        {"model": {"name": "m", "uri": "/var"}},
        breaks=(("model-node-path-not-system", "spec.model"),),
    ),
    # Distributions' and network plugins' state, and the folders holding it (issue 18.10).
    Case(
        "node-path-k3s",
        {"model": {"name": "m", "uri": "/var/lib/rancher/k3s"}},
        breaks=(("model-node-path-not-system", "spec.model"),),
    ),
    Case(
        "node-path-kubernetes-pki",
        {"model": {"name": "m", "uri": "/var/lib/kubernetes"}},
        breaks=(("model-node-path-not-system", "spec.model"),),
    ),
    Case(
        "node-path-cni-bin",
        {"model": {"name": "m", "uri": "/opt/cni/bin"}},
        breaks=(("model-node-path-not-system", "spec.model"),),
    ),
    Case(
        "node-path-above-cni",
        {"model": {"name": "m", "uri": "/opt"}},
        breaks=(("model-node-path-not-system", "spec.model"),),
    ),
    Case(
        "node-path-etc-un-normalised",
        {"model": {"name": "m", "uri": "/etc/../mnt"}},
        breaks=(("model-node-path-normalised", "spec.model"), ("model-node-path-not-system", "spec.model")),
    ),
    Case(
        "bounds-min-above-max",
        {"decode.autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
        breaks=(("autoscaling-min-le-max", "spec.decode.autoscaling"),),
    ),
    Case(
        "bounds-min-above-default-max",
        {"prefill.autoscaling": {"minReplicas": 9}},
        breaks=(("autoscaling-min-le-max", "spec.prefill.autoscaling"),),
    ),
    Case(
        "ratio-min-above-max",
        {"autoscaling": {"prefillToDecodeRatio": {"min": 2, "max": 0.5}}},
        breaks=(("ratio-min-le-max", "spec.autoscaling.prefillToDecodeRatio"),),
    ),
    Case(
        "threshold-min-above-max",
        {"autoscaling": {"disaggregationThreshold": {"minTokens": 2048, "maxTokens": 512}}},
        breaks=(("threshold-min-le-max", "spec.autoscaling.disaggregationThreshold"),),
    ),
    Case(
        "colocation-required-without-key",
        {"placement": {"colocation": "required"}},
        breaks=(("colocation-needs-topology-key", "spec.placement"),),
    ),
    Case(
        "colocation-preferred-without-key",
        {"placement": {"colocation": "preferred"}},
        breaks=(("colocation-needs-topology-key", "spec.placement"),),
    ),
    Case(
        "store-settings-without-backend",
        {"engine.kvCache": {"store": {"mooncake": {"capacityBytes": "4Gi"}}}},
        breaks=(("store-settings-need-backend", "spec.engine.kvCache.store"),),
    ),
    Case(
        "store-metadata-without-address",
        {
            "engine.kvCache": {
                "store": {"backend": "mooncake", "mooncake": {"metadataServer": "http://m:8080/metadata"}}
            }
        },
        breaks=(("mooncake-metadata-needs-address", "spec.engine.kvCache.store.mooncake"),),
    ),
    Case(
        "store-capacity-with-address",
        {
            "engine.kvCache": {
                "store": {"backend": "mooncake", "mooncake": {"masterAddress": "m:50051", "capacityBytes": "4Gi"}}
            }
        },
        breaks=(("mooncake-deployed-settings-without-address", "spec.engine.kvCache.store.mooncake"),),
    ),
    Case(
        "tp-larger-prefill",
        {"prefill.tensorParallelSize": 4, "decode.tensorParallelSize": 2},
        breaks=(("prefill-tp-le-decode-tp", "spec"),),
    ),
    Case(
        "tp-larger-than-default-decode",
        {"prefill.tensorParallelSize": 2},
        breaks=(("prefill-tp-le-decode-tp", "spec"),),
    ),
    Case(
        "sidecar-on-the-engine-port",
        {"router.gateway": {"sidecarPort": 8000}},
        breaks=(("gateway-sidecar-port-free", "spec"),),
    ),
    Case(
        "sidecar-on-a-moved-side-channel",
        {"router.gateway": {"sidecarPort": 8100}, "engine.sideChannelPort": 8100},
        breaks=(("gateway-sidecar-port-free", "spec"),),
    ),
    Case(
        "three-rules-at-once",
        {
            "decode.autoscaling": {"minReplicas": 5, "maxReplicas": 2},
            "placement": {"colocation": "required", "tolerations": [{"effect": "NoSchedule"}]},
        },
        breaks=(
            ("autoscaling-min-le-max", "spec.decode.autoscaling"),
            ("colocation-needs-topology-key", "spec.placement"),
            ("toleration-empty-key-needs-exists", "spec.placement.tolerations[0]"),
        ),
    ),
    # The schema refuses (enums, bounds, patterns, unknown fields).
    Case("unknown-connector", {"engine.kvConnector": "lmcache"}, schema=True),
    Case("block-size-48", {"engine.blockSize": 48}, schema=True),
    Case("slo-zero", {"slo": {"ttftMilliseconds": 0}}, schema=True),
    Case("negative-replicas", {"prefill.replicas": -1}, schema=True),
    Case("quantity-1k-uppercase", {"engine.shmSize": "1K"}, schema=True),
    Case("unknown-field", {"decode.replica": 2}, schema=True),
    # Kubernetes' own formats (kubeformats.py): what the API server would refuse in a rendered child.
    Case("node-selector-key-with-a-space", {"placement.gpuNodeSelector": {"bad key!": "x"}}, schema=True),
    Case("node-selector-key-name-of-64", {"decode.nodeSelector": {f"example.com/{'n' * 64}": "x"}}, schema=True),
    Case("node-selector-key-prefix-of-254", {"router.nodeSelector": {f"{'p' * 254}/name": "x"}}, schema=True),
    Case("node-selector-value-of-64", {"prefill.nodeSelector": {"pool": "v" * 64}}, schema=True),
    Case("node-selector-at-the-limits", {"prefill.nodeSelector": {f"{'p' * 253}/{'n' * 63}": "v" * 63, "e": ""}}),
    Case("topology-key-name-of-64", {"placement.topologyKey": f"example.com/{'n' * 64}"}, schema=True),
    Case("topology-key-prefix-of-254", {"placement.spreadKey": f"{'p' * 254}/zone"}, schema=True),
    Case("toleration-key-with-a-space", {"placement.tolerations": [{"key": "a b", "operator": "Exists"}]}, schema=True),
    Case("toleration-value-of-64", {"decode.tolerations": [{"key": "k", "value": "v" * 64}]}, schema=True),
    Case("resource-name-not-standard", {"decode.resources": {"limits": {"gpu": "1"}}}, schema=True),
    Case("resource-name-with-a-space", {"decode.resources": {"requests": {"big cpu": "1"}}}, schema=True),
    Case("resource-names-valid", {"decode.resources": {"limits": {"hugepages-2Mi": "1Gi", "example.com/d": "1"}}}),
    Case("gpu-resource-without-a-domain", {"placement.gpuResourceName": "gpu"}, schema=True),
    Case("env-name-with-equals", {"engine.env": [{"name": "A=B", "value": "1"}]}, schema=True),
    Case("env-name-non-ascii", {"engine.env": [{"name": "CAF\u00c9", "value": "1"}]}, schema=True),
    Case("env-name-relaxed", {"engine.env": [{"name": "my.var-1 ~!", "value": "1"}]}),
    Case(
        "hub-token-secret-upper-case", {"model": {"name": "m", "uri": "hf://o/m", "hfTokenSecret": "HF"}}, schema=True
    ),
    Case("run-as-root", {"engine.runAsUser": 0}, schema=True),
    # Only `pdserve validate` refuses: rules CEL cannot express, or would newly refuse stored objects.
    Case(
        "gpus-below-tp",
        {"prefill.tensorParallelSize": 2, "prefill.gpusPerPod": 1, "decode.tensorParallelSize": 2},
        python_only=True,
    ),
    Case(
        "decode-tp-not-a-multiple", {"prefill.tensorParallelSize": 2, "decode.tensorParallelSize": 3}, python_only=True
    ),
    Case("owned-flag", {"engine.args": ["--port", "9000"]}, python_only=True),
    Case("offloading-size-flag", {"decode.args": ["--kv-offloading-size=8"]}, python_only=True),
    Case(
        "offload-on-cpu-engines",
        {"engine.kvCache": {"offload": {"cpuBytes": "1Gi"}}, "decode.gpusPerPod": 0, "placement.rdma": "off"},
        python_only=True,
    ),
    Case("owned-env", {"prefill.env": [{"name": "POD_IP", "value": "x"}]}, python_only=True),
    Case("duplicate-env", {"engine.env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, python_only=True),
    Case("port-clash", {"engine.port": 5600}, python_only=True),
    Case("cpu-engine-rdma-required", {"decode.gpusPerPod": 0}, python_only=True),
    Case(
        "hub-token-on-a-path", {"model": {"name": "m", "uri": "/mnt/models/m", "hfTokenSecret": "t"}}, python_only=True
    ),
    # The administrator's policy (this file's `pdserve validate` allows /mnt/models, as the examples assume).
    Case("node-path-not-allowed", {"model": {"name": "m", "uri": "/opt/models/llama"}}, python_only=True),
    Case("owned-flag-abbreviated", {"engine.args": ["--kv-transfer-conf.engine_id=x"]}, python_only=True),
    Case("owned-flag-underscores", {"decode.args": ["--tensor_parallel_size", "2"]}, python_only=True),
    Case("owned-env-nvidia", {"engine.env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}, python_only=True),
    # vLLM's CPU backend: a block size that is a multiple of 32 and a host KV buffer.
    Case(
        "cpu-engines-block-16",
        {"prefill.gpusPerPod": 0, "decode.gpusPerPod": 0, "placement": {"rdma": "off"}, "engine.kvBufferDevice": "cpu"},
        python_only=True,
    ),
    Case(
        "cpu-engines-block-128",
        {
            "prefill.gpusPerPod": 0,
            "decode.gpusPerPod": 0,
            "placement": {"rdma": "off"},
            "engine.kvBufferDevice": "cpu",
            "engine.blockSize": 128,
        },
    ),
]


@dataclass
class Verdict:
    admitted: bool
    problems: set[tuple[str, str]]
    """(field, message) pairs as `pdserve validate` prints them."""


def pdserve_validate(cases: Iterable[Case]) -> dict[str, Verdict]:
    """Run `pdserve validate` once over every case (one multi-document file) and read its verdict per case."""
    cases = list(cases)
    stream = yaml.safe_dump_all([case.manifest for case in cases], sort_keys=False)
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "validate", *EXAMPLES_HOST_PATHS, "-f", "-"],
        cwd=ROOT,
        input=stream,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    verdicts: dict[str, Verdict] = {}
    for line in result.stdout.splitlines():
        label, _, outcome = line.rpartition(": ")
        if outcome == "valid":
            verdicts[label.rsplit("/", 1)[-1]] = Verdict(True, set())
    current: Verdict | None = None
    for line in result.stderr.splitlines():
        if line.startswith("  - "):
            assert current is not None, result.stderr
            where, _, message = line.removeprefix("  - ").partition(": ")
            current.problems.add((where, message))
        elif line.endswith("problem(s)"):
            label = line.rsplit(": ", 1)[0]
            current = verdicts[label.rsplit("/", 1)[-1]] = Verdict(False, set())
    assert result.returncode == (0 if all(v.admitted for v in verdicts.values()) else 1), result.stderr
    assert set(verdicts) == {case.name for case in cases}, f"unparsed output:\n{result.stdout}\n{result.stderr}"
    return verdicts


@pytest.fixture(scope="module")
def offline() -> dict[str, Verdict]:
    return pdserve_validate(CASES)


def test_case_names_are_unique_and_cover_every_rule() -> None:
    assert len({case.name for case in CASES}) == len(CASES)
    broken = {name for case in CASES for name, _ in case.breaks}
    assert broken == set(RULE), f"rules without a failing case: {set(RULE) - broken}"


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_pdserve_validate_judges_as_expected(case: Case, offline: dict[str, Verdict]) -> None:
    verdict = offline[case.name]
    assert verdict.admitted == case.admitted, verdict.problems
    if case.breaks:
        assert verdict.problems == case.expected_rule_problems()


# ------------------------------------------------------------------------------------------------ API server


@pytest.fixture(scope="module")
def namespace(cluster: ClusterHelper) -> str:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "pdservice.yaml"))
    cluster.wait_crd_established()
    return cluster.create_namespace("rules")


def dry_run(cluster: ClusterHelper, namespace: str, manifest: dict[str, Any]) -> tuple[bool, str]:
    doc = {**manifest, "metadata": {**manifest["metadata"], "namespace": namespace}}
    result = cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", input=json.dumps(doc), check=False
    )
    return result.returncode == 0, result.stdout + result.stderr


def _named(output: str, rule: CrossFieldRule[Any], field_path: str) -> bool:
    # The API server reports a failed x-kubernetes-validation as `<object path + fieldPath>: Invalid value: <message>`.
    return f"{field_path}: Invalid value" in output and rule.message in output


@pytest.mark.cluster
def test_api_server_and_pdserve_validate_agree(
    cluster: ClusterHelper, namespace: str, offline: dict[str, Verdict]
) -> None:
    disagreements = []
    for case in CASES:
        admitted, output = dry_run(cluster, namespace, case.manifest)
        verdict = offline[case.name]
        expected_by_server = case.admitted or case.python_only
        if admitted != expected_by_server:
            disagreements.append(
                f"{case.name}: API server admitted={admitted}, expected {expected_by_server}: {output}"
            )
            continue
        if not case.python_only and admitted != verdict.admitted:
            disagreements.append(f"{case.name}: API server admitted={admitted}, pdserve validate {verdict.admitted}")
        for name, at in case.breaks:
            rule = RULE[name]
            if not _named(output, rule, f"{at}.{rule.field}"):
                disagreements.append(
                    f"{case.name}: the API server did not say {at}.{rule.field}: {rule.message}; {output}"
                )
            if (f"{at}.{rule.field}", rule.message) not in verdict.problems:
                disagreements.append(f"{case.name}: pdserve validate did not say {at}.{rule.field}: {rule.message}")
    assert disagreements == [], "\n".join(disagreements)
