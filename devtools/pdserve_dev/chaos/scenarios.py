"""The chaos scenarios: each brings the service to its starting shape, runs a checked load, strikes, judges.

Every scenario runs a fresh `MixedLoad` through the router (streaming and not, long prompts through prefill then
decode, short ones straight to decode, every answer checked to the token) and:

1. waits until each client has had `steady_rounds` answers: the steady state, whose TTFTs give the p50 the
   worst TTFT is compared with;
2. strikes (the fault, at a moment with work in hand where the fault needs it) and waits until the service has
   settled again (pods replaced, rollout done, ...), the load running all along;
3. keeps the load on for `after_rounds` more answers per client, so requests that raced the fault are counted,
   then stops it (every request under way ends: complete, told, or lost).

The floors (see `bench/chaos.py`) are judged from what the clients saw plus the evidence each scenario reads:
the engines' counters, the pods' work in hand when the fault came, the operator's children.

The scenarios run in an order in which each leaves the service close to the next one's starting shape, so
`--quick` spends its time on faults, not on scaling back up; each still brings the service to its own shape,
so any subset runs (`--only`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve_dev.chaos.outcome import Outcome
from pdserve_dev.chaos.service import ENGINES, IMAGES, MODEL, ChaosService
from pdserve_dev.chaos.watch import MismatchWatcher
from pdserve_dev.testing.mixed_load import MixedLoad, Shape, default_mix
from pdserve_dev.testing.wait import wait_for, wait_for_async

RETRIES = "pdserve_router_retries_total"
STORE_LOADS = "pdserve:sim_kv_store_blocks_total"
"""KV store blocks an engine moved; a decode engine only reads (its kv_role is kv_consumer), so these are loads."""
MAX_NUM_SEQS = 4
"""Sequences per decode engine: few, so that a handful of clients keep every engine busy and queues form."""


@dataclass(frozen=True)
class Tuning:
    """How much load each scenario runs: `--quick` (CI) or the full run."""

    steady_rounds: int
    after_rounds: int
    outputs: tuple[int, ...]
    long_output: int
    """The longest streams: long enough to be running (drain, a kill mid-stream) when the fault comes."""
    queued: int
    """Requests waiting at the one decode engine, each with KV a prefill engine holds, before a prefill fault."""
    clients: int
    """Clients of the scenarios that need no queue (rolling update, restarts)."""
    down_rounds: int
    """Answers per client while kube-apiserver is down."""
    queue_output: int
    """The longest output of the prefill scenarios' mix, whose queue at one decode engine must stay inside the
    router's 30 s first-byte timeout (and the 30 s KV lease): beyond it, requests fail for waiting, not for the
    fault."""

    def mix(self) -> list[Shape]:
        return default_mix((*self.outputs, self.long_output))

    def long_heavy(self) -> list[Shape]:
        """Mostly long prompts (through prefill): the decode queue fills with KV waiting to be pulled."""
        shortest = min(self.outputs)
        mix = default_mix((*self.outputs, self.queue_output))
        return [shape for shape in mix if shape.long or shape.max_tokens == shortest]


QUICK = Tuning(
    steady_rounds=1,
    after_rounds=1,
    outputs=(10, 40),
    long_output=300,
    queued=6,
    clients=6,
    down_rounds=2,
    queue_output=200,
)
FULL = Tuning(
    steady_rounds=4,
    after_rounds=3,
    outputs=(30, 120),
    long_output=800,
    queued=12,
    clients=8,
    down_rounds=6,
    queue_output=400,
)


Strike = Callable[[MixedLoad, Outcome], Awaitable[None]]


async def under_load(
    name: str,
    service: ChaosService,
    tuning: Tuning,
    strike: Strike,
    *,
    clients: int,
    mix: list[Shape],
    clients_after: int | None = None,
) -> Outcome:
    """Steady load, the strike, more load, stop (module docstring); the outcome with the base floors judged.

    A strike that fails (a wait timed out, a kubectl failed) is a missed floor of its own; the load's counts are
    still reported."""
    began = time.monotonic()
    fault_at: float | None = None
    notes: Outcome = Outcome(name)  # the strike's evidence and floors, merged below
    load = MixedLoad(service.router, MODEL, concurrency=clients, mix=mix)
    error = ""
    async with load:
        try:
            await load.wait_succeeded(clients * tuning.steady_rounds, within=180)
            fault_at = time.monotonic()
            await strike(load, notes)
            after = (clients_after or clients) * tuning.after_rounds
            await load.wait_succeeded(load.results.succeeded + after, within=180)
        except Exception as exc:  # reported as a missed floor, the bench goes on
            error = f"{type(exc).__name__}: {str(exc)[:500]}"
        finally:
            await load.stop()
    outcome = Outcome.of(name, load.results, fault_at)
    outcome.missed += notes.missed
    outcome.notes += notes.notes
    outcome.require(not error, f"the scenario completed ({error})")
    outcome.seconds = time.monotonic() - began
    return outcome


# -- scale-down with drain ---------------------------------------------------------------------------------------


async def scale_down_decode(service: ChaosService, tuning: Tuning) -> Outcome:
    """Decode 4 -> 1 while long streams have just started, some on the engines removed; then the demand drops to
    what one engine serves, as it does when an autoscaler scales down. Floor: 0 failed (the drain)."""
    await asyncio.to_thread(service.shape, 2, 4)

    async def strike(load: MixedLoad, outcome: Outcome) -> None:
        await wait_for_async(
            _young(load, tuning.long_output, 3), within=120, message="long streams starting on every engine"
        )
        outcome.notes.append(f"long streams under way at the scale-down: {load.young(tuning.long_output, 1e9)}")
        await asyncio.to_thread(service.scale, "decode", 1)
        load.set_concurrency(MAX_NUM_SEQS)
        await asyncio.to_thread(service.wait_pool, "decode", 1)

    outcome = await under_load(
        "scale-down-decode", service, tuning, strike, clients=12, mix=tuning.mix(), clients_after=MAX_NUM_SEQS
    )
    outcome.require(outcome.failed_told == 0, f"failed_told == 0 ({outcome.failed_told})")
    return outcome


def _young(load: MixedLoad, tokens: int, count: int) -> Callable[[], Awaitable[bool]]:
    async def enough() -> bool:
        return load.young(tokens, within=2.0) >= count

    return enough


def _decode_queue(service: ChaosService, depth: int) -> Callable[[], Awaitable[bool]]:
    """At least `depth` requests wait at the one decode engine, each with KV a prefill engine handed out and
    nobody has pulled yet (the simulator, like vLLM, pulls when it schedules the request)."""

    async def deep() -> bool:
        [decode] = await asyncio.to_thread(service.pods, "pdserve.io/role=decode")
        state = await asyncio.to_thread(service.engine_state, decode)
        return int(state.get("waiting_for_remote_kv", 0)) + int(state.get("waiting", 0)) >= depth

    return deep


async def scale_down_prefill(service: ChaosService, tuning: Tuning) -> Outcome:
    """Prefill 2 -> 1 behind one decode engine whose queue holds KV handed out by both prefill engines: the removed
    one keeps serving the pulls while it drains. Floor: 0 failed."""
    await asyncio.to_thread(service.shape, 2, 1)

    async def strike(load: MixedLoad, outcome: Outcome) -> None:
        await wait_for_async(_decode_queue(service, tuning.queued), within=120, message="a deep decode queue")
        [removed] = [
            p
            for p in await asyncio.to_thread(service.pods, "pdserve.io/role=prefill")
            if p["metadata"]["name"].endswith("-1")
        ]
        held = (await asyncio.to_thread(service.engine_state, removed)).get("held_kv", 0)
        outcome.notes.append(f"KV held by the removed prefill engine at the scale-down: {held} requests")
        await asyncio.to_thread(service.scale, "prefill", 1)
        await asyncio.to_thread(service.wait_pool, "prefill", 1)

    outcome = await under_load("scale-down-prefill", service, tuning, strike, clients=20, mix=tuning.long_heavy())
    outcome.require(outcome.failed_told == 0, f"failed_told == 0 ({outcome.failed_told})")
    return outcome


async def decode_scale_and_replace(service: ChaosService, tuning: Tuning) -> Outcome:
    """Decode 1 -> 2, one decode pod deleted and replaced by a new incarnation, then 2 -> 1, the load running all
    along: the router's decode pool grows, turns over and shrinks while requests run, and it must use every Ready
    engine throughout. Before the replacement the other decode engine fails requests until the router ejects it (as
    decode engines do when their KV pulls hit a prefill pod that was replaced), then is healthy again: issue 23's
    order, where the ejected engine was the only Ready one left once the replaced pod started terminating, and
    clients got 503 until the router's own memory let it back. Floor: 0 failed."""
    await asyncio.to_thread(service.shape, 1, 1)

    async def strike(load: MixedLoad, outcome: Outcome) -> None:
        steps: list[str] = []
        began = time.monotonic()

        def step(what: str) -> None:
            nonlocal began
            steps.append(f"{what} {time.monotonic() - began:.0f} s")
            began = time.monotonic()

        await asyncio.to_thread(service.scale, "decode", 2)
        await asyncio.to_thread(service.wait_pool, "decode", 2)
        step("scale-up")
        decodes = await asyncio.to_thread(service.pods, "pdserve.io/role=decode")
        [victim] = [pod for pod in decodes if pod["metadata"]["name"].endswith("-0")]
        [failing] = [pod for pod in decodes if pod is not victim]
        name = failing["metadata"]["name"]
        # Every request it gets fails before a byte is sent (the router retries it on the other engine) until the
        # router ejects it; then it is healthy again, and only the router's memory keeps it out.
        await asyncio.to_thread(service.engine_faults, failing, {"fail_next": 1_000_000, "fail_status": 500})
        try:
            await asyncio.to_thread(
                wait_for, lambda: not service.router_uses("decode", failing), 60, 0.1, f"the router ejects {name}"
            )
        finally:
            await asyncio.to_thread(service.engine_faults, failing, None)
        step(f"{name} failing until ejected")
        await asyncio.to_thread(service.replace_pod, victim)
        await asyncio.to_thread(service.wait_pool, "decode", 2)
        step(f"replacing {victim['metadata']['name']}")
        await asyncio.to_thread(service.scale, "decode", 1)
        await asyncio.to_thread(service.wait_pool, "decode", 1)
        step("scale-down")
        outcome.notes.append(f"steps, each until the router used exactly the new engines: {', '.join(steps)}")

    # Short outputs only: many requests start and end around each change of the pool, and the removed engines
    # drain in seconds (the long streams' drain is scale-down-decode's).
    outcome = await under_load(
        "decode-scale-and-replace", service, tuning, strike, clients=tuning.clients, mix=default_mix(tuning.outputs)
    )
    outcome.require(outcome.failed_told == 0, f"failed_told == 0 ({outcome.failed_told})")
    return outcome


