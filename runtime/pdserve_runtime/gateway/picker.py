"""pdserve's endpoint picker: the router's scheduler behind Envoy's ext_proc, one gRPC stream per request.

The scheduling is the router's own (`policy.scheduler.Scheduler` over the same endpoint table, prefix tracker and
discovery): the same filters, scorers, kv-compat pairing and selective PD decide, only the IO differs. Where the
router sends the request itself, the picker tells the gateway where to send it:

    request headers  -> kept until the body is complete (a GET without a body is picked at once)
    request body     -> buffered (bounded by maxRequestBodyBytes); at its end: parse, plan, then answer the
                        headers with the pick (decode pod's sidecar address, plus `x-prefiller-host-port` when the
                        plan is PD) and send the body back unchanged (full-duplex streaming: the picker owns it)
    response headers -> the served endpoint read back (a gateway that fell back to a later list entry moves the
                        load count there); 5xx from the decode pod feeds its circuit breaker; on 200 the prefix
                        tracker learns that decode (and, on the PD route, prefill) now hold the prompt
    response body    -> echoed chunk by chunk

Load accounting mirrors the router's: the decode engine is leased from the pick to the end of the stream (the
gateway closes it when the response ends or the client leaves), the prefill engine from the pick to the response
headers (the sidecar answers only after decode's first token, so prefill is over by then). Whatever ends the
stream, including a cancelled RPC, releases them (`contextlib.ExitStack` in `finally`).

Refusals, in the OpenAI error shape: 400 for a body that is not JSON, 413 above the body limit, 503 with
Retry-After when no decode engine is usable (or PD is required and no prefill engine can take it), 429 when every
usable decode engine is at `maxInFlightPerDecode`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from time import monotonic, perf_counter
from typing import Any
from urllib.parse import urlsplit

import grpc
from prometheus_client import Counter

from pdserve.api.router_config import PickerConfig, RouterConfig
from pdserve_runtime.gateway import protocol
from pdserve_runtime.gateway.proto import ext_proc_pb2 as pb
from pdserve_runtime.router.endpoints import EndpointState, EndpointTable
from pdserve_runtime.router.messages import parse_body
from pdserve_runtime.router.metrics import RouterMetrics
from pdserve_runtime.router.policy.decision import Route
from pdserve_runtime.router.policy.scheduler import Plan, Scheduler
from pdserve_runtime.router.prefix import PrefixTracker
from pdserve_runtime.router.tokens import PromptInfo, describe_prompt

log = logging.getLogger("pdserve.picker")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
_GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}


def host_port(url: str, port: int | None = None) -> str:
    """`ip:port` of an engine URL (IPv6 in brackets), with the port replaced when `port` is given."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port if port is not None else parts.port}"


@dataclass(frozen=True, slots=True)
class Pick:
    """Where one request goes: the gateway's destinations (first is the pick) and the PD prefill engine."""

    plan: Plan
    decode: EndpointState
    destinations: tuple[str, ...]
    fallbacks: tuple[EndpointState, ...]
    prefill: EndpointState | None


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    message: str
    headers: tuple[tuple[str, str], ...] = ()


