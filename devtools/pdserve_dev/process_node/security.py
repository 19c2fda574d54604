"""A container's securityContext as the process node applies it: identity, capabilities, read-only root.

Pure: pod and container dicts (plus the image map's user for the image) in, a :class:`Security` out. The sandbox
launcher (:mod:`.sandbox`) applies it. What is honoured, with the kubelet's and containerd's rules:

* user: ``runAsUser`` / ``runAsGroup`` (container over pod), else the image's user (the image map's ``user``,
  the Dockerfile's ``USER``), else root; a uid without a group runs with gid 0, as runtimes do for a numeric
  user the image's /etc/passwd does not know. Supplementary groups: ``supplementalGroups`` plus ``fsGroup``.
* ``runAsNonRoot``: a container that would run as uid 0 is refused with the kubelet's messages, which the pod
  shows as ``CreateContainerConfigError``.
* capabilities: containerd's default set, plus ``add``, minus ``drop`` (``ALL`` drops every one first);
  ``privileged`` keeps them all. A non-root user holds none after the switch (the kernel clears them), so
  ``add`` for a non-root user is reported as not emulated (that would need ambient capabilities).
* ``allowPrivilegeEscalation: false`` -> ``no_new_privs``; ``readOnlyRootFilesystem``.

Reported, not emulated (:attr:`Security.not_emulated`; the pod gets one event listing them): seccomp and
AppArmor profiles, SELinux options, ``procMount``, pod ``sysctls``, ``fsGroupChangePolicy``. The process node
filters no system calls and changes no kernel settings; the rest of the contract (who the process runs as, what
it may write, which capabilities it has) holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve_dev.process_node.podenv import ContainerConfigError

Obj = dict[str, Any]

# Linux capability numbers (include/uapi/linux/capability.h).
CAPABILITIES: dict[str, int] = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "DAC_READ_SEARCH": 2,
    "FOWNER": 3,
    "FSETID": 4,
    "KILL": 5,
    "SETGID": 6,
    "SETUID": 7,
    "SETPCAP": 8,
    "LINUX_IMMUTABLE": 9,
    "NET_BIND_SERVICE": 10,
    "NET_BROADCAST": 11,
    "NET_ADMIN": 12,
    "NET_RAW": 13,
    "IPC_LOCK": 14,
    "IPC_OWNER": 15,
    "SYS_MODULE": 16,
    "SYS_RAWIO": 17,
    "SYS_CHROOT": 18,
    "SYS_PTRACE": 19,
    "SYS_PACCT": 20,
    "SYS_ADMIN": 21,
    "SYS_BOOT": 22,
    "SYS_NICE": 23,
    "SYS_RESOURCE": 24,
    "SYS_TIME": 25,
    "SYS_TTY_CONFIG": 26,
    "MKNOD": 27,
    "LEASE": 28,
    "AUDIT_WRITE": 29,
    "AUDIT_CONTROL": 30,
    "SETFCAP": 31,
    "MAC_OVERRIDE": 32,
    "MAC_ADMIN": 33,
    "SYSLOG": 34,
    "WAKE_ALARM": 35,
    "BLOCK_SUSPEND": 36,
    "AUDIT_READ": 37,
    "PERFMON": 38,
    "BPF": 39,
    "CHECKPOINT_RESTORE": 40,
}

# containerd's (and Docker's) default set for a container without a securityContext.
DEFAULT_CAPABILITIES = frozenset(
    {
        "CHOWN",
        "DAC_OVERRIDE",
        "FSETID",
        "FOWNER",
        "MKNOD",
        "NET_RAW",
        "SETGID",
        "SETUID",
        "SETFCAP",
        "SETPCAP",
        "NET_BIND_SERVICE",
        "SYS_CHROOT",
        "KILL",
        "AUDIT_WRITE",
    }
)


@dataclass(frozen=True)
class Security:
    """What the launcher applies to one container."""

    uid: int = 0
    gid: int = 0
    groups: tuple[int, ...] = ()
    capabilities: tuple[int, ...] | None = None
    """Capability numbers the process keeps (and its bounding set); None: all (privileged)."""
    no_new_privs: bool = False
    read_only_root: bool = False
    not_emulated: tuple[str, ...] = field(default_factory=tuple)

    def launcher_fields(self) -> Obj:
        """The sandbox spec's fields for this (see :mod:`.sandbox`)."""
        return {
            "user": {"uid": self.uid, "gid": self.gid, "groups": list(self.groups)},
            "capabilities": None if self.capabilities is None else list(self.capabilities),
            "noNewPrivs": self.no_new_privs,
            "readOnlyRoot": self.read_only_root,
        }