# -- pods killed ------------------------------------------------------------------------------------------------


def _killed_floors(outcome: Outcome, on_pod: int) -> None:
    """Failures only among the requests on the killed pod, each a stream told with an error event after its first
    tokens: a request with no token sent yet (a stream not started, a whole answer) is retried elsewhere."""
    outcome.require(
        outcome.failed_told <= on_pod, f"failed_told <= requests on the killed pod ({outcome.failed_told} > {on_pod})"
    )
    kinds = outcome.failure_kinds
    others = {kind: count for kind, count in kinds.items() if kind != "stream-after-tokens"}
    outcome.require(not others, f"every failure a stream told after its first tokens ({others})")
    outcome.notes.append(f"requests on the killed pod: {on_pod}; failures by kind: {kinds or 'none'}")


async def prefill_killed(service: ChaosService, tuning: Tuning) -> Outcome:
    """A prefill pod killed (SIGKILL, then force-deleted) while the one decode engine's queue holds KV it produced:
    the decode engine's pulls of it fail, and the router must run those requests again through the other prefill
    engine (nothing was sent to their clients yet). Floors: failures limited to streams on that pod that had
    tokens (none expected: KV not pulled means no token sent), never lost."""
    await asyncio.to_thread(service.shape, 2, 1)
    on_pod = 0

    async def strike(load: MixedLoad, outcome: Outcome) -> None:
        nonlocal on_pod
        await wait_for_async(_decode_queue(service, tuning.queued), within=120, message="a deep decode queue")
        prefills = await asyncio.to_thread(service.pods, "pdserve.io/role=prefill")
        states = [await asyncio.to_thread(service.engine_state, pod) for pod in prefills]
        victim, state = max(zip(prefills, states, strict=True), key=lambda pair: int(pair[1].get("held_kv", 0)))
        on_pod = int(state.get("held_kv", 0)) + int(state.get("running", 0)) + int(state.get("waiting", 0))
        [decode] = await asyncio.to_thread(service.pods, "pdserve.io/role=decode")
        failed_pulls = "vllm:nixl_num_failed_transfers_total"
        before = await asyncio.to_thread(service.engine_metric, decode, failed_pulls)
        reprefills = await asyncio.to_thread(service.router_metric, RETRIES, stage="reprefill")
        await asyncio.to_thread(service.kill_pod, victim)
        outcome.notes.append(f"killed {victim['metadata']['name']} holding KV of {state.get('held_kv', 0)} requests")
        outcome.require(int(state.get("held_kv", 0)) > 0, "the killed prefill engine held KV waiting to be pulled")
        await asyncio.to_thread(service.wait_pool, "prefill", 2)
        after = await asyncio.to_thread(service.engine_metric, decode, failed_pulls)
        reprefilled = await asyncio.to_thread(service.router_metric, RETRIES, stage="reprefill") - reprefills
        outcome.notes.append(
            f"decode's failed KV pulls since the kill: {after - before:.0f}; prefilled again: {reprefilled:.0f}"
        )

    outcome = await under_load("prefill-killed", service, tuning, strike, clients=20, mix=tuning.long_heavy())
    _killed_floors(outcome, on_pod)
    return outcome


