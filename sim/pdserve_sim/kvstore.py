"""The simulator's KV store path: prompt KV blocks written to and read from a real Mooncake store.

It stands in for vLLM's MooncakeStoreConnector, against the real thing: Mooncake's own Python client
(``mooncake.store.MooncakeDistributedStore``, PyPI ``mooncake-transfer-engine-non-cuda``) talking to a real
``mooncake_master`` over TCP, with the store's memory in a store server (or any client that mounted a segment).

- Keys: ``<cache_prefix>@<block hash>``, the chained hash of a full prompt block (``kvcache.block_hashes``: a hash
  names the whole prefix up to its block, as vLLM's block hashes do), so a lookup walks the prompt's blocks from
  the first and stops at the first miss, exactly like the local prefix cache. Python's hash of a tuple of ints is
  the same in every process (hash randomisation covers str and bytes only), so every engine derives the same keys.
- Values: ``kv_payload_bytes_per_token x block_size`` bytes per block, so a put and a get move real bytes through
  the transfer engine, as the side channel does for NIXL.
- Writers (vLLM's ``kv_producer`` / ``kv_both``: the prefill pool) put every full block of a prompt they computed
  and do not yet find in the store, behind the answer: vLLM 0.32's MooncakeStoreConnector queues the save as a job
  of its worker and finishes the request without waiting for it (``request_finished`` returns False: the job holds
  its own reference on the blocks). A prefill engine that dies within that write leaves a shorter prefix in the
  store, which a reader takes and computes the rest of.
- Readers (every engine with the store) look up the blocks of a prompt beyond what their own cache holds before
  the request is scheduled, get them, and place them in their cache as if computed (``Engine.preload``); the
  tokens count as ``external_kv_transfer``, like vLLM's connector loads.

The engines contribute no memory (``global_segment_size`` 0, vLLM's ``standalone-store`` mode): a block never lives
in an engine that may die. The client is thread-blocking C++: every call runs in a small thread pool. The client
speaks TCP whatever the file says: the simulator has no RDMA and models the link itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

CONFIG_ENV = "MOONCAKE_CONFIG_PATH"


class StoreError(Exception):
    """The store cannot be used (no client library, master unreachable, a refused call)."""


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """Where the store is and what this engine does with it."""

    master_address: str
    metadata_server: str
    local_buffer_size: int
    cache_prefix: str
    writes: bool

    @classmethod
    def from_vllm(cls, connector: dict[str, Any], config_path: str | None) -> StoreSettings:
        """From a MooncakeStoreConnector entry of vLLM's kv-transfer-config and the MOONCAKE_CONFIG_PATH file."""
        if not config_path:
            raise StoreError(f"MooncakeStoreConnector is configured but {CONFIG_ENV} is not set")
        try:
            with open(config_path) as handle:
                client = json.load(handle)
        except (OSError, ValueError) as exc:
            raise StoreError(f"cannot read the Mooncake client config {config_path}: {exc}") from None
        extra = connector.get("kv_connector_extra_config") or {}
        return cls(
            master_address=str(client.get("master_server_address") or ""),
            metadata_server=str(client.get("metadata_server") or ""),
            local_buffer_size=int(client.get("local_buffer_size") or 64 << 20),
            cache_prefix=str(extra.get("cache_prefix") or ""),
            writes=connector.get("kv_role") in ("kv_producer", "kv_both"),
        )


class KVStore:
    """One engine's Mooncake client: async put, lookup and get of prompt blocks."""

    def __init__(self, settings: StoreSettings, block_bytes: int) -> None:
        self.settings = settings
        self.block_bytes = block_bytes
        self._payload = bytes(block_bytes)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore")
        self._client: Any = None

    def key(self, block_hash: int) -> str:
        prefix = self.settings.cache_prefix
        return f"{prefix}@{block_hash & (2**64 - 1):016x}" if prefix else f"{block_hash & (2**64 - 1):016x}"

    async def connect(self, local_host: str) -> None:
        """Register with the master (retried by the caller's start-up: an engine without its store is not up)."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self._connect, local_host)

    def _connect(self, local_host: str) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # pragma: no cover - the dev install has it
            raise StoreError(f"Mooncake's client is not installed (mooncake-transfer-engine-non-cuda): {exc}") from None
        # The transfer engine binds a LAN interface by default; bind the engine's own address instead (a pod has
        # one; a loopback-only test namespace has no other).
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_host)
        s = self.settings
        host, _, port = s.master_address.rpartition(":")
        try:
            # Mooncake's setup retries an unreachable master for a long time; fail the start-up at once instead.
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            raise StoreError(f"the Mooncake master {s.master_address} is unreachable: {exc}") from None
        client = MooncakeDistributedStore()
        # A local hostname without a port: the transfer engine picks a free one for its handshake.
        rc = client.setup(local_host, s.metadata_server, 0, s.local_buffer_size, "tcp", "", s.master_address)
        if rc != 0:
            raise StoreError(f"Mooncake store setup failed (rc {rc}) master={s.master_address}")
        self._client = client

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await asyncio.get_running_loop().run_in_executor(self._pool, client.close)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def longest_prefix(self, hashes: Sequence[int]) -> int:
        """How many of `hashes`, from the first, the store holds."""
        if not hashes:
            return 0
        found = await self._call(self._client.batch_is_exist, [self.key(h) for h in hashes])
        count = 0
        for present in found:
            if present != 1:
                break
            count += 1
        return count

    async def get(self, hashes: Sequence[int]) -> int:
        """Read the blocks; the bytes read (a block gone meanwhile raises StoreError)."""
        values = await self._call(self._client.get_batch, [self.key(h) for h in hashes])
        sizes = [len(value) for value in values]
        if any(size != self.block_bytes for size in sizes):
            raise StoreError(f"{sum(1 for size in sizes if size != self.block_bytes)} blocks were gone or short")
        return sum(sizes)

    async def put_missing(self, hashes: Sequence[int]) -> int:
        """Write the blocks the store does not hold yet; returns how many were written."""
        if not hashes:
            return 0
        keys = [self.key(h) for h in hashes]
        found = await self._call(self._client.batch_is_exist, keys)
        missing = [key for key, present in zip(keys, found, strict=True) if present != 1]
        if not missing:
            return 0
        rc = await self._call(self._client.put_batch, missing, [self._payload] * len(missing))
        if rc != 0:
            raise StoreError(f"put of {len(missing)} blocks failed (rc {rc})")
        return len(missing)

    async def _call(self, fn: Any, *args: Any) -> Any:
        if self._client is None:
            raise StoreError("not connected to the store")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


def config_path() -> str | None:
    return os.environ.get(CONFIG_ENV)
