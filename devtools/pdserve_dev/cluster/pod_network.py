"""Pod addresses that are local to this machine yet acceptable in EndpointSlices.

Why not 127.x.y.z: kube-apiserver's EndpointSlice (and Endpoints) validation rejects loopback, link-local and
unspecified addresses, so a pod whose IP is 127.0.0.5 never shows up behind a Service. Why not 10.x: nothing
would answer there, and traffic to it would leave the machine.

So the cluster makes one non-loopback block local, exactly the way 127.0.0.0/8 is: a `local` route in the
kernel's local routing table, `ip route add local 198.18.0.0/15 dev lo table local`. Every address of the
block can then be bound like a loopback address, connections to it never leave `lo`, and a connection to an
address nobody listens on is refused at once. 198.18.0.0/15 is reserved for benchmarking (RFC 2544), never
routed on the Internet. The block is split:

    198.18.0.0/16     process-node pods (real processes; passed to the process node as PDSERVE_POD_CIDR)
    198.19.0.0/17     kwok pods (fake IPs; nothing listens there)
    198.19.128.0/18   Service ClusterIPs (there is no kube-proxy: a ClusterIP is only a name)
    198.19.255.254    the kwok nodes' InternalIP

The route is added only inside a private network namespace that holds nothing but `lo` (netns.py): tests,
`pdserve dev demo` and `pdserve dev cluster up` move there first, so the block never exists on the host.
Elsewhere (or without CAP_NET_ADMIN) the cluster still starts, with kwok pod IPs on loopback
(127.250.0.0/16), and warns that EndpointSlices will not list those pods. The route dies with its namespace.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass

from pdserve_dev.cluster import netns

LOCAL_BLOCK = "198.18.0.0/15"


@dataclass(frozen=True)
class PodNetwork:
    """The address plan of one cluster."""

    local_route: bool
    """True when LOCAL_BLOCK is routed to lo, so the addresses below are real and local."""
    process_node_cidr: str | None
    kwok_pod_cidr: str
    service_cidr: str
    kwok_node_ip: str

    @property
    def service_ip(self) -> str:
        """ClusterIP of the `kubernetes` Service: the first address of the service range."""
        return str(next(ipaddress.ip_network(self.service_cidr).hosts()))


ROUTED = PodNetwork(
    local_route=True,
    process_node_cidr="198.18.0.0/16",
    kwok_pod_cidr="198.19.0.0/17",
    service_cidr="198.19.128.0/18",
    kwok_node_ip="198.19.255.254",
)

LOOPBACK_FALLBACK = PodNetwork(
    local_route=False,
    process_node_cidr=None,
    kwok_pod_cidr="127.250.0.0/16",
    service_cidr="198.19.128.0/18",
    kwok_node_ip="127.251.0.1",
)


def _ip() -> str | None:
    return shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip") if shutil.which(p)), None)


def has_local_route() -> bool:
    """Whether LOCAL_BLOCK is already a local route (ours or another cluster's)."""
    ip = _ip()
    if ip is None:
        return False
    out = subprocess.run(
        [ip, "-4", "route", "show", "table", "local", LOCAL_BLOCK],
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    ).stdout
    return out.strip().startswith("local ")


def ensure_local_route() -> tuple[bool, str]:
    """Make LOCAL_BLOCK local if it is not; return (ok, reason when not ok).

    Only ever inside a private network namespace (see netns): in the host's, the block stays what it is."""
    if not netns.loopback_only():
        return False, "pdserve routes it only inside a network namespace that has nothing but loopback"
    if has_local_route():
        return True, ""
    ip = _ip()
    if ip is None:
        return False, "the `ip` command (iproute2) is not installed"
    proc = subprocess.run(
        [ip, "-4", "route", "add", "local", LOCAL_BLOCK, "dev", "lo", "table", "local"],
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    )
    if proc.returncode != 0 and not has_local_route():  # a concurrent cluster may have won the race
        return False, proc.stderr.strip() or f"`ip route add` exited {proc.returncode}"
    return True, ""


def plan(want_local_route: bool = True) -> tuple[PodNetwork, str]:
    """The address plan to use, adding the local route when asked and possible; second item: a warning or ''."""
    if not want_local_route:
        return LOOPBACK_FALLBACK, ""
    ok, reason = ensure_local_route()
    if ok:
        return ROUTED, ""
    return LOOPBACK_FALLBACK, (
        f"Could not make {LOCAL_BLOCK} local ({reason}); pods get loopback IPs, which kube-apiserver refuses "
        "in EndpointSlices, so Services will list no endpoints"
    )