async def prefill_killed_store(service: ChaosService, tuning: Tuning) -> Outcome:
    """`prefill-killed` with the KV store on (a real Mooncake master and store server): prefill writes every prompt
    to the store before it answers, so when the killed engine's KV cannot be pulled the router retries decode from
    the store instead of prefilling again. Floors: 0 lost, 0 failed, 0 requests re-prefilled (the router's
    reprefill retries), and the store path was taken (store retries > 0, blocks loaded by decode)."""
    await asyncio.to_thread(service.use_store)
    await asyncio.to_thread(service.shape, 2, 1)
    counts: dict[str, float] = {}

    async def strike(load: MixedLoad, outcome: Outcome) -> None:
        await wait_for_async(_decode_queue(service, tuning.queued), within=120, message="a deep decode queue")
        prefills = await asyncio.to_thread(service.pods, "pdserve.io/role=prefill")
        states = [await asyncio.to_thread(service.engine_state, pod) for pod in prefills]
        victim, state = max(zip(prefills, states, strict=True), key=lambda pair: int(pair[1].get("held_kv", 0)))
        for stage in ("reprefill", "store"):
            counts[stage] = await asyncio.to_thread(service.router_metric, RETRIES, stage=stage)
        await asyncio.to_thread(service.kill_pod, victim)
        outcome.notes.append(f"killed {victim['metadata']['name']} holding KV of {state.get('held_kv', 0)} requests")
        outcome.require(int(state.get("held_kv", 0)) > 0, "the killed prefill engine held KV waiting to be pulled")
        await asyncio.to_thread(service.wait_pool, "prefill", 2)

    outcome = await under_load("prefill-killed-store", service, tuning, strike, clients=20, mix=tuning.long_heavy())
    if counts:
        reprefilled = await asyncio.to_thread(service.router_metric, RETRIES, stage="reprefill") - counts["reprefill"]
        from_store = await asyncio.to_thread(service.router_metric, RETRIES, stage="store") - counts["store"]
        [decode] = await asyncio.to_thread(service.pods, "pdserve.io/role=decode")
        loaded = await asyncio.to_thread(service.engine_metric, decode, STORE_LOADS)
        outcome.notes.append(
            f"since the kill: {reprefilled:.0f} re-prefilled, {from_store:.0f} decode retries from the store; "
            f"KV blocks decode loaded from the store: {loaded:.0f}"
        )
        outcome.require(reprefilled == 0, f"0 requests re-prefilled ({reprefilled:.0f})")
        outcome.require(from_store > 0, "the store path was taken (decode retries from the store > 0)")
    outcome.require(outcome.failed_told == 0, f"failed_told == 0 ({outcome.failed_told})")
    return outcome


