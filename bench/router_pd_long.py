"""The `pd-long` scenario of `router_bench.py`: the router's cost on the PD path with long, unique prompts.

Run: ``flock /tmp/pdserve-heavy.lock .venv/bin/python bench/router_bench.py --scenario pd-long --pin``

Backends are the fast mock engines of ``pd_mock.py`` (one process: a prefill mock and a decode mock), paced at
10 ms between tokens, 64 output tokens per request, every prompt unique (so no prefix cache helps anyone). The
same mocks serve, interleaved round by round:

- ``direct-pd``: the load generator runs the 3-step PD flow itself (prefill, then decode with the KV): the
  no-router baseline;
- ``pdserve-pd``: the pdserve router with threshold 0 (every request through prefill; prompt analysis, prefix
  tracking and scheduling all run as usual);
- ``vllm-router-pd``: vLLM's Rust router 0.1.17 in PD mode, round robin;
- ``pdserve-base`` (with ``--baseline-tree PATH``): the pdserve router of another checkout, e.g. a worktree of
  main, so that a change is measured against the code before it in the same run.

Cases (``--cases``): 64 streams with prompts of 100 / 1k / 4k / 32k tokens, 1 stream with 4k tokens, and 64
unpaced streams (mocks at ITL 0) with 1k tokens, where relayed events per second against direct PD show whether
the router keeps up. Then a 7 MB prompt is sent again and again while 64 paced 4k-token streams run and a probe
reads ``/health`` every 10 ms: the added latency of /health and of the other streams' first tokens show whether
one huge body stalls the router.

Reported: added TTFT p50/p99 against direct-pd in the same round, router CPU milliseconds per request (user + sys
of the router process over the window / requests finished in it), events per second, share of PD routes.
Floors (issue 12): at 64 streams with 4k tokens added TTFT <= 1 ms p50 and <= 5 ms p99; at 1 stream <= 0.5 ms;
CPU per request <= 1.5x vllm-router's; ITL-0 relay >= x0.95 of direct PD; a 7 MB prompt delays /health and other
requests by <= 50 ms. The exit status is 0 when all hold.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from bench.router_bench import (
    PY,
    ROOT,
    Proc,
    PromptMaker,
    Target,
    _percentile,
    _run_level,
    _wait_http,
    pdserve_router_command,
    tree_environment,
    vllm_router_binary,
)
from pdserve_dev.testing.net import free_port

CASES = {
    "100": (100, 64, "paced"),
    "1k": (1000, 64, "paced"),
    "4k": (4000, 64, "paced"),
    "32k": (32000, 64, "paced"),
    "4k-1": (4000, 1, "paced"),
    "itl0": (1000, 64, "unpaced"),
}
BIG_PROMPT_BYTES = 7_000_000
# One stream finishes a request every 0.65 s: its window is longer, for enough first tokens to take a median of.
WINDOW_FACTOR = {"4k-1": 4.0}


@dataclass
class Backend:
    """One mock process and the routers in front of it."""

    prefill: str
    decode: str
    targets: list[Target]


@dataclass(frozen=True)
class Placement:
    """Which CPUs the routers get and which everything else gets (None: no pinning)."""

    router: set[int] | None
    other: set[int] | None


def _start_backend(  # noqa: PLR0917 (one call site per backend, every argument differs)
    name: str, itl: float, placement: Placement, procs: list[Proc], with_vllm: bool, baseline_tree: str | None
) -> Backend:
    prefill_port, decode_port = free_port(), free_port()
    mock = Proc([PY, str(ROOT / "bench" / "pd_mock.py"), "--prefill-port", str(prefill_port), "--decode-port",
                 str(decode_port), "--itl", str(itl)], placement.other)  # fmt: skip
    procs.append(mock)
    prefill, decode = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    _wait_http(prefill, "/health")
    _wait_http(decode, "/health")
    targets = [Target("direct-pd", decode, baseline=None, client_prefill=prefill)]

    pd_flags = ["--prefill", prefill, "--decode", decode, "--disaggregation-threshold", "0", "--served-model-name", "m",
                "--engine-metrics-interval", "0"]  # fmt: skip
    port, metrics_port = free_port(), free_port()
    # The admission gate on, with a prefill budget that never binds (the mocks have no capacity to protect): its
    # cost per request is in the figures; the baseline tree may not know the flag.
    gated = ["--prefill-budget-tokens", str(1 << 40)]
    router = Proc([*pdserve_router_command(port, metrics_port), *pd_flags, *gated], placement.router)
    procs.append(router)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url, "/ready")
    targets.append(Target("pdserve-pd", url, baseline="direct-pd", router=router,
                          metrics_url=f"http://127.0.0.1:{metrics_port}"))  # fmt: skip
    if baseline_tree:
        port, metrics_port = free_port(), free_port()
        command = pdserve_router_command(port, metrics_port)
        base = Proc([*command, *pd_flags], placement.router, tree_environment(baseline_tree))
        procs.append(base)
        url = f"http://127.0.0.1:{port}"
        _wait_http(url, "/ready")
        targets.append(Target("pdserve-base", url, baseline="direct-pd", router=base,
                              metrics_url=f"http://127.0.0.1:{metrics_port}"))  # fmt: skip
    binary = vllm_router_binary()
    if with_vllm and binary:
        port = free_port()
        peer = Proc([binary, "--vllm-pd-disaggregation", "--prefill", prefill, "none", "--decode", decode,
                     "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
                     str(free_port()), "--log-level", "warning", "--max-concurrent-requests", "4096",
                     "--queue-size", "4096"], placement.router)  # fmt: skip
        procs.append(peer)
        url = f"http://127.0.0.1:{port}"
        _wait_http(url, "/health")
        targets.append(Target("vllm-router-pd", url, baseline="direct-pd", router=peer))
    print(f"# backend {name}: mocks at ITL {itl} s, targets {[t.name for t in targets]}", flush=True)
    return Backend(prefill, decode, targets)


def _median(values: list[float]) -> float:
    """The median of the rounds that measured something (a round whose window saw no first token is NaN)."""
    ordered = sorted(value for value in values if not math.isnan(value))
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _row(result: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """One target's figures in one round, against direct-pd in the same round."""
    routes = result["routes"]
    return {
        "added_p50": result["ttft_p50_ms"] - base["ttft_p50_ms"],
        "added_p99": result["ttft_p99_ms"] - base["ttft_p99_ms"],
        "ttft_p50": result["ttft_p50_ms"],
        "ttft_p99": result["ttft_p99_ms"],
        "relay": result["tokens_per_s"] / max(1e-9, base["tokens_per_s"]),
        "events_per_s": result["tokens_per_s"],
        "cpu_ms": result["cpu_ms_per_request"],
        "own_p50": result["own_p50_ms"],
        "cpu_pct": result["router_cpu_pct"],
        "pd_share": routes.get("pd", 0) / max(1, sum(routes.values())) if routes else float("nan"),
        "errors": result["errors"],
    }


