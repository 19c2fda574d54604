"""Which EndpointSlices and endpoints the router trusts (`discovery.trust`), as a table: issue 18 item 1.

Each row is a slice the pool's label selector finds (it carries the pool's instance, role and kv-compat labels,
which anyone with `edit` can write) and what of it the router may use. The Services the operator owns are the ones
its discovery ConfigMap lists, by UID.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.api.router_config import is_member_pod
from pdserve_runtime.router.discovery.trust import trusted_slices

OWNED = {"llama-decode-6d3fd87539ae": "uid-decode-svc"}
CONTROLLER = "endpointslice-controller.k8s.io"


def slice_(
    service: str = "llama-decode-6d3fd87539ae",
    *,
    managed_by: str | None = CONTROLLER,
    owner_uid: str | None = "uid-decode-svc",
    owner_kind: str = "Service",
    pods: tuple[str, ...] = ("llama-decode-0",),
) -> dict[str, Any]:
    labels = {
        "app.kubernetes.io/instance": "llama",
        "pdserve.io/role": "decode",
        "pdserve.io/kv-compat": "6d3fd87539ae",
        "kubernetes.io/service-name": service,
    }
    if managed_by is not None:
        labels["endpointslice.kubernetes.io/managed-by"] = managed_by
    meta: dict[str, Any] = {"name": f"{service}-x", "labels": labels}
    if owner_uid is not None:
        meta["ownerReferences"] = [{"kind": owner_kind, "name": service, "uid": owner_uid, "controller": True}]
    endpoints = [{"addresses": [f"10.0.0.{i}"], "targetRef": {"kind": "Pod", "name": p}} for i, p in enumerate(pods)]
    return {"metadata": meta, "addressType": "IPv4", "endpoints": endpoints}


@pytest.mark.parametrize(
    ("case", "candidate"),
    [
        ("a tenant's own Service with the pool's labels", slice_("evil", owner_uid="uid-evil")),
        ("a hand-made slice (no EndpointSlice controller)", slice_(managed_by=None)),
        ("a slice claiming another manager", slice_(managed_by="tenant-controller")),
        ("an owned Service's name, another UID (deleted and re-made by someone else)", slice_(owner_uid="uid-new")),
        ("an owned Service's name, no controller reference", slice_(owner_uid=None)),
        ("an owned Service's UID on a reference that is not a Service", slice_(owner_kind="Deployment")),
    ],
)
def test_a_slice_the_operator_does_not_own_gives_no_engine(case: str, candidate: dict[str, Any]) -> None:
    trusted = trusted_slices([candidate], owned=OWNED, require_owned=True, statefulset="llama-decode")
    assert trusted.slices == [], case
    assert len(trusted.ignored) == 1 and trusted.ignored[0].startswith(f"slice {candidate['metadata']['name']}: ")


def test_an_owned_services_slice_gives_only_the_statefulsets_member_pods() -> None:
    pods = ("llama-decode-0", "evil", "llama-decode-x", "llama-decode-01", "llama-decode-1", "llama-prefill-0")
    trusted = trusted_slices([slice_(pods=pods)], owned=OWNED, require_owned=True, statefulset="llama-decode")
    [kept] = trusted.slices
    assert [e["targetRef"]["name"] for e in kept["endpoints"]] == ["llama-decode-0", "llama-decode-1"]
    assert [reason.split(" of slice")[0] for reason in trusted.ignored] == [
        "endpoint evil",
        "endpoint llama-decode-x",
        "endpoint llama-decode-01",
        "endpoint llama-prefill-0",
    ]


def test_nothing_is_trusted_before_the_published_list_is_read_and_everything_without_one() -> None:
    assert trusted_slices([slice_()], owned=None, require_owned=True, statefulset=None).slices == []
    hand_written = slice_("anything", managed_by=None, owner_uid=None)
    assert trusted_slices([hand_written], owned=None, require_owned=False, statefulset=None).slices == [hand_written]


@pytest.mark.parametrize(
    ("pod", "member"),
    [("db-0", True), ("db-12", True), ("db-01", False), ("db--1", False), ("db-", False), ("db-0x", False),
     ("dbx-0", False), ("db-a-0", False)],
)  # fmt: skip
def test_member_names_are_statefulset_ordinals(pod: str, member: bool) -> None:
    assert is_member_pod(pod, "db") is member
