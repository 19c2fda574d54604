"""The proxy: every byte of IO between clients and engines.

Per generation request:

1. Read the body (size-limited), parse it, strip engine-internal fields, take or make the request id.
2. Describe the prompt (approximate tokens, block hashes) and plan: decode engine, route, prefill engine.
3. PD route: POST the prefill body to a prefill engine; on connect error, 5xx or timeout try another (up to
   `maxPrefillAttempts`); if none succeeds fall back to decode-only when allowed, else 503. An engine 4xx is the
   client's fault and is relayed as it is.
4. Decode: POST the client's body (plus the prefill's `kv_transfer_params`) to the decode engine and wait for the
   first chunk before answering the client, so that a failure up to that point is invisible: retry on another
   kv-compatible decode engine with the same KV (up to `maxDecodeAttempts`), then once with a fresh prefill.
5. Relay: non-streaming bodies as they are; streams chunk by chunk, bytes untouched. An engine failure after the
   first byte ends the stream with an OpenAI error event (no retry: tokens already sent must not repeat).

Load counters are taken when an engine is chosen and released in `finally`; a client disconnect cancels the
handler (aiohttp `handler_cancellation`) and closing the upstream response aborts the engine's request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from time import monotonic, perf_counter
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from pdserve.api.router_config import RouterConfig
from pdserve_runtime.router.endpoints import EndpointState, Role
from pdserve_runtime.router.errors import error_response, stream_error_event
from pdserve_runtime.router.messages import (
    decode_body,
    downstream_headers,
    parse_body,
    prefill_body,
    request_id,
    sanitize,
    upstream_headers,
)
from pdserve_runtime.router.metrics import RouterMetrics
from pdserve_runtime.router.policy.decision import Route
from pdserve_runtime.router.policy.scheduler import Scheduler
from pdserve_runtime.router.prefix import PrefixTracker
from pdserve_runtime.router.tokens import PromptInfo, describe_prompt

log = logging.getLogger("pdserve.router")

# Longest engine error body quoted in the router's own error messages.
_DETAIL_LIMIT = 300


class UpstreamError(Exception):
    """An engine could not serve: connect error, timeout, 5xx, or a malformed answer."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


@dataclass(slots=True)
class _Flow:
    """The state of one generation request as it moves through the proxy."""

    request: web.Request
    chat: bool
    path: str
    started: float
    rid: str
    payload: dict[str, Any] = field(default_factory=dict)
    raw: bytes | None = None  # the client's body when it can be forwarded unchanged
    stream: bool = False
    prompt: PromptInfo | None = None
    headers: dict[str, str] = field(default_factory=dict)
    prefix_blocks: Mapping[str, int] = field(default_factory=dict)
    uncached: int = 0
    prefill_bytes: bytes | None = None
    route: str = "none"
    outcome: str = "client_error"
    response: web.StreamResponse | None = None
    # Seconds spent waiting on engines before the first byte (successful and failed tries alike).
    upstream_wait: float = 0.0


def _detail(data: bytes) -> str:
    return data[:_DETAIL_LIMIT].decode("utf-8", "replace")


