"""Calibration: what the product's request path costs beyond the engines' modelled steps, per hop.

Run: ``flock /tmp/pdserve-heavy.lock .venv/bin/python bench/path_costs.py [--repeat 5] [--json FILE]``

The discrete-event replay (`pdserve_dev.replay`) charges each request the engines' cost model: a prefill step, the
KV pull at the modelled link rate, decode's one-token join step. The real path charges more: the client's request
and the router's relay (HTTP, the SSE parsing of the answer), the router's own work (parsing, prompt hashing,
routing), the two engine requests of the PD route (each carries the prompt's body, which each engine parses and
tokenizes before its clock starts), and the simulator's KV side channel moving its payload over a socket before the
modelled link time. This measures them on the product's own processes on loopback, as the closed loop
(`bench/autoscaler_bench.py --cluster`) runs them: a prefill and a decode `pdserve sim` engine with the `h200-8b`
timing and the router with late binding (the rendered budgets), one request at a time through the router (the
closed loop's client, `pdserve_dev.testing.load`: streamed completions of prompts made of unique words), so that no
queue adds to anything. For each request the per-request values come from the deltas of the histograms' sums
around it (router, prefill engine, decode engine), the client's TTFT from the client; the replay's model of the
same request on idle engines from `pdserve_dev.replay` itself. Reported per hop: the measured seconds less the
replay's, per prompt length, and a least-squares line (fixed seconds + seconds per prompt token) over them: what
`pdserve_dev.replay.path.PathCosts` is set from (``LOOPBACK``, with the date and this command).

Hops (PD route; the decode-only route has the client, router and decode hop only):

- ``client``: the client's TTFT less the router's (the request's upload and parsing, the first chunk's relay and
  the client's reading of it);
- ``router``: the router's own share of its TTFT (`pdserve_router_added_latency_seconds`: TTFT less the time it
  waited on engines);
- ``engine requests``: the router's time waiting on engines less both engines' own TTFT (HTTP to and from each
  engine, each engine's parsing and tokenizing before its clock starts);
- ``KV transfer``: the decode engine's measured pull (`vllm:nixl_xfer_time_seconds`) less the modelled link time;
- ``prefill engine`` / ``decode engine``: each engine's TTFT less the replay's (the simulator's fidelity to its own
  model, with the KV transfer's excess taken out of decode's).

It runs on this machine's CPUs, idle but for it: what the hops cost without contention. The closed loop shares two
cores between seven engines, the control plane, the router and the load, and prints its own breakdown beside the
replay's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.router_bench import PY, Proc, _wait_http  # noqa: E402
from pdserve_dev.replay.cluster import ReplayCluster, ReplayConfig  # noqa: E402
from pdserve_dev.replay.gate import LateBinding  # noqa: E402
from pdserve_dev.replay.scalers import StaticScaler  # noqa: E402
from pdserve_dev.replay.trace import Request  # noqa: E402
from pdserve_dev.testing.load import Load  # noqa: E402
from pdserve_dev.testing.metrics import metric_value  # noqa: E402
from pdserve_dev.testing.net import free_port  # noqa: E402
from pdserve_dev.testing.sim import sim_process  # noqa: E402
from pdserve_operator.autoscaler.model import Slo  # noqa: E402
from pdserve_sim.presets import H200_8B  # noqa: E402

MODEL = "tiny-llama"
#: Prompt lengths of the PD route (the closed loop's code slice: 2-4k tokens, a few to 12k) and of decode-only
#: (below the threshold; up to 1024, the most the autoscaler raised the threshold to in the closed loop).
PD_LENGTHS = (256, 512, 1024, 2048, 3072, 4096, 8192, 12000)
DECODE_LENGTHS = (16, 64, 128, 255, 512, 1024)
OUTPUT_TOKENS = 16
LATE_BINDING = LateBinding.rendered(H200_8B, H200_8B)

#: (hop, metric, labels) read around every request; the value is the delta of the histogram's `_sum`.
SUMS: dict[str, tuple[str, str, dict[str, str]]] = {
    "router_ttft": ("router", "pdserve_router_time_to_first_token_seconds_sum", {}),
    "router_own": ("router", "pdserve_router_added_latency_seconds_sum", {}),
    "router_queue": ("router", "pdserve_router_queue_wait_seconds_sum", {}),
    "prefill_ttft": ("prefill", "vllm:time_to_first_token_seconds_sum", {}),
    "decode_ttft": ("decode", "vllm:time_to_first_token_seconds_sum", {}),
    "kv": ("decode", "vllm:nixl_xfer_time_seconds_sum", {}),
}


def modelled(prompt: int, route: str) -> dict[str, float]:
    """The replay's own times for one request on an idle 1 + 1 service (no path costs): prefill engine TTFT,
    decode engine TTFT, KV pull, the router's TTFT."""
    config = ReplayConfig(
        H200_8B,
        H200_8B,
        Slo(ttft_s=10.0, itl_s=1.0, percentile=90),
        (1, 1),
        disaggregation_threshold=256 if route == "pd" else 1 << 30,
        late_binding=LATE_BINDING,
    )
    outcome = ReplayCluster(config, [Request(0.0, prompt, OUTPUT_TOKENS)], StaticScaler(1, 1)).run()
    job = outcome.jobs[0]
    assert job.first_token is not None
    pd = job.route == "pd"
    return {
        "prefill_ttft": job.prefill_done - job.prefill_arrival if pd else 0.0,
        "decode_ttft": job.first_token - job.decode_arrival,
        "kv": job.pull_done - job.admitted if pd else 0.0,
        "router_ttft": job.first_token - job.arrival,
    }


