"""The effective view of a stored PDService: validated once per stored version, under the process's policy."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from pdserve.api.policy import DEFAULT_POLICY, Policy
from pdserve_operator.view import SpecViews, spec_document

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pdservice.yaml"
HOST_PATH = ROOT / "examples" / "mla-hostpath-tcp.yaml"


def stored(path: Path = EXAMPLE, version: str | None = "100", uid: str = "u1") -> dict[str, Any]:
    """A PDService as the informer cache holds it: with a UID, a resourceVersion and a status of ours."""
    body: dict[str, Any] = yaml.safe_load(path.read_text())
    body["metadata"].update(namespace="default", uid=uid)
    if version is not None:
        body["metadata"]["resourceVersion"] = version
    body["status"] = {"observedGeneration": 1, "conditions": []}
    return body


def test_the_spec_document_is_what_the_user_wrote() -> None:
    body = stored()
    document = spec_document(body)
    assert "status" not in document and document["spec"] == body["spec"]
    assert "status" in body  # the cache's copy is left alone


def test_a_stored_version_is_validated_once_and_shared() -> None:
    views = SpecViews(DEFAULT_POLICY)
    first = views.checked(stored())
    assert first.ok and first.spec is not None
    # The reconcile's pass and the autoscaler's tick read the same version: the same result, not a second parse.
    assert views.checked(stored()) is first
    # A new version (a status write, a spec edit) is validated again; so is the same name with a new UID.
    second = views.checked(stored(version="101"))
    assert second is not first and second == first
    assert views.checked(stored(version="101", uid="u2")) is not second
    assert views.size() == 1  # one per PDService, whatever the number of versions seen


def test_a_changed_spec_is_seen_at_its_new_version() -> None:
    views = SpecViews(DEFAULT_POLICY)
    assert views.checked(stored()).ok
    broken = stored(version="101")
    broken["spec"]["prefill"].update(tensorParallelSize=2, gpusPerPod=1)
    checked = views.checked(broken)
    assert not checked.ok and any("gpusPerPod" in str(problem) for problem in checked.problems)


def test_an_object_without_a_version_is_never_remembered() -> None:
    views = SpecViews(DEFAULT_POLICY)
    body = stored(version=None)
    first = views.checked(body)
    assert first.ok and views.checked(copy.deepcopy(body)) is not first
    assert views.size() == 0


def test_the_process_policy_decides_what_is_allowed() -> None:
    body = stored(HOST_PATH)
    assert not SpecViews(DEFAULT_POLICY).checked(body).ok  # node paths are refused unless allowed
    assert SpecViews(Policy.allowing(model_host_paths=["/mnt/models"])).checked(body).ok


def test_a_deleted_pdservice_is_forgotten() -> None:
    views = SpecViews(DEFAULT_POLICY)
    first = views.checked(stored())
    views.forget("default", "llama-8b")
    assert views.size() == 0
    assert views.checked(stored()) is not first
