"""Fast mock engines for router benchmarks: a prefill engine and a decode engine that cost almost no CPU.

Run: ``.venv/bin/python bench/pd_mock.py --prefill-port P --decode-port D [--itl 0.01]``

Why mocks and not the simulator: the router's own cost on long prompts is what a benchmark must isolate, and the
simulator tokenizes every prompt in Python (about 0.1 us per token), which on a shared 2-core machine would
compete with the router for the CPU and hide what the router adds. These mocks parse each body as JSON (as a
real engine would) and answer at once:

- prefill (``/v1/completions`` with ``kv_transfer_params.do_remote_decode``): one token and the
  ``kv_transfer_params`` a vLLM NixlConnector prefill returns, with ``remote_host`` 127.0.0.1 (the address the
  router connects to, so an address check passes);
- decode: ``max_tokens`` SSE events, the first at once and the next every ``--itl`` seconds (0: back to back, one
  write each), ``data: [DONE]`` last; a non-streaming request gets one JSON answer.

One process serves both ports on one event loop (both engines are equally cheap; a benchmark pins the process
away from the router's core).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import orjson
from aiohttp import web

_COUNTER = itertools.count()


def _kv_params(request_id: str, side_port: int) -> dict[str, object]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3, 4]],
        "remote_engine_id": "mock-prefill",
        "remote_request_id": request_id,
        "remote_host": "127.0.0.1",
        "remote_port": side_port,
        "tp_size": 1,
    }


def prefill_app(side_port: int) -> web.Application:
    async def completions(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        rid = f"cmpl-{next(_COUNTER)}"
        answer = {
            "id": rid,
            "object": "text_completion",
            "created": 0,
            "model": body.get("model"),
            "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "kv_transfer_params": _kv_params(rid, side_port),
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", _health)
    return app


def decode_app(itl: float) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        rid = f"cmpl-{next(_COUNTER)}"
        tokens = int(body.get("max_tokens") or 16)
        if body.get("stream") is not True:
            answer = {"id": rid, "object": "text_completion", "created": 0, "model": body.get("model"),
                      "choices": [{"index": 0, "text": " tok" * tokens, "finish_reason": "length"}]}  # fmt: skip
            return web.Response(body=orjson.dumps(answer), content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        head = b'data: {"id":"' + rid.encode() + b'","object":"text_completion","created":0,"model":"m","choices":'
        event = head + b'[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n'
        last = head + b'[{"index":0,"text":" tok","logprobs":null,"finish_reason":"length"}]}\n\n'
        for index in range(tokens):
            if index:
                await asyncio.sleep(itl)  # itl 0 still yields: each event is its own write, like a real engine
            await response.write(last if index == tokens - 1 else event)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", _health)
    return app


async def _health(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def serve(prefill_port: int, decode_port: int, itl: float, side_port: int) -> None:
    runners = []
    for app, port in ((prefill_app(side_port), prefill_port), (decode_app(itl), decode_port)):
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
        runners.append(runner)
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill-port", type=int, required=True)
    parser.add_argument("--decode-port", type=int, required=True)
    parser.add_argument("--itl", type=float, default=0.01, help="seconds between streamed tokens (0: unpaced)")
    parser.add_argument("--side-port", type=int, default=5600, help="remote_port the prefill mock advertises")
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.prefill_port, args.decode_port, args.itl, args.side_port))


if __name__ == "__main__":
    main()
