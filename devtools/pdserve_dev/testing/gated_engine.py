"""A fake engine on a real loopback socket that holds every generation request until the test lets it go.

Why a fake and not the simulator: the admission tests need an engine whose requests end exactly when the test
says (so what waits where is a counted state, not a race against compute time), and an exact count, at every
moment, of what the engine holds at once (requests and prompt tokens), the quantity router budgets bound. The
simulator computes as fast as its timing model says and reports its load only by polling.

It speaks just enough of vLLM's OpenAI API for the router: `POST /v1/completions` (prefill: one token and the
`kv_transfer_params` a NixlConnector prefill returns, `remote_host` 127.0.0.1; decode: a JSON completion, or an
SSE stream of one event and `[DONE]`), `GET /health` (200, or 503 while `ready` is False), `GET /v1/models`,
and `GET /metrics` with `vllm:num_requests_running` (what it holds, plus `others`). Prompts are token-id lists,
so the tokens an engine holds are exact (`len(prompt)`); a request's first token id names its client in `seen`.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from aiohttp import web

_IDS = itertools.count()


@dataclass(eq=False)
class HeldRequest:
    """One request the engine holds."""

    tokens: int
    tag: int  # the prompt's first token id (tests use it to name the client)
    gate: asyncio.Event = field(default_factory=asyncio.Event)


class GatedEngine:
    """See the module docstring. `hold`: requests wait for `release`/`open` (False: answered at once)."""

    def __init__(self, role: Literal["prefill", "decode"], *, hold: bool = True) -> None:
        self.role = role
        self.hold = hold
        self.ready = True
        self.others = 0  # added to the running requests /metrics reports (load the router did not send)
        self.held: list[HeldRequest] = []
        self.seen: list[HeldRequest] = []  # every request, in arrival order
        self.peak_requests = 0
        self.peak_tokens = 0
        self.metrics_reads = 0
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def held_tokens(self) -> int:
        return sum(request.tokens for request in self.held)

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        self.open()
        if self._runner is not None:
            await self._runner.cleanup()

    # -- the test's side ----------------------------------------------------------------------------------------

    def release(self, count: int = 1) -> None:
        """Let the `count` oldest held requests answer."""
        for request in self.held[:count]:
            request.gate.set()

    def release_tag(self, tag: int) -> None:
        """Let every held request of client `tag` answer."""
        for request in self.held:
            if request.tag == tag:
                request.gate.set()

    def open(self) -> None:
        """Answer everything held, and every later request at once."""
        self.hold = False
        for request in self.held:
            request.gate.set()

    async def wait_until(self, predicate: Any, within: float = 20.0) -> None:
        """Wait (bounded) until `predicate(self)` holds, re-checked at every arrival and answer."""
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(lambda: predicate(self))

    # -- the engine's side --------------------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        prompt = body.get("prompt")
        ids = prompt if isinstance(prompt, list) else []
        held = HeldRequest(tokens=len(ids), tag=int(ids[0]) if ids else -1)
        await self._arrive(held)
        try:
            if self.hold:
                await held.gate.wait()
        finally:
            await self._leave(held)
        rid = f"cmpl-{next(_IDS)}"
        if self.role == "prefill":
            answer: dict[str, Any] = _completion(rid, body, " a")
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[1]],
                "remote_engine_id": "gated-prefill",
                "remote_request_id": rid,
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
            }
            return web.Response(body=orjson.dumps(answer), content_type="application/json")
        if body.get("stream") is True:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"data: " + orjson.dumps(_completion(rid, body, " ok")) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.Response(body=orjson.dumps(_completion(rid, body, " ok")), content_type="application/json")

    async def _arrive(self, held: HeldRequest) -> None:
        async with self._changed:
            self.held.append(held)
            self.seen.append(held)
            self.peak_requests = max(self.peak_requests, len(self.held))
            self.peak_tokens = max(self.peak_tokens, self.held_tokens)
            self._changed.notify_all()

    async def _leave(self, held: HeldRequest) -> None:
        async with self._changed:
            self.held.remove(held)
            self._changed.notify_all()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503, text="ok" if self.ready else "not ready")

    async def _models(self, _request: web.Request) -> web.Response:
        model = {"id": "sim-model", "object": "model", "max_model_len": 1_000_000}
        return web.Response(body=orjson.dumps({"object": "list", "data": [model]}), content_type="application/json")

    async def _metrics(self, _request: web.Request) -> web.Response:
        async with self._changed:
            self.metrics_reads += 1
            self._changed.notify_all()
        text = f'vllm:num_requests_running{{engine="0"}} {len(self.held) + self.others}\n'
        text += 'vllm:num_requests_waiting{engine="0"} 0\n'
        return web.Response(text=text, content_type="text/plain")


def _completion(rid: str, body: dict[str, Any], text: str) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": 0,
        "model": body.get("model"),
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
