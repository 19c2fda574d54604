"""What the operator keeps for the router's discovery, pass by pass against a fake of its IO layer: a kv-compat
Service for every value among the engine pods (through a rollout, pruned after it), and the node topology
ConfigMap from the labels of the nodes the engines run on, read once per node (`nodes.NodeLabelCache`)."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import yaml

from pdserve.api.defaults import effective
from pdserve.api.kvcompat import KV_COMPAT_LABEL, kv_compat_hash
from pdserve.api.policy import DEFAULT_POLICY
from pdserve.api.settings import OperatorSettings
from pdserve.api.v1alpha1 import PDService
from pdserve_dev.testing.fake_kube import FakeKube
from pdserve_dev.testing.owners import controlled
from pdserve_operator.nodes import NodeLabelCache
from pdserve_operator.reconcile import Outcome, reconcile
from pdserve_operator.store import Store
from pdserve_operator.view import SpecViews

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pdservice.yaml"  # topologyKey: pdserve.io/rack
NAMESPACE, NAME = "default", "llama-8b"
RACK = "pdserve.io/rack"
TOPOLOGY = f"{NAME}-router-discovery"


def document(image: str = "vllm/vllm-openai:v0.32.0") -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["engine"]["image"] = image
    return doc


def value_of(doc: dict[str, Any]) -> str:
    return kv_compat_hash(effective(PDService.model_validate(doc).spec))


def engine_pod(role: str, index: int, value: str, node: str | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{NAME}-{role}-{index}",
            "namespace": NAMESPACE,
            "resourceVersion": "1",
            "labels": {"app.kubernetes.io/instance": NAME, "pdserve.io/role": role, KV_COMPAT_LABEL: value},
        },
        "spec": {},
        "status": {"phase": "Pending"},
    }
    if node is not None:
        pod["spec"]["nodeName"] = node
    return pod


class World:
    def __init__(self) -> None:
        self.kube = FakeKube()
        self.store = Store()
        self.clock = 0.0
        self.nodes = NodeLabelCache(self.kube, ttl_seconds=600, retry_seconds=60, clock=lambda: self.clock)
        self._ticks = itertools.count()

    def now(self) -> str:
        tick = next(self._ticks)
        return f"2026-01-01T{tick // 3600 % 24:02d}:{tick // 60 % 60:02d}:{tick % 60:02d}Z"

    def put_spec(self, doc: dict[str, Any]) -> None:
        self.store.put_owner(self.kube.add_owner(doc))

    def put_pod(self, pod: dict[str, Any]) -> None:
        """A pod of its pool's StatefulSet (which must exist) reaching the cache."""
        role = pod["metadata"]["labels"]["pdserve.io/role"]
        self.store.put(controlled(pod, self.kube.objects[("StatefulSet", NAMESPACE, f"{NAME}-{role}")]))

    def reconcile(self) -> Outcome:
        return reconcile(
            NAMESPACE,
            NAME,
            self.store,
            self.kube,
            self.now,
            views=SpecViews(DEFAULT_POLICY),
            crash_window=OperatorSettings.crash_recovery_seconds,
            nodes=self.nodes,
        )

    def services(self) -> set[str]:
        return {key[2] for key in self.kube.objects if key[0] == "Service" and KV_COMPAT_LABEL in self.labels(key)}

    def labels(self, key: tuple[str, str, str]) -> dict[str, str]:
        return dict(self.kube.objects[key]["metadata"].get("labels") or {})

    def owned(self) -> dict[str, str]:
        """The Services the discovery ConfigMap tells the router it may take engines from (name -> UID)."""
        parsed: dict[str, str] = json.loads(
            self.kube.objects[("ConfigMap", NAMESPACE, TOPOLOGY)]["data"]["services.json"]
        )["services"]
        return parsed

    def uid(self, kind: str, name: str) -> str:
        return str(self.kube.objects[(kind, NAMESPACE, name)]["metadata"]["uid"])

    def topology(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.kube.objects[("ConfigMap", NAMESPACE, TOPOLOGY)]["data"]["nodes.json"])
        return parsed


def test_a_rollout_keeps_a_service_for_each_value_until_its_last_pod_is_gone() -> None:
    world = World()
    old_doc, new_doc = document(), document("vllm/vllm-openai:v0.32.1")
    old, new = value_of(old_doc), value_of(new_doc)
    world.put_spec(old_doc)
    world.reconcile()
    assert world.services() == {f"{NAME}-prefill-{old}", f"{NAME}-decode-{old}"}
    for pod in [engine_pod("prefill", 0, old), engine_pod("decode", 0, old), engine_pod("decode", 1, old)]:
        world.put_pod(pod)

    # The image changes: the new value's Services come in the same pass as the StatefulSets' new template (the
    # wave before them), the old ones stay while old pods run.
    world.put_spec(new_doc)
    outcome = world.reconcile()
    assert outcome.pruned == []
    assert world.services() == {f"{NAME}-{pool}-{value}" for pool in ("prefill", "decode") for value in (old, new)}

    # Prefill rolled over; one old decode pod remains (terminating pods count too: they still serve).
    world.store.delete(engine_pod("prefill", 0, old))
    world.put_pod(engine_pod("prefill", 0, new))
    world.store.delete(engine_pod("decode", 0, old))
    world.put_pod(engine_pod("decode", 0, new))
    outcome = world.reconcile()
    assert outcome.pruned == [f"Service {NAME}-prefill-{old}"]
    assert world.services() == {f"{NAME}-prefill-{new}", f"{NAME}-decode-{old}", f"{NAME}-decode-{new}"}

    world.store.delete(engine_pod("decode", 1, old))
    world.put_pod(engine_pod("decode", 1, new))
    outcome = world.reconcile()
    assert outcome.pruned == [f"Service {NAME}-decode-{old}"]
    assert world.services() == {f"{NAME}-prefill-{new}", f"{NAME}-decode-{new}"}

    # A rollback brings old pods back before the spec says so (the cache is the truth): their Service returns.
    world.put_pod(engine_pod("decode", 2, old))
    world.reconcile()
    assert f"{NAME}-decode-{old}" in world.services()


