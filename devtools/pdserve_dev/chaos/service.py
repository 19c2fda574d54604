"""One PDService on the local cluster's process node, and the faults and reads a chaos scenario needs.

The PDService is the local example's (`examples/local-sim.yaml`): every pod on the process node, the vLLM image
run as the engine simulator with the renderer's exact command line (its `--shutdown-timeout`, preStop hook and
grace period, its `PDSERVE_KV_COMPAT`), the pdserve image run as the real router. Both pools are
`autoscaling.mode: external`, so the operator keeps whatever replicas `/scale` was given: `scale` writes them the
way an autoscaler does. The operator runs as a local process (`OperatorProcess`) so a scenario can kill it.

Every method blocks (kubectl, HTTP reads): a scenario that runs a load on its event loop calls them in a thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.api.crdgen import custom_resource_definition
from pdserve_dev.process_node.node import SELECTOR, TOLERATION
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.cluster import pod_ready as ready
from pdserve_dev.testing.metrics import metric_value, scrape_sync
from pdserve_dev.testing.mooncake import MooncakeStore, mooncake_store
from pdserve_dev.testing.operator import OperatorProcess
from pdserve_dev.testing.wait import wait_for, wait_until_none_left
from pdserve_operator.render.router import METRICS_PORT

NAME = "chaos"
MODEL = "tiny-llama"
#: Two engine images: switching between them changes the kv-compat value (a rolling update that must never pair
#: engines of different values).
IMAGES = ("vllm/vllm-openai:v0.32.0", "vllm/vllm-openai:v0.32.1")
ENGINES = "pdserve.io/role in (prefill,decode)"
ENGINE_PORT = 8000
ROUTER_PORT = 8080
ROUTER_METRICS_PORT = METRICS_PORT  # what the renderer gives a router serving on ROUTER_PORT
#: What the operator may own, by kubectl resource name (checked for duplicates after a restart mid-rollout).
CHILD_RESOURCES = (
    "statefulsets",
    "deployments",
    "services",
    "configmaps",
    "serviceaccounts",
    "roles",
    "rolebindings",
    "poddisruptionbudgets",
)


def external_pools_manifest(
    name: str,
    namespace: str,
    *,
    prefill: int,
    decode: int,
    max_num_seqs: int,
    image: str = IMAGES[0],
    router_replicas: int = 1,
    max_replicas: int = 4,
) -> dict[str, Any]:
    """The local example's PDService with both pools scaled by an external writer (`scale`)."""
    external = {"enabled": True, "mode": "external", "minReplicas": 1, "maxReplicas": max_replicas}
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": MODEL, "uri": "hf://pdserve/tiny-llama"},
            "engine": {"image": image, "maxModelLen": 4096, "kvLeaseSeconds": 30},
            "prefill": {"replicas": prefill, "autoscaling": external},
            "decode": {"replicas": decode, "maxNumSeqs": max_num_seqs, "autoscaling": external},
            "placement": {"gpuNodeSelector": SELECTOR, "tolerations": [TOLERATION], "rdma": "required"},
            "router": {
                "replicas": router_replicas,
                "nodeSelector": SELECTOR,
                "tolerations": [TOLERATION],
                "routing": {"disaggregationThreshold": 64},
            },
        },
    }


def scale(cluster: ClusterHelper, namespace: str, name: str, role: str, replicas: int) -> None:
    """What an autoscaler does: write the pool StatefulSet's replicas (kubectl scale goes through /scale)."""
    cluster.kubectl("scale", f"statefulset/{name}-{role}", f"--replicas={replicas}", "-n", namespace)


def router_metrics_url(router: str) -> str:
    """The metrics base URL of the router pod whose client base URL is `router` (same address, its metrics port)."""
    return f"{router.rsplit(':', 1)[0]}:{ROUTER_METRICS_PORT}"


def endpoints_up(router: str, role: str) -> int:
    """How many engines of `role` the router at `router` uses now (-1 when it does not answer)."""
    try:
        exposition = scrape_sync(f"{router_metrics_url(router)}/metrics", timeout=3)
        return int(metric_value(exposition, "pdserve_router_endpoint_up", role=role))
    except OSError:
        return -1


