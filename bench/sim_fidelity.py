"""Benchmark: does the simulator reproduce its own timing model over HTTP, alone and under load?

Run: ``.venv/bin/python bench/sim_fidelity.py [--presets cpu-tiny,h200-8b] [--concurrency 32]``

For each preset a simulator subprocess (timed, not ``--fast``) serves two scenarios driven from this process:
1. one request at a time: TTFT of a 401-token prompt and the mean inter-token latency of 32 tokens;
2. ``--concurrency`` streams at once (200-token prompts, 64 tokens each): the mean inter-token latency.
Each measurement is printed next to the value the preset's cost formula predicts for it (the baseline of the
same run) as a ratio measured/modelled; 1.0 is perfect, > 1 means HTTP, the event loop or a busy machine
added latency. The simulator's own ``pdserve:sim_late_steps_total`` is shown too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import aiohttp

from pdserve_dev.testing.metrics import metric_value, scrape
from pdserve_dev.testing.sim import sim_process
from pdserve_sim.presets import PRESETS, TimingParams


async def _stream(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of every token event of one streaming completion (relative to the request)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    started = time.perf_counter()
    times: list[float] = []
    async with http.post(url + "/v1/completions", json=body) as resp:
        buffer = b""
        async for chunk in resp.content.iter_any():
            now = time.perf_counter() - started
            buffer += chunk
            events = buffer.split(b"\n\n")
            buffer = events.pop()
            times.extend(now for e in events if b'"text"' in e)
    return times


def _itl(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


async def _scenarios(preset: str, timing: TimingParams, concurrency: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    async with sim_process(preset=preset, log_level="warning") as sim, aiohttp.ClientSession() as http:
        single = [await _stream(http, sim.url, [300 + i + 1000 * k for i in range(401)], 32) for k in range(3)]
        ttft = statistics.median(t[0] for t in single)
        itl = statistics.median(_itl(t) for t in single)
        rows.append({"scenario": "TTFT, 401-token prompt", "measured": ttft,
                     "modelled": timing.step_seconds(401, 0, 0)})  # fmt: skip
        rows.append({"scenario": "ITL, batch 1", "measured": itl,
                     "modelled": timing.step_seconds(0, 1, 401 + 16)})  # fmt: skip
        prompts = [[5000 + 7 * k + i for i in range(200)] for k in range(concurrency)]
        many = await asyncio.gather(*(_stream(http, sim.url, p, 64) for p in prompts))
        itl_many = statistics.median(_itl(t) for t in many)
        batch = min(concurrency, timing.max_num_seqs)
        rows.append({"scenario": f"ITL, batch {batch}", "measured": itl_many,
                     "modelled": timing.step_seconds(0, batch, batch * (200 + 32))})  # fmt: skip
        late = metric_value(await scrape(sim.url), "pdserve:sim_late_steps_total")
    for row in rows:
        row["preset"] = preset
        row["ratio"] = row["measured"] / row["modelled"]
        row["late_steps"] = late
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="cpu-tiny,h200-8b")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print one JSON object per row")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for preset in args.presets.split(","):
        rows += asyncio.run(_scenarios(preset, PRESETS[preset], args.concurrency))
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(
                f"{row['preset']:9} {row['scenario']:24} measured {1000 * row['measured']:8.2f} ms  "
                f"modelled {1000 * row['modelled']:8.2f} ms  ratio {row['ratio']:.2f}  "
                f"(late steps: {row['late_steps']:.0f})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
