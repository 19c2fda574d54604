"""The KV side channel: how a decode engine pulls a prompt's KV from the prefill engine that computed it.

It stands in for NIXL's transfer. A real TCP server (asyncio streams) listens on the prefill engine's
side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``, advertised as ``remote_port``). A connection carries
one pull at a time; decode engines keep idle connections to each peer for reuse (like NIXL keeps its agent
connections), and either side may close an idle connection (the client then simply opens a new one):

    decode -> prefill   one JSON line: {"v": 1, "op": "pull", "kv_compat_id": ..., "engine_id": <decode id>,
                        "tp_size": <decode TP>, "remote_engine_id": ..., "remote_request_id": ...,
                        "block_ids": [...]}
    prefill -> decode   one JSON line: {"ok": true, "bytes": N, "num_tokens": T} then exactly N bytes,
                        or {"ok": false, "error": <reason>, "message": ...} and close.
    decode -> prefill   once all N bytes are read: {"op": "done", "remote_request_id": ...} (NIXL's
                        notification of a completed READ); no answer.
    decode -> prefill   while requests wait in decode's queue for their pull: {"op": "heartbeat",
                        "remote_request_ids": [...]} every lease / 6 s (NIXL's "HB:" notification, vLLM's
                        lease renewal); the prefill engine extends their leases; no answer.

Reasons: ``kv_compat_mismatch`` (the engines' kv-compat ids differ, like a failed NIXL compatibility check),
``tp_unsupported`` (prefill TP larger than decode TP), ``engine_mismatch`` (remote_engine_id names another
engine), ``unknown_request``, ``expired`` (the lease ran out), ``already_pulled``, ``block_mismatch``,
``bad_request``. The payload is ``kv_payload_bytes_per_token x tokens`` bytes, so the transfer costs real
socket time. The prefill engine frees the blocks on the reader's "done", not when it has written them: as with
vLLM's NixlConnector (the prefill frees blocks on the decode's notification, or when ``kv_lease_duration`` runs
out), a pull that times out, is cut off or is abandoned midway leaves the KV held, so a retry (by this decode
engine or, through the router, another one) can still read it. "done" counts only on the connection that was sent
the KV, so nobody frees another reader's KV.

The client retries connection failures (engine not up, connection reset, closed without an answer) with
exponential backoff until ``kv_transfer_timeout_s`` runs out; a refusal from a live peer is final.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from pdserve_sim.engine import Engine, EngineRequest, HeldKV, KVLoadError
from pdserve_sim.faults import Faults

log = logging.getLogger(__name__)

_LINE_LIMIT = 1 << 20
_ZEROS = bytes(1 << 20)
#: The server closes a connection idle this long; clients stop reusing theirs well before.
_SERVER_IDLE_S = 60.0
_CLIENT_IDLE_S = 20.0
_POOL_PER_PEER = 64
#: Request ids one heartbeat may name (a decode engine's queue is bounded by its max_num_seqs scheduling anyway).
_HEARTBEAT_IDS = 4096


class ConnectionPool:
    """Idle side-channel connections of a decode engine, per prefill peer (host, port)."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    def take(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """An idle, recently used connection to the peer, if any."""
        idle = self._idle.get((host, port))
        now = time.monotonic()
        while idle:
            used, reader, writer = idle.pop()
            if now - used < _CLIENT_IDLE_S and not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.close()
        return None

    def give_back(self, host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Keep a healthy connection for the next pull."""
        idle = self._idle.setdefault((host, port), [])
        if len(idle) >= _POOL_PER_PEER or writer.is_closing():
            writer.close()
            return
        idle.append((time.monotonic(), reader, writer))

    def close(self) -> None:
        """Close every idle connection."""
        for idle in self._idle.values():
            for _used, _reader, writer in idle:
                writer.close()
        self._idle.clear()


