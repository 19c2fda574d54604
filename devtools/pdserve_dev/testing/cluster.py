"""Helpers that tests (and demos) use against a running cluster: kubectl, apply, wait, pod IPs, logs.

Kept free of pytest so the operator's or the runtime's tests, a notebook, or a benchmark can use it with a
cluster from `LocalCluster` or with any kubeconfig (`PDSERVE_CLUSTER_KUBECONFIG`).
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pdserve_dev.cluster import build
from pdserve_dev.cluster.cluster import LocalCluster
from pdserve_dev.testing.net import listening
from pdserve_dev.testing.wait import wait_for

_COMPONENT_NAMES = ("etcd", "kube-apiserver", "kube-controll", "kube-scheduler", "kwok")
# A line of `kubectl auth can-i --list`: resource, [non-resource URLs], [resource names], [verbs].
_CAN_I = re.compile(r"^(\S*)\s+\[(.*?)\]\s+\[(.*?)\]\s+\[(.*?)\]\s*$")


def leaked_listeners(ports: Iterable[int]) -> list[str]:
    """Ports of `ports` that a cluster component still listens on, with ss' description of the socket.

    Once the cluster is gone its ports are free for anyone: on a machine shared with other test runs another
    program may bind one a moment later, which is not a leak, so ownership is checked with `ss -p`.
    """
    leaked = []
    for port in ports:
        if not listening(port):
            continue
        owners = subprocess.run(
            ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
        # No LISTEN line: the connect was a TCP self-connect or met a socket closing just then.
        if owners and ("users:" not in owners or any(f'"{name}' in owners for name in _COMPONENT_NAMES)):
            leaked.append(f"{port}: {owners}")
    return leaked


@dataclass(frozen=True)
class ContainerProcess:
    """Who a container's process runs as and with which environment, as the kernel sees it."""

    pid: int
    uid: int
    gid: int
    environ: dict[str, str]

    @classmethod
    def of(cls, pid: int) -> ContainerProcess:
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
        )
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        environ = dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)
        return cls(pid, int(status["Uid"].split()[1]), int(status["Gid"].split()[1]), environ)


class KubectlError(RuntimeError):
    """kubectl exited non-zero. Not an AssertionError: inside `wait_for` a failed kubectl (an object that does not
    exist yet) means "not yet", while a failed assertion is a verdict."""


def pod_ready(pod: dict[str, Any]) -> bool:
    """Whether a pod object's Ready condition is True."""
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


