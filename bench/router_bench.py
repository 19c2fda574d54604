"""Benchmark: what does the pdserve router add to time-to-first-token, and how many stream chunks can it relay?

Run: ``.venv/bin/python bench/router_bench.py [--seconds 4] [--rounds 2] [--levels 1,64,256] [--max-tokens 64]``

Scenarios (``--scenario``): ``sim`` (this module, below; the default), ``pd-long`` (long unique prompts against
fast mock engines, side by side with vllm-router, a 7 MB prompt against /health: ``router_pd_long.py``, issue 12)
``prefix-accuracy`` (the router's selective-PD decisions against the simulator's real prefix cache:
``router_prefix_accuracy.py``) and ``gateway`` (Envoy + pdserve's picker + the PD sidecar against the router at
64 streams of 4k-token unique prompts: ``router_gateway.py``, issue 22). Run the heavy ones under
``flock /tmp/pdserve-heavy.lock`` on a shared machine.

One prefill and one decode ``pdserve sim`` process are the backends, first with ``--fast`` (no modelled time: the
machine saturates, which measures throughput and CPU cost), then with ``--preset h200-8b`` (streams paced like an
8B model on an H200, so TTFT is not just CPU queueing). In the same run, against the same backends, with the
same load, it measures:

- ``direct-decode``: clients stream from the decode engine itself (no router, no prefill);
- ``direct-pd``: the client runs the 3-step PD flow itself (prefill, then decode with the KV): the no-router
  baseline for routers in PD mode, since a PD request costs a prefill round trip with or without a router;
- ``pdserve-decode``: the pdserve router sending everything straight to decode (the proxy path alone);
- ``pdserve-pd``: the pdserve router disaggregating every request (threshold 0);
- ``vllm-router-pd``: vLLM's Rust router (PyPI ``vllm-router``) in PD mode, when installed.

At each concurrency level a load generator (a separate process, aiohttp, closed loop) keeps N streaming
completions open; TTFT is request sent -> first chunk, throughput is chunks received inside the measured window.
Targets run interleaved (every target once per round, ``--rounds`` rounds, medians reported) so the drift of a
shared machine hits all of them alike. "+p50/+p99" are a router's TTFT percentiles minus its baseline's
(direct-decode for pdserve-decode, direct-pd for the PD routers). "own50/own99" are the pdserve router's own
measure of its share of TTFT (``pdserve_router_added_latency_seconds``: TTFT minus time spent waiting on
engines). Router CPU (user+sys of the router process and its children, from /proc) and RSS are sampled over the
window; "chunks/CPU-s" is relayed chunks per second of router CPU, i.e. what one fully busy core relays.
``--pin`` pins the router to CPU 0 and everything else to the other CPUs.

Floors (issue 6): pdserve-pd added TTFT p50 <= 2 ms and p99 <= 10 ms at 64 streams; >= 10,000 relayed chunks per
router CPU-second. The exit status is 0 when both hold in every backend phase.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve_dev.testing.net import free_port, http_ok
from pdserve_dev.testing.wait import wait_for

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
FILLER = "The quick brown fox jumps over the lazy dog near the river bank today. "


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# --------------------------------------------------------------------------------------------------------
# Load generator (runs in its own process: `router_bench.py loadgen ...`)


class PromptMaker:
    """Unique prompts of about `tokens` tokens under the router's token model (one token per word: every word
    has at most 6 letters), cut at random places out of one pool of random words so that building a prompt costs
    the load generator a slice, not a loop. The request's own tag comes first: no two prompts share a prefix."""

    WORD_TEXT = """the of and to in is was for on that with as by at from his her they this are be it an had not or
        have which one you were all their has been more when can there would who will so about into than its them
        some could only other new time first two may then these like over any such after most also what made well
        where many before must through back years much being way under world"""
    WORDS = WORD_TEXT.split()

    def __init__(self, tokens: int, seed: int = 7) -> None:
        import random

        rng = random.Random(seed)
        count = max(tokens, 1) + 50_000
        words = [rng.choice(self.WORDS) for _ in range(count)]
        self.pool = " ".join(words)
        self.starts: list[int] = []
        offset = 0
        for word in words:
            self.starts.append(offset)
            offset += len(word) + 1
        self.starts.append(offset)
        self.tokens = tokens
        self.rng = rng

    def make(self, tag: str) -> str:
        """`tag` (one or two tokens) then random words, about `tokens` tokens in all."""
        n = max(1, self.tokens - 2)
        first = self.rng.randrange(0, len(self.starts) - n - 1)
        return f"{tag} {self.pool[self.starts[first] : self.starts[first + n] - 1]}"


