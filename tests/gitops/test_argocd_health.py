"""Argo CD's health check for PDServices (gitops/argocd/pdserve.io/PDService), run as Argo CD runs it: the
script under Lua 5.1 (Argo CD embeds gopher-lua, a Lua 5.1) with the object as the global `obj`, returning
`{status, message}`; the cases are Argo CD's own `health_test.yaml` format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa.lua51
import pytest
import yaml

from pdserve.api.defaults import effective
from pdserve.api.settings import OperatorSettings
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import Problem, Validated
from pdserve_operator import status as st
from pdserve_operator.observed import Snapshot
from pdserve_operator.reconcile import status_intent

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "gitops" / "argocd" / "pdserve.io" / "PDService"
CASES = yaml.safe_load((CHECK / "health_test.yaml").read_text())["tests"]
T0 = "2026-01-01T00:00:00Z"


def argo_health(obj: dict[str, Any]) -> dict[str, str]:
    """Run health.lua on `obj` in a fresh Lua 5.1 state, as Argo CD does per object."""
    lua = lupa.lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute((CHECK / "health.lua").read_text())
    return {"status": result["status"], "message": result["message"]}


def test_runs_under_lua_5_1() -> None:
    assert lupa.lua51.LuaRuntime().execute("return _VERSION") == "Lua 5.1"


@pytest.mark.parametrize("case", CASES, ids=lambda c: Path(c["inputPath"]).stem)
def test_health_test_yaml_case(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((CHECK / case["inputPath"]).read_text())
    assert argo_health(obj) == case["healthStatus"]


def test_every_testdata_file_is_a_case() -> None:
    assert sorted(c["inputPath"] for c in CASES) == sorted(
        f"testdata/{p.name}" for p in (CHECK / "testdata").glob("*.yaml")
    )


def _pds(generation: int = 3) -> tuple[dict[str, Any], PDService]:
    body: dict[str, Any] = yaml.safe_load((CHECK / "testdata" / "healthy.yaml").read_text())
    body.pop("status")
    body["metadata"]["generation"] = generation
    return body, PDService.model_validate(body)


def _sts(role: str, replicas: int, ready: int) -> dict[str, Any]:
    return {
        "kind": "StatefulSet",
        "metadata": {"name": f"llama-8b-{role}", "namespace": "default", "generation": 1},
        "spec": {"replicas": replicas},
        "status": {"observedGeneration": 1, "replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas},
    }


def _router(ready: int) -> dict[str, Any]:
    return {
        "kind": "Deployment",
        "metadata": {"name": "llama-8b-router", "namespace": "default", "generation": 1},
        "spec": {"replicas": 2},
        "status": {
            "observedGeneration": 1,
            "replicas": 2,
            "updatedReplicas": 2,
            "readyReplicas": ready,
            "availableReplicas": ready,
        },
    }


def _snapshot(*children: dict[str, Any]) -> Snapshot:
    slices = [{"endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}]}]
    return Snapshot(
        children={(c["kind"], "default", c["metadata"]["name"]): c for c in children}, endpoint_slices=slices
    )


@pytest.mark.parametrize(
    ("snapshot", "problems", "expected"),
    [
        (_snapshot(_sts("prefill", 2, 2), _sts("decode", 4, 4), _router(2)), [], "Healthy"),
        (_snapshot(_sts("prefill", 2, 2), _sts("decode", 4, 1), _router(2)), [], "Progressing"),
        (_snapshot(), [], "Progressing"),
        (_snapshot(_sts("prefill", 2, 2), _sts("decode", 4, 4), _router(2)), [Problem("spec.x", "bad")], "Degraded"),
    ],
)
def test_argo_agrees_with_the_operator_conditions(snapshot: Snapshot, problems: list[Problem], expected: str) -> None:
    """Statuses straight from the operator's status code: Ready -> Healthy, Stalled -> Degraded, Reconciling ->
    Progressing, with the condition's reason and message."""
    body, pds = _pds()
    checked = Validated(pds, effective(pds.spec), tuple(problems))
    intent = status_intent(body, checked, snapshot, report=None, configured=False)
    facts = st.facts_of(body, snapshot, intent, T0, OperatorSettings.crash_recovery_seconds)
    status = st.compute_status(body, facts, intent, problems=checked.problems, now=T0)
    health = argo_health({**body, "status": status})
    assert health["status"] == expected
    verdict = {"Healthy": "Ready", "Degraded": "Stalled", "Progressing": "Reconciling"}[expected]
    condition = next(c for c in status["conditions"] if c["type"] == verdict)
    assert condition["status"] == "True"
    assert health["message"] == f"{condition['reason']}: {condition['message']}"
