"""The informer cache: owner index, stale copies dropped, snapshot contents split by provable ownership."""

from __future__ import annotations

from typing import Any

from pdserve_dev.testing.owners import controlled, replica_set_pod
from pdserve_operator.store import Store

OWNER = {
    "apiVersion": "pdserve.io/v1alpha1",
    "kind": "PDService",
    "metadata": {"name": "llama", "namespace": "ns", "uid": "u-llama", "resourceVersion": "1"},
}
SLICES = {"endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}


def obj(kind: str, name: str, rv: int, instance: str = "llama", **labels: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"u-{name}",
            "resourceVersion": str(rv),
            "labels": {"app.kubernetes.io/instance": instance, **labels},
        },
    }


def child(kind: str, name: str, rv: int) -> dict[str, Any]:
    """An object the PDService llama controls."""
    return controlled(obj(kind, name, rv), OWNER)


def store_with_owner() -> Store:
    store = Store()
    store.put_owner(OWNER)
    return store


def test_snapshot_groups_children_pods_and_router_slices() -> None:
    store = store_with_owner()
    prefill = child("StatefulSet", "llama-prefill", 5)
    router = child("Service", "llama-router", 6)
    assert store.put(prefill) == ("ns", "llama")
    store.put(router)
    store.put(child("Deployment", "llama-router", 6))
    store.put(controlled(obj("Pod", "llama-prefill-0", 6), prefill))
    store.put(replica_set_pod(obj("Pod", "llama-router-5d9c7b-x1", 6), "llama-router"))
    # The KV store's Deployment (engine.kvCache.store) is a child too: its pods are not foreign.
    store.put(child("Deployment", "llama-kvstore", 6))
    store.put(replica_set_pod(obj("Pod", "llama-kvstore-7f8e9d-k2", 6), "llama-kvstore", "7f8e9d"))
    router_slice = {"kubernetes.io/service-name": "llama-router", **SLICES}
    store.put(controlled(obj("EndpointSlice", "llama-router-abc", 7, **router_slice), router))
    store.put(obj("EndpointSlice", "llama-prefill-abc", 8, **{"kubernetes.io/service-name": "llama-prefill"}))
    store.put(obj("StatefulSet", "other-prefill", 9, instance="other"))
    snap = store.snapshot("ns", "llama")
    assert sorted(snap.children) == [
        ("Deployment", "ns", "llama-kvstore"),
        ("Deployment", "ns", "llama-router"),
        ("Service", "ns", "llama-router"),
        ("StatefulSet", "ns", "llama-prefill"),
    ]
    assert sorted(p["metadata"]["name"] for p in snap.pods) == [
        "llama-kvstore-7f8e9d-k2",
        "llama-prefill-0",
        "llama-router-5d9c7b-x1",
    ]
    assert [s["metadata"]["name"] for s in snap.endpoint_slices] == ["llama-router-abc"]
    assert not snap.foreign and not snap.foreign_pods


def test_labels_alone_make_nothing_a_child_a_pod_or_a_router_slice() -> None:
    """What anyone with `edit` in the namespace can write: our labels on their own objects, names that look like
    ours, even an owner reference naming our StatefulSet under a name it never gives its pods."""
    store = store_with_owner()
    prefill = child("StatefulSet", "llama-prefill", 5)
    router = child("Service", "llama-router", 6)
    store.put(prefill)
    store.put(router)
    labels = {"pdserve.io/role": "prefill", "app.kubernetes.io/managed-by": "pdserve-operator"}
    store.put(obj("Role", "llama-router", 7))  # another user's Role of a child's name, labelled like ours
    store.put(obj("Pod", "evil", 8, **labels))
    store.put(obj("Pod", "llama-prefill-1", 8, **labels))  # a pool member's name, no owner reference
    store.put(controlled(obj("Pod", "llama-prefill-x", 8, **labels), prefill))  # not an ordinal
    stale = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "llama-prefill", "uid": "old"}}
    store.put(controlled(obj("Pod", "llama-prefill-2", 8, **labels), stale))  # a predecessor's StatefulSet
    store.put(replica_set_pod(obj("Pod", "llama-router-5d9c7b-x1", 8), "llama-router"))  # no router Deployment
    router_slice = {"kubernetes.io/service-name": "llama-router", **SLICES}
    store.put(obj("EndpointSlice", "llama-router-forged", 9, **router_slice))  # no controller reference
    snap = store.snapshot("ns", "llama")
    assert sorted(snap.children) == [("Service", "ns", "llama-router"), ("StatefulSet", "ns", "llama-prefill")]
    assert list(snap.foreign) == [("Role", "ns", "llama-router")]
    assert snap.pods == []
    assert sorted(p["metadata"]["name"] for p in snap.foreign_pods) == [
        "evil",
        "llama-prefill-1",
        "llama-prefill-2",
        "llama-prefill-x",
        "llama-router-5d9c7b-x1",
    ]
    assert snap.endpoint_slices == []


def test_nothing_is_owned_before_the_owner_is_cached() -> None:
    store = Store()
    store.put(child("StatefulSet", "llama-prefill", 5))
    snap = store.snapshot("ns", "llama")
    assert not snap.children and list(snap.foreign) == [("StatefulSet", "ns", "llama-prefill")]


def test_older_copies_never_replace_newer_ones() -> None:
    store = store_with_owner()
    store.put(child("Service", "llama-router", 10))
    store.put(child("Service", "llama-router", 9))  # an apply response overtaken by its own watch event
    assert (
        store.snapshot("ns", "llama").children[("Service", "ns", "llama-router")]["metadata"]["resourceVersion"] == "10"
    )
    store.delete(obj("Service", "llama-router", 11))
    assert not store.snapshot("ns", "llama").children


def test_owner_lifecycle() -> None:
    store = Store()
    store.put_owner({"metadata": {"name": "a", "namespace": "ns", "resourceVersion": "3"}})
    store.put_owner({"metadata": {"name": "a", "namespace": "ns", "resourceVersion": "2"}})
    assert store.owner("ns", "a") == {"metadata": {"name": "a", "namespace": "ns", "resourceVersion": "3"}}
    store.delete_owner("ns", "a")
    assert store.owner("ns", "a") is None
    assert store.owner_keys() == []


def test_relist_drops_entries_whose_deletion_was_missed() -> None:
    store = store_with_owner()
    store.put(child("Service", "llama-router", 5))
    store.put(child("Service", "llama-prefill", 6))
    other = obj("Service", "x-router", 7, instance="x")
    other["metadata"]["namespace"] = "elsewhere"
    store.put(other)
    dropped = store.replace_kind("Service", ["ns"], [child("Service", "llama-prefill", 8)])
    assert dropped == 1
    assert list(store.snapshot("ns", "llama").children) == [("Service", "ns", "llama-prefill")]
    assert store.snapshot("elsewhere", "x").foreign  # outside the relisted namespaces: untouched


def test_relist_keeps_entries_written_after_its_snapshot() -> None:
    # The list was taken at revision 20; a Service created at 25 reached the cache by its watch event while the
    # list was on its way: absent from the list, but not stale. One from revision 12 that the list lacks is.
    store = store_with_owner()
    store.put(child("Service", "llama-old", 12))
    store.put(child("Service", "llama-new", 25))
    dropped = store.replace_kind("Service", ["ns"], [child("Service", "llama-prefill", 18)], listed_at=["20"])
    assert dropped == 1
    assert sorted(key[2] for key in store.snapshot("ns", "llama").children) == ["llama-new", "llama-prefill"]
