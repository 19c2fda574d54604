"""The router's KV-event subscriptions, one per engine publisher it routes to, and what they say a prompt's engines
hold.

Subscriptions follow the endpoint table (`sync`, called whenever discovery changes it): an engine whose endpoint
names KV event sources (its EndpointSlice's event ports, or static configuration) is followed for as long as it is
in the table; an engine that leaves it is unsubscribed and its index dropped, so a replacement at the same address
starts cold. Engines without sources are not followed: the prefix tracker's guesses stand for them.

When an index is believed (`refine`). An index answers in the router's own block names, which only match the
engine's blocks when the router tokenizes prompts as the engine does (`prompt_blocks`). So an engine's index is
*confirmed* once some prompt's block was found in it (a match by chance is a 64-bit hash collision), and only a
confirmed index may say that an engine holds *nothing* of a prompt; until then an empty match leaves the tracker's
guess in place. An engine whose tokenizer the router does not share (a real vLLM beside the simulator's prompt
model) therefore never confirms and is routed exactly as without events. A new engine incarnation (restart) clears
the index and its confirmation.

The per-tier view (`Held.by_medium`) is what a scorer weighing tiers reads: for each tier (`GPU`, `CPU`, ...), how
many leading blocks of the prompt the engine holds in that tier; `Held.blocks` is the leading run held in any tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping

import zmq.asyncio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve_runtime.router.endpoints import ROLES, EndpointTable, KvEventSource
from pdserve_runtime.router.kvindex import EngineIndex, match_engines
from pdserve_runtime.router.kvsubscriber import Subscription
from pdserve_runtime.router.prompt_blocks import ChainCache
from pdserve_runtime.router.tokens import Held, PromptInfo

log = logging.getLogger("pdserve.router.kvevents")


class KvEventsHub:
    """Subscriptions to every engine publisher in the table, and the prompt matcher over their indices."""

    def __init__(self, table: EndpointTable, *, max_blocks: int = 1_000_000, replay_timeout: float = 5.0) -> None:
        self.table = table
        self._max_blocks = max_blocks
        self._replay_timeout = replay_timeout
        self._context: zmq.asyncio.Context | None = None
        # url -> (sources it was subscribed with, their subscriptions)
        self._subs: dict[str, tuple[tuple[KvEventSource, ...], list[Subscription]]] = {}
        self._indices: dict[str, list[EngineIndex]] = {}
        self._stopping: list[asyncio.Task[None]] = []
        self._chains = ChainCache()
        self.started = False

    # -- following the table ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self.started = True
        self.sync()

    async def stop(self) -> None:
        self.started = False
        for url in list(self._subs):
            self._drop(url)
        for task in self._stopping:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._stopping.clear()
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def sync(self) -> None:
        """Subscribe to engines that appeared (or changed sources), unsubscribe from those that left."""
        if not self.started or self._context is None:
            return
        wanted: dict[str, tuple[KvEventSource, ...]] = {}
        for role in ROLES:
            for state in self.table.states(role):
                if state.endpoint.kv_events:
                    wanted[state.url] = state.endpoint.kv_events
        for url in [url for url, (sources, _) in self._subs.items() if wanted.get(url) != sources]:
            self._drop(url)
        for url, sources in wanted.items():
            if url in self._subs:
                continue
            indices = [EngineIndex(max_blocks=self._max_blocks) for _ in sources]
            subs = [
                Subscription(source, index, self._context, label=url, replay_timeout=self._replay_timeout)
                for source, index in zip(sources, indices, strict=True)
            ]
            for sub in subs:
                sub.start()
            self._subs[url] = (sources, subs)
            self._indices[url] = indices
            log.info("Subscribed to KV events engine=%s sources=%s", url, ",".join(s.endpoint for s in sources))

    def _drop(self, url: str) -> None:
        _, subs = self._subs.pop(url)
        self._indices.pop(url, None)
        for sub in subs:
            self._stopping.append(asyncio.create_task(sub.stop()))
        self._stopping = [task for task in self._stopping if not task.done()]

    def subscriptions(self, url: str) -> list[Subscription]:
        entry = self._subs.get(url)
        return list(entry[1]) if entry else []

    def indices(self) -> Mapping[str, list[EngineIndex]]:
        return self._indices

    # -- matching ---------------------------------------------------------------------------------------------

    def confirmed(self, url: str) -> bool:
        """Whether a prompt's blocks were ever found in this engine's current index (module docstring)."""
        return any(index.confirmed for index in self._indices.get(url, ()))

    def refine(self, prompt: PromptInfo, held: dict[str, Held]) -> None:
        """Replace the tracker's guesses in `held` with what the engines' events say, where they can say it.

        Blocks are cut at the block size each engine's events carry (normally the one the router is configured
        with; an engine started with another one is still matched)."""
        if not self._indices or prompt.size <= 1:
            return
        by_size: dict[int, dict[str, list[EngineIndex]]] = {}
        for url, indices in self._indices.items():
            size = next((index.block_size for index in indices if index.block_size), None)
            if size is not None:
                by_size.setdefault(size, {})[url] = indices
        for size, engines in by_size.items():
            chain = self._chains.start(prompt.key, size)
            matches = match_engines(engines, chain)
            self._chains.keep(chain)
            for url, indices in engines.items():
                match = matches.get(url)
                if match is None:
                    if any(index.confirmed for index in indices):
                        held.pop(url, None)  # the engine says it holds none of the prompt
                    continue
                for index in indices:
                    index.confirmed = True
                held[url] = Held(
                    common=chain.byte_end(match.blocks),
                    stored_next=None,
                    blocks=match.blocks,
                    by_medium=match.by_medium,
                    counted=(chain.tokens_seen, chain.bytes_seen),
                    block_size=size,
                )


class KvEventsCollector(Collector):
    """`pdserve_router_kv_events_*` metrics, read from the hub at scrape time (nothing on the event path)."""

    def __init__(self, hub: KvEventsHub) -> None:
        self.hub = hub

    def collect(self) -> Iterator[Metric]:
        batches = CounterMetricFamily(
            "pdserve_router_kv_events_batches", "KV event batches applied, per engine.", labels=["endpoint"]
        )
        problems = CounterMetricFamily(
            "pdserve_router_kv_events_problems",
            "KV event delivery problems per engine: malformed batches, gaps, restarts, replay failures.",
            labels=["endpoint", "kind"],
        )
        blocks = GaugeMetricFamily(
            "pdserve_router_kv_index_blocks", "Blocks the engine's KV events say it holds.", labels=["endpoint"]
        )
        confirmed = GaugeMetricFamily(
            "pdserve_router_kv_index_confirmed",
            "1 when a prompt's blocks were found in the engine's index (the router tokenizes as the engine does).",
            labels=["endpoint"],
        )
        for url, indices in self.hub.indices().items():
            subs = self.hub.subscriptions(url)
            batches.add_metric([url], sum(sub.stats.batches for sub in subs))
            for kind in ("malformed", "gaps", "restarts", "replay_failures"):
                problems.add_metric([url, kind], sum(getattr(sub.stats, kind) for sub in subs))
            blocks.add_metric([url], sum(len(index) for index in indices))
            confirmed.add_metric([url], 1.0 if self.hub.confirmed(url) else 0.0)
        yield from (batches, problems, blocks, confirmed)

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self)
