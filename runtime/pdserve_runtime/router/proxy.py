"""The proxy: every byte of IO between clients and engines for the generation endpoints.

Per request:

1. Parse the body (400), check it (`validate`: 400 before any engine works on it), strip engine-internal fields,
   keep the client's request id for logs and the answer; engines get ids the router makes, one per attempt, so
   two clients' requests can never collide inside an engine.
2. Describe the prompt and plan (`policy.scheduler`): decode engine, route, prefill engine. On the PD route,
   refuse (400) what cannot fit the decode engine's context (`context`), before prefill works on it.
3. PD: prefill with the client's bytes spliced (`messages.prefill_body`), then check the answer's
   `kv_transfer_params` (size, remote host and port) before a decode engine acts on them.
4. Decode: the client's bytes plus those params; wait for the first chunk before answering the client, so that
   every failure up to then can be retried invisibly (`retry`: the pure decisions).
5. Relay: each further chunk goes from the engine connection's callback straight to the client's transport
   (`upstream.Exchange.relay`), SSE events kept whole; a failure after the first byte ends the stream with an
   OpenAI error event (nothing retried: tokens already sent must not repeat).

Deadlines: `firstByteTimeoutSeconds` for a prefill answer and a stream's first chunk, `readTimeoutSeconds` between
stream chunks, `requestTimeoutSeconds` for the whole request (504, no engine charged). Failures charged to an
engine (and its circuit breaker) are only the engine's own: connect errors, 5xx, timeouts, bad answers, broken
streams; a 4xx is the request's fault and is relayed as it is.

Engines are held (`EndpointState.lease`) from the attempt's start to its end, whatever ends it, and the prefix
tracker learns that an engine holds a prompt only when the engine served it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field, replace
from time import monotonic, perf_counter
from typing import Any

import orjson

from pdserve.api.router_config import RouterConfig
from pdserve_runtime.router import context
from pdserve_runtime.router.admission import Shed
from pdserve_runtime.router.endpoints import EndpointState, EndpointTable, Role
from pdserve_runtime.router.errors import error_payload, stream_error_event
from pdserve_runtime.router.gate import Binding, Gate, client_key
from pdserve_runtime.router.messages import (
    Body,
    decode_body,
    engine_kv_params,
    parse_body,
    prefill_body,
    request_id,
    sanitize,
    upstream_headers,
)
from pdserve_runtime.router.metrics import FastHistogram, RouterMetrics
from pdserve_runtime.router.policy.decision import Route
from pdserve_runtime.router.policy.scheduler import Plan, Scheduler
from pdserve_runtime.router.prefix import PrefixTracker
from pdserve_runtime.router.retry import (
    RetryPolicy,
    Step,
    Tries,
    after_decode_failure,
    after_prefill_failure,
    give_up_status,
)
from pdserve_runtime.router.tiers import STORE
from pdserve_runtime.router.tokens import Held, PromptInfo, describe_prompt
from pdserve_runtime.router.validate import problem
from pdserve_runtime.transport.client import PROTOCOL, STATUS, STREAM, EngineClient, Exchange, UpstreamError
from pdserve_runtime.transport.server import Request, Responder

log = logging.getLogger("pdserve.router")

# Request bodies above this size are analysed in steps, with the event loop free between them.
_YIELD_ABOVE = 256 * 1024
# Largest engine error body read (to log it) before an engine failure is retried.
_ERROR_BODY_LIMIT = 64 * 1024
# Engine answer headers passed to the client: what the body is, nothing about the engine.
_PASSED_DOWN = {"content-type": "Content-Type", "content-encoding": "Content-Encoding"}
_EVENT_END = b"\n\n"
_EVENT_END_CRLF = b"\r\n\r\n"
_EVENT_ENDS = (_EVENT_END, _EVENT_END_CRLF)
# Largest /tokenize answer read (it lists every token id) per token of context.
_TOKENIZE_BYTES_PER_TOKEN = 16


def engine_request_id() -> str:
    """A new request id: 96 random bits, so no id says anything about other requests (how many, or whose)."""
    return f"pdr-{os.urandom(12).hex()}"


@dataclass(slots=True)
class _Flow:
    """One generation request as it moves through the proxy."""

    request: Request
    responder: Responder
    chat: bool
    started: float
    rid: str  # the client's id (or one made for it): logs and the answer header
    engine_rid: str  # the base of the ids engines see
    raw: bytes | bytearray = b""  # the body forwarded to engines: the client's bytes, or their re-encoding
    payload: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    prompt: PromptInfo | None = None
    headers: bytes = b""
    held: dict[str, Held] = field(default_factory=dict)
    uncached: int = 0
    route: str = "none"
    outcome: str = "client_error"
    attempt: int = 0
    tries: Tries = field(default_factory=Tries)
    # Seconds spent waiting on engines before the first byte (successful and failed tries alike).
    upstream_wait: float = 0.0
    relayed: bool = False  # the client has seen bytes of the answer
    binding: Binding | None = None  # the engines the admission gate gave it, and the room it still holds

    def lease_began(self, state: EndpointState) -> None:
        """The request's lease on `state` began: the room the gate reserved there becomes the lease."""
        if self.binding is not None:
            self.binding.started(state)

    def engine_headers(self) -> bytes:
        self.attempt += 1
        return self.headers + b"x-request-id: %s-%d\r\n" % (self.engine_rid.encode(), self.attempt)

    def answer_headers(self) -> list[tuple[str, str]]:
        return [("X-Request-Id", self.rid), ("X-Pdserve-Route", self.route)]


