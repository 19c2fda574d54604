"""Node paths as model sources: what makes one safe to mount, whoever allows it.

`spec.model.uri: /path` mounts that node directory (read-only) into a container whose image the PDService's author
chooses, so a path is the node's file system in the author's hands. Two facts hold whatever an administrator
allows, and the CRD enforces them itself (rules.py turns them into CEL):

- the path is normalised: absolute, no `.` or `..` segment, no empty segment (`//`, a trailing `/`). A prefix check
  on `/mnt/models/../../etc` would otherwise pass; Kubernetes does not clean hostPath paths;
- the path neither is, lies under, nor contains a system path (`SYSTEM_PATHS`): mounting `/var` exposes
  `/var/lib/kubelet` (every pod's Secrets, the kubelet's credentials) as surely as mounting it directly.

Which normalised, non-system paths may be mounted at all is the administrator's decision (`policy.Policy`).
A symbolic link under an allowed prefix still resolves on the node: allow only folders tenants cannot write.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class SystemFolder:
    """A node folder no PDService may mount, nor any folder above or below it, and why."""

    path: str
    holds: str
    """What the folder holds that a tenant's image must never read (docs/security.md shows this table)."""


# The one table of system folders: credentials, other pods' data and volumes, the container runtime's and the
# network plugins' state and sockets, kernel interfaces, devices and the host's programs, on kubeadm, k3s/RKE2, k0s,
# minikube, MicroK8s and the managed distributions' node images. A prefix an administrator allows may neither be,
# lie under, nor contain one of them (`/var` contains `/var/lib/kubelet`, `/opt` contains `/opt/cni`).
SYSTEM_FOLDERS: tuple[SystemFolder, ...] = (
    SystemFolder("/bin", "the host's programs"),
    SystemFolder("/boot", "kernels and boot loader"),
    SystemFolder("/dev", "device nodes (GPUs, disks, memory)"),
    SystemFolder("/etc", "host configuration: /etc/kubernetes (kubeconfigs, PKI), /etc/rancher, /etc/cni, shadow"),
    SystemFolder("/home", "users' home folders (SSH keys; /home/kubernetes on Container-Optimized OS)"),
    SystemFolder("/lib", "the host's libraries and kernel modules"),
    SystemFolder("/lib32", "the host's libraries"),
    SystemFolder("/lib64", "the host's libraries"),
    SystemFolder("/opt/cni", "CNI plugin binaries (/opt/cni/bin), run as root by the container runtime"),
    SystemFolder("/opt/containerd", "containerd's plugins and binaries"),
    SystemFolder("/proc", "every process of the node, their environments and memory"),
    SystemFolder("/root", "root's home folder"),
    SystemFolder("/run", "runtime sockets (containerd, CRI-O, Docker), kubelet and pod state"),
    SystemFolder("/sbin", "the host's programs"),
    SystemFolder("/sys", "kernel interfaces"),
    SystemFolder("/usr", "the host's programs and libraries"),
    SystemFolder("/var/lib/calico", "Calico's node state"),
    SystemFolder("/var/lib/cilium", "Cilium's node state and BPF maps"),
    SystemFolder("/var/lib/cloud", "cloud-init user data (node bootstrap tokens and credentials)"),
    SystemFolder("/var/lib/cni", "CNI plugins' state (pod addresses)"),
    SystemFolder("/var/lib/containerd", "containerd's images and every container's file system"),
    SystemFolder("/var/lib/containers", "CRI-O's and Podman's images and containers"),
    SystemFolder("/var/lib/crio", "CRI-O's state"),
    SystemFolder("/var/lib/docker", "Docker's images and containers"),
    SystemFolder("/var/lib/dockershim", "dockershim's state"),
    SystemFolder("/var/lib/etcd", "etcd's data: every object of the cluster, Secrets included"),
    SystemFolder("/var/lib/k0s", "k0s: the cluster's PKI, etcd and kubeconfigs"),
    SystemFolder("/var/lib/kube-proxy", "kube-proxy's kubeconfig (kubeadm)"),
    SystemFolder("/var/lib/kubelet", "every pod's volumes and Secrets, the kubelet's credentials and PKI"),
    SystemFolder("/var/lib/kubernetes", "control-plane and node certificates and keys (non-kubeadm installs)"),
    SystemFolder("/var/lib/minikube", "minikube's certificates and etcd"),
    SystemFolder("/var/lib/rancher", "k3s and RKE2: server token, PKI, etcd, containerd"),
    SystemFolder("/var/log", "every pod's logs and the node's"),
    SystemFolder("/var/run", "runtime sockets (the older name of /run)"),
    SystemFolder("/var/snap", "MicroK8s (snap): credentials, PKI and the datastore"),
)
SYSTEM_PATHS: tuple[str, ...] = tuple(folder.path for folder in SYSTEM_FOLDERS)

# An un-normalised absolute path: an empty segment (`//`, a trailing `/` after anything), a `.` or a `..` segment.
# RE2 (CEL) and Python's `re` read it alike; `/` alone is normalised (and a system path).
UNNORMALISED = r"//|/\.\.?(/|$)|./$"


def is_node_path(uri: str) -> bool:
    """A model URI that names a node path (the other schemes have a `scheme://` prefix)."""
    return uri.startswith("/")


def is_normalised(path: str) -> bool:
    return path.startswith("/") and re.search(UNNORMALISED, path) is None


def under(path: str, prefix: str) -> bool:
    """`path` is `prefix` or inside it, by whole segments (`/mnt/modelsx` is not under `/mnt/models`)."""
    return path == prefix or path.startswith(prefix + "/")


def touches_system_path(path: str) -> bool:
    """`path` is `/` or a system path, lies under one, or contains one (`/var`). Read literally, as the CEL twin in
    rules.py does: an un-normalised path is refused by the other rule anyway."""
    return path == "/" or any(under(path, system) or under(system, path) for system in SYSTEM_PATHS)


def _ancestors(path: str) -> list[str]:
    """The folders above `path`, `/` excluded: `/var/lib/kubelet` -> `/var`, `/var/lib`."""
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[:depth]) for depth in range(1, len(parts))]


def touching_pattern() -> str:
    """A regular expression matching exactly the normalised paths `touches_system_path` refuses, in the syntax RE2
    (Go, so Helm's JSON schema validator), Python's `re` and ECMA-262 share: `/`, every folder above a system path
    (`/var`, `/var/lib`, `/opt`), and every system path and what lies under it. The chart's values.schema.json
    carries it for `operator.allowModelHostPaths` (a test keeps the two equal)."""
    above = sorted({"/"} | {a for path in SYSTEM_PATHS for a in _ancestors(path)} - set(SYSTEM_PATHS))
    # The folders' names use only characters that mean themselves in all three syntaxes, but `.`.
    assert all(re.fullmatch(r"[/a-z0-9._-]+", path) for path in (*above, *SYSTEM_PATHS))
    holding = "|".join(path.replace(".", r"\.") for path in above)
    system = "|".join(path.replace(".", r"\.") for path in SYSTEM_PATHS)
    return f"^(?:{holding})$|^(?:{system})(?:/|$)"
