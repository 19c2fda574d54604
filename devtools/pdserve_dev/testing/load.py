"""Load for an OpenAI-compatible server (the PD router): open-loop arrivals, closed-loop streams, trace replay.

The autoscaler's end-to-end test, the closed-loop slice of its benchmark and the demo drive the router with it.
Every request is a `/v1/completions` call with a prompt of a given number of tokens under the prompt model the
router and the simulator share (`pdserve.api.prompt`: one short word is one token), every word of it particular to
the request, so that no two prompts share a cached block anywhere (a prefix hit, or a router's estimate of one,
would discount the prefill work the load means to cause).

`Load` runs on the caller's event loop:

- `arrivals(rate, prompt_tokens, output_tokens)`: an open-loop Poisson stream of requests (arrivals do not wait for
  answers, as real users do not), until `stop_arrivals()`;
- `streams(count, prompt_tokens, output_tokens)`: `count` closed-loop clients, each sending its next request when
  the previous one is answered, until `stop_streams()`;
- `send(prompt_tokens, output_tokens)`: one request, e.g. at a trace's arrival times (the benchmark's replay).

It counts what a user would see (`LoadStats`): answered requests, failed ones (an HTTP error, a broken stream, an
`error` event inside a stream, a connection failure) with their first messages, and each answer's time to first
token, completion time and time per output token. `close()` stops everything; requests still in flight are
awaited (`drain=True`) or cancelled, and cancelled ones are counted apart: a client hanging up is not a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp


def prompt_of(tokens: int, number: int) -> str:
    """A prompt of exactly `tokens` tokens (pdserve.api.prompt: words of at most 6 letters and digits) whose words
    depend on `number`, so that prompts of different numbers share no block of tokens."""
    return " ".join(f"{chr(97 + i % 26)}{(number * 7919 + i * 104729) % 0xFFFFF:x}" for i in range(tokens))


@dataclass
class Answer:
    """One answered request."""

    started: float
    #: Seconds to the first token (streamed) or to the whole answer (not streamed).
    ttft_s: float
    seconds: float
    output_tokens: int
    route: str

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        return (self.seconds - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass
class LoadStats:
    """What the clients saw."""

    sent: int = 0
    answers: list[Answer] = field(default_factory=list)
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    cancelled: int = 0
    #: HTTP status of every answer that was not 200 (429 and 503: refused or shed by the router).
    statuses: Counter[int] = field(default_factory=Counter)

    @property
    def ok(self) -> int:
        return len(self.answers)

    def fail(self, message: str) -> None:
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append(message[:300])

    def since(self, started: float) -> list[Answer]:
        """Answers to requests sent at or after `started` (time.monotonic())."""
        return [a for a in self.answers if a.started >= started]


class Load:
    """Requests against `base_url` for model `model` (see the module docstring)."""

    def __init__(self, base_url: str, model: str, *, seed: int = 1, timeout_s: float = 300.0) -> None:
        self.base_url, self.model = base_url.rstrip("/"), model
        self.stats = LoadStats()
        self._rng = random.Random(seed)
        self._ids = itertools.count(seed * 1_000_000)  # distinct prompts across Loads of distinct seeds
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=0),
        )
        self._requests: set[asyncio.Task[None]] = set()
        self._arrivals: asyncio.Task[None] | None = None
        self._streams: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Load:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(drain=False)

    # ------------------------------------------------------------------------------------------------- shapes

    def arrivals(self, rate: float, prompt_tokens: int, output_tokens: int, *, stream: bool = True) -> None:
        """Start (or replace) an open-loop Poisson stream of `rate` requests per second."""
        self.stop_arrivals()

        async def arrive() -> None:
            while True:
                await asyncio.sleep(self._rng.expovariate(rate))
                self.send(prompt_tokens, output_tokens, stream=stream)

        self._arrivals = asyncio.create_task(arrive())

    def stop_arrivals(self) -> None:
        if self._arrivals is not None:
            self._arrivals.cancel()
            self._arrivals = None

    def streams(self, count: int, prompt_tokens: int, output_tokens: tuple[int, int], *, stream: bool = False) -> None:
        """Start `count` closed-loop clients (added to any already running); each request asks for an output
        length drawn uniformly from `output_tokens` so that the clients do not finish in lockstep."""

        async def client() -> None:
            while True:
                await self._request(prompt_tokens, self._rng.randint(*output_tokens), stream=stream)

        for _ in range(count):
            task = asyncio.create_task(client())
            self._streams.append(task)

    async def stop_streams(self) -> None:
        """Stop the closed-loop clients now; their requests in flight are cancelled (counted as cancelled)."""
        tasks, self._streams = self._streams, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def send(self, prompt_tokens: int, output_tokens: int, *, stream: bool = True) -> asyncio.Task[None]:
        """Send one request in the background; returns its task."""
        task = asyncio.create_task(self._request(prompt_tokens, output_tokens, stream=stream))
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)
        return task

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    async def close(self, *, drain: bool = True, within: float = 120.0) -> None:
        """Stop every shape; await the requests in flight (`drain`, up to `within` seconds) or cancel them."""
        self.stop_arrivals()
        await self.stop_streams()
        pending = set(self._requests)
        if drain and pending:
            _, pending = await asyncio.wait(pending, timeout=within)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._session.close()

    # ----------------------------------------------------------------------------------------------- requests

    async def _request(self, prompt_tokens: int, output_tokens: int, *, stream: bool) -> None:
        number = next(self._ids)
        body = {
            "model": self.model,
            "prompt": prompt_of(prompt_tokens, number),
            "max_tokens": output_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
        self.stats.sent += 1
        started = time.monotonic()
        try:
            async with self._session.post(f"{self.base_url}/v1/completions", json=body) as response:
                route = response.headers.get("X-Pdserve-Route", "")
                if response.status != 200:
                    self.stats.statuses[response.status] += 1
                    self.stats.fail(f"HTTP {response.status}: {(await response.text())[:200]}")
                    return
                if stream:
                    first, tokens, error = await _read_stream(response, started)
                else:
                    payload = await response.json()
                    first, tokens, error = time.monotonic() - started, _usage(payload), None
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.stats.fail(f"{type(exc).__name__}: {exc}")
            return
        if error is not None:
            self.stats.fail(error)
            return
        self.stats.answers.append(Answer(started, first, time.monotonic() - started, tokens, route))


async def _read_stream(response: aiohttp.ClientResponse, started: float) -> tuple[float, int, str | None]:
    """(time to first token, completion tokens, error) of an SSE answer."""
    first: float | None = None
    tokens = 0
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return (first if first is not None else time.monotonic() - started), tokens, None
        with contextlib.suppress(ValueError):
            event = json.loads(data)
            if "error" in event:
                return 0.0, tokens, f"error event: {str(event['error'])[:200]}"
            if event.get("choices"):
                if first is None:
                    first = time.monotonic() - started
                tokens += 1
            usage = event.get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens", tokens))
    return 0.0, tokens, "stream ended without [DONE]"


def _usage(payload: dict[str, object]) -> int:
    usage = payload.get("usage")
    if isinstance(usage, dict):
        return int(usage.get("completion_tokens", 0))
    return 0