def test_node_labels_are_read_once_per_node_and_published() -> None:
    world = World()
    world.kube.add_node("gpu-a", {RACK: "rack-1", "kubernetes.io/hostname": "gpu-a"})
    world.kube.add_node("gpu-b", {RACK: "rack-2"})
    doc = document()
    value = value_of(doc)
    world.put_spec(doc)
    world.reconcile()
    assert world.topology() == {"nodes": {}}  # no pod scheduled yet: nothing read, nothing published
    assert world.kube.node_reads == []

    for pod in [
        engine_pod("prefill", 0, value, "gpu-a"),
        engine_pod("decode", 0, value, "gpu-a"),
        engine_pod("decode", 1, value, "gpu-b"),
        engine_pod("decode", 2, value),  # not scheduled
    ]:
        world.put_pod(pod)
    world.reconcile()
    assert world.topology() == {"nodes": {"gpu-a": {RACK: "rack-1"}, "gpu-b": {RACK: "rack-2"}}}
    assert sorted(world.kube.node_reads) == ["gpu-a", "gpu-b"]

    # Later passes find every node cached: no read, and (once the status settled) no write.
    world.reconcile()
    mark = world.kube.mark()
    for _ in range(3):
        assert world.reconcile().result == "noop"
    assert world.kube.calls_since(mark) == []
    assert len(world.kube.node_reads) == 2

    # After the TTL a node is read again, in case it was relabelled.
    world.kube.add_node("gpu-b", {RACK: "rack-3"})
    world.clock += 601
    world.reconcile()
    assert world.topology()["nodes"]["gpu-b"] == {RACK: "rack-3"}
    assert len(world.kube.node_reads) == 4


def test_a_node_that_cannot_be_read_is_left_out_and_retried_later() -> None:
    world = World()
    world.kube.add_node("gpu-a", {RACK: "rack-1"})
    world.kube.fail("node", 403, 'nodes "gpu-a" is forbidden')
    doc = document()
    world.put_spec(doc)
    world.reconcile()
    world.put_pod(engine_pod("decode", 0, value_of(doc), "gpu-a"))
    world.reconcile()
    world.reconcile()
    assert world.topology() == {"nodes": {}}
    assert world.kube.node_reads == ["gpu-a"]  # a refusal is not asked again on every pass
    assert world.kube.objects[("Service", NAMESPACE, f"{NAME}-decode-{value_of(doc)}")]  # the rest is unharmed

    world.kube.failures.clear()
    world.clock += 61
    world.reconcile()
    assert world.topology() == {"nodes": {"gpu-a": {RACK: "rack-1"}}}


def test_without_a_topology_key_no_node_is_read() -> None:
    world = World()
    world.kube.add_node("gpu-a", {RACK: "rack-1"})
    doc = copy.deepcopy(document())
    del doc["spec"]["placement"]["topologyKey"]
    doc["spec"]["placement"]["colocation"] = "none"
    world.put_spec(doc)
    world.reconcile()
    world.put_pod(engine_pod("decode", 0, value_of(doc), "gpu-a"))
    world.reconcile()
    assert world.kube.node_reads == []
    assert world.topology() == {"nodes": {}}


def test_the_router_is_told_the_services_the_operator_created_by_uid() -> None:
    """The first pass creates the per-kv-compat Services; the next lists them with their UIDs (long before a pod
    of theirs can be ready). Through a rollout the new value's Service is listed from the pass after it is created,
    and a pruned one is dropped in the pass that prunes it."""
    world = World()
    old_doc, new_doc = document(), document("vllm/vllm-openai:v0.32.1")
    old, new = value_of(old_doc), value_of(new_doc)
    world.put_spec(old_doc)
    world.reconcile()
    assert world.owned() == {}
    world.reconcile()
    services = [f"{NAME}-prefill-{old}", f"{NAME}-decode-{old}"]
    assert world.owned() == {name: world.uid("Service", name) for name in services}
    world.put_pod(engine_pod("decode", 0, old))

    world.put_spec(new_doc)
    world.reconcile()
    world.reconcile()
    services = [f"{NAME}-{pool}-{value}" for pool in ("prefill", "decode") for value in (old, new)]
    services.remove(f"{NAME}-prefill-{old}")  # no prefill pod carries the old value: pruned
    assert world.owned() == {name: world.uid("Service", name) for name in services}
