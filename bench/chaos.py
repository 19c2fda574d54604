"""Chaos benchmark: nothing lost under faults, in figures (issue 13).

Run: ``.venv/bin/python bench/chaos.py [--quick] [--json FILE] [--only NAME,...] [--keep-workdir]``

On a fresh local cluster (real kube-apiserver, etcd, controllers; the process node running every pod as a local
process): the operator as a process, one PDService whose engines are the simulator with the renderer's exact vLLM
command line (drain, preStop, kv-compat), the real router, and a continuous checked load through the router
(`MixedLoad`: streaming and not, long PD prompts and short ones, every answer checked to the token). Scenarios, in
this order (`pdserve_dev.chaos.scenarios`):

- ``scale-down-decode``: decode 4 -> 1 while long streams run on the engines removed;
- ``prefill-killed``: a prefill pod killed (SIGKILL, then force-deleted) while KV it produced waits to be pulled;
- ``scale-down-prefill``: prefill 2 -> 1 while KV the removed engine produced waits to be pulled;
- ``decode-scale-and-replace``: decode 1 -> 2, one decode pod deleted and replaced, then 2 -> 1;
- ``decode-killed``: a decode pod killed mid-stream;
- ``rolling-update``: the engine image changes, and with it the kv-compat value;
- ``operator-restart``: the operator SIGKILLed mid-rollout and started again;
- ``apiserver-restart``: kube-apiserver stopped under load, then started again;
- ``router-replica-killed``: two router replicas, the load on one, the other killed;
- ``prefill-killed-store``: ``prefill-killed`` with the KV store on (a real Mooncake master and store server the
  engines are pointed at): decode loads what the killed engine computed from the store, nothing is prefilled twice.

Per scenario: requests sent, succeeded, failed with an error the client was told, lost (no complete answer and no
error), answers with duplicated or missing tokens, and the worst TTFT, with its ratio to the same load's
steady-state p50 TTFT before the fault. Floors (exit status 1, naming each one missed): lost == 0 and
duplicated_tokens == 0 everywhere; failed_told == 0 for the scale-downs, the decode scale-up / replacement /
scale-down, the rolling update (where also no P/D pair of different kv-compat values ever served a request: the
simulators' mismatch counters), the restarts and the surviving router replica; for the killed pods, failures only
among the streams on that pod, each told with an error event after its first tokens (everything the protocol lets
the router retry elsewhere succeeds); with the store, failed_told == 0 and 0 requests re-prefilled after the prefill
kill (the router's reprefill retries), the store path taken (decode retries from the store); after the operator
restart the rollout completes with the same children as
before (no duplicates); after the kube-apiserver restart the operator acts again.

``--quick`` (CI) runs every scenario with a few seconds of load each; the full run keeps each phase several
times longer, with longer streams and deeper queues. ``--json FILE`` writes ``{"scenarios": [{name, sent,
succeeded, failed_told, lost, duplicated_tokens, worst_ttft_ms, ...}]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from pdserve_dev.chaos import scenarios
from pdserve_dev.chaos.outcome import Outcome, document, table
from pdserve_dev.chaos.service import ChaosService
from pdserve_dev.cluster import netns
from pdserve_dev.cluster.cluster import LocalCluster
from pdserve_dev.testing.cluster import ClusterHelper


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a few seconds of load per scenario (CI)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--only", default="", help=f"comma-separated scenarios to run (default all: {','.join(scenarios.ALL)})"
    )
    parser.add_argument("--keep-workdir", action="store_true", help="keep the cluster's logs and the operator's")
    args = parser.parse_args(argv)
    unknown = set(filter(None, args.only.split(","))) - set(scenarios.ALL)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    return args


async def run_all(service: ChaosService, names: list[str], tuning: scenarios.Tuning) -> list[Outcome]:
    outcomes = []
    for name in names:
        print(f"== {name}", flush=True)
        try:
            outcome = await scenarios.ALL[name](service, tuning)
        except Exception as exc:  # a scenario that cannot even start is a missed floor
            outcome = Outcome(name, missed=[f"the scenario ran ({type(exc).__name__}: {str(exc)[:500]})"])
        verdict = "pass" if not outcome.missed else "MISSED " + "; ".join(outcome.missed)
        print(
            f"   {outcome.sent} sent, {outcome.succeeded} ok, {outcome.failed_told} told, {outcome.lost} lost, "
            f"{outcome.duplicated_tokens} bad tokens, worst TTFT {outcome.worst_ttft_ms:.0f} ms "
            f"({outcome.seconds:.0f} s): {verdict}",
            flush=True,
        )
        for line in outcome.notes + outcome.problems[:5]:
            print(f"   {line}", flush=True)
        outcomes.append(outcome)
    return outcomes


def main(argv: list[str]) -> int:
    args = parse(argv)
    if netns.should_isolate():
        # The local cluster's pod addresses must stay on this machine: run in a namespace that has only loopback.
        return netns.run_in_fresh([sys.executable, str(Path(__file__).resolve()), *argv])
    names = [name for name in scenarios.ALL if not args.only or name in args.only.split(",")]
    tuning = scenarios.QUICK if args.quick else scenarios.FULL
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    started = time.monotonic()
    local = LocalCluster(workdir / "cluster", topology="none", process_node=True, log=print)
    service: ChaosService | None = None
    try:
        local.start()
        service = ChaosService.deploy(
            ClusterHelper.from_cluster(local), workdir, prefill=2, decode=4, max_num_seqs=scenarios.MAX_NUM_SEQS
        )
        print(f"PDService serving after {time.monotonic() - started:.0f} s", flush=True)
        outcomes = asyncio.run(run_all(service, names, tuning))
    finally:
        if service is not None:
            service.stop()
        local.stop()
        if args.keep_workdir:
            print(f"Logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    mode = "quick" if args.quick else "full"
    print(f"\nChaos ({mode}, {time.monotonic() - started:.0f} s in all):\n")
    print(table(outcomes))
    if args.json:
        args.json.write_text(json.dumps(document(outcomes, mode), indent=2) + "\n")
    missed = [f"{o.name}: {floor}" for o in outcomes for floor in o.missed]
    for line in missed:
        print(f"FLOOR MISSED {line}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
