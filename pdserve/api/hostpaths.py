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

# Node paths no PDService may mount, nor any folder above or below them: credentials, other pods' data and
# volumes, the container runtime's sockets and state, kernel interfaces, devices, and the host's programs.
SYSTEM_PATHS: tuple[str, ...] = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/home",
    "/lib",
    "/lib32",
    "/lib64",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/sys",
    "/usr",
    "/var/lib/cni",
    "/var/lib/containerd",
    "/var/lib/docker",
    "/var/lib/etcd",
    "/var/lib/kubelet",
    "/var/log",
    "/var/run",
)

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