def _run_case(
    case: str, backend: Backend, args: argparse.Namespace, other: set[int] | None
) -> dict[str, dict[str, float]]:
    """Every target of the case's backend, interleaved round by round; per-field medians over rounds."""
    tokens, streams, _ = CASES[case]
    window = argparse.Namespace(**{**vars(args), "seconds": args.seconds * WINDOW_FACTOR.get(case, 1.0)})
    runs: dict[str, list[dict[str, float]]] = {}
    for round_index in range(args.rounds):
        by_target: dict[str, dict[str, Any]] = {}
        for target in backend.targets:
            result = _run_level(target, streams, window, other, prompt_tokens=tokens)
            by_target[target.name] = result
            print(f"# {case} {target.name} round={round_index}: ttft p50 {result['ttft_p50_ms']:.2f} "
                  f"p99 {result['ttft_p99_ms']:.2f} ev/s {result['tokens_per_s']:.0f} "
                  f"cpu/req {result['cpu_ms_per_request']:.3f} ms err {result['errors']} "
                  f"routes {result['routes']}", flush=True)  # fmt: skip
        for name, result in by_target.items():
            runs.setdefault(name, []).append(_row(result, by_target["direct-pd"]))
    return {name: {key: _median([row[key] for row in rows]) for key in rows[0]} for name, rows in runs.items()}


