"""Helpers that start simulators for tests and benchmarks (of the simulator and of other components).

- :func:`sim_process`: an async context manager that starts ``python -m pdserve_sim`` as a real
  subprocess on loopback with free ports (``--port 0 --side-channel-port 0``), waits for its
  ``PDSERVE_SIM_READY`` line and ``/health``, yields a :class:`SimProcess`, and always stops it (SIGTERM,
  then SIGKILL) by PID. Use it when the test needs a separate process (killing it, CPU isolation).
- :func:`sim_in_process`: the same engine inside the current event loop (no process start cost, ~ms);
  yields a :class:`SimHandle`.

Both take native CLI-style options as keyword arguments, e.g.
``async with sim_process(role="prefill", fast=True) as p: ... p.url ...``.

Clients of a running simulator's admin API: :func:`set_faults`, :func:`faults` (which includes the
``requests_seen`` and ``health_checks_seen`` counts tests wait on) and :func:`state` (``/sim/state``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve_dev.testing.wait import wait_for_async
from pdserve_sim.config import SimConfig
from pdserve_sim.presets import FAST

READY_PREFIX = "PDSERVE_SIM_READY "


@dataclass(frozen=True, slots=True)
class SimHandle:
    """Where a running simulator listens."""

    host: str
    http_port: int
    side_channel_port: int

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API, e.g. ``http://127.0.0.1:43123``."""
        return f"http://{self.host}:{self.http_port}"


@dataclass(frozen=True, slots=True)
class SimProcess(SimHandle):
    """A simulator subprocess."""

    process: asyncio.subprocess.Process

    @property
    def pid(self) -> int:
        """The subprocess's PID."""
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL the simulator now (to test what peers see when an engine dies)."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()


def _cli_args(options: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            for item in value:
                args += [flag, str(item)]
        else:
            args += [flag, str(value)]
    return args


async def wait_healthy(url: str, within: float = 20.0) -> None:
    """Poll ``url/health`` until it answers 200."""
    async with aiohttp.ClientSession() as session:

        async def healthy() -> bool:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                return resp.status == 200

        await wait_for_async(healthy, within=within, message=f"the simulator at {url} to answer /health")


async def set_faults(url: str, **changes: Any) -> None:
    """``POST /sim/faults``: change the faults of the simulator at base URL ``url`` (e.g. ``fail_next=1``)."""
    async with aiohttp.ClientSession() as session, session.post(url + "/sim/faults", json=changes) as response:
        assert response.status == 200, await response.text()


async def faults(url: str) -> dict[str, Any]:
    """``GET /sim/faults``: the fault state plus the ``requests_seen`` / ``health_checks_seen`` counts."""
    async with aiohttp.ClientSession() as session, session.get(url + "/sim/faults") as response:
        response.raise_for_status()
        result: dict[str, Any] = await response.json()
        return result


async def requests_seen(url: str) -> int:
    """Generation requests the simulator at ``url`` has answered (failed ones included)."""
    return int((await faults(url))["requests_seen"])


async def health_checks_seen(url: str) -> int:
    """``/health`` calls the simulator at ``url`` has answered (e.g. a router's circuit-breaker probes)."""
    return int((await faults(url))["health_checks_seen"])


async def state(url: str) -> dict[str, Any]:
    """``GET /sim/state``: the scheduler's queues and KV usage (``running``, ``waiting``, ...)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/sim/state") as response:
        response.raise_for_status()
        result: dict[str, Any] = await response.json()
        return result


@contextlib.asynccontextmanager
async def sim_process(
    *serve_args: str,
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    startup_timeout: float = 20.0,
    **options: Any,
) -> AsyncIterator[SimProcess]:
    """Start a simulator subprocess. ``options`` are native flags (``role="decode", fast=True``);
    ``serve_args`` (e.g. ``"serve", "my-model", "--kv-transfer-config", ...``) switch to drop-in mode."""
    options.setdefault("port", 0)
    options.setdefault("side_channel_port", 0)
    options.setdefault("host", host)
    cmd = [sys.executable, "-m", "pdserve_sim", *_cli_args(options), *serve_args]
    proc_env = dict(os.environ)
    proc_env.update(env or {})
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=None, env=proc_env, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        ready: dict[str, Any] | None = None
        try:
            async with asyncio.timeout(startup_timeout):
                while ready is None:
                    line = await proc.stdout.readline()
                    if not line:
                        raise RuntimeError(f"simulator exited early with status {await proc.wait()}: {cmd}")
                    text = line.decode(errors="replace").strip()
                    if text.startswith(READY_PREFIX):
                        ready = json.loads(text[len(READY_PREFIX) :])
        except TimeoutError:
            raise TimeoutError(f"simulator did not start within {startup_timeout} s: {cmd}") from None
        bound_host = env.get("PDSERVE_BIND_HOST", host) if env else host
        handle = SimProcess(bound_host, int(ready["http_port"]), int(ready["side_channel_port"]), proc)
        await wait_healthy(handle.url, startup_timeout)
        # Keep draining stdout so the child never blocks on a full pipe.
        drain = asyncio.create_task(_drain(proc.stdout))
        try:
            yield handle
        finally:
            drain.cancel()
    finally:
        await _stop_process(proc)


async def _drain(stream: asyncio.StreamReader) -> None:
    with contextlib.suppress(Exception):
        while await stream.readline():
            pass


async def _stop_process(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), 5)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def _in_process_config(config: SimConfig | None, changes: dict[str, Any]) -> SimConfig:
    base = config or SimConfig(timing=FAST, fast=True)
    fields: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "side_channel_port": 0}
    if base.engine_id == "sim-engine" and "engine_id" not in changes:
        # Unique per instance, as real engine ids are per pod incarnation.
        fields["engine_id"] = f"sim-{changes.get('role', base.role)}-{uuid.uuid4().hex[:8]}"
    fields.update(changes)
    return dataclasses.replace(base, **fields)


@contextlib.asynccontextmanager
async def sim_in_process(config: SimConfig | None = None, **changes: Any) -> AsyncIterator[SimHandle]:
    """Run a simulator in the current event loop on loopback with free ports.

    ``changes`` replace fields of ``config`` (default: a fast ``both`` engine), e.g. ``role="prefill"``.
    """
    from pdserve_sim.server import SimServer

    cfg = _in_process_config(config, changes)
    server = SimServer(cfg)
    await server.start()
    try:
        yield SimHandle(cfg.host, server.http_port, server.side_channel_port)
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def sim_server_in_process(config: SimConfig | None = None, **changes: Any) -> AsyncIterator[Any]:
    """Like :func:`sim_in_process` but yields the :class:`~pdserve_sim.server.SimServer` itself
    (for tests that inspect the engine); its ``http_port`` and ``config`` say where it listens."""
    from pdserve_sim.server import SimServer

    server = SimServer(_in_process_config(config, changes))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