async def _loadgen(  # noqa: PLR0917 (mirrors the loadgen command line)
    url: str,
    concurrency: int,
    seconds: float,
    max_tokens: int,
    warmup: float,
    prefill: str | None,
    prompt_tokens: int = 0,
) -> dict[str, Any]:
    """Closed-loop streaming load. With `prefill`, the client itself runs the PD flow (step 1 on `prefill`,
    step 3 on `url`): the no-router baseline for routers in PD mode. With `prompt_tokens`, every prompt is
    unique and about that long; otherwise prompts are short and repetitive (the original scenario)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    ttfts: list[float] = []
    chunks = 0
    requests = 0
    errors = 0
    routes: dict[str, int] = {}
    maker = PromptMaker(prompt_tokens) if prompt_tokens else None
    clock = time.perf_counter  # loop.time() is millisecond-grained on uvloop: too coarse for TTFT
    start = clock()
    measure_from = start + warmup
    stop_at = measure_from + seconds

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker(worker_id: int) -> None:
            nonlocal chunks, requests, errors
            i = 0
            while clock() < stop_at:
                i += 1
                if maker is not None:
                    prompt = maker.make(f"w{worker_id}r{i}")
                else:
                    prompt = f"bench worker {worker_id} request {i}. " + FILLER * 2
                body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
                sent = clock()
                first: float | None = None
                try:
                    if prefill is not None:
                        step1 = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
                        async with session.post(prefill + "/v1/completions", json=step1) as response:
                            answer = await response.json()
                        body["kv_transfer_params"] = answer["kv_transfer_params"]
                    async with session.post(url + "/v1/completions", json=body) as response:
                        if response.status != 200:
                            await response.read()
                            errors += 1
                            continue
                        route = response.headers.get("X-Pdserve-Route", "")
                        if route and measure_from <= sent:
                            routes[route] = routes.get(route, 0) + 1
                        async for chunk in response.content.iter_any():
                            now = clock()
                            if first is None:
                                first = now
                                # TTFT of requests sent inside the window whose first byte also came inside it.
                                if measure_from <= sent and now <= stop_at:
                                    ttfts.append(now - sent)
                            if measure_from <= now <= stop_at:
                                chunks += chunk.count(b"data: {")  # throughput: what arrived in the window
                except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                    errors += 1
                    continue
                if measure_from <= clock() <= stop_at:
                    requests += 1

        tasks = [asyncio.create_task(worker(n)) for n in range(concurrency)]
        # Requests still open a little after the window count for nothing more: do not wait for stragglers.
        await asyncio.wait(tasks, timeout=max(0.0, stop_at - clock()) + 10.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "concurrency": concurrency,
        "seconds": seconds,
        "requests": requests,
        "errors": errors,
        "chunks": chunks,
        "ttft_p50_ms": _percentile(ttfts, 50) * 1000,
        "ttft_p90_ms": _percentile(ttfts, 90) * 1000,
        "ttft_p99_ms": _percentile(ttfts, 99) * 1000,
        "routes": routes,
    }


def run_loadgen(args: argparse.Namespace) -> None:
    import uvloop

    result = uvloop.run(
        _loadgen(
            args.url, args.concurrency, args.seconds, args.max_tokens, args.warmup, args.prefill, args.prompt_tokens
        )
    )
    print(json.dumps(result))


# --------------------------------------------------------------------------------------------------------
# Processes and /proc sampling


def _descendants(pid: int) -> list[int]:
    found = [pid]
    for child in Path("/proc").iterdir():
        if not child.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            fields = (child / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) in found:
                found.append(int(child.name))
    return found


def _cpu_seconds(pid: int) -> float:
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for each in _descendants(pid):
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total


def _rss_mb(pid: int) -> float:
    total = 0
    for each in _descendants(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


class Target:
    """Where the load goes, what it is compared with, and the router process to sample (if any)."""

    def __init__(
        self,
        name: str,
        url: str,
        *,
        baseline: str | None,
        router: Proc | None = None,
        client_prefill: str | None = None,
        metrics_url: str | None = None,
    ) -> None:
        self.name = name
        self.url = url
        self.baseline = baseline
        self.router = router
        self.client_prefill = client_prefill
        self.metrics_url = metrics_url  # where the router serves /metrics (pdserve routers only)


class Proc:
    """A child process started with an optional CPU set, stopped by PID."""

    def __init__(self, args: list[str], cpus: set[int] | None, env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(
            args, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        if cpus:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(self.popen.pid, cpus)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def _wait_http(url: str, path: str, within: float = 60.0) -> None:
    wait_for(lambda: http_ok(url + path), timeout=within, interval=0.1, message=f"{url}{path} to answer 200")


# --------------------------------------------------------------------------------------------------------
# The benchmark


def _histogram(url: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a Prometheus histogram, by upper bound."""
    import urllib.request

    buckets: dict[float, float] = {}
    with contextlib.suppress(OSError), urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "_bucket{"):
                bound = line.split('le="', 1)[1].split('"', 1)[0]
                buckets[float("inf") if bound == "+Inf" else float(bound)] = float(line.rsplit(" ", 1)[1])
    return buckets


