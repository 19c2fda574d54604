"""Benchmark: does the simulator reproduce its own timing model over HTTP, alone and under load?

Run: ``.venv/bin/python bench/sim_fidelity.py [--presets cpu-tiny,h200-8b] [--concurrency 32]``
      ``.venv/bin/python bench/sim_fidelity.py --real`` (the simulator's cpu-tiny against real vLLM, below)

For each preset a simulator subprocess (timed, not ``--fast``) serves two scenarios driven from this process:
1. one request at a time: TTFT of a 401-token prompt and the mean inter-token latency of 32 tokens;
2. ``--concurrency`` streams at once (200-token prompts, 64 tokens each): the mean inter-token latency.
Each measurement is printed next to the value the preset's cost formula predicts for it (the baseline of the
same run) as a ratio measured/modelled; 1.0 is perfect, > 1 means HTTP, the event loop or a busy machine
added latency. The simulator's own ``pdserve:sim_late_steps_total`` is shown too.

``--real``: the ``cpu-tiny`` preset against the engine it imitates. Real vLLM (the CPU build ``scripts/install.sh``
installs, serving the real-engine tier's tiny Llama with its flags, pinned to one core) and a ``cpu-tiny``
simulator, pinned to the same core in turn, get the same load: TTFT of one prompt at a time against prompt length
(64 .. 1536 tokens) and ITL against batch size (1, 4, 16 concurrent streams). Each row prints the real engine's
number, the simulator's, and the ratio simulator / real (the floor: within x1.25 either way; exit status 1 names
the rows outside it), then the cost-model parameters a least-squares fit of the real numbers gives, beside the
preset's (``sim/pdserve_sim/presets.py``), so a new CPU class is fitted by copying them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from pdserve_dev.testing.metrics import metric_value, scrape
from pdserve_dev.testing.sim import sim_process
from pdserve_sim.presets import PRESETS, TimingParams


async def _stream(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, model: str | None = None
) -> list[float]:
    """Arrival times of every token event of one streaming completion (relative to the request)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    if model:
        body["model"] = model
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


PROMPT_LENGTHS = (64, 256, 512, 1024, 1536)  # cpu-tiny's max_model_len is 2048
BATCHES = (1, 4, 16)
REAL_TOLERANCE = 1.25
MODEL = "tiny-llama"


def _prompt(length: int, number: int) -> list[int]:
    """Token ids inside the tiny model's vocabulary (800), unique per number so no prefix is cached."""
    return [3 + (number * 131 + i * 7) % 790 for i in range(length)]


async def _load_rows(url: str, *, repeat: int) -> dict[str, float]:
    """The --real scenarios against one server: median TTFT per prompt length, median ITL per batch size."""
    out: dict[str, float] = {}
    serial = iter(range(10_000))
    async with aiohttp.ClientSession() as http:
        for _ in range(2):  # warm-up: the first requests of a fresh engine pay one-time costs
            await _stream(http, url, _prompt(64, next(serial)), 4, MODEL)
        for length in PROMPT_LENGTHS:
            firsts = [(await _stream(http, url, _prompt(length, next(serial)), 2, MODEL))[0] for _ in range(repeat)]
            out[f"TTFT, {length}-token prompt"] = statistics.median(firsts)
        for batch in BATCHES:
            prompts = [_prompt(128, next(serial)) for _ in range(batch)]
            streams = await asyncio.gather(*(_stream(http, url, p, 48, MODEL) for p in prompts))
            # Steady decode only: each stream's ITL after all of them have their first token.
            start = max(times[0] for times in streams)
            itls = [_itl([t for t in times if t >= start]) for times in streams]
            out[f"ITL, batch {batch}"] = statistics.median(itls)
    return out