class _Relay:
    """Receives an engine's answer chunk by chunk (from the connection callback) and writes it to the client.

    For a stream, only whole SSE events are written: a chunk that ends inside an event keeps that tail until the
    rest arrives, so an error event after a broken stream never lands in the middle of one. Bytes are otherwise
    untouched.
    """

    __slots__ = ("events", "itl", "last", "pending", "responder", "written")

    def __init__(self, responder: Responder, itl: FastHistogram, events: bool, now: float) -> None:
        self.responder = responder
        self.itl = itl
        self.events = events
        self.last = now
        self.pending = b""
        self.written = 0

    def __call__(self, data: bytes) -> None:
        now = perf_counter()
        self.itl.observe(now - self.last)
        self.last = now
        self.write(data)

    def write(self, data: bytes) -> None:
        if self.events:
            if self.pending:
                data = self.pending + data
                self.pending = b""
            if not data.endswith(_EVENT_ENDS):
                lf, crlf = data.rfind(_EVENT_END), data.rfind(_EVENT_END_CRLF)
                end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
                self.pending = data[end:]
                data = data[:end]
        if data:
            self.written += len(data)
            self.responder.write(data)

    def flush(self) -> None:
        """The answer ended: whatever is left goes out (an engine may end without a final blank line)."""
        if self.pending:
            self.written += len(self.pending)
            self.responder.write(self.pending)
            self.pending = b""