class Proxy:
    """Request handlers for the generation endpoints, sharing one upstream HTTP client."""

    def __init__(
        self,
        config: RouterConfig,
        scheduler: Scheduler,
        tracker: PrefixTracker,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.table = scheduler.table
        self.tracker = tracker
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._retry_after = {"Retry-After": str(config.retry_after_seconds)}

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Proxy.start() was not called"
        return self._session

    async def start(self) -> None:
        """Open the shared upstream client (connection pool, timeouts)."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self.config.connect_timeout_seconds,
            sock_read=self.config.read_timeout_seconds,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            # Engines must answer uncompressed: the router parses prefill answers and relays decode bytes as they
            # are, without Content-Encoding (aiohttp would otherwise ask for gzip/deflate on the router's behalf).
            headers={"Accept-Encoding": "identity"},
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            raise_for_status=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- handlers -------------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        flow = _Flow(
            request=request,
            chat=chat,
            path=request.path,
            started=perf_counter(),
            rid=request_id(request.headers.get("X-Request-Id"), uuid.uuid4),
        )
        try:
            async with asyncio.timeout(self.config.request_timeout_seconds):
                return await self._serve(flow)
        except TimeoutError:
            flow.outcome = "timeout"
            message = f"request exceeded the router's {self.config.request_timeout_seconds}s limit"
            if flow.response is not None and flow.response.prepared:
                await self._end_stream(flow.response, stream_error_event(504, message))
                return flow.response
            return self._error(flow, 504, message)
        except asyncio.CancelledError:
            flow.outcome = "cancelled"
            raise
        finally:
            self.metrics.count_request(flow.route, flow.outcome)
            self.metrics.e2e_by_route[flow.route].observe(perf_counter() - flow.started)

    def _error(self, flow: _Flow, status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
        merged = {"X-Request-Id": flow.rid, "X-Pdserve-Route": flow.route, **(headers or {})}
        return error_response(status, message, headers=merged)

    async def _serve(self, flow: _Flow) -> web.StreamResponse:
        request = flow.request
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            limit = self.config.max_request_body_bytes
            return self._error(flow, 413, f"request body is larger than the router's limit of {limit} bytes")
        except web.RequestPayloadError:
            # The body's Content-Encoding (gzip, deflate) does not match its bytes: the client's error, not ours.
            coding = request.headers.get("Content-Encoding", "")
            return self._error(flow, 400, f"request body could not be decoded (Content-Encoding: {coding!r})")
        try:
            flow.payload = parse_body(raw)
        except ValueError as exc:
            return self._error(flow, 400, str(exc))
        if sanitize(flow.payload):
            log.info("Stripped engine-internal fields from a client request request_id=%s", flow.rid)
        else:
            flow.raw = raw
        flow.stream = flow.payload.get("stream") is True
        flow.headers = upstream_headers(request.headers, flow.rid)

        decided = perf_counter()
        policy = self.config.policy
        prompt = describe_prompt(flow.payload, flow.chat, policy.block_size_tokens)
        flow.prompt = prompt
        plan = self.scheduler.plan(prompt, monotonic())
        self.metrics.decision.observe(perf_counter() - decided)
        flow.prefix_blocks = plan.prefix_blocks
        flow.uncached = plan.uncached_tokens

        if plan.decode is None:
            flow.outcome = "unavailable"
            return self._error(flow, 503, "no decode engine is available", self._retry_after)
        flow.route = plan.route.value
        kv: tuple[dict[str, Any], EndpointState] | None = None
        if plan.route is Route.PD:
            result = await self._prefill(flow, plan.decode, plan.prefill)
            if isinstance(result, web.StreamResponse):
                return result
            if result is None:
                if not policy.fallback_to_decode:
                    flow.outcome = "unavailable"
                    return self._error(flow, 503, "no prefill engine could serve the request", self._retry_after)
                flow.route = Route.FALLBACK.value
                self.metrics.fallbacks.labels("prefill_failed").inc()
            kv = result
        elif plan.route is Route.FALLBACK:
            if not policy.fallback_to_decode:
                flow.outcome = "unavailable"
                return self._error(flow, 503, "no prefill engine is available", self._retry_after)
            self.metrics.fallbacks.labels("no_prefill").inc()
        return await self._decode(flow, plan.decode, kv)

    # -- prefill --------------------------------------------------------------------------------------------

    async def _prefill(
        self, flow: _Flow, decode: EndpointState, first: EndpointState | None, avoid: str | None = None
    ) -> tuple[dict[str, Any], EndpointState] | web.StreamResponse | None:
        """Run step 1 with retries. Returns (kv_transfer_params, engine), a relayed 4xx, or None if all failed.

        `avoid`: an engine whose KV just failed to reach decode; used only when no other engine can serve.
        """
        assert flow.prompt is not None
        if flow.prefill_bytes is None:
            flow.prefill_bytes = prefill_body(flow.payload, flow.chat)
        tried: set[str] = set()
        candidate = first
        for attempt in range(self.config.policy.max_prefill_attempts):
            if candidate is None:
                pick = self.scheduler.pick_prefill
                if avoid is not None:
                    candidate = pick(flow.prompt, flow.prefix_blocks, decode, excluded={*tried, avoid})
                if candidate is None:
                    candidate = pick(flow.prompt, flow.prefix_blocks, decode, excluded=tried)
                if candidate is None:
                    break
                if attempt:
                    self.metrics.retries.labels("prefill").inc()
            state = candidate
            candidate = None
            tried.add(state.url)
            tokens = flow.uncached
            state.in_flight += 1
            state.in_flight_tokens += tokens
            self.tracker.record(state.url, flow.prompt.block_hashes, monotonic())
            waited = perf_counter()
            try:
                status, data = await self._post_json(state, flow)
            except UpstreamError as failure:
                self._failed(state, "prefill", failure, flow)
                continue
            finally:
                state.in_flight -= 1
                state.in_flight_tokens -= tokens
                flow.upstream_wait += perf_counter() - waited
            if status >= 400:
                # The engine rejected the request itself (bad prompt, unknown model): the client's error.
                flow.outcome = "client_error"
                return web.Response(
                    status=status,
                    body=data,
                    content_type="application/json",
                    headers={"X-Request-Id": flow.rid, "X-Pdserve-Route": flow.route},
                )
            try:
                params = orjson.loads(data).get("kv_transfer_params")
            except (orjson.JSONDecodeError, AttributeError):
                params = None
            if not isinstance(params, dict):
                missing = UpstreamError("protocol", "prefill answer carried no kv_transfer_params")
                self._failed(state, "prefill", missing, flow)
                continue
            state.breaker.record_success()
            return params, state
        return None

    async def _post_json(self, state: EndpointState, flow: _Flow) -> tuple[int, bytes]:
        """POST the prefill body; 5xx and transport errors become UpstreamError."""
        try:
            async with self.session.post(
                state.url + flow.path, data=flow.prefill_bytes, headers=flow.headers
            ) as response:
                data = await response.read()
                status = response.status
        except TimeoutError as exc:
            raise UpstreamError("timeout", f"prefill engine timed out: {exc}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError("connect", f"prefill engine unreachable: {exc}") from None
        if status >= 500:
            raise UpstreamError("status", f"prefill engine answered {status}: {_detail(data)}", status)
        return status, data

    # -- decode ---------------------------------------------------------------------------------------------

    async def _decode(
        self, flow: _Flow, decode: EndpointState, kv: tuple[dict[str, Any], EndpointState] | None
    ) -> web.StreamResponse:
        """Steps 3 and 4: open the decode stream with retries, then relay it."""
        assert flow.prompt is not None
        policy = self.config.policy
        tried: set[str] = set()
        attempts = 0
        reprefilled = False
        last: UpstreamError | None = None
        state: EndpointState | None = decode
        while state is not None:
            body = self._decode_bytes(flow, kv)
            # Nothing may raise between taking the engine's in-flight count and the try that releases it.
            state.in_flight += 1
            self.tracker.record(state.url, flow.prompt.block_hashes, monotonic())
            waited = perf_counter()
            try:
                response, first = await self._open(state, flow, body)
            except BaseException as error:
                if not isinstance(error, UpstreamError):
                    state.in_flight -= 1  # cancelled (client gone) or a bug: release the engine, re-raise
                    raise
                failure = error
                flow.upstream_wait += perf_counter() - waited
                state.in_flight -= 1
                self._failed(state, "decode", failure, flow)
                last = failure
                tried.add(state.url)
                attempts += 1
                peer = kv[1] if kv is not None else None
                state = None
                if attempts < policy.max_decode_attempts:
                    # Same KV on another engine: the prefill engine holds the blocks for its lease.
                    state = self.scheduler.pick_decode(flow.prompt, flow.prefix_blocks, excluded=tried, peer=peer)
                    if state is not None:
                        self.metrics.retries.labels("decode").inc()
                        continue
                if kv is not None and not reprefilled:
                    # The held KV itself may be what fails (prefill gone, lease expired): prefill afresh.
                    reprefilled = True
                    state = self.scheduler.pick_decode(
                        flow.prompt, flow.prefix_blocks, excluded=tried
                    ) or self.scheduler.pick_decode(flow.prompt, flow.prefix_blocks)
                    if state is None:
                        break
                    self.metrics.retries.labels("reprefill").inc()
                    result = await self._prefill(flow, state, None, avoid=peer.url if peer else None)
                    if isinstance(result, web.StreamResponse):
                        return result
                    if result is None:
                        if not policy.fallback_to_decode:
                            break
                        flow.route = Route.FALLBACK.value
                        self.metrics.fallbacks.labels("prefill_failed").inc()
                    kv = result
                continue
            flow.upstream_wait += perf_counter() - waited
            try:
                return await self._relay(flow, state, response, first)
            finally:
                state.in_flight -= 1
                response.close()
        flow.outcome = "upstream_error" if last is not None else "unavailable"
        message = f"no decode engine could serve the request: {last}" if last else "no decode engine is available"
        return self._error(flow, 502 if last is not None else 503, message, self._retry_after)

    def _decode_bytes(self, flow: _Flow, kv: tuple[dict[str, Any], EndpointState] | None) -> bytes:
        if kv is not None:
            return decode_body(flow.payload, kv[0])
        if flow.raw is not None:
            return flow.raw  # nothing to change: forward the client's bytes
        return orjson.dumps(flow.payload)

    async def _open(self, state: EndpointState, flow: _Flow, body: bytes) -> tuple[aiohttp.ClientResponse, bytes]:
        """Send the decode request and read up to the first chunk (or the whole body when not streaming).

        Everything that fails here fails before the client saw a byte, so the caller may retry elsewhere.
        """
        try:
            response = await self.session.post(state.url + flow.path, data=body, headers=flow.headers)
        except TimeoutError as exc:
            raise UpstreamError("timeout", f"decode engine timed out: {exc}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError("connect", f"decode engine unreachable: {exc}") from None
        try:
            status = response.status
            if status >= 500:
                data = await response.read()
                raise UpstreamError("status", f"decode engine answered {status}: {_detail(data)}", status)
            if status >= 400 or not flow.stream:
                return response, await response.read()
            first = await response.content.readany()
            if not first:
                raise UpstreamError("stream", "decode engine closed the stream before the first chunk")
            if first.startswith(b'data: {"error"'):
                raise UpstreamError("stream", f"decode engine streamed an error first: {_detail(first)}")
            return response, first
        except UpstreamError:
            response.close()
            raise
        except TimeoutError as exc:
            response.close()
            raise UpstreamError("timeout", f"decode engine timed out before the first chunk: {exc}") from None
        except aiohttp.ClientError as exc:
            response.close()
            raise UpstreamError("connect", f"decode engine failed before the first chunk: {exc}") from None
        except BaseException:
            response.close()
            raise

    async def _relay(
        self, flow: _Flow, state: EndpointState, upstream: aiohttp.ClientResponse, first: bytes
    ) -> web.StreamResponse:
        """Step 5: pass the decode engine's answer to the client, bytes untouched."""
        state.breaker.record_success()
        metrics = self.metrics
        headers = downstream_headers(upstream.headers, flow.rid, flow.route)
        if not flow.stream or upstream.status >= 400:
            flow.outcome = "success" if upstream.status < 400 else "client_error"
            if upstream.status < 400:
                self._first_byte(flow, perf_counter())
            return web.Response(status=upstream.status, body=first, headers=headers)

        response = web.StreamResponse(status=upstream.status, headers=headers)
        flow.response = response
        await response.prepare(flow.request)
        try:
            await response.write(first)
        except ConnectionResetError:
            flow.outcome = "cancelled"
            return response
        last = perf_counter()
        self._first_byte(flow, last)
        itl = metrics.itl_by_route[flow.route]
        content = upstream.content
        while True:
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                failure = UpstreamError("stream", f"decode engine failed mid-stream: {exc!r}")
                self._failed(state, "decode", failure, flow)
                flow.outcome = "upstream_error"
                await self._end_stream(response, stream_error_event(502, str(failure)))
                return response
            if not chunk:
                break
            now = perf_counter()
            itl.observe(now - last)
            last = now
            try:
                await response.write(chunk)
            except ConnectionResetError:
                flow.outcome = "cancelled"
                return response
        flow.outcome = "success"
        try:
            await response.write_eof()
        except ConnectionResetError:
            flow.outcome = "cancelled"
        return response

    def _first_byte(self, flow: _Flow, now: float) -> None:
        """Record TTFT and the router's own share of it (TTFT minus the time spent waiting on engines)."""
        ttft = now - flow.started
        self.metrics.ttft_by_route[flow.route].observe(ttft)
        self.metrics.overhead.observe(max(0.0, ttft - flow.upstream_wait))

    async def _end_stream(self, response: web.StreamResponse, event: bytes) -> None:
        try:
            await response.write(event)
            await response.write_eof()
        except ConnectionResetError:
            pass

    def _failed(self, state: EndpointState, role: Role, failure: UpstreamError, flow: _Flow) -> None:
        """Count an engine failure and feed its circuit breaker."""
        state.errors += 1
        label = state.endpoint.label
        self.metrics.endpoint_errors.labels(role, label, failure.kind).inc()
        log.warning(
            "Failed %s request endpoint=%s kind=%s request_id=%s error=%s",
            role,
            label,
            failure.kind,
            flow.rid,
            failure,
        )
        if state.breaker.record_failure(monotonic()):
            self.metrics.ejections.labels(role, label).inc()
            log.warning("Ejected %s endpoint=%s after %d failures", role, label, state.breaker.consecutive_failures)
