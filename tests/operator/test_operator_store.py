"""The informer cache: owner index, stale copies dropped, snapshot contents."""

from __future__ import annotations

from typing import Any

from pdserve_operator.store import Store


def obj(kind: str, name: str, rv: int, instance: str = "llama", **labels: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": str(rv),
            "labels": {"app.kubernetes.io/instance": instance, **labels},
        },
    }


def test_snapshot_groups_children_pods_and_router_slices() -> None:
    store = Store()
    store.put_owner({"metadata": {"name": "llama", "namespace": "ns", "resourceVersion": "1"}})
    assert store.put(obj("StatefulSet", "llama-prefill", 5)) == ("ns", "llama")
    store.put(obj("Pod", "llama-prefill-0", 6))
    store.put(obj("EndpointSlice", "llama-router-abc", 7, **{"kubernetes.io/service-name": "llama-router"}))
    store.put(obj("EndpointSlice", "llama-prefill-abc", 8, **{"kubernetes.io/service-name": "llama-prefill"}))
    store.put(obj("StatefulSet", "other-prefill", 9, instance="other"))
    snap = store.snapshot("ns", "llama")
    assert list(snap.children) == [("StatefulSet", "ns", "llama-prefill")]
    assert [p["metadata"]["name"] for p in snap.pods] == ["llama-prefill-0"]
    assert [s["metadata"]["name"] for s in snap.endpoint_slices] == ["llama-router-abc"]


def test_older_copies_never_replace_newer_ones() -> None:
    store = Store()
    store.put(obj("Service", "llama-router", 10))
    store.put(obj("Service", "llama-router", 9))  # an apply response overtaken by its own watch event
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
    store = Store()
    store.put(obj("Service", "llama-router", 5))
    store.put(obj("Service", "llama-prefill", 6))
    other = obj("Service", "x-router", 7, instance="x")
    other["metadata"]["namespace"] = "elsewhere"
    store.put(other)
    dropped = store.replace_kind("Service", ["ns"], [obj("Service", "llama-prefill", 8)])
    assert dropped == 1
    assert list(store.snapshot("ns", "llama").children) == [("Service", "ns", "llama-prefill")]
    assert store.snapshot("elsewhere", "x").children  # outside the relisted namespaces: untouched


def test_relist_keeps_entries_written_after_its_snapshot() -> None:
    # The list was taken at revision 20; a Service created at 25 reached the cache by its watch event while the
    # list was on its way: absent from the list, but not stale. One from revision 12 that the list lacks is.
    store = Store()
    store.put(obj("Service", "llama-old", 12))
    store.put(obj("Service", "llama-new", 25))
    dropped = store.replace_kind("Service", ["ns"], [obj("Service", "llama-prefill", 18)], listed_at=["20"])
    assert dropped == 1
    assert sorted(key[2] for key in store.snapshot("ns", "llama").children) == ["llama-new", "llama-prefill"]
