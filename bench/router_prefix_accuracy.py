"""The `prefix-accuracy` scenario of `router_bench.py`: are the router's selective-PD decisions the ones the
decode engine's real prefix cache calls for?

Run: ``.venv/bin/python bench/router_bench.py --scenario prefix-accuracy``

A router process (the real command) sits in front of one prefill and one decode simulator; the decode simulator
reports its real prefix-cache hits (``--enable-prompt-tokens-details``: usage carries
``prompt_tokens_details.cached_tokens``). Requests go one at a time. For each one this benchmark knows the
right decision: the decode engine holds every full prompt block of every earlier request (the fast preset never
evicts), so the tokens it would have to compute are the prompt's tokens minus its longest run of leading blocks
already seen, never the whole prompt (the last token is always computed), with the simulator's own tokenizer and
block hashes. The right route is PD when that is at or above the threshold, decode-only otherwise; the router's
route is its `X-Pdserve-Route` header.

That model of the engine is checked against the engine itself on every decode-only answer (where the reported
cached tokens are the decode engine's own prefix hit), so "agreement" is measured against the simulator's real
prefix cache, not against a second copy of the router's idea.

The workload mixes what prefix caching is for: multi-turn chats over a few shared system prompts (each turn
extends the last), completions sharing long documents with different questions, and unique prompts of 100-3000
tokens, in a shuffled order. Each threshold (256, 1024) gets fresh engines and fresh routers.

Several router replicas (issue 21): ``--accuracy-routers 3`` starts three router processes and sends each request
to one picked at random. The engines publish their KV events (`--kv-events-config`) and every router follows them
(``--kv-events``), so each knows what the decode engine holds whoever routed the earlier turns; with
``--no-kv-events`` the routers fall back to their own tracking and each sees a third of the traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from bench.router_bench import Proc, PromptMaker, _wait_http, pdserve_router_command
from pdserve_dev.testing.net import free_port

THRESHOLDS = (256, 1024)


@dataclass
class Tally:
    requests: int = 0
    agree: int = 0
    pd_right: int = 0
    pd_router: int = 0
    checked: int = 0
    model_exact: int = 0
    real_cached: int = 0
    decode_only_prompt_tokens: int = 0
    wrong: list[str] = field(default_factory=list)


def _workload(rng: random.Random, size: int) -> list[tuple[str, dict[str, Any]]]:
    """(kind, spec) in send order; chat turns grow as answers come back."""
    systems = [PromptMaker(tokens, seed=11 + tokens).make(f"system{tokens}") for tokens in (200, 700, 2000)]
    documents = [PromptMaker(tokens, seed=23 + tokens).make(f"doc{tokens}") for tokens in (500, 1500, 3000)]
    items: list[tuple[str, dict[str, Any]]] = []
    for index in range(size):
        roll = rng.random()
        if roll < 0.45:
            items.append(("chat", {"conversation": rng.randrange(24), "system": rng.choice(systems)}))
        elif roll < 0.75:
            question = PromptMaker(rng.randrange(10, 400), seed=index).make(f"Question {index}:")
            items.append(("shared-document", {"prompt": rng.choice(documents) + " " + question}))
        else:
            items.append(
                ("unique", {"prompt": PromptMaker(rng.randrange(100, 3000), seed=1000 + index).make(f"u{index}")})
            )
    return items


class EngineCacheModel:
    """The decode simulator's prefix cache as it must be after the requests seen so far (no eviction)."""

    def __init__(self) -> None:
        from pdserve_sim.kvcache import block_hashes

        self._hashes = block_hashes
        self._seen: set[int] = set()

    def cached_tokens(self, prompt_ids: list[int], block_size: int = 16) -> int:
        hashes = self._hashes(prompt_ids, block_size)
        usable = (len(prompt_ids) - 1) // block_size  # the last prompt token is always computed
        hit = 0
        for value in hashes[:usable]:
            if value not in self._seen:
                break
            hit += 1
        return hit * block_size

    def add(self, prompt_ids: list[int], block_size: int = 16) -> None:
        self._seen.update(self._hashes(prompt_ids, block_size))


def _events() -> Any:
    from pdserve_sim.kvevents import KvEventsConfig

    return KvEventsConfig(
        endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kv"
    )


