"""The simulator's HTTP server: vLLM's OpenAI-compatible API over aiohttp, plus admin endpoints.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /ping``, ``GET /version``, ``GET /metrics``, ``POST /tokenize``, ``POST /abort``
(``{"request_id": ...}``), and the simulator's own ``GET|POST|DELETE /sim/faults`` and ``GET /sim/state``.

Streaming follows the shape of vLLM's server: ``data: <json>\\n\\n`` events, one per token (several
tokens ready at once are written in one socket write, still as separate events), the chat stream opening
with a ``{"role": "assistant", "content": ""}`` delta, the last token's event carrying ``finish_reason``, an
optional usage event (``choices: []``) when ``stream_options.include_usage`` is set, then ``data: [DONE]``.
A streaming request that fails after the response started gets a ``data: {"error": {...}}`` event.

On SIGTERM with ``--shutdown-timeout N`` (vLLM's drain, see ``drain``) every path but ``/live``, ``/metrics`` and
``/sim/`` answers 503 while in-flight requests finish and KV already handed out is pulled or expires.
The token events are formatted from precomputed string fragments: the hot path does no JSON encoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve_sim.config import SimConfig
from pdserve_sim.engine import Engine, EngineRequest
from pdserve_sim.faults import Faults
from pdserve_sim.kvevents import KvEventPublisher
from pdserve_sim.kvstore import KVStore
from pdserve_sim.metrics import SimMetrics
from pdserve_sim.protocol import ApiError, ParsedRequest, decode_json, error_body, parse_request
from pdserve_sim.sidechannel import ConnectionPool, SideChannelServer, pull_kv, send_heartbeats
from pdserve_sim.tokenizer import WORD_PIECES, natural_length, word_index

log = logging.getLogger(__name__)

SIM_VERSION = "0.32.0+pdserve.sim"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"


def _json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(body).encode(), status=status, content_type="application/json")


def _model_permission(created: int) -> dict[str, Any]:
    """The permission entry vLLM lists with each base model in /v1/models (its ModelPermission defaults)."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def _error_response(err: ApiError) -> web.Response:
    return _json_response(err.body(), err.status)


def output_text(req: EngineRequest, count: int) -> str:
    """The deterministic text of the first ``count`` generated tokens of ``req``."""
    seed = req.seed
    return "".join(WORD_PIECES[word_index(seed, i)] for i in range(count))


