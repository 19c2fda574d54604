"""Network namespaces that keep the local cluster's pod addresses on this machine, and only there.

kube-apiserver refuses loopback addresses in EndpointSlices, so pods get addresses from 198.18.0.0/15 made local
with a `local` route on `lo` (see pod_network). pdserve never adds that route to the host's network namespace:
the cluster runs in a private one that holds nothing but a loopback interface, so no address a test, a pod or
the demo uses can lead anywhere outside this machine.

- Tests and `pdserve dev demo` run in a fresh, anonymous namespace (`unshare --net`) that dies with them. The
  demo always takes one of its own (even when started from a test's), and with `--keep` publishes what a user
  needs on the loopback of the namespace it was started from (`pdserve_dev.demo_access`).
- `pdserve dev cluster up` leaves the cluster running, so it uses a *named* namespace (`ip netns add`,
  `pdserve-<workdir hash>`): `status` and `kubectl` re-enter it; other clients run with
  `ip netns exec <name> ...`; `down` deletes it.

Entering a namespace needs root (CAP_SYS_ADMIN); without it commands run where they are and the cluster falls
back to loopback pod addresses (kwok pods only; Services then list no endpoints).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

_NAMED_DIR = Path("/run/netns")


def loopback_only() -> bool:
    """True when this process's network namespace has no interface but loopback: nothing can leave it.

    That is the property that matters (not *how* the namespace was made), and unlike comparing namespace links
    with PID 1's it needs no access to other processes (which sandboxes may deny even to root)."""
    return all(name == "lo" for _, name in socket.if_nameindex())


@functools.cache
def can_isolate() -> bool:
    """Whether this process may create and enter network namespaces (tried once, not assumed from being root:
    a container may deny unshare even to root)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--net", "--", "ip", "link", "set", "lo", "up"], check=False, capture_output=True, timeout=10
    )
    return probe.returncode == 0


def should_isolate() -> bool:
    """True when a command should move into a private namespace before it starts anything."""
    return not loopback_only() and can_isolate()


def named_namespace(workdir: Path) -> str:
    """The named namespace of the cluster kept in `workdir`."""
    digest = hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:10]
    return f"pdserve-{digest}"


def named_exists(name: str) -> bool:
    return (_NAMED_DIR / name).exists()


def ensure_named(name: str) -> None:
    """Create the named namespace with its loopback up (no-op when it exists)."""
    if not named_exists(name):
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=10)
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True, timeout=10)


def delete_named(name: str) -> None:
    if named_exists(name):
        subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True, timeout=10)


def run_in_named(name: str, argv: Sequence[str]) -> int:
    """Run argv inside the named namespace; returns its exit code."""
    return subprocess.call(["ip", "netns", "exec", name, *argv])


def fresh_command(argv: Sequence[str]) -> list[str]:
    """The command line that runs argv inside a new anonymous namespace (loopback only) that ends with it. The
    process keeps its PID through `unshare` and `bash` (both exec), so a signal sent to it reaches argv."""
    script = 'ip link set lo up && exec "$@"'
    return ["unshare", "--net", "--", "bash", "-c", script, "pdserve-netns", *argv]


def run_in_fresh(argv: Sequence[str]) -> int:
    """Run argv inside a new anonymous namespace (loopback only) that ends with it; returns its exit code."""
    return subprocess.call(fresh_command(argv))


def exec_in_fresh(argv: Sequence[str]) -> None:
    """Replace this process with argv running in a new anonymous namespace (never returns)."""
    script = 'ip link set lo up && exec "$@"'
    os.execvp("unshare", ["unshare", "--net", "--", "bash", "-c", script, "pdserve-netns", *argv])