async def _scrape(http: aiohttp.ClientSession, urls: dict[str, str]) -> dict[str, float]:
    texts = {}
    for name, url in urls.items():
        async with http.get(url + "/metrics") as response:
            texts[name] = await response.text()
    return {key: metric_value(texts[where], metric, **labels) for key, (where, metric, labels) in SUMS.items()}


async def _measure(
    router: str, urls: dict[str, str], lengths: Sequence[int], repeat: int, route: str
) -> list[dict[str, float]]:
    rows: list[dict[str, float]] = []
    async with aiohttp.ClientSession() as http, Load(router, MODEL, seed=7 if route == "pd" else 8) as load:
        for _warm in range(3):
            await load.send(lengths[0], OUTPUT_TOKENS)
        for prompt in lengths:
            for _ in range(repeat):
                before = await _scrape(http, urls)
                answered = len(load.stats.answers)
                await load.send(prompt, OUTPUT_TOKENS)
                await asyncio.sleep(0.05)  # the engines' last observations
                after = await _scrape(http, urls)
                if len(load.stats.answers) == answered:
                    raise RuntimeError(f"a {prompt}-token request failed: {load.stats.failures[-1:]}")
                answer = load.stats.answers[-1]
                if answer.route != route:
                    raise RuntimeError(f"a {prompt}-token request went {answer.route}, expected {route}")
                got = {key: after[key] - before[key] for key in SUMS}
                model = modelled(prompt, route)
                rows.append(
                    {
                        "prompt": prompt,
                        "client": answer.ttft_s - got["router_ttft"],
                        "router": got["router_own"],
                        "engine requests": got["router_ttft"] - got["router_own"] - got["router_queue"]
                        - got["prefill_ttft"] - got["decode_ttft"],
                        "KV transfer": got["kv"] - model["kv"],
                        "prefill engine": got["prefill_ttft"] - model["prefill_ttft"],
                        "decode engine": got["decode_ttft"] - model["decode_ttft"] - (got["kv"] - model["kv"]),
                        "total": answer.ttft_s - model["router_ttft"],
                        "client TTFT": answer.ttft_s,
                        "modelled TTFT": model["router_ttft"],
                    }
                )  # fmt: skip
    return rows


def fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y over x."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    return my - slope * mx, slope


HOPS = ("client", "router", "engine requests", "KV transfer", "prefill engine", "decode engine", "total")


def report(rows: list[dict[str, float]], route: str) -> dict[str, Any]:
    lengths = sorted({int(r["prompt"]) for r in rows})
    print(f"\n{route} route, median ms per prompt length (measured less the replay's model):")
    print(f"   {'hop':<16}" + "".join(f"{n:>8}" for n in lengths) + f"   {'fit: ms + us/token':>20}")
    fits: dict[str, Any] = {}
    for hop in (*HOPS, "client TTFT", "modelled TTFT"):
        medians = [statistics.median(r[hop] for r in rows if r["prompt"] == n) for n in lengths]
        fixed, per_token = fit(list(zip(lengths, medians, strict=True)))
        fits[hop] = {"fixed_s": fixed, "per_token_s": per_token, "median_s": dict(zip(lengths, medians, strict=True))}
        print(
            f"   {hop:<16}" + "".join(f"{m * 1000:>8.1f}" for m in medians)
            + f"   {fixed * 1000:>8.2f} + {per_token * 1e6:>6.3f}"
        )  # fmt: skip
    return fits


async def run(repeat: int) -> dict[str, Any]:
    async with (
        sim_process(role="prefill", preset="h200-8b", model=MODEL, log_level="warning") as prefill,
        sim_process(role="decode", preset="h200-8b", model=MODEL, log_level="warning") as decode,
    ):
        procs: list[Proc] = []
        routers: dict[str, tuple[str, str]] = {}
        try:
            for route, threshold in (("pd", 256), ("decode-only", 1 << 20)):
                port, metrics_port = free_port(), free_port()
                command = [
                    PY, "-m", "pdserve.cli", "router", "--host", "127.0.0.1", "--port", str(port), "--log-level",
                    "warning", "--metrics-port", str(metrics_port), "--prefill", prefill.url, "--decode", decode.url,
                    "--disaggregation-threshold", str(threshold), "--served-model-name", MODEL,
                    "--prefill-budget-tokens", str(LATE_BINDING.prefill_tokens),
                    "--decode-budget-sequences", str(LATE_BINDING.decode_sequences),
                ]  # fmt: skip
                procs.append(Proc(command, None))
                routers[route] = (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}")
            for base, metrics in routers.values():
                _wait_http(base, "/health")
                _wait_http(metrics, "/metrics")
            results: dict[str, Any] = {}
            for route, lengths in (("pd", PD_LENGTHS), ("decode-only", DECODE_LENGTHS)):
                base, metrics = routers[route]
                urls = {"router": metrics, "prefill": prefill.url, "decode": decode.url}
                rows = await _measure(base, urls, lengths, repeat, route)
                results[route] = {"rows": rows, "fits": report(rows, route)}
            return results
        finally:
            for proc in procs:
                proc.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="requests per prompt length")
    parser.add_argument("--json", metavar="FILE", help="write the rows and fits as JSON")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    results = asyncio.run(run(args.repeat))
    print(f"\n{time.perf_counter() - began:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
