"""The container launcher: a private mount namespace and root, the pod's volumes at their mountPaths, the
container's user and capabilities, then exec.

The process node starts every container as ``python -I -S sandbox.py SPEC.json -- ARGV...`` (this file is run by
path, with the standard library only, so it starts in a few milliseconds) when it can create mount namespaces
(root). It does, in a fresh process, what a container runtime does between fork and exec:

1. ``unshare(CLONE_NEWNS | CLONE_NEWUTS)``, make every mount private, so nothing below is seen outside this
   process, and set the host name to the pod's (what ``gethostname()`` returns in a pod).
2. A root: a tmpfs at ``spec.root`` (an empty folder in the pod's folder) holding a recursive bind mount of each
   entry of the host's ``/``. There are no images: the host's files are the image. The top level being our own
   tmpfs is what lets a mount point appear where the host has no folder.
3. Mount points that the host lacks (``/var/run/secrets/kubernetes.io/serviceaccount`` on most machines) are
   created without touching the host: the nearest existing folder that is a host bind is *shadowed*, i.e.
   replaced (in this namespace) by a tmpfs holding bind mounts of each of its entries, and the new folder is made
   in the tmpfs. Folders on the path to ``spec.reachable`` (the interpreter and the pdserve install that stand in
   for the image's files) that the container's user could not traverse are shadowed the same way, with search
   permission added: an image's files are readable by its user, ``/root/.pyenv`` on the host is not.
4. Each volume is bind-mounted at its mountPath (a file for subPath mounts of files); ``readOnly`` mounts are
   read-only. Without a volume there, ``/dev/shm`` is a private 64 MiB tmpfs, and so is ``/tmp`` unless the root
   file system is read-only (a container's own writable layer, instead of the host's ``/tmp``). A ``reachable``
   path such a mount would hide (a checkout or virtualenv under the host's ``/tmp``, as CI clones are) is bound
   back below it, read-only.
5. ``readOnlyRootFilesystem``: every mount of the root is made read-only recursively (``mount_setattr`` with
   ``AT_RECURSIVE``) except the writable volumes, ``/dev`` and ``/proc``. Writes elsewhere fail with EROFS, as in
   a container.
6. chroot into the root and chdir to the working folder (created in the root when missing, as runtimes do).
7. Identity: the bounding capability set is cut to the container's set; supplementary groups, gid and uid are
   switched (a non-root uid then holds no capabilities); a root container keeps exactly its set; ``no_new_privs``
   when ``allowPrivilegeEscalation: false``. Then exec ARGV with the environment this process was given.

A failure before exec prints ``process-node sandbox: ...`` to stderr (the container's log) and exits 125, the
code container runtimes use for "the runtime failed, not your program"; an ARGV that cannot be executed exits
127 (not found) or 126 (not executable), like a shell.

``--probe`` only checks that steps 1 and 2 are possible here (the process node runs it once at start).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import sys
from collections.abc import Iterable
from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture since Linux 5.12
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
LINUX_CAPABILITY_VERSION_3 = 0x20080522
STASH = ".process-node-stash"
EXIT_RUNTIME = 125


class SandboxError(Exception):
    """A step of the set-up failed; the message names it."""


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise SandboxError(f"{what}: {os.strerror(code)}")


def _bytes(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    result = _libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags), _bytes(data))
    _check(result, f"mount {source or fstype} on {target}")


def _set_readonly(path: str, readonly: bool, recursive: bool) -> None:
    attr = _MountAttr(MOUNT_ATTR_RDONLY if readonly else 0, 0 if readonly else MOUNT_ATTR_RDONLY, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    result = _libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        path.encode(),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(result, f"make {path} {'read-only' if readonly else 'writable'}")


def _prctl(option: int, arg: int) -> int:
    """prctl(option, arg, 0, 0, 0); returns 0 or the errno."""
    result = _libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    return 0 if result == 0 else ctypes.get_errno()


class Root:
    """The private root under construction; paths given to it are container paths (``/etc/...``)."""

    def __init__(self, host_path: str) -> None:
        self.host_path = host_path.rstrip("/")
        # Folders whose content is ours (a tmpfs we mounted, or a folder made in one): mkdir there is private.
        self._owned: set[str] = set()
        self._shadows = 0

    def real(self, path: str) -> str:
        return self.host_path + path if path != "/" else self.host_path

    def build(self) -> None:
        """tmpfs root with a recursive bind of every entry of the host's /."""
        _mount("tmpfs", self.host_path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
        self._owned.add(self.host_path)
        self._replicate("/", self.host_path)
        os.mkdir(os.path.join(self.host_path, STASH), 0o700)

    def _replicate(self, source_dir: str, target_dir: str) -> None:
        """Re-create each entry of `source_dir` in `target_dir` (ours): symlinks copied, the rest bind-mounted."""
        for name in sorted(os.listdir(source_dir)):
            source, target = os.path.join(source_dir, name), os.path.join(target_dir, name)
            if source == self.host_path or os.path.lexists(target):
                continue
            info = os.lstat(source)
            if stat.S_ISLNK(info.st_mode):
                os.symlink(os.readlink(source), target)
                continue
            if stat.S_ISDIR(info.st_mode):
                os.mkdir(target, 0o755)
            else:
                with open(target, "w"):
                    pass
            try:
                _mount(source, target, None, MS_BIND | MS_REC)
            except SandboxError:
                # An entry that cannot be bound (e.g. a stale mount point) is left out of the container's view.
                (os.rmdir if stat.S_ISDIR(info.st_mode) else os.unlink)(target)

    def own(self, real_dir: str) -> None:
        """Mark a folder whose content is the container's own (a tmpfs or a volume mounted there): points are
        made in it as they are, not shadowed."""
        self._owned.add(real_dir)

    def shadow(self, real_dir: str, add_mode: int = 0) -> None:
        """Replace `real_dir` in this namespace by a tmpfs holding bind mounts of its entries (see module doc)."""
        if real_dir in self._owned:
            return
        info = os.stat(real_dir)
        self._shadows += 1
        stash = os.path.join(self.host_path, STASH, str(self._shadows))
        os.mkdir(stash, 0o700)
        _mount(real_dir, stash, None, MS_BIND | MS_REC)
        mode = (stat.S_IMODE(info.st_mode) | add_mode) & 0o7777
        options = f"mode={mode:o},uid={info.st_uid},gid={info.st_gid}"
        _mount("tmpfs", real_dir, "tmpfs", MS_NOSUID | MS_NODEV, options)
        self._replicate(stash, real_dir)
        _check(_libc.umount2(stash.encode(), MNT_DETACH), f"unmount {stash}")
        os.rmdir(stash)
        self._owned.add(real_dir)

    def resolve(self, path: str, *, create: str | None = None, depth: int = 0) -> str:
        """The real path of container path `path`, following symlinks inside the root.

        `create` = "dir" or "file" makes the last component (and folders on the way) when missing, shadowing the
        host folder it would otherwise be made in."""
        if depth > 40:
            raise SandboxError(f"too many levels of symbolic links in {path}")
        current = self.host_path
        parts = [p for p in path.split("/") if p and p != "."]
        for index, part in enumerate(parts):
            if part == "..":
                current = os.path.dirname(current) if current != self.host_path else current
                continue
            candidate = os.path.join(current, part)
            if os.path.islink(candidate):
                link = os.readlink(candidate)
                base = "" if link.startswith("/") else current[len(self.host_path) :]
                rest = "/".join(parts[index + 1 :])
                return self.resolve(f"{base}/{link}/{rest}", create=create, depth=depth + 1)
            last = index == len(parts) - 1
            if not os.path.lexists(candidate):
                if create is None:
                    raise SandboxError(f"{path} does not exist")
                self.shadow(current)
                if last and create == "file":
                    with open(candidate, "w"):
                        pass
                else:
                    os.mkdir(candidate, 0o755)
                self._owned.add(candidate)
            current = candidate
        return current

    def make_reachable(self, path: str, uid: int, gids: set[int]) -> None:
        """Shadow, with search permission added, each folder on the way to `path` that `uid` could not enter."""
        current = self.host_path
        for part in [p for p in path.split("/") if p]:
            if not _can_search(current, uid, gids):
                self.shadow(current, add_mode=0o011)
            candidate = os.path.join(current, part)
            if not os.path.isdir(candidate) or os.path.islink(candidate):
                return  # symlinks are followed by their own reachable entries (the node lists real paths)
            current = candidate
        if not _can_search(current, uid, gids):
            self.shadow(current, add_mode=0o011)

    def drop_stash(self) -> None:
        os.rmdir(os.path.join(self.host_path, STASH))


def _can_search(path: str, uid: int, gids: set[int]) -> bool:
    info = os.stat(path)
    if info.st_uid == uid:
        return bool(info.st_mode & stat.S_IXUSR)
    if info.st_gid in gids:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return 40


def _capset(keep: list[int]) -> None:
    """Set this (root) process' effective, permitted and inheritable sets to `keep`."""
    machine = os.uname().machine
    number = SYS_CAPSET.get(machine)
    if number is None:
        raise SandboxError(f"capset: unknown system call number on {machine}")
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    words = [0, 0]
    for cap in keep:
        words[cap // 32] |= 1 << (cap % 32)
    data = (_CapData * 2)(*(_CapData(word, word, word) for word in words))
    _check(_libc.syscall(ctypes.c_long(number), ctypes.byref(header), data), "capset")


def set_up(spec: dict[str, Any]) -> None:
    """Steps 1-7 of the module docstring (everything but exec)."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare the mount and UTS namespaces")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    hostname = str(spec.get("hostname") or "")
    if hostname:
        name = hostname.encode()[:64]
        _check(_libc.sethostname(name, ctypes.c_size_t(len(name))), "set the host name")
    root = Root(spec["root"])
    root.build()
    user = spec.get("user") or {}
    uid, gid = int(user.get("uid", 0)), int(user.get("gid", 0))
    groups = [int(g) for g in user.get("groups", [])]
    if uid != 0:
        for path in spec.get("reachable", []):
            root.make_reachable(path, uid, {gid, *groups})
    writable: list[str] = []
    read_only: list[str] = []
    targets = set()
    for mount in sorted(spec.get("mounts", []), key=lambda m: m["target"].rstrip("/").count("/")):
        source = mount["source"]
        target = root.resolve(mount["target"], create="dir" if os.path.isdir(source) else "file")
        _mount(source, target, None, MS_BIND | MS_REC)
        (read_only if mount.get("readOnly") else writable).append(target)
        targets.add(mount["target"].rstrip("/"))
    private = {"/dev/shm": "mode=1777,size=64m"}
    if not spec.get("readOnlyRoot"):
        private["/tmp"] = "mode=1777,size=256m"
    for path, options in private.items():
        if path not in targets:
            target = root.resolve(path, create="dir")
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, options)
            writable.append(target)
            targets.add(path)
    # The interpreter and the pdserve install stand in for the image's files; a checkout under the host's /tmp
    # (a CI clone) would be hidden by the container's /tmp. Bind them back, read-only, below that mount.
    for cover, entry in hidden_entries(spec.get("reachable", []), targets):
        root.own(root.resolve(cover))
        target = root.resolve(entry, create="dir" if os.path.isdir(entry) else "file")
        _mount(entry, target, None, MS_BIND | MS_REC)
        read_only.append(target)
    working_dir = root.resolve(spec.get("workingDir") or "/", create="dir")
    root.drop_stash()
    if spec.get("readOnlyRoot"):
        _set_readonly(root.host_path, True, recursive=True)
        for path in ("/dev", "/proc"):
            _set_readonly(root.real(path), False, recursive=path == "/dev")
        for target in writable:
            _set_readonly(target, False, recursive=False)
    for target in read_only:
        _set_readonly(target, True, recursive=False)
    os.chroot(root.host_path)
    os.chdir(working_dir[len(root.host_path) :] or "/")
    keep = spec.get("capabilities")
    if keep is not None:
        for cap in range(_last_cap() + 1):
            code = _prctl(PR_CAPBSET_DROP, cap) if cap not in keep else 0
            if code not in (0, errno.EINVAL):  # EINVAL: a capability this kernel does not know
                raise SandboxError(f"drop capability {cap} from the bounding set: {os.strerror(code)}")
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    if uid == 0 and keep is not None:
        _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
        _capset(list(keep))
    if spec.get("noNewPrivs") and _prctl(PR_SET_NO_NEW_PRIVS, 1) != 0:
        raise SandboxError("set no_new_privs: refused")


def hidden_entries(paths: Iterable[str], covers: Iterable[str]) -> list[tuple[str, str]]:
    """(cover, entry) for each host entry that holds one of `paths` but lies below a container mount in `covers`
    (which hides it): the entry right below the deepest such mount, e.g. ("/tmp", "/tmp/checkout") for
    "/tmp/checkout/.venv"."""
    deepest_first = sorted((c.rstrip("/") for c in covers if c.rstrip("/")), key=len, reverse=True)
    found: dict[str, str] = {}
    for path in paths:
        cover = next((c for c in deepest_first if path.startswith(c + "/")), None)
        if cover is not None:
            found.setdefault(cover + "/" + path[len(cover) + 1 :].split("/")[0], cover)
    return [(cover, entry) for entry, cover in found.items()]


def probe(folder: str) -> None:
    """Steps 1 and 2 on `folder` (an empty folder), in this throw-away process."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare the mount and UTS namespaces")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    _set_readonly(folder, True, recursive=True)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--probe":
        try:
            probe(argv[1])
        except (SandboxError, OSError) as exc:
            print(f"process-node sandbox: {exc}", file=sys.stderr)
            return EXIT_RUNTIME
        return 0
    if len(argv) < 3 or argv[1] != "--":
        print("usage: sandbox.py SPEC.json -- ARGV... | --probe FOLDER", file=sys.stderr)
        return EXIT_RUNTIME
    try:
        with open(argv[0]) as handle:
            spec: dict[str, Any] = json.load(handle)
        set_up(spec)
    except (SandboxError, OSError, ValueError, KeyError) as exc:
        print(f"process-node sandbox: {exc}", file=sys.stderr, flush=True)
        return EXIT_RUNTIME
    command = argv[2:]
    try:
        os.execvpe(command[0], command, dict(os.environ))
    except OSError as exc:
        print(f"process-node sandbox: cannot execute {command[0]!r}: {exc.strerror}", file=sys.stderr, flush=True)
        return 127 if exc.errno == errno.ENOENT else 126
    return EXIT_RUNTIME  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