@dataclass
class ClusterHelper:
    """What the `cluster` fixture yields."""

    kubeconfig: Path
    process_node_workdir: Path | None = None
    """The process node's workdir (None when reusing an external cluster or running without one)."""
    local: LocalCluster | None = None
    kubectl_path: Path | None = None

    @classmethod
    def from_cluster(cls, local: LocalCluster) -> ClusterHelper:
        return cls(
            kubeconfig=local.kubeconfig,
            process_node_workdir=local.process_node_workdir if local.process_node else None,
            local=local,
        )

    # -- kubectl ------------------------------------------------------------------------------------------

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against the cluster; with check=True a failure raises and shows kubectl's stderr."""
        kubectl = self.kubectl_path or build.binary("kubectl")
        proc = subprocess.run(
            [str(kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise KubectlError(
                f"kubectl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    def apply(
        self, manifests: str | Mapping[str, Any] | Iterable[Mapping[str, Any]], namespace: str | None = None
    ) -> str:
        """Server-side apply YAML text, one object or several; return kubectl's output."""
        if isinstance(manifests, str):
            text = manifests
        elif isinstance(manifests, Mapping):
            text = yaml.safe_dump(dict(manifests))
        else:
            text = yaml.safe_dump_all([dict(m) for m in manifests])
        args = ["apply", "--server-side", "--field-manager=pdserve-tests", "-f", "-"]
        if namespace:
            args.insert(0, f"--namespace={namespace}")
        return self.kubectl(*args, input=text).stdout

    def get_json(self, *args: str) -> Any:
        """`kubectl get ... -o json`, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def wait_crd_established(self, name: str = "pdservices.pdserve.io", timeout: float = 60.0) -> None:
        """Wait until a CRD is served. Not `kubectl wait --for=condition=Established`: right after an apply the CRD
        may have no conditions yet, and kubectl then fails at once instead of waiting."""

        def established() -> bool:
            crd = self.get_json("crd", name)
            conditions = (crd.get("status") or {}).get("conditions") or []
            return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

        wait_for(established, timeout=timeout, message=f"CRD {name} Established")

    def create_namespace(self, prefix: str = "test") -> str:
        """A fresh namespace (unique name) so tests sharing the session cluster do not see each other."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.kubectl("create", "namespace", name)
        wait_for(
            lambda: (
                self.kubectl("get", "serviceaccount", "default", f"--namespace={name}", check=False).returncode == 0
            ),
            timeout=30,
            message=f"the default ServiceAccount of namespace {name}",
        )
        return name

    # -- queries ------------------------------------------------------------------------------------------

    wait_for = staticmethod(wait_for)

    def pods(self, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        args = ["pods", f"--namespace={namespace}"]
        if selector:
            args.append(f"--selector={selector}")
        items: list[dict[str, Any]] = self.get_json(*args).get("items", [])
        return items

    def pod_ips(self, namespace: str, selector: str = "", ready_only: bool = True) -> list[str]:
        """IPs of the (ready) pods matching `selector`, sorted."""
        ips = []
        for pod in self.pods(namespace, selector):
            status = pod.get("status", {})
            if status.get("podIP") and (pod_ready(pod) or not ready_only):
                ips.append(status["podIP"])
        return sorted(ips)

    def serving_ips(self, namespace: str, selector: str) -> list[str]:
        """IPs of the Ready pods matching `selector`, those not being deleted first: where a Service would send
        new connections (a rolling update lists the pod going away, still Ready, beside its successor)."""
        pods = [pod for pod in self.pods(namespace, selector) if pod.get("status", {}).get("podIP") and pod_ready(pod)]
        pods.sort(key=lambda pod: "deletionTimestamp" in pod["metadata"])
        return [pod["status"]["podIP"] for pod in pods]

    def logs(self, namespace: str, pod: str, container: str | None = None) -> str:
        """A container's log: the process node's log file when it ran there, else `kubectl logs`."""
        if self.process_node_workdir is not None:
            logs = self.process_node_workdir / "logs"
            pattern = f"{namespace}_{pod}_{container or '*'}.log"
            files = sorted(logs.glob(pattern))
            if files:
                return "\n".join(f.read_text(errors="replace") for f in files)
        args = ["logs", f"--namespace={namespace}", pod]
        if container:
            args.append(f"--container={container}")
        proc = self.kubectl(*args, check=False)
        return proc.stdout if proc.returncode == 0 else f"(no logs: {proc.stderr.strip()})"

    def container_process(self, namespace: str, pod: str, container: str) -> ContainerProcess:
        """The running process of a container on the process node (from its PID file and /proc)."""
        if self.process_node_workdir is None:
            raise RuntimeError("no process node in this cluster")
        pid = int((self.process_node_workdir / "pids" / f"{namespace}_{pod}_{container}.pid").read_text())
        return ContainerProcess.of(pid)

    def can_i_list(self, namespace: str, user: str) -> set[tuple[str, str, str]]:
        """What `user` may do in `namespace`, from `kubectl auth can-i --list`: (resource, resource name or "",
        verb) per resource rule (`pdservices.pdserve.io/status` style resource names; URL rules left out)."""
        out = self.kubectl("auth", "can-i", "--list", f"--namespace={namespace}", f"--as={user}").stdout
        grants: set[tuple[str, str, str]] = set()
        for line in out.splitlines()[1:]:
            match = _CAN_I.match(line)
            if match is None:
                raise KubectlError(f"unexpected `kubectl auth can-i --list` line: {line!r}")
            resource, _urls, names, verbs = match.groups()
            if resource:
                for name in names.split() or [""]:
                    grants |= {(resource, name, verb) for verb in verbs.split()}
        return grants

    def can_i(self, namespace: str, user: str, verb: str, resource: str) -> bool:
        """`kubectl auth can-i VERB RESOURCE` as `user` (exit status 0: yes, 1: no)."""
        proc = self.kubectl("auth", "can-i", verb, resource, f"--namespace={namespace}", f"--as={user}", check=False)
        if proc.returncode not in (0, 1):
            raise KubectlError(f"kubectl auth can-i {verb} {resource} failed: {proc.stderr.strip()}")
        return proc.returncode == 0

    def api_client(self) -> Any:
        """A new `kubernetes.client.ApiClient` (use it in a `with` block)."""
        from pdserve.api.kubeclient import new_api_client  # lazy: the kubernetes client is slow to import

        return new_api_client(self.kubeconfig)

    def edit_user(self, namespace: str, name: str, path: Path) -> ClusterHelper:
        """A namespace user holding the built-in `edit` ClusterRole in `namespace` and nothing else but PDServices
        (which the chart aggregates into `edit`: its `-edit` ClusterRole, granted here by a Role of the same
        rule so no cluster-wide role changes): a ServiceAccount bound to both, returned as a ClusterHelper that
        authenticates with its TokenRequest token (kubeconfig written to `path`). The hostile tenant of the
        security tests: whatever it does, it does with exactly these permissions."""
        self.kubectl("create", "serviceaccount", name, f"--namespace={namespace}")
        self.kubectl("create", "rolebinding", f"{name}-edit", "--clusterrole=edit",
                     f"--serviceaccount={namespace}:{name}", f"--namespace={namespace}")  # fmt: skip
        self.apply(
            [
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "Role",
                    "metadata": {"name": f"{name}-pdservices"},
                    "rules": [
                        {
                            "apiGroups": ["pdserve.io"],
                            "resources": ["pdservices"],
                            "verbs": [
                                "get",
                                "list",
                                "watch",
                                "create",
                                "update",
                                "patch",
                                "delete",
                                "deletecollection",
                            ],
                        }
                    ],
                },
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "RoleBinding",
                    "metadata": {"name": f"{name}-pdservices"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{name}-pdservices"},
                    "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
                },
            ],
            namespace=namespace,
        )
        return ClusterHelper(
            kubeconfig=self.service_account_kubeconfig(namespace, name, path), kubectl_path=self.kubectl_path
        )

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path, duration: str = "2h") -> Path:
        """A kubeconfig that authenticates as ServiceAccount `namespace/name` with a TokenRequest token, written to
        `path`: to run a component (the operator) under exactly the RBAC its pod would get."""
        token = self.kubectl("create", "token", name, f"--namespace={namespace}", f"--duration={duration}").stdout
        admin = yaml.safe_load(self.kubectl("config", "view", "--raw", "--minify", "--flatten").stdout)
        cluster = admin["clusters"][0]
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [cluster],
            "users": [{"name": name, "user": {"token": token.strip()}}],
            "contexts": [{"name": name, "context": {"cluster": cluster["name"], "user": name, "namespace": namespace}}],
            "current-context": name,
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path
