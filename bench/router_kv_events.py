"""KV events benchmark (issue 21, part A): prefix awareness that survives several router replicas and restarts.

Run: ``.venv/bin/python bench/router_kv_events.py [--conversations 16] [--skip-cluster] [--skip-micro]``

Through the operator on a fresh local cluster (`pdserve_dev.kvroutes`): 1 prefill + 3 decode simulator engines
with the renderer's exact vLLM command line, threshold 256, conversations of six turns over 1,200-word system
prompts (each set of conversations new, so no phase profits from another's cache), every request to a random router
pod. Phases, without KV events (the router's own tracking, as before) and then with them:

1. one router replica: six turns of each conversation;
2. three router replicas: six turns of new conversations;
3. every router pod deleted at once, then two more turns of phase 2's conversations (32 turns with 16), whose
   prefixes the decode engines hold.

Printed: PD routes per phase, the ratio of phase 2 to phase 1 (floor with events: within 10 %), PD routes after the
restart (floor with events: at most 1 in 16 of those turns, 2 of 32), the routers' mean routing-decision time in
both modes (from their own histograms). Then, without a cluster, what the events cost
(`--skip-micro` leaves this out):

- the router's hot path at 4k-token prompts: `Scheduler.held_by` (prompt -> blocks -> every engine's index) for a
  prompt nobody holds and for one an engine holds whole, against the same call without events, same process;
- the engine side: encoding and publishing a batch (the simulator's publisher; vLLM's msgspec encoder does the same
  work in C), per block;
- the router side: decoding a batch and applying it to an index, per block.

Exit status 1 when a floor is missed (with events).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOOR_RATIO = 1.10


def cluster_phases(conversations: int) -> tuple[list[str], bool]:
    from pdserve_dev.cluster.cluster import LocalCluster
    from pdserve_dev.kvroutes import KvRoutesService, run_turns
    from pdserve_dev.kvroutes import conversations as make_conversations
    from pdserve_dev.testing.cluster import ClusterHelper

    workdir = Path(tempfile.mkdtemp(prefix="pdserve-kvroutes-"))
    local = LocalCluster(workdir / "cluster", topology="none", process_node=True, log=lambda _: None)
    lines: list[str] = []
    ok = True
    service: KvRoutesService | None = None
    try:
        local.start()
        helper = ClusterHelper.from_cluster(local)
        started = time.monotonic()
        service = KvRoutesService.deploy(helper, workdir, routers=1, kv_events=False)
        print(f"# PDService serving after {time.monotonic() - started:.0f} s", flush=True)
        lines.append("| KV events | PD routes, 1 router | PD routes, 3 routers | ratio | PD routes after every router "
                     "restarted | mean routing decision |")  # fmt: skip
        lines.append("| --- | --- | --- | --- | --- | --- |")
        seed = 1
        for events in (False, True):
            if events:
                service.patch(routers=1, kv_events=True)
            before = service.decision_seconds()
            one = asyncio.run(run_turns(service.router_urls(), make_conversations(conversations, seed), 6, seed=seed))
            decision_one = service.decision_seconds()
            service.patch(routers=3, kv_events=events)
            chats = make_conversations(conversations, seed + 1)
            three = asyncio.run(run_turns(service.router_urls(), chats, 6, seed=seed + 1))
            service.restart_routers(3, events)
            after = asyncio.run(run_turns(service.router_urls(), chats, 2, seed=seed + 2))
            seed += 3
            failures = one.failures + three.failures + after.failures
            ratio = three.pd / max(one.pd, 1)
            spent = decision_one[0] - before[0]
            counted = decision_one[1] - before[1]
            mean_ms = 1000 * spent / counted if counted else float("nan")
            label = "on" if events else "off"
            lines.append(f"| {label} | {one.pd} / {one.requests} | {three.pd} / {three.requests} | x{ratio:.2f} | "
                         f"{after.pd} / {after.requests} | {mean_ms:.3f} ms |")  # fmt: skip
            print(lines[-1], flush=True)
            if failures:
                lines.append(f"#   {label}: {len(failures)} failed requests, first: {failures[0]}")
                ok = False
            if events:
                limit = max(1, after.requests // 16)
                if ratio > FLOOR_RATIO:
                    lines.append(f"# MISSED: 3 routers took {ratio:.2f}x the PD routes of one (floor x{FLOOR_RATIO})")
                    ok = False
                if after.pd > limit:
                    lines.append(f"# MISSED: {after.pd} turns took PD after the restart (floor {limit})")
                    ok = False
            if not events:
                service.patch(routers=1, kv_events=False)
    finally:
        if service is not None:
            service.stop()
        local.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return lines, ok


def _timed(call: object, repeat: int) -> float:
    """Median microseconds of `call()` over `repeat` runs."""
    assert callable(call)
    samples = []
    for _ in range(repeat):
        begun = time.perf_counter()
        call()
        samples.append(time.perf_counter() - begun)
    return 1e6 * statistics.median(samples)


def _timed_together(first: object, second: object, repeat: int) -> tuple[float, float]:
    """Median microseconds of two calls measured alternately (a busy machine slows both alike)."""
    assert callable(first) and callable(second)
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for call, out in ((first, samples[0]), (second, samples[1])):
            begun = time.perf_counter()
            call()
            out.append(time.perf_counter() - begun)
    return 1e6 * statistics.median(samples[0]), 1e6 * statistics.median(samples[1])


def micro() -> list[str]:
    """Hot-path and per-block costs, in this process (module docstring)."""
    from bench.router_bench import PromptMaker
    from pdserve.api.kvevents import BlockStored, EventBatch, decode_batch, encode_batch
    from pdserve.api.prompt import count_tokens, token_ids, utf8
    from pdserve.api.router_config import RoutingPolicyConfig
    from pdserve_runtime.router.endpoints import Endpoint, EndpointTable, KvEventSource
    from pdserve_runtime.router.kvhub import KvEventsHub
    from pdserve_runtime.router.kvindex import EngineIndex
    from pdserve_runtime.router.policy.scheduler import Scheduler
    from pdserve_runtime.router.prefix import PrefixTracker
    from pdserve_runtime.router.prompt_blocks import ChainCache, PromptBlocks
    from pdserve_runtime.router.tokens import TEXT_TAG, PromptInfo
    from pdserve_sim.kvcache import block_hashes
    from pdserve_sim.kvevents import KvEventRecorder

    block = 16
    maker = PromptMaker(4096, seed=5)
    held_text = maker.make("held")
    other_text = maker.make("other")
    ids = token_ids(utf8(held_text))
    hashes = block_hashes(ids, block)
    # The engine's events for the held prompt, as the simulator records them.
    recorder = KvEventRecorder(block)
    for index, value in enumerate(hashes):
        recorder.stored(value, hashes[index - 1] if index else None, ids[index * block : (index + 1) * block])
    batch = EventBatch(time.time(), tuple(recorder.take()), 0)
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    payload = encode_batch(batch)

    table = EndpointTable()
    urls = [f"http://10.0.0.{n}:8000" for n in range(1, 4)]
    table.replace("decode", [Endpoint(url, "decode", kv_events=(KvEventSource("tcp://x:1"),)) for url in urls])
    hub = KvEventsHub(table)
    indices = {url: [EngineIndex()] for url in urls}
    indices[urls[0]][0].apply(decode_batch(payload))
    hub._indices = indices  # the subscriptions' indices, filled directly (no sockets in a micro-benchmark)
    policy = RoutingPolicyConfig(disaggregation_threshold_tokens=256)
    tracker = PrefixTracker()
    tracker.record(urls[0], TEXT_TAG + utf8(held_text), 0.0)  # without events the tracker holds it (same work)
    with_events = Scheduler(table, tracker, policy, kv=hub)
    without = Scheduler(table, tracker, policy)
    # Events on, but no engine publishes (pd-long's mock engines): the hub has no index.
    silent = Scheduler(table, tracker, policy, kv=KvEventsHub(table))
    held = PromptInfo(TEXT_TAG + utf8(held_text), block)
    other = PromptInfo(TEXT_TAG + utf8(other_text), block)
    assert with_events.held_by(held, 0.0)[urls[0]].blocks == len(hashes)
    repeat = 400

    def first_sight(prompt: PromptInfo) -> object:
        hub._chains = ChainCache()  # this router never saw the prompt (nor one sharing its bytes)
        return with_events.held_by(prompt, 0.0)

    base_other = _timed(lambda: without.held_by(other, 0.0), repeat)
    cost_silent = _timed(lambda: silent.held_by(other, 0.0), repeat)
    base_held = _timed(lambda: without.held_by(held, 0.0), repeat)
    cost_other = _timed(lambda: first_sight(other), repeat)
    cost_held, reference = _timed_together(lambda: first_sight(held), lambda: count_tokens(held.key), repeat)
    with_events.held_by(held, 0.0)
    seen_held = _timed(lambda: with_events.held_by(held, 0.0), repeat)
    # The next turn of a chat this router routed before: the old prompt plus an answer and a question.
    last_turn = PromptBlocks(held.key, block)
    last_turn.block(len(hashes))  # every block computed, as routing the last turn left it
    turn = PromptInfo(held.key + b" and the answer was short. What about the next one?", block)

    def next_turn_call() -> object:
        hub._chains = ChainCache()
        hub._chains.keep(last_turn)
        return with_events.held_by(turn, 0.0)

    next_turn = _timed(next_turn_call, repeat)
    blocks = len(hashes)
    encode = _timed(lambda: encode_batch(batch), repeat)
    apply = _timed(lambda: EngineIndex().apply(decode_batch(payload)), repeat)
    return [
        "",
        f"| hot path, 4k-token prompt ({len(ids)} tokens, 3 engines) | without events | with events | added |",
        "| --- | --- | --- | --- |",
        f"| no engine publishes events | {base_other:.1f} us | {cost_silent:.1f} us | "
        f"{cost_silent - base_other:+.1f} us |",
        f"| nobody holds it | {base_other:.1f} us | {cost_other:.1f} us | {cost_other - base_other:+.1f} us |",
        f"| one engine holds all {blocks} blocks, first sight | {base_held:.1f} us | {cost_held:.1f} us | "
        f"{cost_held - base_held:+.1f} us |",
        f"| the same prompt again (its blocks cached by this router) | {base_held:.1f} us | {seen_held:.1f} us | "
        f"{seen_held - base_held:+.1f} us |",
        f"| the chat's next turn, this router saw the last one | {base_held:.1f} us | {next_turn:.1f} us | "
        f"{next_turn - base_held:+.1f} us |",
        f"| reference: counting every token of the prompt once (C passes; the decision without events counts "
        f"only up to the threshold) | {reference:.1f} us | | first sight = x{cost_held / reference:.1f} of it |",
        "",
        "| events' cost, one 4k-token prompt stored | per batch | per block |",
        "| --- | --- | --- |",
        f"| engine: encode the batch (simulator, msgpack) | {encode:.0f} us | {encode / blocks:.2f} us |",
        f"| router: decode and index the batch | {apply:.0f} us | {apply / blocks:.2f} us |",
        f"| wire: payload | {len(payload)} bytes | {len(payload) / blocks:.0f} bytes |",
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--conversations", type=int, default=16, help="conversations per phase (default 16)")
    parser.add_argument("--skip-cluster", action="store_true", help="only the in-process costs")
    parser.add_argument("--skip-micro", action="store_true", help="only the cluster phases")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from pdserve_dev.cluster import netns

    if not args.skip_cluster and netns.should_isolate():
        return netns.run_in_fresh([sys.executable, str(Path(__file__).resolve()), *argv])
    ok = True
    lines: list[str] = []
    if not args.skip_cluster:
        found, ok = cluster_phases(args.conversations)
        lines += found
    if not args.skip_micro:
        lines += micro()
    print()
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
