"""The `kubernetes` Service for pods: the environment the kubelet gives every container, and a relay that plays
kube-proxy for that one Service.

The kubelet sets ``KUBERNETES_SERVICE_HOST`` / ``KUBERNETES_SERVICE_PORT`` (and the Docker-link style
``KUBERNETES_PORT_443_TCP...`` variables) in every container from the ``default/kubernetes`` Service: its ClusterIP
and port, even with ``enableServiceLinks: false``. In-cluster clients connect there and check the API server's
certificate, which names that IP (the local cluster's PKI puts the ClusterIP in the serving certificate).

The local cluster has no kube-proxy, so the process node listens on ClusterIP:port itself and relays each
connection to the API server (TLS passes through untouched: the client still talks to kube-apiserver). The
ClusterIP is local only when the cluster's address block is routed to ``lo`` (see pdserve_dev.cluster.pod_network),
and port 443 needs root; when the address cannot be bound (no local route, not root, or another cluster's process
node in the same network namespace holds it), pods get the API server's own address instead, as in clusters that
run without kube-proxy, and the node logs that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

RELAY_CHUNK = 65536


def service_env(host: str, port: int) -> dict[str, str]:
    """The variables the kubelet derives from the `kubernetes` Service (the Docker-link convention)."""
    url = f"tcp://{host}:{port}"
    prefix = f"KUBERNETES_PORT_{port}_TCP"
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": str(port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
        "KUBERNETES_PORT": url,
        prefix: url,
        f"{prefix}_PROTO": "tcp",
        f"{prefix}_PORT": str(port),
        f"{prefix}_ADDR": host,
    }


def upstream_of(server: str) -> tuple[str, int]:
    """(host, port) of an API server URL such as ``https://127.0.0.1:6443``."""
    parts = urlsplit(server)
    if parts.hostname is None:
        raise ValueError(f"no host in API server URL {server!r}")
    return parts.hostname, parts.port or 443


def service_address(service: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """ClusterIP and https port of the `kubernetes` Service object, None when it is absent or has no IP."""
    if not service:
        return None
    spec = service.get("spec")
    if not isinstance(spec, dict):
        return None
    ip = spec.get("clusterIP")
    ports = [p for p in spec.get("ports") or [] if isinstance(p, dict)]
    https = next((p for p in ports if p.get("name") == "https"), ports[0] if ports else None)
    if not ip or ip == "None" or https is None:
        return None
    return str(ip), int(https.get("port", 443))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(RELAY_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


@dataclass
class ServiceRelay:
    """Listens on (host, port) and relays every connection to `upstream`, on its own event loop thread."""

    host: str
    port: int
    upstream: tuple[str, int]

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="kubernetes-service", daemon=True)
        self.connections = 0

    def start(self) -> None:
        """Bind (raising OSError when the address cannot be bound), then serve in the background."""
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._relay, self.host, self.port, reuse_address=True)
        )
        self._thread.start()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError as exc:
            log.warning("Failed to reach the API server for a pod error=%s", exc)
            client_writer.close()
            return
        try:
            await asyncio.gather(_pipe(client_reader, server_writer), _pipe(server_reader, client_writer))
        finally:
            for writer in (client_writer, server_writer):
                with contextlib.suppress(Exception):
                    writer.close()

    def stop(self) -> None:
        if self._server is None:
            return
        server = self._server

        async def close() -> None:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def start(service: tuple[str, int] | None, upstream: tuple[str, int]) -> tuple[dict[str, str], ServiceRelay | None]:
    """The pods' `kubernetes` Service variables, relaying the ClusterIP when it can be bound (see module doc)."""
    if service is not None:
        relay = ServiceRelay(service[0], service[1], upstream)
        try:
            relay.start()
        except OSError as exc:
            log.warning(
                "Cannot serve the kubernetes Service on %s:%s (%s); pods get the API server's address %s:%s",
                service[0],
                service[1],
                exc.strerror or exc,
                *upstream,
            )
        else:
            log.info("Relaying the kubernetes Service %s:%s to the API server %s:%s", *service, *upstream)
            return service_env(*service), relay
    return service_env(*upstream), None
