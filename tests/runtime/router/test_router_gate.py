"""The admission gate on the live endpoint table (no sockets): what one dispatch pass binds, and when passes run."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from prometheus_client import CollectorRegistry

from pdserve.api.router_config import AdmissionConfig, RoutingPolicyConfig
from pdserve_runtime.router.admission import Shed
from pdserve_runtime.router.endpoints import Endpoint, EndpointTable
from pdserve_runtime.router.gate import Binding, Gate, client_key
from pdserve_runtime.router.policy.decision import Route
from pdserve_runtime.router.policy.scheduler import Scheduler
from pdserve_runtime.router.prefix import PrefixTracker
from pdserve_runtime.router.tokens import PromptInfo, describe_prompt

pytestmark = pytest.mark.timeout(30)

_UNIQUE = itertools.count(1)


def prompt(tokens: int) -> PromptInfo:
    return describe_prompt({"prompt": [next(_UNIQUE), *range(tokens - 1)]}, chat=False, block_size=16)


def router(**admission: object) -> tuple[EndpointTable, Scheduler, Gate]:
    table = EndpointTable()
    policy = RoutingPolicyConfig(disaggregation_threshold_tokens=0)
    scheduler = Scheduler(table, PrefixTracker(max_blocks=1000, ttl_seconds=60, block_size=16), policy)
    gate = Gate(
        AdmissionConfig.model_validate(admission),
        table,
        scheduler,
        CollectorRegistry(),
        fallback_to_decode=True,
        retry_after_s=1,
    )
    table.replace("decode", [Endpoint("http://d", "decode")])
    return table, scheduler, gate


async def queued(gate: Gate, count: int) -> None:
    """Let the admitting tasks run until `count` wait (each needs one turn of the loop to queue)."""
    for _ in range(100):
        if len(gate.queue) == count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(gate.queue)} waiting, expected {count}")


async def test_an_engine_that_joins_takes_waiting_requests_in_the_pass_its_arrival_runs() -> None:
    table, scheduler, gate = router(prefill_budget_tokens=4000)
    slow = Endpoint("http://p-slow", "prefill")
    table.replace("prefill", [slow])
    full = table.states("prefill")[0]
    full.in_flight, full.in_flight_tokens = 2, 3000  # the slow engine holds its budget's worth
    prompts = [prompt(1500) for _ in range(5)]
    tasks = [asyncio.create_task(gate.admit(scheduler.plan(p, 0.0), p, "client")) for p in prompts]
    await queued(gate, 5)
    table.replace("prefill", [slow, Endpoint("http://p-new", "prefill")])
    # No turn of the event loop since: the pass ran inside the table's change.
    new = table.states("prefill")[1]
    assert (new.reserved, new.reserved_tokens, len(gate.queue)) == (2, 3000, 3)
    bound = [await task for task in tasks[:2]]
    assert all(isinstance(b, Binding) and b.prefill is new and b.route is Route.PD for b in bound)
    # A request ending on the slow engine makes room for one more there, in the pass its end runs.
    full.in_flight, full.in_flight_tokens = 1, 1500
    gate.dispatch()
    assert (full.reserved, len(gate.queue)) == (1, 2)
    for task in tasks[2:]:
        task.cancel()
    await asyncio.gather(*tasks[2:], return_exceptions=True)
    assert len(gate.queue) == 0


async def test_a_binding_holds_its_room_until_the_lease_starts_or_the_request_ends() -> None:
    table, scheduler, gate = router(prefill_budget_tokens=3000, decode_budget_sequences=2)
    table.replace("prefill", [Endpoint("http://p", "prefill")])
    first = prompt(2000)
    binding = await gate.admit(scheduler.plan(first, 0.0), first, "a")
    assert isinstance(binding, Binding) and binding.prefill is not None
    assert (binding.prefill.reserved_tokens, binding.decode.reserved) == (2000, 1)
    # The room is taken until the request starts: the next prompt has to wait.
    second = prompt(2000)
    waiting = asyncio.create_task(gate.admit(scheduler.plan(second, 0.0), second, "b"))
    await queued(gate, 1)
    binding.started(binding.prefill)  # its lease took over the tokens (the proxy counts them in flight now)
    binding.prefill.in_flight_tokens += 2000
    assert binding.prefill.reserved_tokens == 0 and len(gate.queue) == 1
    binding.prefill.in_flight_tokens -= 2000
    binding.release()  # the request ended: the decode reservation is given back and a pass runs
    assert (binding.decode.reserved, len(gate.queue)) == (1, 0)
    assert isinstance(await waiting, Binding)


async def test_a_decode_only_request_is_not_held_behind_a_prefill_head() -> None:
    table, scheduler, gate = router(prefill_budget_tokens=1000)
    table.replace("prefill", [Endpoint("http://p", "prefill")])
    table.states("prefill")[0].in_flight_tokens, table.states("prefill")[0].in_flight = 1000, 1
    long = prompt(2000)
    blocked = asyncio.create_task(gate.admit(scheduler.plan(long, 0.0), long, "a"))
    await queued(gate, 1)
    short = prompt(10)
    scheduler.threshold = 100
    plan = scheduler.plan(short, 0.0)
    assert plan.route is Route.DECODE_ONLY
    found = await gate.admit(plan, short, "b")
    assert isinstance(found, Binding) and found.route is Route.DECODE_ONLY
    blocked.cancel()
    await asyncio.gather(blocked, return_exceptions=True)


async def test_the_prefill_pool_gone_while_waiting_falls_back_to_decode() -> None:
    table, scheduler, gate = router(prefill_budget_tokens=1000)
    table.replace("prefill", [Endpoint("http://p", "prefill")])
    table.states("prefill")[0].in_flight_tokens, table.states("prefill")[0].in_flight = 1000, 1
    waiting = prompt(500)
    task = asyncio.create_task(gate.admit(scheduler.plan(waiting, 0.0), waiting, "a"))
    await queued(gate, 1)
    table.replace("prefill", [])
    found = await task
    assert isinstance(found, Binding) and found.route is Route.FALLBACK and found.prefill is None


async def test_replicas_divide_the_budget_and_a_larger_count_takes_effect_at_once() -> None:
    table, scheduler, gate = router(prefill_budget_tokens=4000, router_replicas=1)
    table.replace("prefill", [Endpoint("http://p", "prefill")])
    engine = table.states("prefill")[0]
    engine.in_flight, engine.in_flight_tokens = 1, 1500
    gate.replicas = 2  # 2000 each: 1500 + 1000 no longer fits
    later = prompt(1000)
    task = asyncio.create_task(gate.admit(scheduler.plan(later, 0.0), later, "a"))
    await queued(gate, 1)
    gate.replicas = 1  # the other replica left: 4000 again, and the pass runs at once
    assert len(gate.queue) == 0
    assert isinstance(await task, Binding)


async def test_a_closed_gate_tells_every_waiting_and_arriving_request() -> None:
    table, scheduler, gate = router(prefill_budget_tokens=1000)
    table.replace("prefill", [Endpoint("http://p", "prefill")])
    table.states("prefill")[0].in_flight_tokens, table.states("prefill")[0].in_flight = 1000, 1
    first = prompt(500)
    task = asyncio.create_task(gate.admit(scheduler.plan(first, 0.0), first, "a"))
    await queued(gate, 1)
    gate.close()
    told = await task
    assert isinstance(told, Shed) and (told.status, told.reason) == (503, "shutdown")
    late = prompt(10)
    assert isinstance(await gate.admit(scheduler.plan(late, 0.0), late, "b"), Shed)


@pytest.mark.parametrize(
    ("headers", "address", "header", "expected_prefix"),
    [
        ({}, "10.0.0.1", None, "a:10.0.0.1"),
        ({"authorization": "Bearer k1"}, "10.0.0.1", None, "k:"),
        ({"authorization": "Bearer k1", "x-user": "u"}, "10.0.0.1", "X-User", "h:"),
        ({"authorization": "Bearer k1"}, "10.0.0.1", "X-User", "k:"),  # the header absent: the key
    ],
)
def test_who_a_client_is(headers: dict[str, str], address: str, header: str | None, expected_prefix: str) -> None:
    key = client_key(headers, address, header)
    assert key.startswith(expected_prefix)
    assert "k1" not in key  # a secret is never kept


def test_two_api_keys_behind_one_address_are_two_clients() -> None:
    one = client_key({"authorization": "Bearer one"}, "10.0.0.9", None)
    two = client_key({"authorization": "Bearer two"}, "10.0.0.9", None)
    assert one != two