class SideChannelServer:
    """Serves held KV to pulling decode engines."""

    def __init__(self, engine: Engine, faults: Faults) -> None:
        self.engine = engine
        self.faults = faults
        self.server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[Any]] = set()
        #: Connections accepted so far (pooled clients reuse theirs, so this grows slower than pulls).
        self.accepted = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (port 0 = any); returns the bound port."""
        self.server = await asyncio.start_server(self._handle, host, port, limit=_LINE_LIMIT, backlog=4096)
        sock = self.server.sockets[0]
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        """Stop listening and drop open transfers."""
        if self.server is not None:
            self.server.close()
            for task in list(self._conns):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        self.accepted += 1
        #: KV sent on this connection whose reader has not notified yet, by request id.
        lent: dict[str, HeldKV] = {}
        try:
            while True:
                try:
                    line = await asyncio.wait_for(reader.readline(), _SERVER_IDLE_S)
                except TimeoutError:
                    return
                except ValueError:  # a line over the limit
                    await self._refuse(writer, "bad_request", "side-channel request too long")
                    return
                if not line or self.faults.drop_side_channel:
                    return  # closed by the peer, or the fault: close without answering
                try:
                    msg = json.loads(line)
                    if not isinstance(msg, dict) or msg.get("op") not in ("pull", "done", "heartbeat"):
                        raise ValueError("expected a pull request or a notification")
                except ValueError:
                    await self._refuse(writer, "bad_request", "malformed side-channel request")
                    return
                if msg["op"] == "done":
                    held = lent.pop(str(msg.get("remote_request_id")), None)
                    if held is not None:
                        self.engine.sent(held)
                    continue
                if msg["op"] == "heartbeat":
                    ids = msg.get("remote_request_ids")
                    if isinstance(ids, list):
                        self.engine.extend_leases(str(i) for i in ids[:_HEARTBEAT_IDS])
                    continue
                await self._serve_pull(msg, writer, lent)
        except (ConnectionError, asyncio.LimitOverrunError, asyncio.CancelledError):
            pass
        finally:
            if task is not None:
                self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve_pull(self, msg: dict[str, Any], writer: asyncio.StreamWriter, lent: dict[str, HeldKV]) -> None:
        engine = self.engine
        cfg = engine.config
        compat = cfg.effective_kv_compat_id
        if msg.get("kv_compat_id") != compat:
            engine.metrics.kv_compat_mismatch.inc()
            await self._refuse(
                writer,
                "kv_compat_mismatch",
                f"KV compatibility check failed: local {compat}, remote {msg.get('kv_compat_id')}",
            )
            return
        decode_tp = msg.get("tp_size", 1)
        if isinstance(decode_tp, int) and cfg.tensor_parallel_size > decode_tp:
            await self._refuse(
                writer,
                "tp_unsupported",
                f"prefill TP {cfg.tensor_parallel_size} > decode TP {decode_tp} is not supported",
            )
            return
        remote_engine = msg.get("remote_engine_id")
        if remote_engine not in (None, cfg.engine_id):
            await self._refuse(writer, "engine_mismatch", f"this is engine {cfg.engine_id}, not {remote_engine}")
            return
        request_id = str(msg.get("remote_request_id"))
        held = engine.lend_held(request_id)
        if isinstance(held, str):
            await self._refuse(writer, held, f"no KV held for request {request_id}: {held}")
            return
        wanted = msg.get("block_ids")
        if wanted is not None and list(wanted) != held.blocks:
            await self._refuse(writer, "block_mismatch", "block ids do not match the held KV")
            return
        lent[request_id] = held
        size = cfg.timing.kv_payload_bytes_per_token * held.num_tokens
        header = {"ok": True, "bytes": size, "num_tokens": held.num_tokens}
        writer.write(json.dumps(header).encode() + b"\n")
        view = memoryview(_ZEROS)
        left = size
        while left > 0:
            n = min(left, len(_ZEROS))
            writer.write(view[:n])
            left -= n
            await writer.drain()
        await writer.drain()

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter, reason: str, message: str) -> None:
        writer.write(json.dumps({"ok": False, "error": reason, "message": message}).encode() + b"\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()


class _TransientError(Exception):
    """A failure worth retrying (peer not reachable yet / connection dropped)."""


class _StaleConnectionError(_TransientError):
    """A reused connection failed before the peer answered: open a new one right away."""


async def pull_kv(engine: Engine, req: EngineRequest, pool: ConnectionPool | None = None) -> int:
    """Pull ``req``'s KV from its prefill engine; returns the payload size. Raises KVLoadError."""
    remote = req.remote_prefill
    assert remote is not None
    cfg = engine.config
    m = engine.metrics
    await _handshake(engine, req)
    deadline = time.monotonic() + cfg.kv_transfer_timeout_s
    delay = 0.02
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVLoadError("unreachable", f"KV pull from {remote.host}:{remote.port} failed: {last}")
        try:
            started = time.monotonic()
            try:
                size, posted = await asyncio.wait_for(_pull_once(engine, req, pool, reuse=True), left)
            except _StaleConnectionError:
                # The pooled connection had gone stale (peer closed it): retry at once on a fresh one.
                left = max(deadline - time.monotonic(), 0.001)
                size, posted = await asyncio.wait_for(_pull_once(engine, req, pool, reuse=False), left)
            elapsed = time.monotonic() - started
            m.nixl_post_time.observe(posted)
            m.nixl_bytes.observe(size)
            m.nixl_descriptors.observe(len(remote.block_ids))
            link = cfg.timing.kv_link_bytes_per_second
            if link > 0:
                # Add the modelled link time of the real model's KV on top of the socket transfer.
                modelled = cfg.timing.kv_model_bytes_per_token * len(req.prompt_ids) / link / cfg.speed
                await asyncio.sleep(modelled)
                elapsed += modelled
            m.nixl_xfer_time.observe(elapsed)
            return size
        except _TransientError as exc:
            last = str(exc)
        except TimeoutError:
            last = "timed out"
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        # Back off before retrying, never past the deadline.
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.5)


