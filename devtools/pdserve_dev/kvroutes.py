"""Route counts of multi-turn chats through several router replicas, on the local cluster (issue 21, part A).

The shape the issue measured: one PDService deployed by the operator, 1 prefill and 3 decode engines (the
simulator, run with the renderer's exact vLLM command line, `--kv-events-config` included), threshold 256,
conversations of six turns over 1,200-word system prompts (each conversation its own), each request sent to a
router pod picked at random. Turn 1 of a conversation has ~1,600 uncached tokens and rightly takes the PD route;
every later turn extends a prompt a decode engine already holds, so it should go straight to that engine. How many
requests took the PD route is read from each answer's `X-Pdserve-Route` header.

`KvRoutesService` deploys and reshapes the PDService (router replicas, KV events on or off, a restart of every
router pod); `run_turns` plays turns of a set of conversations and counts routes. The benchmark
(`bench/router_kv_events.py`) and the cluster test (`tests/e2e/test_kv_events_cluster.py`) are built from these.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.api.crdgen import custom_resource_definition
from pdserve_dev.chaos.service import router_metrics_url
from pdserve_dev.process_node.node import SELECTOR, TOLERATION
from pdserve_dev.testing.cluster import ClusterHelper, pod_ready
from pdserve_dev.testing.metrics import metric_value, scrape_sync
from pdserve_dev.testing.operator import OperatorProcess
from pdserve_dev.testing.wait import wait_for

NAME = "kvroutes"
MODEL = "tiny-llama"
ROUTER_PORT = 8080
THRESHOLD = 256
ENGINES = "pdserve.io/role in (prefill,decode)"
ROUTERS = "pdserve.io/role=router"

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "they",
    "this",
    "are",
    "be",
    "it",
    "an",
    "had",
    "not",
    "or",
    "have",
    "which",
    "one",
    "you",
    "were",
    "all",
    "their",
    "has",
    "been",
    "more",
    "when",
    "can",
    "there",
    "would",
    "who",
    "will",
    "so",
    "about",
    "into",
    "than",
    "its",
    "them",
    "some",
    "could",
    "only",
    "other",
    "new",
    "time",
    "first",
    "two",
    "may",
    "then",
    "these",
    "like",
    "over",
    "any",
    "such",
    "after",
    "most",
    "also",
    "what",
    "made",
    "well",
    "where",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "much",
    "being",
    "way",
    "under",
    "world",
    "state",
    "place",
    "early",
    "north",
    "south",
    "river",
    "stone",
    "music",
    "market",
]


def manifest(namespace: str, *, routers: int, kv_events: bool, prefill: int = 1, decode: int = 3) -> dict[str, Any]:
    """The PDService: every pod on the process node, threshold 256, KV events on or off."""
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDService",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"name": MODEL, "uri": "hf://pdserve/tiny-llama"},
            "engine": {"image": "vllm/vllm-openai:v0.32.0", "maxModelLen": 8192, "kvEvents": {"enabled": kv_events}},
            "prefill": {"replicas": prefill},
            "decode": {"replicas": decode},
            "placement": {"gpuNodeSelector": SELECTOR, "tolerations": [TOLERATION], "rdma": "required"},
            "router": {
                "replicas": routers,
                "nodeSelector": SELECTOR,
                "tolerations": [TOLERATION],
                "routing": {"disaggregationThreshold": THRESHOLD},
            },
        },
    }


def system_prompt(seed: int, words: int = 1200) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class Conversation:
    """One chat: its messages so far (the system prompt first)."""

    messages: list[dict[str, str]]
    turns: int = 0


def conversations(count: int, seed: int) -> list[Conversation]:
    """`count` fresh conversations, each over its own 1,200-word system prompt (seeds never reused across sets)."""
    return [Conversation([{"role": "system", "content": system_prompt(seed * 1000 + index)}]) for index in range(count)]


@dataclass
class Tally:
    """Routes taken by a set of turns."""

    requests: int = 0
    routes: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def pd(self) -> int:
        return self.routes.get("pd", 0)


async def run_turns(
    routers: list[str], chats: list[Conversation], turns: int, *, seed: int, max_tokens: int = 16
) -> Tally:
    """Play `turns` more turns of every conversation, conversations in parallel and turns in order, each request
    to a router picked at random; count the routes."""
    import aiohttp

    rng = random.Random(seed)
    tally = Tally()
    timeout = aiohttp.ClientTimeout(total=120)

    async def one(session: aiohttp.ClientSession, chat: Conversation) -> None:
        for _ in range(turns):
            chat.turns += 1
            chat.messages.append({"role": "user", "content": f"turn {chat.turns}: tell me more about that, please."})
            body = {"model": MODEL, "messages": chat.messages, "max_tokens": max_tokens}
            router = rng.choice(routers)
            async with session.post(f"{router}/v1/chat/completions", json=body) as response:
                answer = await response.json(content_type=None)
                if response.status != 200:
                    tally.failures.append(f"{response.status} {str(answer)[:200]}")
                    chat.messages.pop()
                    return
                route = response.headers.get("X-Pdserve-Route", "none")
            tally.requests += 1
            tally.routes[route] = tally.routes.get(route, 0) + 1
            chat.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, chat) for chat in chats))
    return tally


@dataclass
class KvRoutesService:
    """The deployed PDService and its operator process."""

    cluster: ClusterHelper
    namespace: str
    operator: OperatorProcess
    log: Callable[[str], None] = print

    @classmethod
    def deploy(
        cls, cluster: ClusterHelper, workdir: Path, *, routers: int, kv_events: bool, log: Callable[[str], None] = print
    ) -> KvRoutesService:
        cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(custom_resource_definition()))
        cluster.wait_crd_established()
        namespace = cluster.create_namespace("kvroutes")
        operator = OperatorProcess(
            cluster.kubeconfig, workdir / "operator.log", namespaces=[namespace], identity="kvroutes",
            lease_namespace=namespace,
        )  # fmt: skip
        service = cls(cluster, namespace, operator, log)
        try:
            operator.start().wait_ready()
            cluster.apply(manifest(namespace, routers=routers, kv_events=kv_events))
            service.wait_settled(routers, kv_events)
        except BaseException:
            operator.stop()
            raise
        return service

    def stop(self) -> None:
        self.operator.stop()

    def patch(self, *, routers: int, kv_events: bool) -> None:
        spec = manifest(self.namespace, routers=routers, kv_events=kv_events)["spec"]
        patch = {
            "spec": {"router": {"replicas": spec["router"]["replicas"]}, "engine": {"kvEvents": {"enabled": kv_events}}}
        }
        self.cluster.kubectl("patch", f"pds/{NAME}", "-n", self.namespace, "--type=merge", "-p", json.dumps(patch))
        self.wait_settled(routers, kv_events)

    def router_urls(self) -> list[str]:
        pods = [pod for pod in self.cluster.pods(self.namespace, ROUTERS) if pod_ready(pod)]
        return sorted(f"http://{pod['status']['podIP']}:{ROUTER_PORT}" for pod in pods)

    def restart_routers(self, routers: int, kv_events: bool) -> None:
        """Delete every router pod at once (a new router process each, with an empty memory) and wait for the
        replacements to serve."""
        old = {pod["metadata"]["name"] for pod in self.cluster.pods(self.namespace, ROUTERS)}
        self.cluster.kubectl("delete", "pods", "-n", self.namespace, "-l", ROUTERS, "--wait=false")

        def gone() -> bool:
            return not old & {pod["metadata"]["name"] for pod in self.cluster.pods(self.namespace, ROUTERS)}

        wait_for(gone, timeout=120, interval=0.5, message="the old router pods gone")
        self.wait_settled(routers, kv_events)

    def wait_settled(self, routers: int, kv_events: bool, timeout: float = 300.0) -> list[str]:
        """Every pod Ready with the spec's KV events setting, and every router replica using every engine (and,
        with events, subscribed to every engine)."""

        def settled() -> list[str] | None:
            engines = self.cluster.pods(self.namespace, ENGINES)
            if len(engines) != 4 or not all(map(pod_ready, engines)):
                return None
            flags = [" ".join(pod["spec"]["containers"][0].get("args", [])) for pod in engines]
            if any(("--kv-events-config" in args) != kv_events for args in flags):
                return None
            pods = self.cluster.pods(self.namespace, ROUTERS)
            if (
                len(pods) != routers
                or not all(map(pod_ready, pods))
                or any(p["metadata"].get("deletionTimestamp") for p in pods)
            ):
                return None
            urls = self.router_urls()
            for url in urls:
                try:
                    text = scrape_sync(f"{router_metrics_url(url)}/metrics", timeout=3)
                except OSError:
                    return None
                used = metric_value(text, "pdserve_router_endpoint_up", role="prefill") + metric_value(
                    text, "pdserve_router_endpoint_up", role="decode"
                )
                if used != 4:
                    return None
                if kv_events and text.count("pdserve_router_kv_index_blocks{") != 4:
                    return None
            return urls

        return wait_for(settled, timeout=timeout, interval=1.0, message=f"{routers} routers and 4 engines settled")

    def decision_seconds(self) -> tuple[float, float]:
        """(sum, count) of the routing-decision histogram over every router pod now serving."""
        total = count = 0.0
        for url in self.router_urls():
            text = scrape_sync(f"{router_metrics_url(url)}/metrics", timeout=3)
            total += metric_value(text, "pdserve_router_routing_decision_seconds_sum")
            count += metric_value(text, "pdserve_router_routing_decision_seconds_count")
        return total, count
