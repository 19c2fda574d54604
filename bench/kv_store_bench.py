"""Benchmark: what each KV path costs, PD direct against the KV store, and what a failure after prefill costs.

Run: ``.venv/bin/python bench/kv_store_bench.py [--preset h200-8b] [--tokens 4096] [--requests 8]``

A real Mooncake master and store server on loopback (`pdserve_dev.testing.mooncake`), and simulator engines in
their own processes, timed by a preset (default ``h200-8b``: Llama-3.1-8B on an H200, a 50 GB/s KV link; the KV
payload moved for real is 1 KB per token, the model's 128 KB per token is added as modelled link time, for NIXL
pulls and store reads and writes alike). Each request is a unique prompt of ``--tokens`` tokens, one at a time, so
the figures are the paths' own costs, not queueing. Driven as a PD proxy drives vLLM (KNOWLEDGE.md's three steps):

- ``prefill``: prefill's answer (its compute; the store's write goes on behind it, as vLLM queues it: shown too,
  until the write is done);
- ``decode, pulled``: decode's first token with prefill's kv_transfer_params (a NIXL pull): PD direct;
- ``decode, from store``: decode's first token for the plain request, loading the prompt from the store: what the
  router's store retry costs after a decode failure, and what a later turn on another engine costs;
- ``decode, recomputed``: decode's first token computing the whole prompt itself (no store);
- ``recovery without store`` / ``with store``: a decode failure after prefill (prefill gone): a second prefill and
  pull (without the store) against one store read (with it); the failed attempt itself (the engine's pull timeout)
  is the same in both and left out.

Ratios are against PD direct's prefill + pull of the same run. Mooncake's own put/get rate on loopback is shown too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from pdserve_dev.cluster import netns
from pdserve_dev.testing.metrics import wait_for_metric
from pdserve_dev.testing.mooncake import mooncake_store, store_transfer_config
from pdserve_dev.testing.sim import sim_process
from pdserve_sim.presets import PRESETS


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default="h200-8b", help="simulator timing preset")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--requests", type=int, default=8, help="prompts per path")
    return parser.parse_args(argv)


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Seconds until the answer's first byte (the whole answer for max_tokens 1), and the answer."""
    started = time.perf_counter()
    async with http.post(url + "/v1/completions", json=body) as resp:
        first = await resp.content.readany()
        elapsed = time.perf_counter() - started
        rest = await resp.read()
        assert resp.status == 200, (first + rest)[:300]
    text = (first + rest).decode()
    return elapsed, (json.loads(text) if not body.get("stream") else {})


def _nixl(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role})


def _prompt(index: int, tokens: int) -> list[int]:
    return [1000 + (index * 7919 + i) % 30000 for i in range(tokens)]