async def _handshake(engine: Engine, req: EngineRequest) -> None:
    """Model NIXL's one-time agent handshake with a new prefill peer (concurrent first pulls share it)."""
    seconds = engine.config.kv_handshake_s
    remote = req.remote_prefill
    if seconds <= 0 or remote is None:
        return
    key = (remote.host, remote.port, remote.engine_id)
    done = engine.peers.get(key)
    if done is None:
        log.info("Handshaking with KV peer %s:%d engine_id=%s", remote.host, remote.port, remote.engine_id)
        done = asyncio.ensure_future(asyncio.sleep(seconds / engine.config.speed))
        engine.peers[key] = done
    await asyncio.shield(done)


async def _pull_once(
    engine: Engine, req: EngineRequest, pool: ConnectionPool | None, *, reuse: bool
) -> tuple[int, float]:
    remote = req.remote_prefill
    assert remote is not None
    cfg = engine.config
    t0 = time.monotonic()
    conn = pool.take(remote.host, remote.port) if pool is not None and reuse else None
    reused = conn is not None
    if conn is None:
        conn = await asyncio.open_connection(remote.host, remote.port, limit=_LINE_LIMIT)
    reader, writer = conn
    healthy = False
    answered = False
    try:
        msg = {
            "v": 1,
            "op": "pull",
            "kv_compat_id": cfg.effective_kv_compat_id,
            "engine_id": cfg.engine_id,
            "tp_size": cfg.tensor_parallel_size,
            "remote_engine_id": remote.engine_id,
            "remote_request_id": remote.request_id,
            "block_ids": list(remote.block_ids),
        }
        writer.write(json.dumps(msg).encode() + b"\n")
        await writer.drain()
        posted = time.monotonic() - t0
        line = await reader.readline()
        if not line:
            raise _TransientError("the prefill engine closed the side channel without answering")
        answered = True
        try:
            header = json.loads(line)
        except ValueError:
            raise KVLoadError("protocol", "malformed side-channel answer") from None
        if not header.get("ok"):
            healthy = True  # a refusal leaves the connection usable
            raise KVLoadError(str(header.get("error")), str(header.get("message")))
        size = int(header["bytes"])
        remote_tokens = header.get("num_tokens")
        if remote_tokens != len(req.prompt_ids):
            # Real vLLM would silently use KV of a different prompt; make a proxy that changed the body
            # between prefill and decode visible instead.
            engine.metrics.prompt_mismatch.inc()
            log.warning(
                "Pulled KV for %s prompt tokens into a request with %d request_id=%s remote_request_id=%s",
                remote_tokens,
                len(req.prompt_ids),
                req.request_id,
                remote.request_id,
            )
        left = size
        while left > 0:
            chunk = await reader.read(min(left, 1 << 20))
            if not chunk:
                raise _TransientError("the side channel closed mid-transfer")
            left -= len(chunk)
        # The KV is here: notify the prefill engine so it frees the blocks. A lost notification does not undo
        # the transfer; the prefill engine then frees them when the lease runs out (vLLM counts it the same way).
        try:
            writer.write(json.dumps({"op": "done", "remote_request_id": remote.request_id}).encode() + b"\n")
            await writer.drain()
            healthy = True
        except ConnectionError:
            engine.metrics.nixl_failed_notifications.inc()
        return size, posted
    except (ConnectionError, asyncio.IncompleteReadError, _TransientError) as exc:
        if reused and not answered:
            raise _StaleConnectionError(f"{type(exc).__name__}: {exc}") from None
        if isinstance(exc, _TransientError):
            raise
        raise _TransientError(f"{type(exc).__name__}: {exc}") from None
    finally:
        if healthy and pool is not None:
            pool.give_back(remote.host, remote.port, reader, writer)
        else:
            writer.close()


async def send_heartbeats(engine: Engine, pool: ConnectionPool) -> None:
    """One round of lease renewals: to each prefill engine that holds KV for requests still queued here, the ids of
    those requests (vLLM's NixlConnector sends them as NIXL notifications). A peer that cannot be reached is skipped
    (vLLM logs it at debug level): its KV then expires as it would have without the heartbeat."""
    for (host, port), ids in engine.awaiting_pull().items():
        try:
            conn = pool.take(host, port)
            if conn is None:
                conn = await asyncio.wait_for(asyncio.open_connection(host, port, limit=_LINE_LIMIT), 2.0)
            reader, writer = conn
            writer.write(json.dumps({"op": "heartbeat", "remote_request_ids": ids}).encode() + b"\n")
            await asyncio.wait_for(writer.drain(), 2.0)
            pool.give_back(host, port, reader, writer)
        except (OSError, TimeoutError) as exc:
            log.debug("Heartbeat to %s:%d failed: %s", host, port, exc)