class Proxy:
    """Handlers of the generation endpoints, sharing one engine client."""

    def __init__(
        self,
        config: RouterConfig,
        scheduler: Scheduler,
        tracker: PrefixTracker,
        metrics: RouterMetrics,
        client: EngineClient,
        *,
        gate: Gate,
    ) -> None:
        self.config = config
        self.gate = gate
        self.scheduler = scheduler
        self.table: EndpointTable = scheduler.table
        self.tracker = tracker
        self.metrics = metrics
        self.client = client
        policy = config.policy
        self.retry_policy = RetryPolicy(
            policy.max_prefill_attempts, policy.max_decode_attempts, policy.fallback_to_decode, policy.kv_store
        )
        self._retry_after = (("Retry-After", str(config.retry_after_seconds)),)
        self._kv_ports = frozenset(config.kv_side_channel_ports)

    # -- handlers -------------------------------------------------------------------------------------------

    async def completions(self, request: Request, responder: Responder) -> None:
        await self._generate(request, responder, chat=False)

    async def chat_completions(self, request: Request, responder: Responder) -> None:
        await self._generate(request, responder, chat=True)

    async def _generate(self, request: Request, responder: Responder, chat: bool) -> None:
        engine_rid = engine_request_id()
        flow = _Flow(
            request=request,
            responder=responder,
            chat=chat,
            started=perf_counter(),
            rid=request_id(request.headers.get("x-request-id"), lambda: engine_rid),
            engine_rid=engine_rid,
        )
        try:
            async with asyncio.timeout(self.config.request_timeout_seconds):
                await self._serve(flow)
        except TimeoutError:
            flow.outcome = "timeout"
            message = f"the request exceeded the router's {self.config.request_timeout_seconds:g} s deadline"
            log.warning("Timed out request request_id=%s route=%s", flow.rid, flow.route)
            if responder.started:
                responder.end(stream_error_event(504, message) if flow.stream else b"")
            else:
                self._error(flow, 504, message)
        except asyncio.CancelledError:
            flow.outcome = "cancelled"
            raise
        finally:
            if flow.binding is not None:
                flow.binding.release()
            self.metrics.count_request(flow.route, flow.outcome)
            self.metrics.e2e_by_route[flow.route].observe(perf_counter() - flow.started)

    def _error(
        self,
        flow: _Flow,
        status: int,
        message: str,
        headers: tuple[tuple[str, str], ...] = (),
        param: str | None = None,
    ) -> None:
        body = orjson.dumps(error_payload(status, message, param=param))
        flow.responder.send(status, body, [*flow.answer_headers(), *headers])

    async def _serve(self, flow: _Flow) -> None:
        raw = flow.request.body
        # A body of megabytes costs tens of milliseconds in each C step below (parse, encode): let the event loop
        # serve everyone else between the steps, so no one step's stall adds up with the next.
        big = len(raw) > _YIELD_ABOVE
        try:
            payload = parse_body(raw)
        except ValueError as exc:
            self._error(flow, 400, str(exc))
            return
        if big:
            await asyncio.sleep(0)
        found = problem(payload, flow.chat)
        if found is not None:
            self._error(flow, 400, found[0], param=found[1])
            return
        if sanitize(payload):
            log.info("Stripped engine-internal fields from a client request request_id=%s", flow.rid)
            raw = orjson.dumps(payload)
        flow.raw = raw
        flow.payload = payload
        flow.stream = payload.get("stream") is True
        flow.headers = upstream_headers(flow.request.headers)

        decided = perf_counter()
        prompt = describe_prompt(payload, flow.chat, self.config.policy.block_size_tokens)
        flow.prompt = prompt
        if big:
            deciding = perf_counter() - decided
            await asyncio.sleep(0)
            decided = perf_counter() - deciding
        plan = self._plan(flow.request, prompt)
        self.metrics.decision.observe(perf_counter() - decided)
        flow.held = dict(plan.held)
        flow.uncached = plan.uncached_tokens

        if plan.decode is None:
            flow.outcome = "unavailable"
            self._error(flow, 503, "no decode engine is available", self._retry_after)
            return
        flow.route = plan.route.value
        kv: tuple[dict[str, Any], EndpointState] | None = None
        if plan.route is not Route.DECODE_ONLY and not await self._fits_context(flow, plan.decode, plan.prefill):
            return
        # Late binding: wait for engines with room (at once when they have it), or be told why not.
        client = client_key(flow.request.headers, flow.request.client, self.config.admission.client_header)
        admitted = await self.gate.admit(plan, prompt, client)
        if isinstance(admitted, Shed):
            flow.outcome = "shed"
            self._error(flow, admitted.status, admitted.message, (("Retry-After", str(admitted.retry_after)),))
            return
        flow.binding = admitted
        route, decode = admitted.route, admitted.decode
        flow.route = route.value
        if route is not Route.DECODE_ONLY:
            outcome = await self._prefill(flow, decode, admitted.prefill)
            if outcome is None:
                return  # answered (a relayed 4xx, or refused)
            if isinstance(outcome, str):
                flow.route = Route.FALLBACK.value
            else:
                kv = outcome
        await self._decode(flow, decode, kv)

    def _plan(self, request: Request, prompt: PromptInfo) -> Plan:
        """The routing decision (the PD sidecar overrides this: the gateway's picker has made it)."""
        return self.scheduler.plan(prompt, monotonic())

    # -- the context length ---------------------------------------------------------------------------------

    async def _fits_context(self, flow: _Flow, decode: EndpointState, prefill: EndpointState | None) -> bool:
        """False (and the client answered 400) when prompt plus output budget cannot fit the decode engine's
        context. Only the PD route needs it: on decode-only the engine refuses before it works."""
        limit = decode.max_model_len
        if limit is None:
            return True  # not known (yet): the engines check, as they always do
        need = context.budget(flow.payload, flow.chat, len(flow.raw))
        found = context.verdict(need, limit)
        counted = need.exact
        if found is context.Verdict.ASK:
            assert need.tokenize is not None
            counted = await self._count_tokens(flow, prefill or decode, need.tokenize, limit)
            found = context.Verdict.FITS if counted is None else context.counted_verdict(need, limit, counted)
        if found is not context.Verdict.REFUSE:
            return True
        flow.outcome = "client_error"
        self._error(flow, 400, context.refusal(need, limit, counted), param=need.param)
        return False

    async def _count_tokens(self, flow: _Flow, state: EndpointState, body: dict[str, Any], limit: int) -> int | None:
        """The prompt's tokens as the engine counts them (its /tokenize), or None when it cannot tell."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.config.first_byte_timeout_seconds, 10.0)
        waited = perf_counter()
        exchange: Exchange | None = None
        try:
            exchange = await self.client.send(state.url, "POST", "/tokenize", flow.headers, [orjson.dumps(body)])
            data = await exchange.read_all(_TOKENIZE_BYTES_PER_TOKEN * limit + 65536, deadline)
            answer = orjson.loads(data) if exchange.status == 200 else None
        except (UpstreamError, orjson.JSONDecodeError) as exc:
            log.info("Failed counting prompt tokens endpoint=%s request_id=%s error=%s", state.endpoint.label,
                     flow.rid, exc)  # fmt: skip
            return None
        finally:
            if exchange is not None:
                exchange.close()
            flow.upstream_wait += perf_counter() - waited
        count = answer.get("count") if isinstance(answer, dict) else None
        return count if isinstance(count, int) and not isinstance(count, bool) else None

    # -- prefill --------------------------------------------------------------------------------------------

    async def _prefill(
        self, flow: _Flow, decode: EndpointState, first: EndpointState | None, avoid: str | None = None
    ) -> tuple[dict[str, Any], EndpointState] | str | None:
        """Prefill with retries: (kv_transfer_params, engine), "fallback" (decode-only), or None when the request
        was answered here (a relayed 4xx, or a 503 refusal).

        `avoid`: an engine whose KV just failed to reach decode; used only when no other engine can serve.
        """
        prompt = flow.prompt
        assert prompt is not None
        body = prefill_body(flow.raw, flow.payload, flow.chat)
        tried: set[str] = set()
        candidate = first
        while True:
            if candidate is None:
                candidate = self._pick_prefill(flow, decode, tried, avoid)
            if candidate is None:
                step = after_prefill_failure(flow.tries, self.retry_policy, another_prefill=False)
            else:
                state = candidate
                tried.add(state.url)
                result = await self._prefill_once(flow, state, body)
                if isinstance(result, UpstreamError):
                    flow.tries = flow.tries.prefill_failed()
                    self._failed(state, "prefill", result, flow)
                    candidate = self._pick_prefill(flow, decode, tried, avoid)
                    step = after_prefill_failure(flow.tries, self.retry_policy, another_prefill=candidate is not None)
                    if step is Step.PREFILL_ELSEWHERE:
                        self.metrics.retries.labels("prefill").inc()
                        continue
                elif result is None:
                    return None
                else:
                    flow.tries = flow.tries.prefill_succeeded()
                    return result, state
            if step is Step.FALLBACK:
                reason = "prefill_failed" if tried else "no_prefill"
                self.metrics.fallbacks.labels(reason).inc()
                return "fallback"
            flow.outcome = "unavailable"
            message = "no prefill engine could serve the request" if tried else "no prefill engine is available"
            self._error(flow, 503, message, self._retry_after)
            return None

    def _pick_prefill(
        self, flow: _Flow, decode: EndpointState, tried: set[str], avoid: str | None
    ) -> EndpointState | None:
        assert flow.prompt is not None
        pick = self.scheduler.pick_prefill
        candidate = pick(flow.prompt, flow.held, decode, excluded={*tried, avoid}) if avoid else None
        return candidate or pick(flow.prompt, flow.held, decode, excluded=tried)

    async def _prefill_once(
        self, flow: _Flow, state: EndpointState, body: Body
    ) -> dict[str, Any] | UpstreamError | None:
        """One prefill attempt: the checked kv_transfer_params, the engine's failure, or None when a 4xx was
        relayed to the client."""
        assert flow.prompt is not None
        config = self.config
        waited = perf_counter()
        exchange: Exchange | None = None
        try:
            with state.lease(flow.uncached):
                flow.lease_began(state)
                deadline = asyncio.get_running_loop().time() + config.first_byte_timeout_seconds
                exchange = await self.client.send(state.url, "POST", flow.request.path, flow.engine_headers(), body)
                data = await exchange.read_all(config.max_prefill_answer_bytes, deadline)
                status = exchange.status
                if status >= 500:
                    detail = data[:300].decode("utf-8", "replace")
                    return UpstreamError(STATUS, f"prefill engine answered {status}: {detail}", status)
                passed = _passed_down(exchange.headers)
        except UpstreamError as failure:
            return failure
        finally:
            if exchange is not None:
                exchange.close()
            flow.upstream_wait += perf_counter() - waited
            self.gate.dispatch()  # the engine has room again: a waiting request may take it
        if status >= 400:
            # The engine refused the request itself (a prompt too long, an unknown model): the client's error.
            flow.outcome = "client_error"
            flow.responder.send(status, data, [*passed, *flow.answer_headers()])
            return None
        checked = engine_kv_params(data, state.endpoint.kv_hosts, self._kv_ports)
        if isinstance(checked, str):
            return UpstreamError(PROTOCOL, checked)
        state.breaker.record_success()
        now = monotonic()
        self.tracker.record(state.url, flow.prompt.key, now)
        if self.config.policy.kv_store:
            # Prefill answers only once the prompt is in the store (vLLM saves before it finishes the request).
            self.tracker.record(STORE, flow.prompt.key, now)
        self.gate.observe_prefill(flow.uncached, perf_counter() - waited)
        return checked

    # -- decode ---------------------------------------------------------------------------------------------

    async def _decode(
        self, flow: _Flow, decode: EndpointState, kv: tuple[dict[str, Any], EndpointState] | None
    ) -> None:
        """Open the decode answer with retries (`retry.after_decode_failure`), then relay it."""
        prompt = flow.prompt
        assert prompt is not None
        tried: set[str] = set()
        state = decode
        while True:
            body: Body = decode_body(flow.raw, flow.payload, kv[0]) if kv is not None else [flow.raw]
            tried.add(state.url)
            failure = await self._decode_once(flow, state, body)
            if failure is None:
                return
            flow.tries = flow.tries.decode_failed(failure.kind, answered=failure.status is not None)
            self._failed(state, "decode", failure, flow)
            peer = kv[1] if kv is not None else None
            elsewhere = self.scheduler.pick_decode(prompt, flow.held, excluded=tried, peer=peer)
            step = after_decode_failure(
                flow.tries, self.retry_policy, another_decode=elsewhere is not None, same_usable=state.usable
            )
            if step is Step.DECODE_FROM_STORE:
                # Prefill wrote the prompt to the store before it answered: a decode engine given the plain request
                # loads it from there. Another engine if there is one (kv-compat with the prefill's, whose layout the
                # store's blocks have), else this one when it still serves (it may be the pull that failed).
                flow.tries = replace(flow.tries, from_store=True)
                target = elsewhere or (state if state.usable else None)
                if target is not None:
                    self.metrics.retries.labels("store").inc()
                    kv, state = None, target
                    continue
                step = Step.REPREFILL if not flow.tries.reprefilled else Step.GIVE_UP
            if step is Step.DECODE_ELSEWHERE and elsewhere is not None:
                self.metrics.retries.labels("decode").inc()
                state = elsewhere
                continue
            if step is Step.DECODE_SAME:
                self.metrics.retries.labels("decode").inc()
                continue
            if step is Step.REPREFILL:
                # The KV itself may be what fails (prefill gone, lease expired, pull refused): prefill afresh,
                # elsewhere if possible, and decode on an engine not tried yet if there is one.
                flow.tries = replace(flow.tries, prefill=0, have_kv=False, reprefilled=True)
                fresh = self.scheduler.pick_decode(prompt, flow.held, excluded=tried)
                again = fresh or (state if state.usable else None) or self.scheduler.pick_decode(prompt, flow.held)
                if again is None:
                    break
                state = again
                self.metrics.retries.labels("reprefill").inc()
                outcome = await self._prefill(flow, state, None, avoid=peer.url if peer else None)
                if outcome is None:
                    return
                if isinstance(outcome, str):
                    flow.route = Route.FALLBACK.value
                    kv = None
                else:
                    kv = outcome
                continue
            break
        status = give_up_status(flow.tries)
        flow.outcome = "unavailable" if status == 503 else "upstream_error"
        self._error(
            flow,
            status,
            f"no decode engine could serve the request (request id {flow.rid})",
            self._retry_after if status == 503 else (),
        )

    async def _decode_once(self, flow: _Flow, state: EndpointState, body: Body) -> UpstreamError | None:
        """One decode attempt, relayed to the client when it gets as far as a first chunk; the failure otherwise."""
        assert flow.prompt is not None
        config = self.config
        loop = asyncio.get_running_loop()
        exchange: Exchange | None = None
        waited = perf_counter()
        try:
            with state.lease():
                flow.lease_began(state)
                try:
                    # A stream's first chunk must come in time; a whole answer only within the request deadline.
                    deadline = loop.time() + config.first_byte_timeout_seconds if flow.stream else None
                    exchange = await self.client.send(state.url, "POST", flow.request.path, flow.engine_headers(), body)
                    first = await exchange.first_chunk(deadline)
                    status = exchange.status
                    if status >= 500:
                        detail = await _error_detail(exchange, first, deadline)
                        raise UpstreamError(STATUS, f"decode engine answered {status}: {detail}", status)
                    if flow.stream and status < 400 and first.startswith(b'data: {"error"'):
                        raise UpstreamError(STREAM, f"decode engine streamed an error first: {first[:200]!r}", status)
                except UpstreamError as failure:
                    return failure
                finally:
                    flow.upstream_wait += perf_counter() - waited
                self.gate.observe_first_chunk(perf_counter() - waited)
                await self._relay(flow, state, exchange, status, first)
                return None
        finally:
            if exchange is not None:
                exchange.close()
            self.gate.dispatch()  # the engine has room again: a waiting request may take it

    async def _relay(self, flow: _Flow, state: EndpointState, exchange: Exchange, status: int, first: bytes) -> None:
        """Pass the decode engine's answer to the client: the first chunk now, the rest as it comes."""
        assert flow.prompt is not None
        responder = flow.responder
        ok = status < 400
        if ok:
            state.breaker.record_success()
            self.tracker.record(state.url, flow.prompt.key, monotonic())
        responder.start(status, [*_passed_down(exchange.headers), *flow.answer_headers()])
        now = perf_counter()
        relay = _Relay(responder, self.metrics.itl_by_route[flow.route], flow.stream and ok, now)
        relay.write(first)
        if ok:
            self._first_byte(flow, now)
        responder.flow_control(exchange.pause_reading, exchange.resume_reading)
        try:
            await exchange.relay(relay, self.config.read_timeout_seconds if flow.stream else None)
        except UpstreamError as failure:
            self._failed(state, "decode", UpstreamError(failure.kind, f"decode engine failed mid-stream: {failure}"),
                         flow)  # fmt: skip
            flow.outcome = "upstream_error"
            if flow.stream:
                responder.end(stream_error_event(502, "decode engine failed mid-stream"))
            else:
                responder.end()  # cannot be made whole: the client sees a short body and the cut connection
            return
        finally:
            responder.flow_control(None, None)
        relay.flush()
        flow.outcome = "success" if ok else "client_error"
        responder.end()

    def _first_byte(self, flow: _Flow, now: float) -> None:
        """Record TTFT and the router's own share of it (TTFT minus the time spent waiting on engines)."""
        ttft = now - flow.started
        self.metrics.ttft_by_route[flow.route].observe(ttft)
        self.metrics.overhead.observe(max(0.0, ttft - flow.upstream_wait))

    def _failed(self, state: EndpointState, role: Role, failure: UpstreamError, flow: _Flow) -> None:
        """Count an engine failure and feed its circuit breaker."""
        state.errors += 1
        label = state.endpoint.label
        self.metrics.endpoint_errors.labels(role, label, failure.kind).inc()
        log.warning("Failed %s request endpoint=%s kind=%s request_id=%s error=%s", role, label, failure.kind,
                    flow.rid, failure)  # fmt: skip
        if self.table.record_failure(state, monotonic()):
            self.metrics.ejections.labels(role, label).inc()
            log.warning("Ejected %s endpoint=%s after %d failures", role, label, state.breaker.consecutive_failures)


def _passed_down(headers: dict[str, str]) -> list[tuple[str, str]]:
    return [(canonical, headers[name]) for name, canonical in _PASSED_DOWN.items() if name in headers]


async def _error_detail(exchange: Exchange, first: bytes, deadline: float | None) -> str:
    """The start of an engine's error body, for the log (never for the client)."""
    try:
        data = first + await exchange.read_all(_ERROR_BODY_LIMIT, deadline)
    except UpstreamError:
        data = first
    return data[:300].decode("utf-8", "replace")