def _histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Like PromQL histogram_quantile over the increase between two scrapes (linear within a bucket)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return float("nan")
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return lower


def pdserve_router_command(port: int, metrics_port: int | None) -> list[str]:
    """`pdserve router` on loopback, quiet, serving clients on `port` and /metrics on `metrics_port` (None: a
    router from a tree that still serves /metrics on its client port, see `--baseline-tree`)."""
    cmd = [PY, "-m", "pdserve.cli", "router", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    return cmd if metrics_port is None else [*cmd, "--metrics-port", str(metrics_port)]


def tree_environment(tree: str) -> dict[str, str]:
    """The environment that makes `python -m pdserve.cli` run the code of another checkout (`--baseline-tree`):
    its import roots first on the path (they win over this checkout's editable install)."""
    root = Path(tree).resolve()
    roots = [root, root / "operator", root / "runtime", root / "sim"]
    return {"PYTHONPATH": os.pathsep.join(str(path) for path in roots)}


def vllm_router_binary() -> str | None:
    """The `vllm-router` executable beside this Python, or on PATH (None when not installed)."""
    return shutil.which("vllm-router", path=str(Path(PY).parent)) or shutil.which("vllm-router")


def _run_level(
    target: Target, level: int, args: argparse.Namespace, cpus: set[int] | None, prompt_tokens: int = 0
) -> dict[str, Any]:
    router = target.router
    cmd = [PY, __file__, "loadgen", "--url", target.url, "--concurrency", str(level), "--seconds", str(args.seconds)]
    cmd += ["--max-tokens", str(args.max_tokens), "--warmup", str(args.warmup), "--prompt-tokens", str(prompt_tokens)]
    if target.client_prefill:
        cmd += ["--prefill", target.client_prefill]
    cpu_before = _cpu_seconds(router.pid) if router else 0.0
    started = time.monotonic()
    loadgen = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(loadgen.pid, cpus)
    # Sample the router while the measured window runs (after the warm-up).
    time.sleep(args.warmup)
    own = "pdserve_router_added_latency_seconds"
    own_before = _histogram(target.metrics_url, own) if target.metrics_url else {}
    cpu_window_start = _cpu_seconds(router.pid) if router else 0.0
    window_start = time.monotonic()
    time.sleep(args.seconds)
    cpu_window = (_cpu_seconds(router.pid) - cpu_window_start) if router else 0.0
    window = time.monotonic() - window_start
    rss = _rss_mb(router.pid) if router else 0.0
    own_after = _histogram(target.metrics_url, own) if target.metrics_url else {}
    out, _ = loadgen.communicate(timeout=args.seconds + 180)
    del cpu_before, started
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    seconds = float(result["seconds"])
    result["tokens_per_s"] = result["chunks"] / seconds
    result["requests_per_s"] = result["requests"] / seconds
    result["router_cpu_pct"] = 100 * cpu_window / window if router else 0.0
    result["router_rss_mb"] = rss
    # The router's own measure of its share of TTFT (TTFT minus time waiting on engines), pdserve only.
    result["own_p50_ms"] = 1000 * _histogram_quantile(own_before, own_after, 0.5) if own_after else float("nan")
    result["own_p99_ms"] = 1000 * _histogram_quantile(own_before, own_after, 0.99) if own_after else float("nan")
    result["chunks_per_cpu_s"] = (result["tokens_per_s"] / (cpu_window / window)) if router and cpu_window else 0.0
    # Router CPU per request: CPU seconds in the window over requests completed in it (sent in it or not).
    result["cpu_ms_per_request"] = 1000 * cpu_window / result["requests"] if router and result["requests"] else 0.0
    return result


def run_bench(args: argparse.Namespace) -> int:
    levels = [int(level) for level in args.levels.split(",")]
    status = 0
    everything: dict[str, Any] = {}
    for preset in args.sim_presets.split(","):
        print(f"\n## backends: pdserve sim {'--fast' if preset == 'fast' else '--preset ' + preset}", flush=True)
        results = run_preset(args, preset, levels)
        status |= _report(results, levels, preset)
        everything[preset] = results
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=2))
    return status


