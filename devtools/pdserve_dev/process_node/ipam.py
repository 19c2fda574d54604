"""Pod IPs: one local address per pod.

Linux routes all of 127.0.0.0/8 to the loopback interface, so a process can bind any 127.x.y.z without
configuration; by default each process node hands out addresses from its own /16 block ``127.B.0.0`` (B
chosen from the work directory unless given). kube-apiserver, however, refuses loopback addresses in
EndpointSlices, so the local cluster makes a non-loopback block local the same way (``ip route add local
198.18.0.0/16 dev lo table local``, see ``pdserve_dev.cluster.pod_network``) and passes it as ``--pod-cidr``
(``PDSERVE_POD_CIDR``); the allocator then hands out addresses of that block instead.

Either way, the allocator skips any address that some socket is already listening on (read from
/proc/net/tcp), so clusters sharing a block on one machine do not collide, and it starts at an offset derived
from the work directory so they rarely even try. It walks the block round-robin instead of reusing the
lowest free address: a pod recreated under the same name gets a new IP, as on a real node, and stale
endpoints can't silently reach a new pod. An allocation is stable per pod UID, and a pod that already
reports an IP keeps it when the process node restarts. 127.0.0.1 is never handed out.
"""

from __future__ import annotations

import hashlib
import ipaddress
import threading
from collections.abc import Callable
from pathlib import Path

_TCP_LISTEN = "0A"


def listening_ipv4_addresses(proc_net_tcp: Path = Path("/proc/net/tcp")) -> set[str]:
    """Every local IPv4 address with a listening TCP socket."""
    try:
        lines = proc_net_tcp.read_text().splitlines()[1:]
    except OSError:
        return set()
    found: set[str] = set()
    for line in lines:
        fields = line.split()
        if len(fields) < 4 or fields[3] != _TCP_LISTEN:
            continue
        hex_ip = fields[1].split(":")[0]
        # The kernel prints the address as a host-order (little-endian) 32-bit hex number.
        found.add(str(ipaddress.IPv4Address(int.from_bytes(bytes.fromhex(hex_ip), "little"))))
    return found


def _seed_number(seed: str) -> int:
    return int.from_bytes(hashlib.sha256(seed.encode()).digest()[:4], "big")


def loopback_cidr(seed: str) -> str:
    """A 127.B.0.0/16 block with B in 2..254 derived from ``seed`` (127.0/16 and 127.1/16 left to others)."""
    return f"127.{2 + _seed_number(seed) % 253}.0.0/16"


class PodIPAllocator:
    """Hands out the addresses of ``cidr`` (none ending in .0 or .255), stable per pod UID."""

    def __init__(self, cidr: str, seed: str = "", busy: Callable[[], set[str]] = listening_ipv4_addresses) -> None:
        network = ipaddress.IPv4Network(cidr, strict=False)
        self.cidr = str(network)
        self._base = int(network.network_address)
        self._size = network.num_addresses
        self._busy = busy
        self._by_uid: dict[str, str] = {}
        self._next = _seed_number(seed) % self._size if seed else 0
        self._lock = threading.Lock()
        self._network = network
        if not any(self._usable(str(address)) for address in list(network)[:512]):
            raise ValueError(f"pod CIDR {cidr} has no usable address")

    @staticmethod
    def _usable(address: str) -> bool:
        return address != "127.0.0.1" and not address.endswith((".0", ".255"))

    def owns(self, ip: str) -> bool:
        """Whether ``ip`` is an address this allocator could hand out."""
        try:
            return ipaddress.IPv4Address(ip) in self._network and self._usable(ip)
        except ValueError:
            return False

    def allocate(self, uid: str, preferred: str | None = None) -> str:
        """The pod's address: its current one, ``preferred`` when free and ours, else the next free one."""
        with self._lock:
            if uid in self._by_uid:
                return self._by_uid[uid]
            taken = set(self._by_uid.values())
            if preferred and self.owns(preferred) and preferred not in taken:
                self._by_uid[uid] = preferred
                return preferred
            busy = self._busy()
            for _ in range(self._size):
                candidate = str(ipaddress.IPv4Address(self._base + self._next))
                self._next = (self._next + 1) % self._size
                if self._usable(candidate) and candidate not in taken and candidate not in busy:
                    self._by_uid[uid] = candidate
                    return candidate
            raise RuntimeError(f"no free pod address left in {self.cidr}")

    def release(self, uid: str) -> None:
        with self._lock:
            self._by_uid.pop(uid, None)

    def allocated(self) -> dict[str, str]:
        with self._lock:
            return dict(self._by_uid)