class SimServer:
    """One simulated engine: HTTP API, scheduler loop and (for prefill/both) the KV side channel."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        timing = config.timing
        cache_info = {
            "block_size": str(timing.block_size),
            "num_gpu_blocks": str(timing.num_kv_blocks),
            "enable_prefix_caching": "True",
        }
        self.metrics = SimMetrics(config.public_model_name, timing.max_model_len, cache_info=cache_info)
        self.engine = Engine(config, self.metrics)
        self.faults = Faults(config.faults)
        self.side_channel = SideChannelServer(self.engine, self.faults)
        self.kv_connections = ConnectionPool()
        self.engine.pull = lambda req: pull_kv(self.engine, req, self.kv_connections)
        self.runner: web.AppRunner | None = None
        self._heartbeats: asyncio.Task[None] | None = None
        self.kv_publisher: KvEventPublisher | None = None
        self.http_port = config.port
        self.side_channel_port = config.side_channel_port
        self.created = int(time.time())
        #: Set on a graceful shutdown: new requests are refused while in-flight ones finish.
        self.draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # ----------------------------------------------------------------------------------------------------

    @web.middleware
    async def _refuse_while_draining(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """vLLM's ScalingMiddleware: while draining, every path but /live and /metrics answers 503 (so /health
        turns readiness false); the simulator's own /sim/ admin paths stay open for tests."""
        path = request.path
        if self.draining and path not in ("/live", "/metrics") and not path.startswith("/sim/"):
            return _json_response({"error": "Server is unavailable. Please try again later."}, 503)
        response: web.StreamResponse = await handler(request)
        return response

    def build_app(self) -> web.Application:
        """The aiohttp application with every route."""
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._refuse_while_draining])
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/ping", self.health),
                web.get("/version", self.version),
                web.get("/metrics", self.metrics_handler),
                web.post("/abort", self.abort),
                web.post("/tokenize", self.tokenize),
                web.get("/sim/faults", self.get_faults),
                web.post("/sim/faults", self.post_faults),
                web.delete("/sim/faults", self.delete_faults),
                web.get("/sim/state", self.state),
            ]
        )
        return app

    async def start(self) -> None:
        """Connect to the KV store (if any), bind the HTTP server and the side channel, start the engine loop."""
        cfg = self.config
        if cfg.kv_events is not None:
            self.kv_publisher = KvEventPublisher(cfg.kv_events, cfg.side_channel_bind_host or cfg.host)
            self.engine.publish_events = self.kv_publisher.publish
        if cfg.kv_store is not None:
            # vLLM's engine does not come up without its store: neither does the simulator (StoreError).
            store = KVStore(cfg.kv_store, cfg.timing.kv_payload_bytes_per_token * cfg.timing.block_size)
            host = cfg.side_channel_host if cfg.side_channel_host not in ("0.0.0.0", "::", "") else "127.0.0.1"
            await store.connect(host)
            self.engine.store = store
            log.info("Connected to the KV store master=%s writes=%s", cfg.kv_store.master_address, cfg.kv_store.writes)
        self.engine.start()
        if cfg.role in ("prefill", "both"):
            bind = cfg.side_channel_bind_host or cfg.host
            self.side_channel_port = await self.side_channel.start(bind, cfg.side_channel_port)
            if cfg.side_channel_port == 0:
                # Advertise the port actually bound (tests bind port 0).
                cfg = dataclasses.replace(cfg, side_channel_port=self.side_channel_port)
                self.config = self.engine.config = cfg
        if cfg.role in ("decode", "both") and cfg.kv_lease_seconds > 0:
            self._heartbeats = asyncio.get_running_loop().create_task(self._renew_leases(cfg.kv_lease_seconds / 6))
        self.runner = web.AppRunner(self.build_app(), access_log=None, handler_cancellation=True, shutdown_timeout=2.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, cfg.host, cfg.port, backlog=4096, reuse_address=True)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        if sockets:
            self.http_port = int(sockets[0].getsockname()[1])

    async def drain(self, within: float) -> None:
        """vLLM's --shutdown-timeout: refuse new requests, wait up to ``within`` s for in-flight ones, then (a
        prefill engine) for the KV it handed out to be pulled or to expire, so no decode engine is left pulling
        from a closed side channel. The side channel stays up meanwhile; what is left at the deadline is aborted.
        """
        self.draining = True
        engine = self.engine
        log.info(
            "Draining in-flight requests count=%d held_kv=%d timeout=%.1fs",
            self._inflight,
            engine.kv_outstanding,
            within,
        )
        started = time.monotonic()
        try:
            async with asyncio.timeout(within):
                await self._idle.wait()
                # Every KV hold exists by now: a prefill request holds its blocks before its answer goes out.
                await engine.kv_settled()
            log.info("Drained in %.1fs", time.monotonic() - started)
        except TimeoutError:
            log.warning(
                "Drain timed out after %.1fs, aborting requests count=%d held_kv=%d",
                time.monotonic() - started,
                self._inflight,
                engine.kv_outstanding,
            )

    async def _renew_leases(self, interval: float) -> None:
        """vLLM's heartbeat (a decode engine's NixlConnector): every lease / 6 s, renew the prefill engines' leases
        on the KV of requests still queued here."""
        while True:
            await asyncio.sleep(interval)
            await send_heartbeats(self.engine, self.kv_connections)

    async def stop(self) -> None:
        """Stop serving and release everything."""
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeats
        await self.side_channel.stop()
        # Finish every request first (streams end with their last event), release stalled streams, then
        # close the HTTP server, so shutdown never waits on an open stream.
        await self.engine.stop()
        if self.engine.store is not None:
            await self.engine.store.close()
        self.kv_connections.close()
        self.faults.clear()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.kv_publisher is not None:
            self.engine.publish_events = None
            await asyncio.to_thread(self.kv_publisher.close)

    # ----------------------------------------------------------------------------------------------------
    # Small endpoints

    async def health(self, request: web.Request) -> web.Response:
        self.faults.health_checks_seen += 1
        if self.faults.unready or self.draining:
            return web.Response(status=503)
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return _json_response({"version": SIM_VERSION})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self.engine._update_gauges()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.config
        data: list[dict[str, Any]] = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": cfg.model,
                "parent": None,
                "max_model_len": cfg.timing.max_model_len,
                "permission": [_model_permission(self.created)],
            }
            for name in cfg.model_names
        ]
        return _json_response({"object": "list", "data": data})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the simulator's token ids of a prompt or of chat messages."""
        cfg = self.config
        try:
            body = decode_json(await request.read())
            chat = "messages" in body
            probe: dict[str, Any] = {k: body[k] for k in ("model", "prompt", "messages") if k in body}
            parsed = parse_request(
                dict(probe, max_tokens=1),
                chat=chat,
                model_names=cfg.model_names,
                max_model_len=1 << 30,  # report the count even past the context length
            )
        except ApiError as err:
            return _error_response(err)
        ids = parsed.prompt_ids
        return _json_response(
            {"count": len(ids), "max_model_len": cfg.timing.max_model_len, "tokens": ids, "token_strs": None}
        )

    async def abort(self, request: web.Request) -> web.Response:
        try:
            body = decode_json(await request.read())
            request_id = body.get("request_id")
            if not isinstance(request_id, str):
                raise ApiError(400, "request_id must be a string", "request_id")
        except ApiError as err:
            return _error_response(err)
        req = self.engine.find(request_id)
        if req is None:
            return _error_response(ApiError(404, f"No running request {request_id}", "request_id"))
        self.engine.abort(req)
        return _json_response({"aborted": request_id})

    async def get_faults(self, request: web.Request) -> web.Response:
        return _json_response(self.faults.to_dict())

    async def post_faults(self, request: web.Request) -> web.Response:
        try:
            body = decode_json(await request.read())
        except ApiError as err:
            return _error_response(err)
        crash = body.pop("crash", False)
        try:
            self.faults.update(body)
        except ValueError as exc:
            return _error_response(ApiError(400, str(exc)))
        if crash is True:
            log.warning("Crashing on request of /sim/faults")
            asyncio.get_running_loop().call_later(0.05, os._exit, 70)
        return _json_response(self.faults.to_dict())

    async def delete_faults(self, request: web.Request) -> web.Response:
        self.faults.clear()
        return _json_response(self.faults.to_dict())

    async def state(self, request: web.Request) -> web.Response:
        cfg = self.config
        out = self.engine.snapshot()
        out.update(
            role=cfg.role,
            engine_id=cfg.engine_id,
            kv_compat_id=cfg.effective_kv_compat_id,
            http_port=self.http_port,
            side_channel_port=self.side_channel_port,
            side_channel_connections=self.side_channel.accepted,
            model=cfg.public_model_name,
        )
        return _json_response(out)

    # ----------------------------------------------------------------------------------------------------
    # Generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        faults = self.faults
        faults.requests_seen += 1
        if faults.crash_after_requests is not None and faults.requests_seen >= faults.crash_after_requests:
            log.warning("Crashing on request %d (fault crash_after_requests)", faults.requests_seen)
            os._exit(70)
        if self.draining:
            return _json_response(error_body(503, "The server is shutting down."), 503)
        if faults.fail_next > 0:
            faults.fail_next -= 1
            status = faults.fail_status
            return _json_response(error_body(status, f"Injected failure (status {status})"), status)
        if faults.latency_s > 0:
            await asyncio.sleep(faults.latency_s)
        cfg = self.config
        try:
            parsed = parse_request(
                decode_json(await request.read()),
                chat=chat,
                model_names=cfg.model_names,
                max_model_len=cfg.timing.max_model_len,
            )
        except ApiError as err:
            return _error_response(err)
        base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
        req = EngineRequest(
            request_id,
            parsed.prompt_ids,
            parsed.max_tokens,
            min_tokens=parsed.min_tokens,
            remote_decode=parsed.remote_decode,
            remote_prefill=parsed.remote_prefill,
        )
        req.wants_tokens = parsed.stream
        if cfg.eos_mean_tokens > 0 and not parsed.ignore_eos:
            req.stop_after = natural_length(req.seed, cfg.eos_mean_tokens)
        engine = self.engine
        if engine.store is not None and parsed.remote_prefill is None:
            # vLLM's store connector looks the prompt up before the request is scheduled; so does the simulator.
            await engine.preload(req)
        engine.add(req)
        headers = {"X-Request-Id": base} if cfg.request_id_headers else {}
        self._inflight += 1
        self._idle.clear()
        try:
            if parsed.stream:
                return await self._stream(request, parsed, req, headers)
            response = await self._unary(parsed, req)
            response.headers.update(headers)
            return response
        finally:
            if not req.finished:
                engine.abort(req)
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    async def _unary(self, parsed: ParsedRequest, req: EngineRequest) -> web.Response:
        faults = self.faults
        while not req.finished:
            await req.wait_beyond(req.outputs)
        while faults.stall_after_tokens is not None and req.outputs > faults.stall_after_tokens:
            await faults.unstalled.wait()
        if req.error is not None:
            return _json_response(error_body(req.error_status, req.error), req.error_status)
        text = output_text(req, req.outputs)
        prompt_tokens = len(req.prompt_ids)
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + req.outputs,
            "completion_tokens": req.outputs,
            "prompt_tokens_details": self._prompt_details(req),
        }
        finish = req.finish_reason if req.finish_reason in ("length", "stop") else "abort"
        body: dict[str, Any]
        if parsed.chat:
            body = {
                "id": req.request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": parsed.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "tool_calls": [],
                            "reasoning_content": None,
                        },
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "prompt_logprobs": None,
                "kv_transfer_params": req.kv_transfer_params_out,
            }
        else:
            body = {
                "id": req.request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": parsed.model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                        "prompt_logprobs": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "kv_transfer_params": req.kv_transfer_params_out,
            }
        return _json_response(body)

    async def _stream(
        self, request: web.Request, parsed: ParsedRequest, req: EngineRequest, headers: dict[str, str]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        try:
            await resp.prepare(request)
            await self._stream_events(request, resp, parsed, req)
        except ConnectionError:
            # The client went away mid-stream; the caller aborts the request and frees its KV.
            log.debug("Client disconnected request_id=%s", req.request_id)
        return resp

    async def _stream_events(
        self, request: web.Request, resp: web.StreamResponse, parsed: ParsedRequest, req: EngineRequest
    ) -> None:
        created = int(time.time())
        model = json.dumps(parsed.model)
        prompt_tokens = len(req.prompt_ids)
        if parsed.chat:
            head = (
                f'data: {{"id":"{req.request_id}","object":"chat.completion.chunk","created":{created},'
                f'"model":{model},"choices":[{{"index":0,"delta":{{"content":"'
            )
            mid = '"},"logprobs":null,"finish_reason":null}]'
            last_pre, last_post = '"},"logprobs":null,"finish_reason":"', '","stop_reason":null}]'
            opening = (
                f'data: {{"id":"{req.request_id}","object":"chat.completion.chunk","created":{created},'
                f'"model":{model},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
                '"logprobs":null,"finish_reason":null}]'
            )
        else:
            head = (
                f'data: {{"id":"{req.request_id}","object":"text_completion","created":{created},'
                f'"model":{model},"choices":[{{"index":0,"text":"'
            )
            mid = '","logprobs":null,"finish_reason":null,"stop_reason":null}]'
            last_pre, last_post = '","logprobs":null,"finish_reason":"', '","stop_reason":null}]'
            opening = ""
        continuous = parsed.continuous_usage
        end = "}\n\n"
        mid_end = mid + end
        seed = req.seed
        faults = self.faults
        sent = 0
        while True:
            cut = faults.disconnect_after_tokens
            if cut is not None and sent >= cut and request.transport is not None:
                if sent == 0:
                    # Cut before the first token only once the engine has computed it: a PD decode has read its KV
                    # by then (what a router must not reuse), as when an engine dies after its transfer.
                    await req.wait_beyond(0)
                # Injected connection loss mid-stream: no [DONE], no chunked terminator.
                request.transport.abort()
                return
            stall = faults.stall_after_tokens
            if stall is not None and sent >= stall:
                # Injected stall: hold the stream open without sending until the fault is cleared.
                await faults.unstalled.wait()
                continue
            await req.wait_beyond(sent)
            produced = req.outputs
            if stall is not None and produced > stall:
                produced = stall
            if cut is not None and produced > cut:
                produced = cut
            if produced > sent:
                finished_now = req.finished and produced == req.outputs
                parts: list[str] = []
                if sent == 0 and opening:
                    parts.append(opening + (self._usage_json(prompt_tokens, 0) if continuous else "") + end)
                for pos in range(sent, produced):
                    piece = WORD_PIECES[word_index(seed, pos)]
                    if finished_now and pos == produced - 1:
                        reason = req.finish_reason if req.finish_reason in ("length", "stop") else "abort"
                        parts.append(head + piece + last_pre + reason + last_post)
                    elif not continuous:
                        parts.append(head + piece + mid_end)
                        continue
                    else:
                        parts.append(head + piece + mid)
                    if continuous:
                        parts.append(self._usage_json(prompt_tokens, pos + 1))
                    parts.append(end)
                sent = produced
                if req.finished and sent >= req.outputs:
                    # Last token, usage, [DONE] and the chunked-encoding terminator in one socket write.
                    await resp.write_eof("".join(parts).encode() + self._tail(parsed, req, created, sent))
                    return
                await resp.write("".join(parts).encode())
            elif req.finished and sent >= req.outputs:
                final = ""
                if req.error is None and req.finish_reason not in ("length", "stop"):
                    # Aborted between tokens (shutdown, /abort): an empty event carries the finish reason.
                    final = (opening + end if sent == 0 and opening else "") + head + last_pre + "abort" + last_post
                    final += self._usage_json(prompt_tokens, sent) + end if continuous else end
                await resp.write_eof(final.encode() + self._tail(parsed, req, created, sent))
                return

    def _tail(self, parsed: ParsedRequest, req: EngineRequest, created: int, sent: int) -> bytes:
        """The events after the last token: an error or the usage event (if asked for), then [DONE]."""
        tail_parts: list[bytes] = []
        prompt_tokens = len(req.prompt_ids)
        if req.error is not None:
            tail_parts.append(b"data: " + json.dumps(error_body(req.error_status, req.error)).encode() + b"\n\n")
        elif parsed.include_usage:
            usage: dict[str, Any] = {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + sent,
                "completion_tokens": sent,
            }
            details = self._prompt_details(req)
            if details is not None:
                usage["prompt_tokens_details"] = details
            chunk: dict[str, Any] = {
                "id": req.request_id,
                "object": "chat.completion.chunk" if parsed.chat else "text_completion",
                "created": created,
                "model": parsed.model,
                "choices": [],
                "usage": usage,
            }
            tail_parts.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
        tail_parts.append(_DONE)
        return b"".join(tail_parts)

    def _prompt_details(self, req: EngineRequest) -> dict[str, int] | None:
        """vLLM's prompt_tokens_details (with --enable-prompt-tokens-details): tokens not computed here."""
        if not self.config.prompt_tokens_details:
            return None
        return {"cached_tokens": req.num_cached_tokens + req.external_tokens}

    @staticmethod
    def _usage_json(prompt_tokens: int, completion_tokens: int) -> str:
        return (
            f',"usage":{{"prompt_tokens":{prompt_tokens},"total_tokens":{prompt_tokens + completion_tokens},'
            f'"completion_tokens":{completion_tokens}}}'
        )
