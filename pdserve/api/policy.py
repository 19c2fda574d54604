"""What an administrator allows beyond the API's own rules: decisions of the cluster, not of a PDService's author.

The CRD and `validation` say what a PDService may contain anywhere. Some choices depend on the cluster and are the
operator's to make, given by flags (`pdserve operator --allow-model-host-paths PREFIX`, and the same flag on
`pdserve validate` and `render` to check a spec against a cluster's policy offline). `Policy()` allows nothing
beyond the API: the safe default for every caller that does not say otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.api import hostpaths

HOST_PATH_FLAG = "--allow-model-host-paths"


class PolicyError(ValueError):
    """An administrator's setting that would undo a guarantee (e.g. allowing `/`, `/etc`, or `/var`, which holds
    `/var/lib/kubelet`)."""


@dataclass(frozen=True)
class Policy:
    """The cluster's policy for PDServices."""

    model_host_paths: tuple[str, ...] = ()
    """Node folders `spec.model.uri` may name (a path equal to or under one of them); empty: no node paths."""

    @classmethod
    def allowing(cls, *, model_host_paths: Iterable[str] = ()) -> Policy:
        """A policy from an administrator's settings, refusing any prefix that is un-normalised, is or lies under a
        system folder, or contains one (`hostpaths.SYSTEM_FOLDERS`)."""
        prefixes = tuple(model_host_paths)
        for prefix in prefixes:
            if not prefix.startswith("/") or not hostpaths.is_normalised(prefix):
                raise PolicyError(
                    f"{HOST_PATH_FLAG} {prefix!r}: give an absolute, normalised folder (no '.', '..', '//' or "
                    "trailing '/'), e.g. /mnt/models"
                )
            # Not only a system folder or one below it: a folder above one (`/var`, `/var/lib`, `/opt`) would let
            # PDServices name the system folder inside it (`/var/lib/kubelet`, `/opt/cni/bin`) as their model.
            if hostpaths.touches_system_path(prefix):
                raise PolicyError(f"{HOST_PATH_FLAG} {prefix!r}: {_why_system(prefix)}")
        return cls(model_host_paths=prefixes)

    def allows_model_host_path(self, path: str) -> bool:
        return any(hostpaths.under(path, prefix) for prefix in self.model_host_paths)


def _why_system(prefix: str) -> str:
    """Why an administrator's prefix touches the system folders, naming them."""
    if prefix == "/":
        reason = "it is the node's root"
    elif holder := next((s for s in hostpaths.SYSTEM_PATHS if hostpaths.under(prefix, s)), None):
        reason = f"it is or lies in the system folder {holder}"
    else:
        inside = [s for s in hostpaths.SYSTEM_PATHS if hostpaths.under(s, prefix)]
        reason = f"it contains the system folders {', '.join(inside)}"
    return (
        f"{reason}, and a PDService's image must never read the node's system folders (docs/security.md lists "
        "them); allow a folder dedicated to models, e.g. /mnt/models"
    )


DEFAULT_POLICY = Policy()
"""A cluster whose administrator allowed nothing beyond the API: what every caller gets unless told otherwise."""