class PickerMetrics:
    """The picker's own counters, in the router's registry (the router's histograms and table gauges apply too)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.picks = Counter(
            "pdserve_picker_picks", "Requests the picker answered, by route or refusal.", ["route"],
            registry=metrics.registry,
        )  # fmt: skip
        self.served = Counter(
            "pdserve_picker_served",
            "Responses by the endpoint the gateway reports having served them from: the pick, a fallback endpoint of "
            "the list, or unreported (a gateway that sends neither the envoy.lb metadata nor upstream.address).",
            ["endpoint"],
            registry=metrics.registry,
        )
        self.served_by = {label: self.served.labels(label) for label in ("pick", "fallback", "unreported")}
        self.upstream_errors = Counter(
            "pdserve_picker_upstream_errors", "Responses of 5xx from a picked decode pod.", registry=metrics.registry
        )


class EndpointPicker:
    """Plans requests for a gateway (the ext_proc servicer)."""

    def __init__(
        self,
        config: RouterConfig,
        settings: PickerConfig,
        scheduler: Scheduler,
        tracker: PrefixTracker,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.settings = settings
        self.scheduler = scheduler
        self.table: EndpointTable = scheduler.table
        self.tracker = tracker
        self.metrics = metrics
        self.picker_metrics = PickerMetrics(metrics)
        self._retry_after = (("retry-after", str(config.retry_after_seconds)),)

    # -- choosing -------------------------------------------------------------------------------------------

    def destination(self, state: EndpointState) -> str:
        """Where the gateway sends a request for this decode engine: its pod's sidecar (or the engine itself)."""
        return host_port(state.url, self.settings.target_port)

    def choose(self, prompt: PromptInfo, subset: frozenset[str] | None) -> Pick | Refusal:
        """The scheduler's plan as a gateway pick, or the refusal the protocol asks for."""
        candidates: list[EndpointState] | None = None
        if subset is not None:
            candidates = [state for state in self.table.states("decode") if self.destination(state) in subset]
        usable = [state for state in (candidates if candidates is not None else self.table.usable("decode"))
                  if state.usable]  # fmt: skip
        if not usable:
            return Refusal(503, "no decode engine is available", self._retry_after)
        cap = self.settings.max_in_flight_per_decode
        if cap and all(state.in_flight >= cap for state in usable):
            return Refusal(429, "every decode engine is at its in-flight limit; retry later", self._retry_after)
        started = perf_counter()
        plan = self.scheduler.plan(prompt, monotonic(), candidates)
        decode = plan.decode
        if decode is None:
            return Refusal(503, "no decode engine is available", self._retry_after)
        if plan.route is Route.FALLBACK and not self.config.policy.fallback_to_decode:
            return Refusal(503, "no prefill engine is available", self._retry_after)
        fallbacks: list[EndpointState] = []
        excluded = {decode.url}
        for _ in range(self.settings.fallback_endpoints):
            extra = self.scheduler.pick_decode(prompt, plan.held, excluded=excluded, candidates=candidates)
            if extra is None:
                break
            fallbacks.append(extra)
            excluded.add(extra.url)
        self.metrics.decision.observe(perf_counter() - started)
        destinations = tuple(self.destination(state) for state in (decode, *fallbacks))
        prefill = plan.prefill if plan.route is Route.PD else None
        return Pick(plan, decode, destinations, tuple(fallbacks), prefill)

    # -- the ext_proc stream --------------------------------------------------------------------------------

    async def process(
        self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """One request's ext_proc stream (`ExternalProcessor.Process`)."""
        stream = PickerStream(self)
        try:
            async for message in requests:
                for answer in stream.handle(message):
                    yield answer
        finally:
            stream.close()


@dataclass(slots=True)
class PickerStream:
    """The state of one ext_proc stream: what was received, what was picked, what is held.

    Transport-free: `handle` takes one message and returns its answers, for the gRPC servicer and the relay's
    link (`link.py`) alike."""

    picker: EndpointPicker
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    subset: frozenset[str] | None = None
    pick: Pick | None = None
    prompt: PromptInfo | None = None
    decode: EndpointState | None = None
    leases: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    prefill_lease: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    refused: bool = False
    outcome: str = "cancelled"
    # How the gateway sends bodies (its first message says; absent: full duplex, what GIE gateways configure).
    request_duplex: bool = True
    response_duplex: bool = True
    request_chunks: int = 0

    def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self.request_duplex = config.request_body_mode == pb.FULL_DUPLEX_STREAMED
            self.response_duplex = config.response_body_mode == pb.FULL_DUPLEX_STREAMED
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self.headers = protocol.headers_of(message.request_headers)
            subset = protocol.endpoint_subset(message)
            self.subset = subset
            if message.request_headers.end_of_stream:
                return [self._decide(b"")]
            return []
        if kind == "request_body":
            chunk = message.request_body
            if self.refused:
                return []
            self.body += chunk.body
            self.request_chunks += 1
            if len(self.body) > self.picker.config.max_request_body_bytes:
                return [self.too_large()]
            if not chunk.end_of_stream:
                return []
            return self._body_complete(end_of_stream=True)
        if kind == "request_trailers":
            trailers = protocol.continue_trailers("request_trailers")
            if self.pick is not None or self.refused:
                return [trailers]
            # No body chunk carried end_of_stream: the trailers end the request, so its body is complete now.
            return [*self._body_complete(end_of_stream=False), trailers]
        if kind == "response_headers":
            self._served(message, protocol.headers_of(message.response_headers))
            return [protocol.continue_headers("response_headers")]
        if kind == "response_body":
            chunk = message.response_body
            if chunk.end_of_stream:
                self.close()
            if self.response_duplex:
                return [protocol.response_body_response(chunk.body, chunk.end_of_stream)]
            return [protocol.continue_body("response_body")]
        if kind == "response_trailers":
            self.close()
            return [protocol.continue_trailers("response_trailers")]
        return []

    def _body_complete(self, *, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        """The pick and the body's answers once the whole body is in. `end_of_stream` is false when trailers end
        the request: the body sent back must leave the stream open for their answer."""
        answer = self._decide(bytes(self.body))
        if answer.WhichOneof("response") == "immediate_response":
            return [answer]
        if self.request_duplex:
            if not self.request_chunks and not end_of_stream:
                return [answer]  # headers, then trailers: there is no body to send back
            return [answer, protocol.request_body_response(bytes(self.body), end_of_stream)]
        # The gateway kept the body: one "continue" per chunk it sent, after the headers' answer.
        return [answer, *(protocol.continue_body("request_body") for _ in range(self.request_chunks))]

    def too_large(self) -> pb.ProcessingResponse:
        """The 413 for a body over the limit (from here, or from a link frame too long to read)."""
        self.refused = True
        limit = self.picker.config.max_request_body_bytes
        return self._refuse(Refusal(413, f"the request body exceeds {limit} bytes"))

    def _decide(self, raw: bytes) -> pb.ProcessingResponse:
        picker = self.picker
        chat = _GENERATION_PATHS.get(self.headers.get(":path", "").split("?", 1)[0])
        payload: dict[str, Any] = {}
        if chat is not None and raw:
            try:
                payload = parse_body(raw)
            except ValueError as exc:
                self.refused = True
                return self._refuse(Refusal(400, str(exc)))
        prompt = describe_prompt(payload, bool(chat), picker.config.policy.block_size_tokens)
        choice = picker.choose(prompt, self.subset)
        if isinstance(choice, Refusal):
            self.refused = True
            return self._refuse(choice)
        self.pick, self.prompt, self.decode = choice, prompt, choice.decode
        self.leases.enter_context(choice.decode.lease())
        prefill = None
        if choice.prefill is not None:
            self.prefill_lease.enter_context(choice.prefill.lease(choice.plan.uncached_tokens))
            prefill = host_port(choice.prefill.url)
        picker.picker_metrics.picks.labels(choice.plan.route.value).inc()
        return protocol.pick_response(choice.destinations, prefill)

    def _refuse(self, refusal: Refusal) -> pb.ProcessingResponse:
        self.outcome = "refused"
        self.picker.picker_metrics.picks.labels(str(refusal.status)).inc()
        return protocol.immediate(refusal.status, refusal.message, refusal.headers)

    def _served(self, message: pb.ProcessingRequest, headers: dict[str, str]) -> None:
        """The response began: learn who served it and how it went."""
        self.prefill_lease.close()
        pick, prompt = self.pick, self.prompt
        if pick is None or prompt is None or self.decode is None:
            return
        picker = self.picker
        served = protocol.served_endpoint(message)
        if served is None:
            picker.picker_metrics.served_by["unreported"].inc()
        elif served == pick.destinations[0]:
            picker.picker_metrics.served_by["pick"].inc()
        else:
            for index, state in enumerate(pick.fallbacks, start=1):
                if served == pick.destinations[index]:
                    # The gateway fell back down the list: count the load where it went.
                    self.leases.close()
                    self.leases.enter_context(state.lease())
                    self.decode = state
                    picker.picker_metrics.served_by["fallback"].inc()
                    break
        status = int(headers.get(":status", "0") or 0)
        now = monotonic()
        if status >= 500:
            self.outcome = "upstream_error"
            picker.picker_metrics.upstream_errors.inc()
            if picker.table.record_failure(self.decode, now):
                label = self.decode.endpoint.label
                picker.metrics.ejections.labels("decode", label).inc()
                log.warning("Ejected decode endpoint=%s after %d failures", label,
                            self.decode.breaker.consecutive_failures)  # fmt: skip
            return
        if status == 200:
            self.outcome = "success"
            self.decode.breaker.record_success()
            picker.tracker.record(self.decode.url, prompt.key, now)
            route = headers.get(protocol.ROUTE_HEADER)
            if pick.prefill is not None and route == Route.PD.value:
                picker.tracker.record(pick.prefill.url, prompt.key, now)
        else:
            self.outcome = "client_error"

    def close(self) -> None:
        """Release whatever the stream still holds (idempotent)."""
        self.prefill_lease.close()
        self.leases.close()