def wait_pool(
    cluster: ClusterHelper,
    namespace: str,
    role: str,
    replicas: int,
    *,
    router: str | Callable[[], str],
    timeout: float = 180.0,
) -> None:
    """Wait until the pool has exactly `replicas` pods, all Ready, and the router uses all of them. `router` may
    be a function giving the serving router's URL at each check, for a router that may roll meanwhile (a change of
    the SLO rolls it: its configuration holds the targets)."""

    def settled() -> bool:
        pods = cluster.pods(namespace, f"pdserve.io/role={role}")
        if len(pods) != replicas or not all(map(ready, pods)):
            return False
        return endpoints_up(router() if callable(router) else router, role) == replicas

    wait_for(settled, timeout=timeout, interval=0.5, message=f"{replicas} {role} engines Ready and used by the router")


@dataclass
class ChaosService:
    """The deployed PDService (`deploy`), its operator process and the router the load goes through."""

    cluster: ClusterHelper
    namespace: str
    workdir: Path
    operator: OperatorProcess
    router: str = ""
    """Base URL of the router pod the load goes through."""
    log: Callable[[str], None] = print
    store: MooncakeStore | None = None
    """The Mooncake master and store server the engines use once `use_store` turned the store on."""
    _exits: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @classmethod
    def deploy(
        cls,
        cluster: ClusterHelper,
        workdir: Path,
        *,
        prefill: int,
        decode: int,
        max_num_seqs: int,
        log: Callable[[str], None] = print,
    ) -> ChaosService:
        """Install the CRD, start the operator, apply the PDService and wait until it is Available and the router
        uses every engine."""
        cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(custom_resource_definition()))
        cluster.wait_crd_established()
        namespace = cluster.create_namespace("chaos")
        operator = cls._operator(cluster, workdir, namespace)
        service = cls(cluster, namespace, workdir, operator, log=log)
        try:
            operator.start().wait_ready()
            cluster.apply(
                external_pools_manifest(NAME, namespace, prefill=prefill, decode=decode, max_num_seqs=max_num_seqs)
            )
            result = cluster.kubectl(
                "wait", "--for=condition=Available", f"pds/{NAME}", "-n", namespace, "--timeout=240s", timeout=260,
                check=False,
            )  # fmt: skip
            if result.returncode != 0:
                raise RuntimeError(f"{NAME} not Available: {result.stderr.strip()}\n{operator.log_tail()}")
            service.use_router(service.router_pods()[0])
            service.wait_pool("prefill", prefill)
            service.wait_pool("decode", decode)
        except BaseException:
            service.stop()  # the caller gets no service to stop: the operator process must not outlive the run
            raise
        return service

    @staticmethod
    def _operator(cluster: ClusterHelper, workdir: Path, namespace: str) -> OperatorProcess:
        return OperatorProcess(
            cluster.kubeconfig, workdir / "operator.log", namespaces=[namespace], identity="chaos",
            lease_namespace=namespace,
        )  # fmt: skip

    def stop(self) -> None:
        try:
            self.operator.stop()
        finally:
            self._exits.close()

    # -- the KV store -------------------------------------------------------------------------------------------

    def use_store(self, timeout: float = 240.0) -> MooncakeStore:
        """Turn the PDService's KV store on (a real Mooncake master and store server on loopback, the engines told
        its address, as `masterAddress` points a PDService at an existing master) and wait until every engine runs
        with it. The local cluster has no DNS, so the master pdserve deploys (its Service name) is not reachable
        from the engines here: that one is checked by the operator's cluster tests."""
        if self.store is None:
            self.store = self._exits.enter_context(mooncake_store(self.workdir / "mooncake", capacity_bytes=1 << 30))
        store = self.store
        mooncake = {"masterAddress": store.master_address, "metadataServer": store.metadata_server, "protocol": "tcp"}
        self.patch({"engine": {"kvCache": {"store": {"backend": "mooncake", "mooncake": mooncake}}}})

        def gaps() -> list[str]:
            pods = self.pods(ENGINES)
            missing = [
                pod["metadata"]["name"]
                for pod in pods
                if not ready(pod)
                or pod["metadata"].get("deletionTimestamp")
                or not any(
                    env.get("name") == "MOONCAKE_CONFIG_PATH" for env in pod["spec"]["containers"][0].get("env", [])
                )
            ]
            return [f"engines not yet Ready with the store: {missing}"] if missing else []

        wait_until_none_left(gaps, timeout, 1.0, "every engine restarted with the KV store")
        # The router's config changed too (its policy knows the store): its pods were replaced; use a new one.
        replicas = int(self.pds()["spec"].get("router", {}).get("replicas", 1))
        self.use_router(self.wait_routers(replicas, timeout)[0])
        return store

    def router_metric(self, name: str, **labels: str) -> float:
        """One series of the router the load goes through."""
        return metric_value(scrape_sync(f"{router_metrics_url(self.router)}/metrics", timeout=3), name, **labels)

    # -- the PDService ----------------------------------------------------------------------------------------

    def pds(self) -> dict[str, Any]:
        found: dict[str, Any] = self.cluster.get_json(f"pds/{NAME}", "-n", self.namespace)
        return found

    def patch(self, spec: dict[str, Any]) -> None:
        self.cluster.kubectl(
            "patch", f"pds/{NAME}", "-n", self.namespace, "--type=merge", "-p", json.dumps({"spec": spec})
        )

    def kv_compat(self) -> str:
        return str(self.pds().get("status", {}).get("kvCompatHash", ""))

    def converged(self) -> bool:
        """The operator has caught up with the spec: status for this generation, Available."""
        doc = self.pds()
        status = doc.get("status", {})
        available = any(c["type"] == "Available" and c["status"] == "True" for c in status.get("conditions", []))
        return available and status.get("observedGeneration") == doc["metadata"]["generation"]

    def owned_children(self) -> Counter[str]:
        """How many objects of each kind the PDService owns (a controller ownerReference to its UID)."""
        uid = self.pds()["metadata"]["uid"]
        items = self.cluster.get_json(",".join(CHILD_RESOURCES), "-n", self.namespace)["items"]
        return Counter(
            item["kind"]
            for item in items
            if any(ref.get("uid") == uid for ref in item["metadata"].get("ownerReferences", []))
        )

    # -- pools --------------------------------------------------------------------------------------------------

    def scale(self, role: str, replicas: int) -> None:
        scale(self.cluster, self.namespace, NAME, role, replicas)

    def wait_pool(self, role: str, replicas: int, timeout: float = 180.0) -> None:
        wait_pool(self.cluster, self.namespace, role, replicas, router=self.router, timeout=timeout)

    def shape(self, prefill: int, decode: int) -> None:
        """Bring both pools to these sizes (each a no-op where it already is) and wait until they serve."""
        self.scale("prefill", prefill)
        self.scale("decode", decode)
        self.wait_pool("prefill", prefill)
        self.wait_pool("decode", decode)

    def pods(self, selector: str) -> list[dict[str, Any]]:
        return self.cluster.pods(self.namespace, selector)

    def engine_url(self, pod: dict[str, Any]) -> str:
        return f"http://{pod['status']['podIP']}:{ENGINE_PORT}"

    def engine_state(self, pod: dict[str, Any]) -> dict[str, Any]:
        """The simulator's `/sim/state` (running, waiting, held_kv, ...); empty when it does not answer."""
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.engine_url(pod)}/sim/state", timeout=3) as response:
                state: dict[str, Any] = json.loads(response.read())
                return state
        except (OSError, ValueError):
            return {}

    def engine_faults(self, pod: dict[str, Any], faults: dict[str, Any] | None) -> None:
        """Set faults of the simulator in `pod` (its `/sim/faults`), or clear them all with None."""
        import urllib.request

        request = urllib.request.Request(
            f"{self.engine_url(pod)}/sim/faults",
            data=None if faults is None else json.dumps(faults).encode(),
            method="DELETE" if faults is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def engine_metric(self, pod: dict[str, Any], name: str) -> float:
        return metric_value(scrape_sync(f"{self.engine_url(pod)}/metrics", timeout=3), name)

    def rollout_gaps(self, value: str, prefill: int, decode: int) -> list[str]:
        """What still separates the service from a finished rollout to kv-compat `value` (empty: finished): every
        engine runs with that value, the pools are whole and Ready, no Service of another value is left, and the
        router uses every engine. A timed-out wait reports these, so a stuck rollout says where it stuck."""
        pods = self.pods(ENGINES)
        gaps = []
        if len(pods) != prefill + decode:
            gaps.append(f"{len(pods)} engine pods, not {prefill + decode}")
        values = sorted({pod["metadata"]["labels"].get("pdserve.io/kv-compat") or "" for pod in pods})
        if values != [value]:
            gaps.append(f"kv-compat values {values}")
        unready = sorted(pod["metadata"]["name"] for pod in pods if not ready(pod))
        if unready:
            gaps.append(f"not Ready: {unready}")
        services = self.cluster.get_json("services", "-n", self.namespace, "-l", "pdserve.io/kv-compat")["items"]
        stale = sorted(
            s["metadata"]["name"] for s in services if s["metadata"]["labels"]["pdserve.io/kv-compat"] != value
        )
        if stale:
            gaps.append(f"Services of another value: {stale}")
        for role, wanted in (("prefill", prefill), ("decode", decode)):
            used = endpoints_up(self.router, role)
            if used != wanted:
                gaps.append(f"the router uses {used} {role} engines, not {wanted}")
        return gaps

    def wait_rolled_to(self, value: str, prefill: int, decode: int, timeout: float) -> None:
        """Wait until the rollout to `value` finished; on timeout, say what was still missing."""
        wait_until_none_left(
            lambda: self.rollout_gaps(value, prefill, decode), timeout, 1.0, "the rollout to the new image"
        )

    # -- faults ---------------------------------------------------------------------------------------------

    def kill_pod(self, pod: dict[str, Any]) -> None:
        """A crash, then the pod's removal: SIGKILL the pod's processes (no drain, no preStop: what a node failure
        or an OOM kill does to work in hand), then `kubectl delete --grace-period=0 --force` so its controller
        replaces it with a new incarnation."""
        name = pod["metadata"]["name"]
        for container in pod["spec"]["containers"]:
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                pid = self.cluster.container_process(self.namespace, name, container["name"]).pid
                # The process node starts each container as a process-group leader: the group is that container.
                os.killpg(pid, signal.SIGKILL)
        self.cluster.kubectl("delete", "pod", name, "-n", self.namespace, "--grace-period=0", "--force", "--wait=false")

    def replace_pod(self, pod: dict[str, Any], timeout: float = 180.0) -> None:
        """Delete a pod the way `kubectl delete pod` does (its grace period: preStop, the engine's drain) and wait
        until its StatefulSet's new incarnation of the same name is Ready."""
        name, old_uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        self.cluster.kubectl("delete", "pod", name, "-n", self.namespace, "--wait=false")

        def replaced() -> bool:
            found = [p for p in self.pods(ENGINES) if p["metadata"]["name"] == name]
            return bool(found) and found[0]["metadata"]["uid"] != old_uid and ready(found[0])

        wait_for(replaced, timeout=timeout, interval=0.5, message=f"{name} replaced by a Ready new incarnation")

    def restart_operator(self) -> None:
        """SIGKILL the operator (no lease release, no cleanup) and start a new one with the same identity."""
        self.operator.kill()
        self.operator = self._operator(self.cluster, self.workdir, self.namespace)
        self.operator.start().wait_ready(timeout=90)

    # -- the router -------------------------------------------------------------------------------------------

    def router_pods(self) -> list[dict[str, Any]]:
        """The router's Ready pods, oldest first."""
        pods = [pod for pod in self.pods("pdserve.io/role=router") if ready(pod) and pod["status"].get("podIP")]
        return sorted(pods, key=lambda pod: pod["metadata"]["creationTimestamp"])

    def router_uses(self, role: str, pod: dict[str, Any]) -> bool:
        """Whether the router takes the engine in `pod` for new requests (ready, not ejected)."""
        exposition = scrape_sync(f"{router_metrics_url(self.router)}/metrics", timeout=3)
        up = metric_value(exposition, "pdserve_router_endpoint_up", role=role, endpoint=pod["metadata"]["name"])
        return up == 1

    def use_router(self, pod: dict[str, Any]) -> None:
        self.router = f"http://{pod['status']['podIP']}:{ROUTER_PORT}"

    def wait_routers(self, replicas: int, timeout: float = 120.0) -> list[dict[str, Any]]:
        """Wait until exactly `replicas` router pods exist, all Ready and using every engine; return them."""

        def settled() -> list[dict[str, Any]] | None:
            pods = self.pods("pdserve.io/role=router")
            if len(pods) != replicas or not all(map(ready, pods)):
                return None
            engines = self.pods(ENGINES)
            for pod in pods:
                url = f"http://{pod['status']['podIP']}:{ROUTER_PORT}"
                if endpoints_up(url, "prefill") + endpoints_up(url, "decode") != len(engines):
                    return None
            return self.router_pods()

        return wait_for(settled, timeout=timeout, interval=0.5, message=f"{replicas} router pods Ready")