async def decode_killed(service: ChaosService, tuning: Tuning) -> Outcome:
    """A decode pod killed mid-stream: its streams that had sent tokens end with an error event (tokens already
    sent must not repeat); everything else, including whole answers it was generating, succeeds elsewhere."""
    await asyncio.to_thread(service.shape, 1, 2)
    on_pod = 0

    async def strike(load: MixedLoad, outcome: Outcome) -> None:
        nonlocal on_pod
        await wait_for_async(_young(load, tuning.long_output, 2), within=120, message="long streams starting")
        decodes = await asyncio.to_thread(service.pods, "pdserve.io/role=decode")
        states = [await asyncio.to_thread(service.engine_state, pod) for pod in decodes]
        victim, state = max(zip(decodes, states, strict=True), key=lambda pair: int(pair[1].get("running", 0)))
        on_pod = sum(int(state.get(key, 0)) for key in ("running", "waiting", "waiting_for_remote_kv"))
        await asyncio.to_thread(service.kill_pod, victim)
        outcome.notes.append(f"killed {victim['metadata']['name']} with {on_pod} requests on it")
        await asyncio.to_thread(service.wait_pool, "decode", 2)

    outcome = await under_load("decode-killed", service, tuning, strike, clients=8, mix=tuning.mix())
    _killed_floors(outcome, on_pod)
    return outcome