def _fit(real: dict[str, float]) -> dict[str, float]:
    """Least squares through the real numbers: TTFT = a + b * tokens + q * pairs (the preset's prefill with its
    attention term, pairs = n (n + 1) / 2 for a prompt with nothing cached) and ITL = c + d * batch."""
    rows = [(1.0, float(n), float(TimingParams.prefill_pairs(0, n))) for n in PROMPT_LENGTHS]
    a, b, q = _least_squares(rows, [real[f"TTFT, {n}-token prompt"] for n in PROMPT_LENGTHS])
    c, d = _least_squares([(1.0, float(n)) for n in BATCHES], [real[f"ITL, batch {n}"] for n in BATCHES])
    return {
        "ttft_fixed_s": a,
        "prefill_per_token_s": b,
        "prefill_per_pair_s": q,
        "itl_fixed_s": c,
        "decode_per_seq_s": d,
    }


def _least_squares(rows: Sequence[tuple[float, ...]], ys: list[float]) -> list[float]:
    """The coefficients minimising the squared error of ``rows @ x = ys`` (normal equations, Gauss-Jordan): a
    handful of points and two or three unknowns, so no linear-algebra library for it."""
    k = len(rows[0])
    m = [[sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))]
         for i in range(k)]  # fmt: skip
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(k):
            if r != col:
                factor = m[r][col] / m[col][col]
                m[r] = [x - factor * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][k] / m[i][i] for i in range(k)]


def run_real(repeat: int, core: int, as_json: bool) -> int:
    """The --real comparison; returns the exit status."""
    from pdserve_dev.realvllm.engine import local_engine

    with local_engine(port=18321, core=core) as url:
        real = asyncio.run(_load_rows(url, repeat=repeat))

    async def simulated() -> dict[str, float]:
        # The simulator gets the core the engine had (taskset), as the engine had it alone.
        async with sim_process(preset="cpu-tiny", model=MODEL, log_level="warning") as sim:
            os.sched_setaffinity(sim.pid, {core})
            return await _load_rows(sim.url, repeat=repeat)

    sim = asyncio.run(simulated())
    outside = []
    for scenario, measured in real.items():
        ratio = sim[scenario] / measured
        row = {"scenario": scenario, "real": measured, "simulated": sim[scenario], "ratio": ratio}
        if not 1 / REAL_TOLERANCE <= ratio <= REAL_TOLERANCE:
            outside.append(scenario)
        if as_json:
            print(json.dumps(row))
        else:
            print(f"cpu-tiny vs real vLLM  {scenario:26} real {1000 * measured:8.2f} ms  "
                  f"simulated {1000 * sim[scenario]:8.2f} ms  ratio {ratio:.2f}")  # fmt: skip
    fit = _fit(real)
    preset = PRESETS["cpu-tiny"]
    print(
        f"fit of the real engine: TTFT = {1000 * fit['ttft_fixed_s']:.2f} ms + {1e6 * fit['prefill_per_token_s']:.2f} "
        f"us/token + {1e9 * fit['prefill_per_pair_s']:.2f} ns/pair (preset: "
        f"{1000 * (preset.step_overhead + preset.prefill_fixed):.2f} ms + {1e6 * preset.prefill_per_token:.2f} us + "
        f"{1e9 * preset.prefill_per_token_pair:.2f} ns); ITL = {1000 * fit['itl_fixed_s']:.2f} ms + "
        f"{1e6 * fit['decode_per_seq_s']:.1f} us/sequence (preset: {1000 * preset.step_overhead:.2f} ms + "
        f"{1e6 * preset.decode_per_seq:.1f} us + context)"
    )
    if outside:
        print(f"outside x{REAL_TOLERANCE}: {', '.join(outside)}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="cpu-tiny,h200-8b")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print one JSON object per row")
    parser.add_argument("--real", action="store_true", help="cpu-tiny against real vLLM (the CPU build)")
    parser.add_argument("--repeat", type=int, default=5, help="--real: requests per prompt length")
    parser.add_argument("--core", type=int, default=1, help="--real: the CPU core both servers are pinned to")
    args = parser.parse_args()
    if args.real:
        return run_real(args.repeat, args.core, args.json)
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
