"""Argo CD's health check for PDServices (gitops/argocd/pdserve.io/PDService), run as Argo CD runs it: the
script under Lua 5.1 (Argo CD embeds gopher-lua, a Lua 5.1) with the object as the global `obj`, returning
`{status, message}`; the cases are Argo CD's own `health_test.yaml` format, and a generated table of every
combination of conditions, condition order, generations and deletion is checked against the real kstatus."""

from __future__ import annotations

import itertools
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lupa.lua51
import pytest
import yaml

from pdserve.api.defaults import effective
from pdserve.api.settings import OperatorSettings
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import Problem, Validated
from pdserve_dev.cluster import tools
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


# --------------------------------------------------------------------------- every combination, against kstatus

KSTATUS_TO_ARGO = {
    "Current": "Healthy",
    "InProgress": "Progressing",
    "Failed": "Degraded",
    "Terminating": "Progressing",
}
KSTATUS_FALLBACK = "Resource is current"
"""kstatus' message when nothing in the object decided (its default for kinds it has no rules for)."""
STATES = (None, "True", "False", "Unknown")  # None: the condition is absent
# The legacy conditions only matter where Ready is absent; their values that change the Lua's legacy reading.
LEGACY: tuple[tuple[tuple[str, str, str], ...], ...] = (
    (),
    (("Available", "True", "MinimumReplicasAvailable"),),
    (("Available", "True", "MinimumReplicasAvailable"), ("Degraded", "True", "PodsPending")),
    (("Available", "False", "MinimumReplicasUnavailable"), ("Degraded", "True", "InvalidSpec")),
    (("Available", "True", "MinimumReplicasAvailable"), ("Progressing", "True", "RollingOut")),
)
# (metadata.generation, status.observedGeneration); None: the field is absent. kstatus compares only when both are
# there, and any difference (older or newer) is InProgress.
GENERATIONS = ((3, 3), (4, 3), (3, 4), (3, None), (None, 3))


def _condition(kind: str, state: str, reason: str | None = None) -> dict[str, Any]:
    return {"type": kind, "status": state, "reason": reason or f"{kind}{state}", "message": f"{kind} is {state}"}


def _condition_lists() -> Iterator[list[dict[str, Any]]]:
    """Every state (absent/True/False/Unknown) of Ready, Reconciling and Stalled, in both orders of Reconciling and
    Stalled when both are there (kstatus takes the first True one), each beside each legacy set."""
    for ready, reconciling, stalled in itertools.product(STATES, repeat=3):
        present = [(k, v) for k, v in (("Reconciling", reconciling), ("Stalled", stalled)) if v is not None]
        orders = [present, present[::-1]] if len(present) == 2 else [present]
        for order in orders:
            for legacy in LEGACY:
                conditions = [_condition(k, v, r) for k, v, r in legacy]
                if ready is not None:
                    conditions.append(_condition("Ready", ready))
                conditions += [_condition(k, v) for k, v in order]
                yield conditions


def _objects() -> Iterator[dict[str, Any]]:
    base: dict[str, Any] = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDService"}
    for generation, observed in GENERATIONS:
        metadata: dict[str, Any] = {"name": "llama-8b", "namespace": "default"}
        if generation is not None:
            metadata["generation"] = generation
        yield {**base, "metadata": metadata}  # no status at all
        yield {**base, "metadata": metadata, "status": {}}
        for conditions in _condition_lists():
            status: dict[str, Any] = {"conditions": conditions}
            if observed is not None:
                status["observedGeneration"] = observed
            yield {**base, "metadata": metadata, "status": status}
    # Being deleted, whatever the status says.
    deleting = {"name": "llama-8b", "namespace": "default", "generation": 3, "deletionTimestamp": T0}
    for conditions in _condition_lists():
        yield {**base, "metadata": deleting, "status": {"observedGeneration": 3, "conditions": conditions}}


def _kstatus(objects: list[dict[str, Any]]) -> list[dict[str, str]]:
    """kstatus' own verdicts (sigs.k8s.io/cli-utils pkg/kstatus status.Compute, built from the Go module proxy and
    cached, as tests/operator/test_operator_status.py runs it)."""
    proc = subprocess.run(
        [str(tools.kstatus_binary())],
        input=json.dumps(objects),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    verdicts: list[dict[str, str]] = json.loads(proc.stdout)
    assert len(verdicts) == len(objects)
    return verdicts


def _without_a_kstatus_verdict(obj: dict[str, Any]) -> str:
    """What the Lua answers where kstatus found nothing in the object and fell back to Current: Healthy only on
    Ready=True (or, with no Ready condition, the legacy Available reading), as documented in health.lua."""
    conditions = {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}
    state = {kind: c["status"] for kind, c in conditions.items()}
    if "status" not in obj or "Ready" in state:
        return "Healthy" if state.get("Ready") == "True" else "Progressing"
    degraded = conditions.get("Degraded")
    if degraded and degraded["status"] == "True" and degraded["reason"] in {"InvalidSpec", "ApplyFailed"}:
        return "Degraded"
    healthy = state.get("Available") == "True" and "True" not in (state.get("Progressing"), state.get("Degraded"))
    return "Healthy" if healthy else "Progressing"


def test_lua_agrees_with_kstatus_on_every_combination() -> None:
    """Every state of Ready/Reconciling/Stalled in every relevant order, beside the legacy conditions, for every
    generation/observedGeneration relation and while being deleted: wherever kstatus decides from the object, the
    Lua says the same (Current -> Healthy, InProgress and Terminating -> Progressing, Failed -> Degraded). Where
    kstatus decided nothing (its fallback message), the Lua is Healthy exactly when Ready=True or, with no Ready
    condition, the legacy reading is healthy."""
    objects = list(_objects())
    verdicts = _kstatus(objects)
    decided = fallback = 0
    disagreements = []
    for obj, verdict in zip(objects, verdicts, strict=True):
        lua = argo_health(obj)["status"]
        if verdict["status"] == "Current" and verdict["message"] == KSTATUS_FALLBACK:
            fallback += 1
            expected = _without_a_kstatus_verdict(obj)
        else:
            decided += 1
            expected = KSTATUS_TO_ARGO[verdict["status"]]
        if lua != expected:
            disagreements.append((lua, expected, verdict, obj.get("metadata"), obj.get("status")))
    assert disagreements == [], f"{len(disagreements)} of {len(objects)}: {disagreements[:3]}"
    # The table reaches both regions, and every kstatus verdict.
    assert decided > 1000 and fallback > 100, (decided, fallback)
    assert {v["status"] for v in verdicts} == set(KSTATUS_TO_ARGO)


def test_ready_never_outweighs_reconciling_or_stalled() -> None:
    """The combinations an adversarial review found reported Healthy, asserted on their own."""
    for other, expected in (("Reconciling", "Progressing"), ("Stalled", "Degraded")):
        for conditions in (
            [_condition("Ready", "True"), _condition(other, "True")],
            [_condition(other, "True"), _condition("Ready", "True")],
        ):
            obj = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "conditions": conditions}}
            assert argo_health(obj)["status"] == expected, conditions
