"""A real Mooncake store on loopback for tests and benchmarks: `mooncake_master` and a store server.

The binaries are the ones PyPI's ``mooncake-transfer-engine-non-cuda`` ships inside its ``mooncake`` package (they
need Debian's ``libibverbs1``, which ``scripts/install.sh`` installs), the same pair pdserve's renderer deploys
(`render.kvcache`): the master (metadata, allocation, the HTTP metadata server, ``/health`` on its admin port) and
a store server (``mooncake_client``) whose segment holds the KV blocks. Both are started as processes in a session
of their own, waited for on their health endpoints, and stopped by PID (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pdserve_dev.testing.net import free_ports, http_ok

HOST = "127.0.0.1"


def binary(name: str) -> Path:
    """A Mooncake binary from the installed ``mooncake`` package."""
    import mooncake

    path = Path(mooncake.__file__).parent / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: install mooncake-transfer-engine-non-cuda (scripts/install.sh)")
    return path


@dataclass(frozen=True)
class MooncakeStore:
    """Where a running store listens."""

    rpc_port: int
    metadata_port: int
    metrics_port: int
    store_http_port: int
    capacity_bytes: int

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{HOST}:{self.metadata_port}/metadata"

    @property
    def health_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}/health"

    def client_config(self, local_buffer_bytes: int = 64 << 20) -> dict[str, object]:
        """The engines' MOONCAKE_CONFIG_PATH file for this store, as the renderer writes it."""
        return {
            "metadata_server": self.metadata_server,
            "master_server_address": self.master_address,
            "protocol": "tcp",
            "device_name": "",
            "mode": "standalone-store",
            "global_segment_size": 0,
            "local_buffer_size": local_buffer_bytes,
        }

    def write_client_config(self, path: Path) -> Path:
        path.write_text(json.dumps(self.client_config()) + "\n")
        return path


def store_transfer_config(role: str, engine_id: str, cache_prefix: str = "pdserve/test") -> str:
    """An engine's --kv-transfer-config with the store, as the renderer writes it (`render.kvcache`)."""
    nixl_role = "kv_producer" if role == "prefill" else "kv_consumer"
    config = {
        "kv_connector": "MultiConnector",
        "kv_role": nixl_role,
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": nixl_role},
                {
                    "kv_connector": "MooncakeStoreConnector",
                    "kv_role": "kv_both" if role == "prefill" else "kv_consumer",
                    "kv_connector_extra_config": {"cache_prefix": cache_prefix},
                },
            ]
        },
    }
    return json.dumps(config)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited {proc.returncode} before it was healthy:\n{log.read_text()[-2000:]}")
        if http_ok(url):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy within {within:g} s:\n{log.read_text()[-2000:]}")


@contextlib.contextmanager
def mooncake_store(workdir: Path, capacity_bytes: int = 256 << 20, within: float = 30.0) -> Iterator[MooncakeStore]:
    """A master and one store server of `capacity_bytes` on loopback, healthy; both stopped on exit."""
    rpc, metadata, metrics, store_port, store_http = free_ports(5)
    store = MooncakeStore(rpc, metadata, metrics, store_http, capacity_bytes)
    workdir.mkdir(parents=True, exist_ok=True)
    started: list[subprocess.Popen[bytes]] = []
    try:
        master_log = workdir / "mooncake-master.log"
        with master_log.open("wb") as out:
            master = subprocess.Popen(
                [
                    str(binary("mooncake_master")),
                    f"--rpc_port={rpc}",
                    f"--rpc_address={HOST}",
                    "--enable_http_metadata_server=true",
                    f"--http_metadata_server_host={HOST}",
                    f"--http_metadata_server_port={metadata}",
                    f"--metrics_host={HOST}",
                    f"--metrics_port={metrics}",
                    "--rpc_thread_num=2",
                ],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        started.append(master)
        _wait_healthy(store.health_url, master, master_log, within)
        store_log = workdir / "mooncake-store.log"
        with store_log.open("wb") as out:
            server = subprocess.Popen(
                [
                    str(binary("mooncake_client")),
                    f"--host={HOST}",
                    f"--port={store_port}",
                    f"--global_segment_size={capacity_bytes}",
                    f"--master_server_address={store.master_address}",
                    f"--metadata_server={store.metadata_server}",
                    "--protocol=tcp",
                    "--enable_http_server=true",
                    f"--http_port={store_http}",
                ],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                # Its transfer engine looks for a LAN interface; a loopback-only namespace has none.
                env={**os.environ, "MC_TCP_BIND_ADDRESS": HOST},
            )  # fmt: skip
        started.append(server)
        _wait_healthy(f"http://{HOST}:{store_http}/health", server, store_log, within)
        yield store
    finally:
        for proc in reversed(started):
            _stop(proc)


def master_metric(store: MooncakeStore, name: str) -> float:
    """One unlabelled series of the master's /metrics (e.g. master_key_count)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{HOST}:{store.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} is not in the master's metrics")
