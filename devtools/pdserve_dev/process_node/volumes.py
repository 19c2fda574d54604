"""Volumes materialised as folders in the pod's folder, and (without the sandbox) mount paths rewritten to them.

Each supported volume becomes ``<pod dir>/volumes/<name>``, written once when the pod starts (projected service
account tokens are refreshed, see :mod:`.tokens`). With the sandbox (:mod:`.sandbox`) each container sees its
volumes bind-mounted at their mountPaths. Without it (no mount namespaces, i.e. not root), processes cannot
mount, so every command word, argument and env value that names a path under a volumeMount's ``mountPath`` is
rewritten to the folder instead (``subPath`` honoured): a value counts as a path when it starts with the mount
path, or when it is a ``--flag=PATH`` option whose PATH does; longer mount paths win.

Supported: emptyDir (a folder with mode 0777, like the kubelet's; ``medium: Memory`` is a folder too), configMap,
secret, downwardAPI, and the configMap/secret/downwardAPI/serviceAccountToken sources of projected volumes
(tokens only when a token source is given, i.e. with the sandbox: without it no path could put them where
clients look). ``fsGroup`` makes the files group-owned by it with group read (and write for emptyDir), as the
kubelet's volume ownership does. Everything else (PVCs, hostPath, ...) is skipped with a warning; the mount path
then stays unrewritten (and, in the sandbox, shows the host's folder if there is one).
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve_dev.process_node.podenv import ContainerConfigError, ObjectLookup, PodAddresses, field_ref
from pdserve_dev.process_node.tokens import ProjectedToken, TokenSource

log = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass(frozen=True)
class Mount:
    """A container path and the local folder or file standing in for it."""

    mount_path: str
    local_path: str


def container_mounts(container: Obj, volume_dirs: dict[str, Path]) -> list[Mount]:
    """The container's volumeMounts that point at materialised volumes, longest mount path first."""
    mounts: list[Mount] = []
    for mount in container.get("volumeMounts") or []:
        folder = volume_dirs.get(mount.get("name", ""))
        path = str(mount.get("mountPath", "")).rstrip("/")
        if folder is None or not path:
            # Not materialised, or "/" itself: rewriting every absolute path would be wrong.
            continue
        local = folder / mount["subPath"] if mount.get("subPath") else folder
        mounts.append(Mount(path, str(local)))
    return sorted(mounts, key=lambda m: len(m.mount_path), reverse=True)


def rewrite_path(value: str, mounts: Sequence[Mount]) -> str:
    """``value`` with a leading mount path (or one after ``--flag=``) replaced by its local folder."""
    if value.startswith("-") and "=" in value:
        flag, _, rest = value.partition("=")
        rewritten = rewrite_path(rest, mounts)
        return value if rewritten == rest else f"{flag}={rewritten}"
    for mount in mounts:
        if value == mount.mount_path or value.startswith(mount.mount_path + "/"):
            return mount.local_path + value[len(mount.mount_path) :]
    return value


def _write_file(folder: Path, relative: str, content: bytes, mode: int | None) -> None:
    target = (folder / relative).resolve()
    if not target.is_relative_to(folder.resolve()):
        raise ContainerConfigError(f"volume item path {relative!r} escapes the volume")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(content)
    if mode is not None:
        os.chmod(target, mode & 0o777)


def _key_items(
    source: Obj, data: dict[str, bytes] | None, *, kind: str, namespace: str, folder: Path, default_mode: int | None
) -> None:
    """Write a configMap's or secret's keys (all, or the listed ``items``) into ``folder``."""
    name = source.get("name") or source.get("secretName") or ""
    if data is None:
        if source.get("optional"):
            return
        raise ContainerConfigError(f'{kind} "{name}" not found in namespace "{namespace}"')
    items = source.get("items")
    if not items:
        items = [{"key": key, "path": key} for key in data]
    for item in items:
        key = item.get("key", "")
        if key not in data:
            if source.get("optional"):
                continue
            raise ContainerConfigError(f"couldn't find key {key} in {kind} {namespace}/{name}")
        mode = item.get("mode", source.get("defaultMode", default_mode))
        _write_file(folder, item.get("path", key), data[key], mode)


def _downward_items(pod: Obj, source: Obj, addresses: PodAddresses, folder: Path) -> None:
    for item in source.get("items") or []:
        ref = item.get("fieldRef")
        if ref is None:
            log.warning("Skipped downwardAPI item without fieldRef path=%s", item.get("path"))
            continue
        path = ref.get("fieldPath", "")
        meta = pod.get("metadata", {})
        if path in ("metadata.labels", "metadata.annotations"):
            # Whole maps are written one `key="value"` per line, sorted, as the kubelet does.
            entries = meta.get(path.split(".")[1]) or {}
            text = "\n".join(f'{k}="{v}"' for k, v in sorted(entries.items()))
        else:
            text = field_ref(pod, path, addresses)
        _write_file(folder, item.get("path", ""), text.encode(), item.get("mode", source.get("defaultMode")))