def parse_user(user: str | None) -> tuple[int | None, int | None]:
    """An image's ``USER`` (``65532``, ``65532:65532``) as (uid, gid); names are not resolvable without an image."""
    if not user:
        return None, None
    uid_text, _, gid_text = str(user).partition(":")
    try:
        return int(uid_text), int(gid_text) if gid_text else None
    except ValueError:
        message = f"image user {user!r} is not numeric (the process node has no /etc/passwd)"
        raise ContainerConfigError(message) from None


def _name(capability: str) -> str:
    name = capability.upper()
    return name[4:] if name.startswith("CAP_") else name


def container_security(pod: Obj, container: Obj, image_user: str | None = None) -> Security:
    """The container's effective security settings; ContainerConfigError when runAsNonRoot cannot hold."""
    pod_context: Obj = pod.get("spec", {}).get("securityContext") or {}
    context: Obj = container.get("securityContext") or {}

    def pick(key: str) -> Any:
        return context[key] if context.get(key) is not None else pod_context.get(key)

    image_uid, image_gid = parse_user(image_user)
    run_as_user = pick("runAsUser")
    uid = int(run_as_user) if run_as_user is not None else (image_uid if image_uid is not None else 0)
    run_as_group = pick("runAsGroup")
    if run_as_group is not None:
        gid = int(run_as_group)
    elif run_as_user is None and image_gid is not None:
        gid = image_gid
    else:
        gid = 0
    if pick("runAsNonRoot") and uid == 0:
        where = f"(pod: {pod.get('metadata', {}).get('name', '')}, container: {container.get('name', '')})"
        if run_as_user is not None:
            raise ContainerConfigError(f"container's runAsUser breaks non-root policy {where}")
        raise ContainerConfigError(f"container has runAsNonRoot and image will run as root {where}")
    groups = [int(g) for g in pod_context.get("supplementalGroups") or []]
    if pod_context.get("fsGroup") is not None:
        groups.append(int(pod_context["fsGroup"]))

    not_emulated: list[str] = []
    capabilities: tuple[int, ...] | None
    if context.get("privileged"):
        capabilities = None
    else:
        spec = context.get("capabilities") or {}
        drop = {_name(c) for c in spec.get("drop") or []}
        add = {_name(c) for c in spec.get("add") or []}
        kept = set() if "ALL" in drop else set(DEFAULT_CAPABILITIES) - drop
        kept |= CAPABILITIES.keys() if "ALL" in add else add
        unknown = sorted(kept - CAPABILITIES.keys())
        if unknown:
            raise ContainerConfigError(f"unknown capabilities {', '.join(unknown)}")
        capabilities = tuple(sorted(CAPABILITIES[c] for c in kept))
        if uid != 0 and add:
            not_emulated.append(f"capabilities.add {sorted(add)} for non-root user {uid}")
    for key in ("seccompProfile", "appArmorProfile", "seLinuxOptions"):
        profile = pick(key)
        if profile and not (isinstance(profile, dict) and profile.get("type") == "Unconfined"):
            kind = profile.get("type", "") if isinstance(profile, dict) else ""
            not_emulated.append(f"{key} {kind}".strip())
    if context.get("procMount") not in (None, "Default"):
        not_emulated.append(f"procMount {context['procMount']}")
    if pod_context.get("sysctls"):
        not_emulated.append("sysctls")
    if pod_context.get("fsGroupChangePolicy"):
        not_emulated.append("fsGroupChangePolicy")
    escalation = context.get("allowPrivilegeEscalation")
    return Security(
        uid=uid,
        gid=gid,
        groups=tuple(dict.fromkeys(groups)),
        capabilities=capabilities,
        no_new_privs=escalation is False,
        read_only_root=bool(context.get("readOnlyRootFilesystem")),
        not_emulated=tuple(not_emulated),
    )