async def _paths(preset: str, tokens: int, requests: int, config: Path) -> dict[str, list[float]]:
    env = {"MOONCAKE_CONFIG_PATH": str(config)}
    common: dict[str, Any] = {
        "preset": preset,
        "log_level": "warning",
        "max_model_len": tokens + 64,
        "num_kv_blocks": 200_000,
    }
    timings: dict[str, list[float]] = {
        name: [] for name in ("prefill", "prefill+store", "write", "pulled", "store", "recomputed")
    }
    decode_body = {"max_tokens": 2, "stream": True, "ignore_eos": True}
    blocks = tokens // PRESETS[preset].block_size
    async with (
        sim_process("serve", "m", "--kv-transfer-config", store_transfer_config("prefill", "p"), env=env, **common)
        as prefill_store,
        sim_process(
            "serve", "m", "--kv-transfer-config", _nixl("kv_producer"), **common,
        ) as prefill_direct,
        sim_process("serve", "m", "--kv-transfer-config", store_transfer_config("decode", "d"), env=env, **common)
        as decode_store,
        sim_process(
            "serve", "m", "--kv-transfer-config", _nixl("kv_consumer"), **common,
        ) as decode_plain,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http,
    ):  # fmt: skip
        ask = {"do_remote_decode": True, "do_remote_prefill": False}
        for index in range(requests):
            # PD direct: prefill, then decode pulls over the side channel.
            prompt = _prompt(index, tokens)
            elapsed, answer = await _post(
                http, prefill_direct.url, {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": ask}
            )
            timings["prefill"].append(elapsed)
            pulled = {**decode_body, "prompt": prompt, "kv_transfer_params": answer["kv_transfer_params"]}
            timings["pulled"].append((await _post(http, decode_plain.url, pulled))[0])
            # The store: prefill writes before answering; a decode engine that has never seen the prompt loads it.
            prompt = _prompt(requests + index, tokens)
            elapsed, _ = await _post(
                http, prefill_store.url, {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": ask}
            )
            timings["prefill+store"].append(elapsed)
            # The write goes on behind the answer (vLLM queues it): the read is measured once it is done.
            started = time.perf_counter()
            total = (index + 1) * blocks
            await wait_for_metric(prefill_store.url, "pdserve:sim_kv_store_blocks_total", total, within=60, op="put")
            timings["write"].append(time.perf_counter() - started + elapsed)
            # The write goes on behind the answer (vLLM queues it): the read is measured once it is done.
            started = time.perf_counter()
            await wait_for_metric(
                prefill_store.url, "pdserve:sim_kv_store_blocks_total", (index + 1) * blocks, op="put"
            )
            timings["write"].append(time.perf_counter() - started + elapsed)
            timings["store"].append((await _post(http, decode_store.url, {**decode_body, "prompt": prompt}))[0])
            # Decode computing a prompt it has nowhere to load from.
            prompt = _prompt(2 * requests + index, tokens)
            timings["recomputed"].append((await _post(http, decode_plain.url, {**decode_body, "prompt": prompt}))[0])
    return timings


def _store_rate(store_address: str, metadata: str) -> tuple[float, float]:
    """MB/s of Mooncake puts and gets of 64 KB values on loopback, from this process."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", metadata, 0, 256 << 20, "tcp", "", store_address) == 0
    value, count = bytes(64 << 10), 256
    keys = [f"bench-{i}" for i in range(count)]
    started = time.perf_counter()
    for start in range(0, count, 32):
        assert client.put_batch(keys[start : start + 32], [value] * 32) == 0
    put = count * len(value) / (time.perf_counter() - started) / 1e6
    started = time.perf_counter()
    for start in range(0, count, 32):
        client.get_batch(keys[start : start + 32])
    get = count * len(value) / (time.perf_counter() - started) / 1e6
    client.close()
    return put, get


def main(argv: list[str]) -> int:
    args = _args(argv)
    if netns.should_isolate():
        return netns.run_in_fresh([sys.executable, str(Path(__file__).resolve()), *argv])
    import os

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with (
        tempfile.TemporaryDirectory(prefix="pdserve-kvstore-") as folder,
        mooncake_store(Path(folder), 2 << 30) as store,
    ):
        config = store.write_client_config(Path(folder) / "mooncake.json")
        timings = asyncio.run(_paths(args.preset, args.tokens, args.requests, config))
        put_rate, get_rate = _store_rate(store.master_address, store.metadata_server)
    p50 = {name: statistics.median(values) * 1000 for name, values in timings.items()}
    direct = p50["prefill"] + p50["pulled"]
    rows = [
        ("prefill (PD direct)", p50["prefill"]),
        ("prefill, with the store (its answer)", p50["prefill+store"]),
        ("prefill, with the store, until its write is done", p50["write"]),
        ("decode first token, pulled from prefill (NIXL)", p50["pulled"]),
        ("decode first token, loaded from the store", p50["store"]),
        ("decode first token, recomputed", p50["recomputed"]),
        ("PD direct, prefill + pull", direct),
        ("PD with store, prefill + pull", p50["prefill+store"] + p50["pulled"]),
        ("recovery without store: prefill again + pull", direct),
        ("recovery with store: one store read", p50["store"]),
    ]
    print(f"KV paths, {args.tokens}-token prompts, preset {args.preset}, p50 of {args.requests} each:\n")
    print("| path | ms (p50) | x PD direct |\n| --- | --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value:.1f} | x{value / direct:.2f} |")
    print(f"\nMooncake on loopback (64 KB values, batches of 32): put {put_rate:.0f} MB/s, get {get_rate:.0f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
