"""Shared fixtures for the router tests: endpoint-state factories and routers on real loopback sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from pdserve.api.router_config import RouterConfig
from pdserve_runtime.router.breaker import CircuitBreaker
from pdserve_runtime.router.endpoints import Endpoint, EndpointState, Role

StateFactory = Callable[..., EndpointState]


def _state(
    url: str,
    role: Role = "decode",
    *,
    kv: str | None = None,
    topology: dict[str, str] | None = None,
    in_flight: int = 0,
    tokens: int = 0,
    ready: bool = True,
    ejected: bool = False,
) -> EndpointState:
    breaker = CircuitBreaker()
    if ejected:
        breaker.opened_at = 0.0
    return EndpointState(
        endpoint=Endpoint(url=url, role=role, kv_compat=kv, topology=topology or {}, ready=ready),
        breaker=breaker,
        in_flight=in_flight,
        in_flight_tokens=tokens,
    )


@pytest.fixture
def make_state() -> StateFactory:
    """Build an EndpointState in one call: make_state("http://d1", in_flight=3, kv="a")."""
    return _state


@asynccontextmanager
async def running_router(config: RouterConfig, **config_updates: Any) -> AsyncIterator[tuple[str, Any]]:
    """Serve a RouterApp on a free loopback port, as `pdserve router` does."""
    from pdserve_runtime.router.app import RouterApp

    if config_updates:
        config = config.model_copy(update=config_updates)
    router = RouterApp(config, access_log=False)
    try:
        port = await router.start("127.0.0.1", 0, metrics_port=0)
        yield f"http://127.0.0.1:{port}", router
    finally:
        await router.stop()


@pytest.fixture
def router_server() -> Callable[..., Any]:
    """`async with router_server(config) as (url, router_app): ...`"""
    return running_router


#: The connect timeout of test configs unless a test sets its own. The engines here listen on loopback, most in
#: the test's own process and event loop: a connect that takes more than the router's default 2 s is the test
#: process stalled on a loaded machine, not an engine, and failing it over turns the behaviour under test into a
#: fallback (a fresh-clone run: "connecting to the engine took over 2 s" to an in-process engine, route `fallback`
#: where the test asserts `pd`). An engine that refuses a connection still fails at once.
TEST_CONNECT_TIMEOUT_S = 30.0


def static_config(prefill: list[str], decode: list[str], **policy: Any) -> RouterConfig:
    """A static-mode config for tests; `policy` fields and a few top-level ones (by python name) override."""
    policy.setdefault("connect_timeout_seconds", TEST_CONNECT_TIMEOUT_S)
    top = {key: policy.pop(key) for key in list(policy) if key in RouterConfig.model_fields}
    breaker = policy.pop("breaker", None)
    top.setdefault("engine_metrics_interval_seconds", 0.0)
    config = RouterConfig(
        served_model_name="sim-model", discovery="static", static_prefill=prefill, static_decode=decode, **top
    )
    updates: dict[str, Any] = {"policy": config.policy.model_copy(update=policy)}
    if breaker:
        updates["circuit_breaker"] = config.circuit_breaker.model_copy(update=breaker)
    return config.model_copy(update=updates)


@pytest.fixture
def make_config() -> Callable[..., RouterConfig]:
    return static_config
