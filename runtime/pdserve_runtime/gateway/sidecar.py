"""The PD sidecar: the router's PD flow on a decode pod, with the plan made by the gateway's picker.

A gateway sends each request to one pod. For the PD route to work through it, the flow runs beside decode: the
sidecar listens on the pod's target port, and for each request it runs exactly the router's proxy (`Proxy`: the
same parsing, validation, stripping of client `kv_transfer_params`, prefill body splice, check of the prefill
answer's `remote_host`/`remote_port`, decode with the returned params, relay, retries and error shapes). Only the
plan differs (`_plan`): the decode engine is the pod's own, and the prefill engine is the one the picker named in
`x-prefiller-host-port` (no header: decode-only). It must be an `ip:port` (never a name to resolve); the prefill
answer's `remote_host` must be that ip, as the router requires of its own prefill picks.

Failures are the router's: a prefill engine's 4xx is relayed (the request is at fault); a connect error, 5xx,
timeout or bad answer falls back to prefilling on the local decode engine (one prefill attempt, `fallbackToDecode`
on: the picker named one prefill engine and the sidecar has no other to try); the answer then says
`X-Pdserve-Route: fallback`.

Trust: the picker removes any client-supplied `x-prefiller-host-port` at the gateway hop and sets its own; the body's
`kv_transfer_params` is stripped here, as the router strips it. A client that reaches the sidecar's port directly,
around the gateway, can still name a prefill host: keep the port reachable only from the gateway (docs/gateway.md).
"""

from __future__ import annotations

import ipaddress
import logging
from collections import OrderedDict
from typing import Any

from pdserve.api.router_config import RouterConfig
from pdserve_runtime.gateway.protocol import PREFILLER_HEADER
from pdserve_runtime.router.breaker import CircuitBreaker
from pdserve_runtime.router.endpoints import Endpoint, EndpointState
from pdserve_runtime.router.policy.decision import Route
from pdserve_runtime.router.policy.scheduler import Plan
from pdserve_runtime.router.proxy import Proxy, _Flow
from pdserve_runtime.router.tokens import PromptInfo
from pdserve_runtime.transport.server import Request

log = logging.getLogger("pdserve.sidecar")

# Prefill engines remembered (their breaker and load state); the pool is small, the bound only stops abuse.
_MAX_PREFILL_STATES = 256


def parse_host_port(value: str) -> tuple[str, int] | None:
    """(ip, port) of an `ip:port` / `[v6]:port` value, or None when it is anything else (a name, no port, junk)."""
    host, sep, port_text = value.strip().rpartition(":")
    if not sep or not port_text.isdigit():
        return None
    port = int(port_text)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not 0 < port < 65536 or address.is_unspecified or address.is_multicast:
        return None
    return str(address), port


def sidecar_config(config: RouterConfig) -> RouterConfig:
    """The router config as the sidecar runs it: one prefill try (the picker named one engine), then local prefill.

    No admission budgets: the picker has bound the request to its engines already, and the sidecar's table knows
    only its own decode engine, so a queue here could only re-plan wrongly; the router's gate passes every request
    straight through when its budgets are unbounded (`router.gate`)."""
    policy = config.policy.model_copy(update={"max_prefill_attempts": 1, "fallback_to_decode": True})
    admission = config.admission.model_copy(update={"prefill_budget_tokens": 0, "decode_budget_sequences": 0})
    return config.model_copy(update={"policy": policy, "admission": admission})


class SidecarProxy(Proxy):
    """The router's proxy, planning from the picker's header instead of the scheduler."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prefills: OrderedDict[str, EndpointState] = OrderedDict()

    def _plan(self, request: Request, prompt: PromptInfo) -> Plan:
        decode = self._local_decode()
        if decode is None:
            return Plan(Route.DECODE_ONLY, None, None, 0, {})
        named = request.headers.get(PREFILLER_HEADER)
        prefill = self._prefill_state(named) if named else None
        if named and prefill is None:
            log.warning("Ignored a prefill engine that is not an ip:port value=%r", named[:80])
        route = Route.PD if prefill is not None else Route.DECODE_ONLY
        return Plan(route, decode, prefill, 0, {})

    def _pick_prefill(
        self, flow: _Flow, decode: EndpointState, tried: set[str], avoid: str | None
    ) -> EndpointState | None:
        # The picker named one prefill engine (it is the plan's); there is no other here: fall back to local prefill.
        return None

    def _local_decode(self) -> EndpointState | None:
        states = self.table.states("decode")
        return states[0] if states else None

    def _prefill_state(self, value: str) -> EndpointState | None:
        parsed = parse_host_port(value)
        if parsed is None:
            return None
        host, port = parsed
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{port}"
        prefills = self._prefills
        state = prefills.get(url)
        if state is None:
            breaker = self.config.circuit_breaker
            state = EndpointState(
                endpoint=Endpoint(url=url, role="prefill", addresses=frozenset({host}), name=f"{shown}:{port}"),
                breaker=CircuitBreaker(
                    failure_threshold=breaker.failure_threshold,
                    open_seconds=breaker.open_seconds,
                    success_threshold=breaker.success_threshold,
                ),
            )
            prefills[url] = state
            if len(prefills) > _MAX_PREFILL_STATES:
                prefills.popitem(last=False)
        else:
            prefills.move_to_end(url)
        return state