def run_preset(args: argparse.Namespace, preset: str, levels: list[int]) -> dict[str, dict[int, dict[str, Any]]]:
    ncpu = os.cpu_count() or 1
    pin = ncpu >= 2 and args.pin
    router_cpus = {0} if pin else None
    other_cpus = set(range(1, ncpu)) if pin else None

    procs: list[Proc] = []
    try:
        timing = ["--fast"] if preset == "fast" else ["--preset", preset]
        sim = [PY, "-m", "pdserve_sim", *timing, "--host", "127.0.0.1", "--log-level", "warning"]
        prefill_port, decode_port = free_port(), free_port()
        prefill = Proc([*sim, "--role", "prefill", "--port", str(prefill_port), "--side-channel-port",
                        str(free_port())], other_cpus)  # fmt: skip
        decode = Proc([*sim, "--role", "decode", "--port", str(decode_port), "--side-channel-port",
                       str(free_port())], other_cpus)  # fmt: skip
        procs += [prefill, decode]
        prefill_url, decode_url = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
        _wait_http(prefill_url, "/health")
        _wait_http(decode_url, "/health")

        metrics: dict[str, str] = {}

        def pdserve(threshold: int) -> tuple[str, Proc]:
            port, metrics_port = free_port(), free_port()
            cmd = [*pdserve_router_command(port, metrics_port), "--prefill", prefill_url, "--decode", decode_url,
                   "--disaggregation-threshold", str(threshold), "--served-model-name", "sim-model"]  # fmt: skip
            proc = Proc(cmd, router_cpus)
            url = f"http://127.0.0.1:{port}"
            _wait_http(url, "/ready")
            metrics[url] = f"http://127.0.0.1:{metrics_port}"
            return url, proc

        def vllm_router() -> tuple[str, Proc]:
            binary = vllm_router_binary()
            if binary is None:
                raise FileNotFoundError("vllm-router is not installed (pip install vllm-router)")
            port = free_port()
            cmd = [binary, "--vllm-pd-disaggregation", "--prefill", prefill_url, "none", "--decode", decode_url,
                   "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
                   "--log-level", "warning", "--max-concurrent-requests", "4096", "--queue-size", "4096"]  # fmt: skip
            proc = Proc(cmd, router_cpus)
            url = f"http://127.0.0.1:{port}"
            _wait_http(url, "/health")
            return url, proc

        targets = [
            Target("direct-decode", decode_url, baseline=None),
            Target("direct-pd", decode_url, baseline=None, client_prefill=prefill_url),
        ]
        starters: list[tuple[str, Callable[[], tuple[str, Proc]], str]] = [
            ("pdserve-decode", lambda: pdserve(10**9), "direct-decode"),
            ("pdserve-pd", lambda: pdserve(0), "direct-pd"),
            ("vllm-router-pd", vllm_router, "direct-pd"),
        ]
        for name, start, baseline in starters:
            if name == "vllm-router-pd" and args.no_vllm_router:
                continue
            try:
                url, router = start()
            except (FileNotFoundError, TimeoutError) as exc:
                print(f"# {name}: skipped ({exc})", flush=True)
                continue
            procs.append(router)
            targets.append(Target(name, url, baseline=baseline, router=router, metrics_url=metrics.get(url)))

        # Interleave: every target runs once per round at a level before any runs again, so slow drifts of a
        # shared machine hit all targets alike; each figure is the median over rounds.
        rounds: dict[str, dict[int, list[dict[str, Any]]]] = {t.name: {level: [] for level in levels} for t in targets}
        for level in levels:
            for round_index in range(args.rounds):
                for target in targets:
                    result = _run_level(target, level, args, other_cpus)
                    rounds[target.name][level].append(result)
                    print(f"# {target.name} c={level} round={round_index}: {json.dumps(result)}", flush=True)
        results = {
            target.name: {level: _median(rounds[target.name][level]) | {"baseline": target.baseline}
                          for level in levels}
            for target in targets
        }  # fmt: skip
    finally:
        for proc in reversed(procs):
            proc.stop()
    return results


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-field median over rounds (numbers), first value otherwise."""
    merged: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, int | float):
            values = sorted(float(run[key]) for run in runs)
            merged[key] = values[len(values) // 2] if len(values) % 2 else sum(values[len(values) // 2 - 1 :][:2]) / 2
        else:
            merged[key] = value
    return merged


def _report(results: dict[str, dict[int, dict[str, Any]]], levels: list[int], preset: str) -> int:
    header = (f"{'target':<16}{'c':>5}{'TTFT p50':>10}{'p99':>9}{'+p50':>8}{'+p99':>8}{'own50':>7}{'own99':>7}"
              f"{'tok/s':>9}{'req/s':>8}{'CPU%':>7}{'RSS MB':>8}{'chunks/CPU-s':>14}{'err':>5}")  # fmt: skip
    print()
    print(header)
    print("-" * len(header))
    for name, by_level in results.items():
        for level in levels:
            r = by_level.get(level)
            if r is None:
                continue
            base = results.get(r["baseline"], {}).get(level) if r["baseline"] else None
            added50 = r["ttft_p50_ms"] - base["ttft_p50_ms"] if base else float("nan")
            added99 = r["ttft_p99_ms"] - base["ttft_p99_ms"] if base else float("nan")
            r["added_ttft_p50_ms"], r["added_ttft_p99_ms"] = added50, added99
            print(f"{name:<16}{level:>5}{r['ttft_p50_ms']:>10.2f}{r['ttft_p99_ms']:>9.2f}{added50:>8.2f}{added99:>8.2f}"
                  f"{r['own_p50_ms']:>7.2f}{r['own_p99_ms']:>7.2f}"
                  f"{r['tokens_per_s']:>9.0f}{r['requests_per_s']:>8.1f}{r['router_cpu_pct']:>7.0f}"
                  f"{r['router_rss_mb']:>8.0f}{r['chunks_per_cpu_s']:>14.0f}{r['errors']:>5}")  # fmt: skip
    ok = True
    ours = results.get("pdserve-pd", {})
    theirs = results.get("vllm-router-pd", {})
    print()
    if theirs:
        for level in levels:
            if level in ours and level in theirs:
                a, b = ours[level], theirs[level]
                tokens = a["tokens_per_s"] / max(1e-9, b["tokens_per_s"])
                ttft = a["ttft_p50_ms"] / max(1e-9, b["ttft_p50_ms"])
                cpu_a = a["router_cpu_pct"] / max(1e-9, a["tokens_per_s"])
                cpu_b = b["router_cpu_pct"] / max(1e-9, b["tokens_per_s"])
                print(
                    f"pdserve-pd / vllm-router-pd at c={level}: tokens/s x{tokens:.2f}, TTFT p50 x{ttft:.2f}, "
                    f"router CPU per chunk x{cpu_a / max(1e-9, cpu_b):.2f}"
                )
    if 64 in ours and "direct-pd" in results:
        p50, p99 = ours[64]["added_ttft_p50_ms"], ours[64]["added_ttft_p99_ms"]
        floor_ttft = p50 <= 2.0 and p99 <= 10.0
        ok &= floor_ttft
        print(f"floor: added TTFT at 64 streams p50 {p50:.2f} ms (<= 2), p99 {p99:.2f} ms (<= 10): "
              f"{'met' if floor_ttft else 'MISSED'}")  # fmt: skip
    capacity = max((r["chunks_per_cpu_s"] for r in ours.values()), default=0.0)
    floor_chunks = capacity >= 10_000
    ok &= floor_chunks
    print(
        f"floor: relayed chunks per router CPU-second {capacity:.0f} (>= 10000): {'met' if floor_chunks else 'MISSED'}"
    )
    print(f"(backends: {preset})")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    load = sub.add_parser("loadgen", help="internal: the load generator process")
    load.add_argument("--url", required=True)
    load.add_argument("--concurrency", type=int, required=True)
    load.add_argument("--seconds", type=float, required=True)
    load.add_argument("--max-tokens", type=int, default=64)
    load.add_argument("--warmup", type=float, default=1.0)
    load.add_argument("--prefill", help="run the PD flow client-side with this prefill engine")
    load.add_argument("--prompt-tokens", type=int, default=0, help="unique prompts of about this many tokens")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each window")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs per target and level (median)")
    parser.add_argument("--levels", default="1,64,256", help="concurrent streams, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per streamed completion")
    parser.add_argument("--no-vllm-router", action="store_true", help="skip the vllm-router comparison")
    parser.add_argument(
        "--pin", action="store_true", help="pin the router to CPU 0 and everything else to the other CPUs"
    )
    parser.add_argument(
        "--sim-presets",
        default="fast,h200-8b",
        help="backend timing, comma-separated: fast (no modelled time: saturates the machine) and/or h200-8b "
        "(streams paced like an 8B model on an H200, so TTFT is not CPU queueing)",
    )
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument(
        "--scenario",
        choices=("sim", "pd-long", "prefix-accuracy", "gateway"),
        default="sim",
        help="sim: short prompts against simulators (issue 6); pd-long: long unique prompts against fast mocks, "
        "side by side with vllm-router (issue 12, see router_pd_long.py); prefix-accuracy: the router's prefix "
        "predictions against the simulator's real prefix cache (router_prefix_accuracy.py); gateway: Envoy + "
        "pdserve's picker + the PD sidecar against the router (router_gateway.py, issue 22)",
    )
    parser.add_argument("--gateway-prompt-tokens", type=int, default=4096, help="gateway: unique prompt length")
    parser.add_argument("--gateway-itl", type=float, default=0.02, help="gateway: the decode mock's inter-token gap")
    parser.add_argument(
        "--gateway-without-relay",
        action="store_true",
        help="gateway: also measure Envoy talking to the picker's gRPC service directly (no relay)",
    )
    parser.add_argument("--cases", default="100,1k,4k,32k,4k-1,itl0", help="pd-long: which cases, comma-separated")
    parser.add_argument("--accuracy-requests", type=int, default=400, help="prefix-accuracy: requests to send")
    parser.add_argument(
        "--accuracy-routers",
        type=int,
        default=1,
        help="prefix-accuracy: router replicas (requests spread at random)",
    )
    parser.add_argument(
        "--no-kv-events", dest="kv_events", action="store_false", help="prefix-accuracy: engines publish no KV events"
    )
    parser.add_argument("--no-big-prompt", dest="big_prompt", action="store_false", help="pd-long: skip the 7 MB one")
    parser.add_argument(
        "--baseline-tree",
        help="pd-long: also run the router of this checkout (e.g. a worktree of main) as `pdserve-base`, on the "
        "same mocks in the same rounds, and report this router's added TTFT against it",
    )
    args = parser.parse_args()
    if args.command == "loadgen":
        run_loadgen(args)
        return
    sys.path.insert(0, str(ROOT))  # the scenarios live beside this file, in the bench/ namespace package
    if args.scenario == "pd-long":
        from bench.router_pd_long import run_pd_long

        sys.exit(run_pd_long(args))
    if args.scenario == "gateway":
        from bench.router_gateway import run_gateway

        sys.exit(run_gateway(args))
    if args.scenario == "prefix-accuracy":
        from bench.router_prefix_accuracy import run_prefix_accuracy

        sys.exit(run_prefix_accuracy(args))
    sys.exit(run_bench(args))


if __name__ == "__main__":
    main()