# -- rollouts and restarts ----------------------------------------------------------------------------------------

ROLLOUT_TIMEOUT = 400.0


def _other_image(service: ChaosService) -> str:
    current = service.pds()["spec"]["engine"]["image"]
    return IMAGES[1] if current == IMAGES[0] else IMAGES[0]


async def _new_value(service: ChaosService, old: str) -> str:
    """Wait until the operator has rendered the new spec (its status carries the new kv-compat value)."""

    def rendered() -> str:
        value = service.kv_compat()
        return value if value != old else ""

    return await asyncio.to_thread(wait_for, rendered, 60, 0.5, "the operator renders the new kv-compat value")


async def rolling_update(service: ChaosService, tuning: Tuning) -> Outcome:
    """The engine image changes, and with it the kv-compat value: the pools roll one pod at a time (each old
    engine draining), the router pairs only engines of one value. Floors: 0 failed; no engine ever refused a KV
    pull for a kv-compat mismatch (every engine's counter, read all along)."""
    await asyncio.to_thread(service.shape, 1, 2)
    watcher = MismatchWatcher(service.cluster, service.namespace).start()

    async def strike(load: MixedLoad, outcome: Outcome) -> None:
        old = await asyncio.to_thread(service.kv_compat)
        await asyncio.to_thread(service.patch, {"engine": {"image": await asyncio.to_thread(_other_image, service)}})
        new = await _new_value(service, old)
        await asyncio.to_thread(service.wait_rolled_to, new, 1, 2, ROLLOUT_TIMEOUT)

    try:
        outcome = await under_load("rolling-update", service, tuning, strike, clients=tuning.clients, mix=tuning.mix())
    finally:
        await asyncio.to_thread(watcher.stop)
    outcome.require(outcome.failed_told == 0, f"failed_told == 0 ({outcome.failed_told})")
    outcome.require(watcher.total == 0, f"no kv-compat mismatched pull ({watcher.total:.0f}: {watcher.mismatches})")
    outcome.notes.append(
        f"kv-compat mismatches {watcher.total:.0f} over {len(watcher.mismatches)} engine incarnations read; "
        f"polls with Ready engines of both values: {watcher.mixed_polls} of {watcher.polls}"
    )
    return outcome


async def operator_restart(service: ChaosService, tuning: Tuning) -> Outcome:
    """The operator SIGKILLed mid-rollout (after it rendered the new image, while the pools roll) and started
    again. Floors: 0 failed; it converges (the rollout completes, status for the new generation, Available) with
    exactly the children it owned before (no duplicate StatefulSet, Service, ...)."""
    await asyncio.to_thread(service.shape, 1, 2)
    await asyncio.to_thread(wait_for, service.converged, 60, 0.5, "the operator settled before the fault")
    before = await asyncio.to_thread(service.owned_children)

    async def strike(load: MixedLoad, outcome: Outcome) -> None:
        old = await asyncio.to_thread(service.kv_compat)
        await asyncio.to_thread(service.patch, {"engine": {"image": await asyncio.to_thread(_other_image, service)}})
        new = await _new_value(service, old)

        def rolling() -> bool:
            pods = service.pods(ENGINES)
            return any(
                pod["metadata"].get("deletionTimestamp") or pod["metadata"]["labels"].get("pdserve.io/kv-compat") == new
                for pod in pods
            )

        await asyncio.to_thread(wait_for, rolling, 60, 0.2, "the rollout under way")
        await asyncio.to_thread(service.restart_operator)
        outcome.notes.append("operator SIGKILLed mid-rollout and restarted")
        await asyncio.to_thread(service.wait_rolled_to, new, 1, 2, ROLLOUT_TIMEOUT)
        await asyncio.to_thread(wait_for, service.converged, 120, 0.5, "the restarted operator converges")

    outcome = await under_load("operator-restart", service, tuning, strike, clients=tuning.clients, mix=tuning.mix())
    # Read after the load, whatever the strike reached: a stuck rollout shows what the operator owns by then.
    after = dict(await asyncio.to_thread(service.owned_children))
    outcome.require(outcome.failed_told == 0, f"failed_told == 0 ({outcome.failed_told})")
    outcome.require(after == dict(before), f"the same children after the restart ({dict(before)} -> {after})")
    outcome.notes.append(f"children owned before and after: {dict(before)} / {after}")
    return outcome


