"""Validation: every rule fires on the field it names, valid examples pass, pydantic errors become problems."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import InvalidSpecError, Problem, validate
from pdserve_dev.testing.examples import POLICY as EXAMPLES_POLICY

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def base() -> dict[str, Any]:
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDService",
        "metadata": {"name": "svc"},
        "spec": {
            "model": {"name": "m", "uri": "hf://org/model"},
            "engine": {"image": "vllm/vllm-openai:v0.32.0"},
        },
    }


def with_spec(**patch: Any) -> dict[str, Any]:
    doc = base()
    for dotted, value in patch.items():
        node = doc["spec"]
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return doc


@pytest.mark.parametrize("path", sorted(p.name for p in EXAMPLES.glob("*.yaml") if p.name != "invalid.yaml"))
def test_examples_are_valid(path: str) -> None:
    for doc in yaml.safe_load_all((EXAMPLES / path).read_text()):
        assert validate(doc, EXAMPLES_POLICY).problems == ()


CASES: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "gpus below TP",
        with_spec(prefill__tensorParallelSize=2, prefill__gpusPerPod=1, decode__tensorParallelSize=2),
        "spec.prefill.gpusPerPod",
        "cannot hold tensorParallelSize 2",
    ),
    (
        "prefill TP above decode TP",
        with_spec(prefill__tensorParallelSize=4, decode__tensorParallelSize=2),
        "spec.prefill.tensorParallelSize",
        "must be <= decode.tensorParallelSize",
    ),
    (
        "decode TP not a multiple",
        with_spec(prefill__tensorParallelSize=2, decode__tensorParallelSize=3),
        "spec.decode.tensorParallelSize",
        "not a multiple",
    ),
    (
        "autoscaling bounds",
        with_spec(decode__autoscaling={"minReplicas": 3, "maxReplicas": 2}),
        "spec.decode.autoscaling.minReplicas",
        "minReplicas must be <= maxReplicas",
    ),
    (
        "autoscaling min above default max",
        with_spec(prefill__autoscaling={"minReplicas": 9}),
        "spec.prefill.autoscaling.minReplicas",
        "maxReplicas 8",
    ),
    (
        "colocation without key",
        with_spec(placement={"colocation": "required"}),
        "spec.placement.topologyKey",
        "topologyKey is required",
    ),
    (
        "revision on pvc",
        with_spec(model={"name": "m", "uri": "pvc://claim/x", "revision": "main"}),
        "spec.model.revision",
        "hf:// models only",
    ),
    (
        "token on a path",
        with_spec(model={"name": "m", "uri": "/models/x", "hfTokenSecret": "s"}),
        "spec.model.hfTokenSecret",
        "hf:// models only",
    ),
    (
        "owned flag",
        with_spec(engine={"image": "i", "args": ["--kv-transfer-config={}"]}),
        "spec.engine.args[0]",
        "--kv-transfer-config is set by pdserve",
    ),
    (
        "owned pool flag",
        with_spec(decode__args=["--foo", "--tensor-parallel-size", "2"]),
        "spec.decode.args[1]",
        "use spec.<pool>.tensorParallelSize",
    ),
    (
        "owned env",
        with_spec(prefill__env=[{"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "1"}]),
        "spec.prefill.env[0].name",
        "set by pdserve",
    ),
    (
        "duplicate env",
        with_spec(engine={"image": "i", "env": [{"name": "A", "value": "1"}, {"name": "A"}]}),
        "spec.engine.env[1].name",
        "defined twice",
    ),
    (
        "port clash",
        with_spec(engine={"image": "i", "port": 5600}),
        "spec.engine.sideChannelPort",
        "cannot both use port 5600",
    ),
    (
        "port clash with a data-parallel rank's side channel",
        with_spec(engine={"image": "i", "port": 8001, "sideChannelPort": 8000}, decode__dataParallelSize=2),
        "spec.engine.sideChannelPort",
        "ports 8000-8001 (one per rank), which includes the HTTP port 8001",
    ),
    (
        "side channels beyond the last port",
        with_spec(engine={"image": "i", "sideChannelPort": 65535}, prefill__dataParallelSize=2),
        "spec.engine.sideChannelPort",
        "ports 65535-65536 (one per rank), beyond 65535",
    ),
    ("cpu engines with rdma required", with_spec(decode__gpusPerPod=0), "spec.decode.gpusPerPod", "placement.rdma=off"),
    (
        "unknown connector",
        with_spec(engine={"image": "i", "kvConnector": "lmcache"}),
        "spec.engine.kvConnector",
        "'nixl'",
    ),
    (
        "env value and valueFrom",
        with_spec(
            prefill__env=[{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
        ),
        "spec.prefill.env[0].valueFrom",
        "not both",
    ),
    (
        "toleration Exists with a value",
        with_spec(placement={"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}),
        "spec.placement.tolerations[0].value",
        "operator is Exists",
    ),
    (
        "tolerationSeconds without NoExecute",
        with_spec(router={"tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 5}]}),
        "spec.router.tolerations[0].tolerationSeconds",
        "NoExecute",
    ),
    (
        "toleration without key or Exists",
        with_spec(decode__tolerations=[{"effect": "NoSchedule"}]),
        "spec.decode.tolerations[0].operator",
        "empty key",
    ),
    (
        "ratio bounds reversed",
        with_spec(autoscaling={"prefillToDecodeRatio": {"min": 2, "max": 0.5}}),
        "spec.autoscaling.prefillToDecodeRatio.min",
        "min must be <= max",
    ),
    (
        "gpu budget below the minimums",
        with_spec(
            autoscaling={"maxGpus": 5},
            prefill__autoscaling={"enabled": True, "minReplicas": 2},
            decode__tensorParallelSize=2,
            decode__autoscaling={"enabled": True, "minReplicas": 2},
        ),
        "spec.autoscaling.maxGpus",
        "below the 6 GPUs",
    ),
    (
        "unknown autoscaling mode",
        with_spec(decode__autoscaling={"mode": "keda"}),
        "spec.decode.autoscaling.mode",
        "'pdserve' or 'external'",
    ),
    ("unknown field", with_spec(decode__replica=2), "spec.decode.replica", "unknown field"),
    ("missing engine", {**base(), "spec": {"model": {"name": "m", "uri": "hf://o/m"}}}, "spec.engine", "missing"),
    ("bad uri", with_spec(model={"name": "m", "uri": "s3://bucket/x"}), "spec.model.uri", "pattern"),
    ("bad name", {**base(), "metadata": {"name": "Bad_Name"}}, "metadata.name", "pattern"),
    ("negative replicas", with_spec(prefill__replicas=-1), "spec.prefill.replicas", "greater than or equal to 0"),
]


@pytest.mark.parametrize(("case", "doc", "field", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_rule_names_field_and_fix(case: str, doc: dict[str, Any], field: str, fragment: str) -> None:
    problems = validate(doc).problems
    matching = [p for p in problems if p.field == field]
    assert matching, f"{case}: no problem at {field}; got {problems}"
    assert any(fragment in p.message for p in matching), matching


def test_all_problems_reported_at_once() -> None:
    doc = yaml.safe_load((EXAMPLES / "invalid.yaml").read_text())
    fields = {p.field for p in validate(doc).problems}
    assert {
        "spec.model.revision",
        "spec.prefill.gpusPerPod",
        "spec.prefill.tensorParallelSize",
        "spec.decode.autoscaling.minReplicas",
        "spec.engine.args[0]",
        "spec.engine.sideChannelPort",
    } <= fields


def test_mla_allows_larger_prefill_tp() -> None:
    doc = with_spec(prefill__tensorParallelSize=4, decode__tensorParallelSize=2)
    assert validate(doc).problems
    doc["spec"]["engine"]["attention"] = "mla"
    assert validate(doc).problems == ()


def test_validate_returns_the_parsed_model_and_its_effective_spec() -> None:
    checked = validate(base())
    assert checked.ok
    pds, spec = checked.require()
    assert pds.metadata.name == "svc"
    assert spec.engine.port == 8000 and spec.model.uri == "hf://org/model"
    broken = copy.deepcopy(base())
    broken["spec"]["prefill"] = {"tensorParallelSize": 2}
    checked = validate(broken)
    assert checked.pds is not None and checked.spec is not None, "a parsed spec with problems keeps its model"
    with pytest.raises(InvalidSpecError) as info:
        checked.require()
    assert info.value.problems == [Problem("spec.prefill.tensorParallelSize", info.value.problems[0].message)]
    assert "spec.prefill.tensorParallelSize" in str(info.value)


def test_unparseable_document_has_no_model() -> None:
    checked = validate({**base(), "spec": {"model": {"name": "m"}}})
    assert checked.pds is None and checked.spec is None
    assert {p.field for p in checked.problems} == {"spec.model.uri", "spec.engine"}


def test_a_parsed_model_is_checked_without_parsing_again() -> None:
    pds = PDService.model_validate(base())
    checked = validate(pds)
    assert checked.pds is pds and checked.ok


# Quantities Kubernetes parses (suffixes n u m k M G T P E, Ki..Ei, or a decimal exponent) and spellings it rejects
# ("K" alone, a lower-case binary suffix): a spec the CRD admits must render objects the API server admits.
GOOD_QUANTITIES = ["8", "500m", "0.5", ".5", "1k", "16Gi", "1Ei", "1E", "1e3", "1E-3", "+2", "100u", "5n"]
BAD_QUANTITIES = ["1K", "1ki", "1mi", "1ni", "1ui", "1gi", "1KB", "-1", "1e", ""]


@pytest.mark.parametrize("quantity", GOOD_QUANTITIES)
def test_kubernetes_quantities_are_accepted(quantity: str) -> None:
    assert validate(with_spec(decode__resources={"limits": {"memory": quantity}}, engine__shmSize=quantity)).ok


@pytest.mark.parametrize("quantity", BAD_QUANTITIES)
def test_non_kubernetes_quantities_are_rejected(quantity: str) -> None:
    problems = validate(
        with_spec(decode__resources={"limits": {"memory": quantity}}, engine__shmSize=quantity)
    ).problems
    assert {p.field for p in problems} == {"spec.decode.resources.limits.memory", "spec.engine.shmSize"}


def test_kubernetes_valid_env_and_tolerations_pass() -> None:
    doc = with_spec(
        engine={"image": "i", "env": [{"name": "E", "value": "", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]},
        placement={"tolerations": [{"operator": "Exists"}, {"key": "k", "operator": "Exists", "value": ""}]},
        router={"tolerations": [{"key": "k", "value": "v", "effect": "NoExecute", "tolerationSeconds": 0}]},
    )
    assert validate(doc).problems == ()


# ------------------------------------------------------------------------------------------------ CPU engines


def cpu_engines(**engine: Any) -> dict[str, Any]:
    """Both pools without GPUs (vLLM's CPU backend), TCP transport."""
    return with_spec(
        engine={"image": "vllm-cpu:0.32.0", **engine},
        prefill__gpusPerPod=0,
        decode__gpusPerPod=0,
        placement={"rdma": "off"},
    )


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_cpu_engines_need_a_block_size_multiple_of_32(block_size: int) -> None:
    # Real vLLM 0.32 on the CPU: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])" at start-up.
    (problem,) = validate(cpu_engines(kvBufferDevice="cpu", blockSize=block_size)).problems
    assert problem.field == "spec.engine.blockSize"
    assert "32, 64 or 128" in problem.message and "CPU" in problem.message


def test_cpu_engines_default_block_size_is_refused() -> None:
    (problem,) = validate(cpu_engines(kvBufferDevice="cpu")).problems
    assert problem.field == "spec.engine.blockSize" and "16" in problem.message


def test_cpu_engines_need_a_cpu_kv_buffer() -> None:
    # vLLM's NixlConnector on the CPU platform registers KV buffers in host memory only.
    (problem,) = validate(cpu_engines(blockSize=128)).problems
    assert problem.field == "spec.engine.kvBufferDevice" and "cpu" in problem.message


@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_cpu_engines_with_a_cpu_buffer_and_a_multiple_of_32_pass(block_size: int) -> None:
    assert validate(cpu_engines(kvBufferDevice="cpu", blockSize=block_size)).problems == ()


def test_gpu_engines_with_a_host_kv_buffer_keep_block_size_16() -> None:
    # On GPUs the attention backend takes multiples of 16; a host (cpu) NIXL buffer does not change that.
    assert validate(with_spec(engine={"image": "i", "kvBufferDevice": "cpu", "blockSize": 16})).problems == ()


def test_gpu_budget_that_covers_the_minimums_is_valid() -> None:
    doc = with_spec(
        autoscaling={"maxGpus": 6, "prefillToDecodeRatio": {"min": 0.5, "max": 0.5}},
        prefill__autoscaling={"enabled": True, "minReplicas": 2},
        decode__tensorParallelSize=2,
        decode__autoscaling={"enabled": True, "minReplicas": 2, "mode": "external"},
    )
    assert validate(doc).problems == ()