def run_pd_long(args: argparse.Namespace) -> int:
    ncpu = os.cpu_count() or 1
    pin = ncpu >= 2 and args.pin
    placement = Placement({0} if pin else None, set(range(1, ncpu)) if pin else None)
    cases = [case.strip() for case in args.cases.split(",") if case.strip()]
    procs: list[Proc] = []
    ok = True
    try:
        backends: dict[str, Backend] = {}
        with_vllm = not args.no_vllm_router
        if any(CASES[case][2] == "paced" for case in cases) or args.big_prompt:
            backends["paced"] = _start_backend("paced", 0.01, placement, procs, with_vllm, args.baseline_tree)
        if any(CASES[case][2] == "unpaced" for case in cases):
            backends["unpaced"] = _start_backend("unpaced", 0.0, placement, procs, with_vllm, args.baseline_tree)
        if placement.other:
            os.sched_setaffinity(0, placement.other)
        table = {case: _run_case(case, backends[CASES[case][2]], args, placement.other) for case in cases}
        ok &= _report(table)
        if args.big_prompt:
            ok &= _big_prompt(backends["paced"], args, placement.other)
    finally:
        for proc in reversed(procs):
            proc.stop()
    return 0 if ok else 1


def _report(table: dict[str, dict[str, dict[str, float]]]) -> bool:
    nan = float("nan")
    print()
    print("| prompt | streams | pdserve added TTFT p50 / p99 | vllm-router added TTFT p50 / p99 | CPU per request "
          "pdserve / vllm-router | ratio | events/s vs direct PD, pdserve / vllm-router | PD share |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for case, rows in table.items():
        tokens, streams, kind = CASES[case]
        ours, theirs = rows.get("pdserve-pd", {}), rows.get("vllm-router-pd", {})
        ratio = ours.get("cpu_ms", nan) / theirs["cpu_ms"] if theirs.get("cpu_ms") else nan
        print(f"| {tokens} tokens{', ITL 0' if kind == 'unpaced' else ''} | {streams} | "
              f"{ours.get('added_p50', nan):+.2f} / {ours.get('added_p99', nan):+.2f} ms | "
              f"{theirs.get('added_p50', nan):+.2f} / {theirs.get('added_p99', nan):+.2f} ms | "
              f"{ours.get('cpu_ms', nan):.2f} / {theirs.get('cpu_ms', nan):.2f} ms | x{ratio:.2f} | "
              f"x{ours.get('relay', nan):.3f} / x{theirs.get('relay', nan):.3f} | "
              f"{100 * ours.get('pd_share', 0):.0f} % |")  # fmt: skip
    print()
    checks: list[tuple[str, bool]] = []
    if "4k" in table:
        ours = table["4k"]["pdserve-pd"]
        checks.append((f"64 streams 4k: added TTFT p50 {ours['added_p50']:.2f} ms (<= 1), p99 {ours['added_p99']:.2f} "
                       "ms (<= 5)", ours["added_p50"] <= 1.0 and ours["added_p99"] <= 5.0))  # fmt: skip
        peer = table["4k"].get("vllm-router-pd")
        if peer and peer["cpu_ms"]:
            ratio = ours["cpu_ms"] / peer["cpu_ms"]
            checks.append((f"CPU per request x{ratio:.2f} of vllm-router's (<= 1.5)", ratio <= 1.5))
    if "4k-1" in table:
        ours = table["4k-1"]["pdserve-pd"]
        checks.append((f"1 stream 4k: added TTFT p50 {ours['added_p50']:.2f} ms (<= 0.5)", ours["added_p50"] <= 0.5))
    if "itl0" in table:
        relay = table["itl0"]["pdserve-pd"]["relay"]
        checks.append((f"ITL 0: relayed events x{relay:.3f} of direct PD (>= 0.95)", relay >= 0.95))
    lengths = [case for case in ("100", "1k", "4k", "32k") if case in table]
    if len(lengths) >= 2:
        spread = [table[case]["pdserve-pd"]["added_p50"] for case in lengths]
        checks.append((f"added TTFT p50 over prompt lengths {', '.join(lengths)}: "
                       f"{', '.join(f'{v:+.2f}' for v in spread)} ms (all <= 1)", max(spread) <= 1.0))  # fmt: skip
    for text, held in checks:
        print(f"floor: {text}: {'met' if held else 'MISSED'}")
    _report_against_baseline(table)
    return all(held for _, held in checks)


def _report_against_baseline(table: dict[str, dict[str, dict[str, float]]]) -> None:
    """With --baseline-tree: this router's added TTFT and CPU against the other checkout's, case by case."""
    if not any("pdserve-base" in rows for rows in table.values()):
        return
    print()
    print("| prompt | streams | added TTFT p50 this / baseline tree | p99 this / baseline | difference p50 | "
          "router's own share of TTFT p50 this / baseline | CPU per request this / baseline |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case, rows in table.items():
        tokens, streams, kind = CASES[case]
        ours, base = rows.get("pdserve-pd"), rows.get("pdserve-base")
        if ours is None or base is None:
            continue
        print(f"| {tokens} tokens{', ITL 0' if kind == 'unpaced' else ''} | {streams} | "
              f"{ours['added_p50']:+.2f} / {base['added_p50']:+.2f} ms | {ours['added_p99']:+.2f} / "
              f"{base['added_p99']:+.2f} ms | {ours['added_p50'] - base['added_p50']:+.2f} ms | "
              f"{ours['own_p50']:.3f} / {base['own_p50']:.3f} ms | "
              f"{ours['cpu_ms']:.2f} / {base['cpu_ms']:.2f} ms |")  # fmt: skip


def _big_prompt(backend: Backend, args: argparse.Namespace, other: set[int] | None) -> bool:
    """A 7 MB prompt, sent again and again, against /health and 64 paced 4k-token streams (pdserve only)."""
    import subprocess

    import orjson

    target = next(t for t in backend.targets if t.name == "pdserve-pd")
    maker = PromptMaker(BIG_PROMPT_BYTES // 5)
    text = maker.make("big")
    while len(text) < BIG_PROMPT_BYTES:
        text += " " + text[: BIG_PROMPT_BYTES - len(text)]
    body = orjson.dumps({"model": "m", "prompt": text[:BIG_PROMPT_BYTES], "max_tokens": 1})
    results: dict[str, dict[str, float]] = {}
    for phase in ("without", "with"):
        cmd = [PY, str(ROOT / "bench" / "router_bench.py"), "loadgen", "--url", target.url, "--concurrency", "64",
               "--seconds", str(args.seconds), "--max-tokens", str(args.max_tokens), "--warmup", str(args.warmup),
               "--prompt-tokens", "4000"]  # fmt: skip
        loadgen = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        if other:
            os.sched_setaffinity(loadgen.pid, other)
        probe = asyncio.run(_probe(target.url, body if phase == "with" else None, args.warmup, args.seconds))
        out, _ = loadgen.communicate(timeout=args.seconds + 180)
        load = orjson.loads(out.strip().splitlines()[-1])
        results[phase] = probe | {"stream_ttft_p50": load["ttft_p50_ms"], "stream_ttft_p99": load["ttft_p99_ms"],
                                  "errors": load["errors"]}  # fmt: skip
        print(f"# 7 MB prompt {phase}: {results[phase]}", flush=True)
    without, with_big = results["without"], results["with"]
    health_delay = with_big["health_max"] - without["health_p50"]
    stream_delay = with_big["stream_ttft_p99"] - without["stream_ttft_p99"]
    print()
    print(
        "| 7 MB prompts | /health p50 | /health p99 | /health max | other streams TTFT p50 | p99 | big prompts sent |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for phase, row in results.items():
        health = f"{row['health_p50']:.2f} ms | {row['health_p99']:.2f} ms | {row['health_max']:.2f} ms"
        streams = f"{row['stream_ttft_p50']:.2f} ms | {row['stream_ttft_p99']:.2f} ms"
        print(f"| {phase} | {health} | {streams} | {row['big_sent']:.0f} |")
    held = health_delay <= 50.0 and stream_delay <= 50.0
    print(f"floor: a 7 MB prompt delays /health by {health_delay:.1f} ms at most (max minus p50 without) and "
          f"other streams' TTFT p99 by {stream_delay:.1f} ms (<= 50): {'met' if held else 'MISSED'}")  # fmt: skip
    return held


async def _probe(url: str, big: bytes | None, warmup: float, seconds: float) -> dict[str, float]:
    """Read /health every 10 ms for the measured window; meanwhile post `big` back to back when given."""
    import aiohttp

    latencies: list[float] = []
    sent = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.sleep(warmup)
        stop = time.perf_counter() + seconds

        async def bigs() -> None:
            nonlocal sent
            assert big is not None
            headers = {"Content-Type": "application/json"}
            while time.perf_counter() < stop:
                async with session.post(url + "/v1/completions", data=big, headers=headers) as response:
                    await response.read()
                    sent += 1

        task = asyncio.create_task(bigs()) if big is not None else None
        while time.perf_counter() < stop:
            began = time.perf_counter()
            async with session.get(url + "/health") as response:
                await response.read()
            latencies.append(1000 * (time.perf_counter() - began))
            await asyncio.sleep(0.01)
        if task is not None:
            await task
    return {
        "health_p50": _percentile(latencies, 50),
        "health_p99": _percentile(latencies, 99),
        "health_max": max(latencies),
        "big_sent": float(sent),
    }