async def _measure(threshold: int, size: int, seed: int, routers: int = 1, kv_events: bool = True) -> Tally:
    import aiohttp

    from pdserve_dev.testing.sim import sim_in_process
    from pdserve_sim.tokenizer import flatten_chat, tokenize

    tally = Tally()
    model = EngineCacheModel()
    rng = random.Random(seed)
    prefill_events, decode_events = (_events(), _events()) if kv_events else (None, None)
    async with (
        sim_in_process(role="prefill", kv_events=prefill_events) as prefill,
        sim_in_process(role="decode", prompt_tokens_details=True, kv_events=decode_events) as decode,
    ):
        flags = ["--prefill", prefill.url, "--decode", decode.url, "--disaggregation-threshold", str(threshold),
                 "--served-model-name", "sim-model"]  # fmt: skip
        for engine, events in ((prefill, prefill_events), (decode, decode_events)):
            if events is not None:
                flags += ["--kv-events", f"{engine.url}={events.endpoint},{events.replay_endpoint}"]
        procs, urls = [], []
        for _ in range(routers):
            port = free_port()
            procs.append(Proc([*pdserve_router_command(port, free_port()), *flags], None))
            urls.append(f"http://127.0.0.1:{port}")
        try:
            for url in urls:
                await asyncio.to_thread(_wait_http, url, "/ready")
            histories: dict[int, list[dict[str, str]]] = {}
            async with aiohttp.ClientSession() as session:
                for kind, spec in _workload(rng, size):
                    if kind == "chat":
                        history = histories.setdefault(spec["conversation"], [{"role": "system",
                                                                               "content": spec["system"]}])  # fmt: skip
                        history.append({"role": "user", "content": f"turn {len(history)}: tell me more, please."})
                        body: dict[str, Any] = {"model": "sim-model", "messages": history, "max_tokens": 24}
                        path = "/v1/chat/completions"
                        ids = tokenize(flatten_chat([(m["role"], m["content"]) for m in history]))
                    else:
                        body = {"model": "sim-model", "prompt": spec["prompt"], "max_tokens": 4}
                        path = "/v1/completions"
                        ids = tokenize(spec["prompt"])
                    expected_cached = model.cached_tokens(ids)
                    right = "pd" if len(ids) - expected_cached >= threshold else "decode-only"
                    async with session.post(rng.choice(urls) + path, json=body) as response:
                        answer = await response.json()
                        assert response.status == 200, answer
                        route = response.headers["X-Pdserve-Route"]
                    model.add(ids)
                    if kind == "chat":
                        history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
                    tally.requests += 1
                    tally.agree += route == right
                    tally.pd_right += right == "pd"
                    tally.pd_router += route == "pd"
                    if route != right and len(tally.wrong) < 5:
                        tally.wrong.append(f"{kind} tokens={len(ids)} cached={expected_cached} router={route}")
                    if route == "decode-only":
                        real = int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
                        tally.checked += 1
                        tally.model_exact += real == expected_cached
                        tally.real_cached += real
                        tally.decode_only_prompt_tokens += len(ids)
        finally:
            for proc in procs:
                proc.stop()
    return tally


def run_prefix_accuracy(args: argparse.Namespace) -> int:
    routers, kv_events = args.accuracy_routers, args.kv_events
    print(f"# {routers} router replica(s), KV events {'on' if kv_events else 'off'}")
    print()
    print("| threshold | requests | route agrees with the engine's cache | PD (right / router) | engine model = "
          "engine's report (decode-only answers) | real cached share of decode-only prompts |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    ok = True
    for threshold in THRESHOLDS:
        tally = asyncio.run(_measure(threshold, args.accuracy_requests, seed=3, routers=routers, kv_events=kv_events))
        print(f"| {threshold} | {tally.requests} | {100 * tally.agree / tally.requests:.1f} % | {tally.pd_right} / "
              f"{tally.pd_router} | {tally.model_exact} / {tally.checked} | "
              f"{100 * tally.real_cached / max(1, tally.decode_only_prompt_tokens):.1f} % |")  # fmt: skip
        for line in tally.wrong:
            print(f"#   disagreed: {line}")
        ok &= tally.model_exact == tally.checked
    if not ok:
        print("the engine model disagreed with the engine: the agreement figures are not trustworthy")
    return 0 if ok else 1
