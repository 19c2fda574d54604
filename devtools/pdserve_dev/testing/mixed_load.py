"""A steady, checked load through a router: the client-side truth of "nothing lost" for drain and chaos tests.

`MixedLoad` runs `concurrency` workers, each sending one request after another until stopped. The requests cycle
through a fixed mix: completions and chat, streaming and not, long prompts (unique, so the router sends them
through prefill then decode) and short ones (straight to decode), and several output lengths. Every answer is
checked to the token and sorted into one outcome, the categories issue 13's chaos table reports:

- `succeeded`: a complete answer: HTTP 200; a stream ends with `data: [DONE]`, has exactly `max_tokens` token
  events, its last one with `finish_reason: length`, and a usage event counting `max_tokens` completion tokens;
  a whole answer has `finish_reason: length` and `usage.completion_tokens == max_tokens`;
- `failed_told`: the client was told it failed: an HTTP error status, or an error event in the stream;
- `lost`: no complete answer and no error: a connection dropped or a stream cut before `[DONE]`, a timeout;
- `bad_tokens`: a complete-looking answer with a token count other than asked for (duplicated or missing tokens).

The engines never stop early (the simulator without `--eos-mean-tokens`, or `ignore_eos`), so `max_tokens` is the
exact count a correct answer has. Tests wait on the counters (`wait_succeeded`), never on time.
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
from typing import Any

import aiohttp

from pdserve_dev.testing.wait import wait_for_async

#: A worker's pause after a failed request: the first, and the most it doubles to.
_FIRST_PAUSE_S, _MAX_PAUSE_S = 0.05, 1.0
_LONG_TEXT = " ".join(f"word{i}" for i in range(300))


@dataclass(frozen=True, slots=True)
class Shape:
    """One kind of request of the mix."""

    chat: bool
    stream: bool
    long: bool
    max_tokens: int


def default_mix(max_tokens: tuple[int, ...] = (30, 120, 400)) -> list[Shape]:
    """Every combination of endpoint, streaming and prompt length, each with every output length.

    (`MixedLoad` gives each client its own order of it.)
    """
    return [
        Shape(chat, stream, long, tokens)
        for long in (True, False)
        for stream in (True, False)
        for chat in (False, True)
        for tokens in max_tokens
    ]


@dataclass
class LoadResults:
    """What the clients saw (read it after `stop`, or live)."""

    sent: int = 0
    succeeded: int = 0
    failed_told: int = 0
    lost: int = 0
    bad_tokens: int = 0
    worst_ttft_seconds: float = 0.0
    routes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    ttfts: list[tuple[float, float]] = field(default_factory=list)
    """(monotonic time of the first token, TTFT in seconds) of every stream that got a token: a chaos run splits
    them at the fault to compare the worst TTFT with the steady state's."""
    failure_kinds: Counter[str] = field(default_factory=Counter)
    """Why each `failed_told` request failed: `stream-after-tokens` (an error event once tokens had been sent:
    the only failure a router may not hide by retrying), `stream-before-tokens` (an error event before any
    token) or `http-<status>` (an error status, streamed or not)."""

    @property
    def in_flight(self) -> int:
        return self.sent - self.succeeded - self.failed_told - self.lost - self.bad_tokens

    def summary(self) -> str:
        """One line for assertion messages, with the first problems seen."""
        head = (
            f"sent={self.sent} succeeded={self.succeeded} failed_told={self.failed_told} lost={self.lost} "
            f"bad_tokens={self.bad_tokens} routes={dict(self.routes)}"
        )
        return head + "".join(f"\n  {problem}" for problem in self.problems[:10])