async def apiserver_restart(service: ChaosService, tuning: Tuning) -> Outcome:
    """kube-apiserver stopped under load (the router keeps serving on its last table: no watch, no slices), then
    started again; the operator must act again: the router is scaled to two replicas through the PDService, which
    only a reconnected operator turns into pods. Floor: 0 failed."""
    local = service.cluster.local
    if local is None:
        raise RuntimeError("apiserver-restart needs a local cluster (its kube-apiserver process)")
    await asyncio.to_thread(service.patch, {"router": {"replicas": 1}})
    service.use_router((await asyncio.to_thread(service.wait_routers, 1))[0])

    async def strike(load: MixedLoad, outcome: Outcome) -> None:
        await asyncio.to_thread(local.stop_apiserver)
        try:
            served = load.results.succeeded
            await load.wait_succeeded(served + tuning.clients * tuning.down_rounds, within=120)
            outcome.notes.append(f"answers while kube-apiserver was down: {load.results.succeeded - served}")
        finally:
            await asyncio.to_thread(local.start_apiserver)
        await asyncio.to_thread(service.patch, {"router": {"replicas": 2}})
        await asyncio.to_thread(service.wait_routers, 2, 180)
        outcome.notes.append("after the restart the operator scaled the router to 2 replicas")

    outcome = await under_load("apiserver-restart", service, tuning, strike, clients=tuning.clients, mix=tuning.mix())
    outcome.require(outcome.failed_told == 0, f"failed_told == 0 ({outcome.failed_told})")
    return outcome


async def router_replica_killed(service: ChaosService, tuning: Tuning) -> Outcome:
    """Two router replicas, the load on one pod's address, the other killed (SIGKILL, force-deleted) and replaced.
    Floor: 0 failed on the surviving replica."""
    await asyncio.to_thread(service.patch, {"router": {"replicas": 2}})
    survivor, victim = await asyncio.to_thread(service.wait_routers, 2)
    service.use_router(survivor)

    async def strike(load: MixedLoad, outcome: Outcome) -> None:
        await asyncio.to_thread(service.kill_pod, victim)
        outcome.notes.append(f"killed router pod {victim['metadata']['name']}")
        await asyncio.to_thread(service.wait_routers, 2)

    outcome = await under_load(
        "router-replica-killed", service, tuning, strike, clients=tuning.clients, mix=tuning.mix()
    )
    outcome.require(outcome.failed_told == 0, f"failed_told == 0 ({outcome.failed_told})")
    return outcome


ALL: dict[str, Callable[[ChaosService, Tuning], Awaitable[Outcome]]] = {
    "scale-down-decode": scale_down_decode,
    "prefill-killed": prefill_killed,
    "scale-down-prefill": scale_down_prefill,
    "decode-scale-and-replace": decode_scale_and_replace,
    "decode-killed": decode_killed,
    "rolling-update": rolling_update,
    "operator-restart": operator_restart,
    "apiserver-restart": apiserver_restart,
    "router-replica-killed": router_replica_killed,
    # Last: turning the store on rolls every engine, and the store stays on for whatever would run after it.
    "prefill-killed-store": prefill_killed_store,
}
"""The scenarios in the order they run (issue 13's names: contract). Blocking calls (kubectl, scrapes) run in
threads (`asyncio.to_thread`): the load's clients share the event loop."""
