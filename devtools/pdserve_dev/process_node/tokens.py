"""Projected service account tokens, requested and refreshed the way the kubelet's token manager does.

Every pod that automounts its ServiceAccount carries a projected volume (``kube-api-access-*``) whose
``serviceAccountToken`` source asks for a token of the pod's ServiceAccount (audience, ``expirationSeconds``,
default 3607 s as the admission plugin writes it). The process node asks the API server's TokenRequest API for it,
bound to the pod (``boundObjectRef`` kind Pod with its name and UID: the token dies with the pod), writes it to the
volume folder, and writes a fresh one when the old one is 80 % through its lifetime or 24 h old, whichever comes
first (the kubelet's rule). Writes are atomic (a temporary file renamed over the old one), so a reader never sees
half a token; a container reads the new file through its bind mount at once, like the kubelet's atomic writer
(a ``subPath`` mount of the file would keep the old one, as in Kubernetes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pdserve_dev.process_node.podenv import ContainerConfigError

Obj = dict[str, Any]

DEFAULT_EXPIRATION_SECONDS = 3600
MAX_TOKEN_AGE = 24 * 3600.0
REFRESH_FRACTION = 0.8


class TokenSource(Protocol):
    """The TokenRequest API (pdserve_dev.process_node.kube.Kube implements it)."""

    def request_token(
        self,
        namespace: str,
        service_account: str,
        *,
        audience: str | None,
        expiration_seconds: int,
        pod_name: str,
        pod_uid: str,
    ) -> tuple[str, float]:
        """A token and its expiration time (epoch seconds)."""
        ...


def refresh_time(expires_at: float, expiration_seconds: int) -> float:
    """When a token issued for `expiration_seconds` and expiring at `expires_at` is due for renewal."""
    issued_at = expires_at - expiration_seconds
    return min(issued_at + REFRESH_FRACTION * expiration_seconds, issued_at + MAX_TOKEN_AGE)


def write_atomically(path: Path, content: bytes, mode: int | None, group: int | None = None) -> None:
    """Replace `path` by `content` in one rename (group-owned by `group` with group read, for fsGroup)."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(content)
    if mode is not None:
        os.chmod(temporary, mode & 0o777)
    if group is not None:
        os.chown(temporary, -1, group)
        os.chmod(temporary, temporary.stat().st_mode & 0o777 | 0o040)
    os.replace(temporary, path)


@dataclass
class ProjectedToken:
    """One ``serviceAccountToken`` source of a projected volume, materialised in `folder`."""

    folder: Path
    path: str
    audience: str | None
    expiration_seconds: int
    mode: int | None
    group: int | None = None
    refresh_at: float = 0.0

    @classmethod
    def from_source(cls, source: Obj, folder: Path, default_mode: int | None, group: int | None) -> ProjectedToken:
        return cls(
            folder=folder,
            path=str(source.get("path", "token")),
            audience=source.get("audience") or None,
            expiration_seconds=int(source.get("expirationSeconds") or DEFAULT_EXPIRATION_SECONDS),
            mode=default_mode,
            group=group,
        )

    @property
    def file(self) -> Path:
        return self.folder / self.path

    def due(self, now: float) -> bool:
        return now >= self.refresh_at

    def refresh(self, tokens: TokenSource, pod: Obj) -> None:
        """Request a token for the pod's ServiceAccount, bound to the pod, and write it."""
        meta, spec = pod.get("metadata", {}), pod.get("spec", {})
        token, expires_at = tokens.request_token(
            meta.get("namespace", "default"),
            spec.get("serviceAccountName") or "default",
            audience=self.audience,
            expiration_seconds=self.expiration_seconds,
            pod_name=meta["name"],
            pod_uid=meta["uid"],
        )
        target = self.file.resolve()
        if not target.is_relative_to(self.folder.resolve()):
            raise ContainerConfigError(f"token path {self.path!r} escapes the volume")
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(target, token.encode(), self.mode, self.group)
        self.refresh_at = refresh_time(expires_at, self.expiration_seconds)