class MixedLoad:
    """`async with MixedLoad(router_url, model) as load: ... await load.stop()`; then read `load.results`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        concurrency: int = 8,
        mix: list[Shape] | None = None,
        request_timeout: float = 120.0,
        extra_body: dict[str, Any] | None = None,
        count_token_events: bool = True,
        pause_seconds: float = 0.0,
    ) -> None:
        """`extra_body` is merged into every request (real vLLM: `{"ignore_eos": True}`, so every answer has
        `max_tokens` tokens). `count_token_events=False` checks a stream by its usage, finish reason and `[DONE]`
        only: a real tokenizer has tokens whose text is empty on their own (special tokens, part of a UTF-8
        character), so their events carry no text; the simulator's tokens all do. `pause_seconds` is each client's
        think time after an answer: without it the clients keep every engine busy all the time, and on a machine
        of two cores a real engine starting beside busy ones took minutes instead of the 40 s it takes alone."""
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.concurrency = concurrency
        self.mix = mix or default_mix()
        self.results = LoadResults()
        self._extra_body = dict(extra_body or {})
        self._count_token_events = count_token_events
        self._pause_s = pause_seconds
        self._timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._stopping = False
        self._clients = concurrency
        self._running: dict[int, tuple[Shape, float]] = {}
        self._numbers = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._workers: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> MixedLoad:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._workers = [asyncio.create_task(self._worker(i), name=f"load-{i}") for i in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> LoadResults:
        """Send nothing more and wait for every request under way to end (each is bounded by its timeout)."""
        self._stopping = True
        if self._workers:
            await asyncio.gather(*self._workers, return_exceptions=True)
            self._workers = []
        if self._session is not None:
            await self._session.close()
            self._session = None
        return self.results

    def set_concurrency(self, clients: int) -> None:
        """Keep `clients` clients sending (at most the starting number); the others stop after their request."""
        self._clients = clients

    def young(self, min_tokens: int, within: float) -> int:
        """Requests under way that asked for at least `min_tokens` tokens and started less than `within` s ago."""
        now = time.monotonic()
        return sum(
            1 for shape, started in self._running.values() if shape.max_tokens >= min_tokens and now - started < within
        )

    async def wait_succeeded(self, count: int, within: float = 120.0) -> None:
        """Wait until `count` requests in all have succeeded (a counted event, whatever the wall clock says)."""

        async def reached() -> bool:
            return self.results.succeeded >= count

        await wait_for_async(
            reached, within=within, interval=0.1, message=lambda: f"{count} successes ({self.results.summary()})"
        )

    # -- one worker ---------------------------------------------------------------------------------------------

    async def _worker(self, index: int) -> None:
        # Each client runs the whole mix in its own fixed order: clients started together do not stay in step
        # (all in long streams at once, then all in short ones), so at any moment the lengths are mixed.
        order = list(self.mix)
        random.Random(index).shuffle(order)
        shapes = itertools.cycle(order)
        pause = 0.0
        while not self._stopping and index < self._clients:
            outcome = await self._one(next(shapes), next(self._numbers))
            # A client whose request failed waits before its next one (50 ms, doubling to 1 s; a success resets
            # it), as a real client backs off: against a router that refuses connections at once, workers that
            # retried at once spun the machine's cores and slowed everything else under test.
            failed = outcome in ("failed_told", "lost")
            pause = min(max(pause * 2, _FIRST_PAUSE_S), _MAX_PAUSE_S) if failed else 0.0
            if pause or self._pause_s:
                await asyncio.sleep(max(pause, self._pause_s))

    async def _one(self, shape: Shape, number: int) -> str:
        """Send one request of `shape`; its outcome (a `LoadResults` counter's name)."""
        session = self._session
        assert session is not None
        # A unique head keeps every long prompt uncached: the router sends it through prefill.
        text = f"Request {number}. {_LONG_TEXT}" if shape.long else f"Say hi to number {number}."
        body: dict[str, Any] = {
            **self._extra_body,
            "model": self.model,
            "max_tokens": shape.max_tokens,
            "stream": shape.stream,
        }
        if shape.chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if shape.stream:
            body["stream_options"] = {"include_usage": True}
        path = "/v1/chat/completions" if shape.chat else "/v1/completions"
        results = self.results
        results.sent += 1
        started = time.monotonic()
        self._running[number] = (shape, started)
        label = f"#{number} {path} stream={shape.stream} long={shape.long} max_tokens={shape.max_tokens}"
        try:
            return await self._send(session, path, body, shape=shape, started=started, label=label)
        finally:
            del self._running[number]

    async def _send(
        self,
        session: aiohttp.ClientSession,
        path: str,
        body: dict[str, Any],
        *,
        shape: Shape,
        started: float,
        label: str,
    ) -> str:
        results = self.results
        try:
            async with session.post(self.base_url + path, json=body, timeout=self._timeout) as response:
                results.routes[response.headers.get("X-Pdserve-Route", "?")] += 1
                if response.status != 200:
                    detail = (await response.read())[:300].decode(errors="replace")
                    results.failure_kinds[f"http-{response.status}"] += 1
                    self._count("failed_told", f"{label}: HTTP {response.status}: {detail}")
                    return "failed_told"
                if shape.stream:
                    outcome, why = await _check_stream(response, shape, started, results, self._count_token_events)
                else:
                    outcome, why = _check_whole(await response.read(), shape)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            self._count("lost", f"{label}: {type(exc).__name__}: {exc}")
            return "lost"
        self._count(outcome, f"{label}: {why}" if why else "")
        return outcome

    def _count(self, outcome: str, problem: str) -> None:
        results = self.results
        setattr(results, outcome, getattr(results, outcome) + 1)
        if problem and outcome != "succeeded":
            results.problems.append(problem)


def _tokens_of(chunk: dict[str, Any]) -> int:
    """Token events in one stream chunk: choices with generated text (the chat opening's empty delta is none)."""
    count = 0
    for choice in chunk.get("choices") or ():
        piece = choice.get("text")
        if piece is None:
            piece = (choice.get("delta") or {}).get("content")
        count += 1 if piece else 0
    return count


async def _check_stream(
    response: aiohttp.ClientResponse, shape: Shape, started: float, results: LoadResults, count_events: bool = True
) -> tuple[str, str]:
    tokens = 0
    usage: int | None = None
    finish: str | None = None
    buffer = b""
    async for data in response.content.iter_any():
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            payload = event.removeprefix(b"data: ").strip()
            if payload == b"[DONE]":
                if buffer.strip():
                    return "bad_tokens", f"bytes after [DONE]: {buffer[:100]!r}"
                events_ok = tokens == shape.max_tokens or not count_events
                if usage != shape.max_tokens or not events_ok or finish != "length":
                    return "bad_tokens", f"{tokens} token events, usage {usage}, finish {finish}"
                return "succeeded", ""
            try:
                chunk = json.loads(payload)
            except ValueError:
                return "bad_tokens", f"not JSON: {payload[:100]!r}"
            if "error" in chunk:
                results.failure_kinds["stream-after-tokens" if tokens else "stream-before-tokens"] += 1
                return "failed_told", f"error event after {tokens} tokens: {chunk['error']}"
            found = _tokens_of(chunk)
            if found and tokens == 0:
                now = time.monotonic()
                results.worst_ttft_seconds = max(results.worst_ttft_seconds, now - started)
                results.ttfts.append((now, now - started))
            tokens += found
            for choice in chunk.get("choices") or ():
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage") and not chunk.get("choices"):
                usage = chunk["usage"].get("completion_tokens")
    return "lost", f"the stream ended after {tokens} tokens without [DONE]"


def _check_whole(raw: bytes, shape: Shape) -> tuple[str, str]:
    with contextlib.suppress(ValueError):
        answer = json.loads(raw)
        choice = (answer.get("choices") or [{}])[0]
        completion = (answer.get("usage") or {}).get("completion_tokens")
        if completion == shape.max_tokens and choice.get("finish_reason") == "length":
            return "succeeded", ""
        return "bad_tokens", f"completion_tokens {completion}, finish {choice.get('finish_reason')}"
    return "lost", f"not a JSON answer: {raw[:100]!r}"
