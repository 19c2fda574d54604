"""Loopback pod IPs: one address of 127.0.0.0/8 per pod.

Linux routes all of 127.0.0.0/8 to the loopback interface, so a process can bind any 127.x.y.z without
configuration. Each process node hands out addresses from its own /16 block ``127.B.0.0`` (B chosen from the
work directory unless given), so two local clusters on one machine rarely overlap, and it skips any address
that some socket is already listening on (read from /proc/net/tcp), so they never collide.

Allocation walks the block round-robin instead of reusing the lowest free address: a pod recreated under the
same name gets a new IP, as on a real node, and stale endpoints can't silently reach a new pod. An allocation
is stable per pod UID, and a pod that already reports an IP keeps it when the process node restarts.
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


def block_for(seed: str) -> int:
    """A second octet in 2..254 derived from ``seed`` (127.0.x.x and 127.1.x.x are left to others)."""
    return 2 + int.from_bytes(hashlib.sha256(seed.encode()).digest()[:4], "big") % 253


class LoopbackAllocator:
    """Hands out 127.B.x.y addresses (y in 1..254), stable per pod UID."""

    def __init__(self, block: int, busy: Callable[[], set[str]] = listening_ipv4_addresses) -> None:
        if not 1 <= block <= 255:
            raise ValueError(f"loopback block must be 1..255, got {block}")
        self.block = block
        self._busy = busy
        self._by_uid: dict[str, str] = {}
        self._next = 0
        self._lock = threading.Lock()

    def _address(self, index: int) -> str:
        # 254 usable last octets per third octet: skip .0 and .255 so addresses look ordinary.
        third, fourth = divmod(index, 254)
        return f"127.{self.block}.{third}.{fourth + 1}"

    @property
    def capacity(self) -> int:
        return 256 * 254

    def owns(self, ip: str) -> bool:
        """Whether ``ip`` is an address this allocator could hand out."""
        parts = ip.split(".")
        return len(parts) == 4 and parts[:2] == ["127", str(self.block)] and parts[3] not in ("0", "255")

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
            for _ in range(self.capacity):
                candidate = self._address(self._next)
                self._next = (self._next + 1) % self.capacity
                if candidate not in taken and candidate not in busy:
                    self._by_uid[uid] = candidate
                    return candidate
            raise RuntimeError(f"no free loopback address left in 127.{self.block}.0.0/16")

    def release(self, uid: str) -> None:
        with self._lock:
            self._by_uid.pop(uid, None)

    def allocated(self) -> dict[str, str]:
        with self._lock:
            return dict(self._by_uid)