class VolumeData:
    """configMap and secret contents as bytes, for files (secrets base64-decoded)."""

    def __init__(self, lookup: ObjectLookup, namespace: str) -> None:
        self._lookup = lookup
        self._namespace = namespace

    def configmap(self, name: str) -> dict[str, bytes] | None:
        data = self._lookup.configmap_data(self._namespace, name)
        return None if data is None else {k: v.encode() for k, v in data.items()}

    def secret(self, name: str) -> dict[str, bytes] | None:
        data = self._lookup.secret_data(self._namespace, name)
        return None if data is None else {k: v.encode() for k, v in data.items()}


@dataclass
class Materialised:
    """The pod's volume folders (volume name -> folder) and the service account tokens to keep fresh."""

    folders: dict[str, Path] = field(default_factory=dict)
    tokens: list[ProjectedToken] = field(default_factory=list)


def apply_fs_group(folder: Path, gid: int, writable: bool) -> None:
    """Group-own everything in `folder` by `gid` with group read (and write), folders setgid, as the kubelet does."""
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        os.chown(path, -1, gid)
        mode = path.stat().st_mode & 0o7777
        if path.is_dir():
            mode |= 0o2050 | (0o020 if writable else 0)
        else:
            mode |= 0o040 | (0o020 if writable else 0)
        os.chmod(path, mode)


def materialise(
    pod: Obj,
    root: Path,
    lookup: ObjectLookup,
    addresses: PodAddresses,
    *,
    warn: Callable[[str], None] = log.warning,
    tokens: TokenSource | None = None,
) -> Materialised:
    """Write the pod's supported volumes under ``root`` (service account tokens only with a token source)."""
    namespace = pod.get("metadata", {}).get("namespace", "default")
    data = VolumeData(lookup, namespace)
    result = Materialised()
    folders = result.folders
    fs_group = (pod.get("spec", {}).get("securityContext") or {}).get("fsGroup")
    for volume in pod.get("spec", {}).get("volumes") or []:
        name = volume.get("name", "")
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in volume:
            os.chmod(folder, 0o777)  # any container user may write, as with the kubelet's emptyDir
        elif "configMap" in volume:
            source = volume["configMap"]
            _key_items(
                source,
                data.configmap(source.get("name", "")),
                kind="configmap",
                namespace=namespace,
                folder=folder,
                default_mode=None,
            )
        elif "secret" in volume:
            source = volume["secret"]
            _key_items(
                source,
                data.secret(source.get("secretName", "")),
                kind="secret",
                namespace=namespace,
                folder=folder,
                default_mode=None,
            )
        elif "downwardAPI" in volume:
            _downward_items(pod, volume["downwardAPI"], addresses, folder)
        elif "projected" in volume:
            projected = volume["projected"]
            for source in projected.get("sources") or []:
                if "configMap" in source:
                    ref = source["configMap"]
                    _key_items(
                        ref,
                        data.configmap(ref.get("name", "")),
                        kind="configmap",
                        namespace=namespace,
                        folder=folder,
                        default_mode=projected.get("defaultMode"),
                    )
                elif "secret" in source:
                    ref = source["secret"]
                    _key_items(
                        ref,
                        data.secret(ref.get("name", "")),
                        kind="secret",
                        namespace=namespace,
                        folder=folder,
                        default_mode=projected.get("defaultMode"),
                    )
                elif "downwardAPI" in source:
                    _downward_items(pod, source["downwardAPI"], addresses, folder)
                elif "serviceAccountToken" in source:
                    # Without a token source they are silent: the API server adds one to every pod.
                    if tokens is not None:
                        token = ProjectedToken.from_source(
                            source["serviceAccountToken"],
                            folder,
                            projected.get("defaultMode"),
                            None if fs_group is None else int(fs_group),
                        )
                        token.refresh(tokens, pod)
                        result.tokens.append(token)
                else:
                    warn(f"Skipped projected volume source volume={name} source={sorted(source)}")
        else:
            warn(f"Skipped unsupported volume volume={name} kind={sorted(k for k in volume if k != 'name')}")
            folder.rmdir()
            continue
        if fs_group is not None:
            apply_fs_group(folder, int(fs_group), writable="emptyDir" in volume)
        folders[name] = folder
    return result


def decode_secret(data: dict[str, str]) -> dict[str, str]:
    """A secret's ``data`` (base64) as text, ``stringData`` never reaches readers."""
    return {key: base64.b64decode(value).decode("utf-8", errors="replace") for key, value in data.items()}
