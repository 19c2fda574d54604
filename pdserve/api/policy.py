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
    """An administrator's setting that would undo a guarantee (e.g. allowing `/` or `/etc`)."""


@dataclass(frozen=True)
class Policy:
    """The cluster's policy for PDServices."""

    model_host_paths: tuple[str, ...] = ()
    """Node folders `spec.model.uri` may name (a path equal to or under one of them); empty: no node paths."""

    @classmethod
    def allowing(cls, *, model_host_paths: Iterable[str] = ()) -> Policy:
        """A policy from an administrator's settings, refusing any that would allow a system or un-normalised path."""
        prefixes = tuple(model_host_paths)
        for prefix in prefixes:
            if not prefix.startswith("/") or not hostpaths.is_normalised(prefix):
                raise PolicyError(
                    f"{HOST_PATH_FLAG} {prefix!r}: give an absolute, normalised folder (no '.', '..', '//' or "
                    "trailing '/'), e.g. /mnt/models"
                )
            if prefix == "/" or any(hostpaths.under(prefix, system) for system in hostpaths.SYSTEM_PATHS):
                raise PolicyError(
                    f"{HOST_PATH_FLAG} {prefix!r}: a system path (or /) can never hold model weights for a "
                    "PDService; allow a folder dedicated to models, e.g. /mnt/models"
                )
        return cls(model_host_paths=prefixes)

    def allows_model_host_path(self, path: str) -> bool:
        return any(hostpaths.under(path, prefix) for prefix in self.model_host_paths)


DEFAULT_POLICY = Policy()
"""A cluster whose administrator allowed nothing beyond the API: what every caller gets unless told otherwise."""
