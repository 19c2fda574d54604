"""The replay's path costs: every hop of a request's path is charged where the product pays it, and only there."""

from __future__ import annotations

import pytest

from pdserve_dev.replay.cluster import ReplayCluster, ReplayConfig, met
from pdserve_dev.replay.engines import Job
from pdserve_dev.replay.gate import LateBinding
from pdserve_dev.replay.path import IDEAL, LOOPBACK, Hop, PathCosts
from pdserve_dev.replay.scalers import StaticScaler
from pdserve_dev.replay.trace import Request
from pdserve_operator.autoscaler.model import Slo
from pdserve_sim.presets import H200_8B

SLO = Slo(ttft_s=0.3, itl_s=0.04, percentile=90)
#: Hops of distinct sizes, so that a hop charged twice or not at all shows in the sums.
PATH = PathCosts(
    router=Hop(0.001, 1e-6),
    engine_requests=Hop(0.010, 4e-6),
    decode_request=Hop(0.003, 2e-6),
    kv_transfer=Hop(0.002, 3e-6),
    client=Hop(0.020, 0.0),
)


def one(prompt: int, path: PathCosts, *, late_binding: bool = True) -> Job:
    """One request on an idle 1 + 1 service."""
    config = ReplayConfig(
        H200_8B,
        H200_8B,
        SLO,
        (1, 1),
        late_binding=LateBinding.rendered(H200_8B, H200_8B) if late_binding else None,
        path=path,
    )
    outcome = ReplayCluster(config, [Request(0.0, prompt, 8)], StaticScaler(1, 1)).run()
    (job,) = outcome.jobs
    return job


@pytest.mark.parametrize("late_binding", [True, False])
def test_a_pd_request_pays_every_hop_once_on_top_of_the_cost_model(late_binding: bool) -> None:
    prompt = 3000
    ideal, costly = one(prompt, IDEAL, late_binding=late_binding), one(prompt, PATH, late_binding=late_binding)
    assert ideal.route == costly.route == "pd"
    hops = PATH.router.seconds(prompt) + PATH.engine_requests.seconds(prompt) + PATH.kv_transfer.seconds(prompt)
    assert ideal.ttft is not None and costly.ttft is not None and costly.first_token is not None
    assert costly.ttft - ideal.ttft == pytest.approx(hops + PATH.client.seconds(prompt))
    # The router's own TTFT (what the autoscaler reads) has the hops inside the service, not the client's.
    assert costly.first_token - costly.arrival == pytest.approx(costly.ttft - PATH.client.seconds(prompt))
    # Where: the first engine request before prefill, the second between prefill and decode, the rest in the pull.
    assert costly.prefill_arrival - costly.dispatched == pytest.approx(PATH.dispatch_s("pd", prompt))
    assert costly.decode_arrival - costly.prefill_done == pytest.approx(PATH.handoff_s(prompt))
    assert (costly.pull_done - costly.admitted) - (ideal.pull_done - ideal.admitted) == pytest.approx(
        PATH.kv_transfer.seconds(prompt)
    )
    # Engines' own times are the cost model's, untouched.
    assert costly.prefill_done - costly.prefill_arrival == pytest.approx(ideal.prefill_done - ideal.prefill_arrival)


def test_a_decode_only_request_pays_the_router_one_engine_request_and_the_client() -> None:
    prompt = 100
    ideal, costly = one(prompt, IDEAL), one(prompt, PATH)
    assert ideal.route == costly.route == "decode-only"
    assert ideal.ttft is not None and costly.ttft is not None
    hops = PATH.router.seconds(prompt) + PATH.decode_request.seconds(prompt) + PATH.client.seconds(prompt)
    assert costly.ttft - ideal.ttft == pytest.approx(hops)


def test_the_clients_ttft_decides_attainment() -> None:
    job = Job(Request(0.0, 3000, 1), "pd")
    job.first_token, job.finished = 0.29, 0.29
    assert met(job, SLO)
    job.client_s = 0.02
    assert not met(job, SLO), "0.29 s at the router, 0.31 s at the client: a miss against 0.3 s"


def test_requests_in_transit_count_against_the_routers_budget_and_keep_a_draining_engine() -> None:
    # A prefill budget of two 3000-token prompts and a hop far longer than a prefill: the third request must wait
    # in the router although the engine has received nothing yet, as the product's in-flight count has it.
    budget = LateBinding(prefill_tokens=6000, decode_sequences=256)
    slow = PathCosts(engine_requests=Hop(2.0, 0.0))
    config = ReplayConfig(H200_8B, H200_8B, SLO, (1, 1), late_binding=budget, path=slow)
    requests = [Request(0.001 * i, 3000, 4) for i in range(3)]
    outcome = ReplayCluster(config, requests, StaticScaler(1, 1)).run()
    dispatched = sorted(job.dispatched for job in outcome.jobs)
    assert dispatched[1] < 0.01 and dispatched[2] > 1.0, dispatched
    # The prefill pool scaled to nothing while its one request is in transit: the replica drains, it is not
    # removed under the request (which it then serves).
    config = ReplayConfig(H200_8B, H200_8B, SLO, (1, 1), interval_s=0.5, late_binding=budget, path=slow)
    cluster = ReplayCluster(config, requests[:1], StaticScaler(0, 1))
    (job,) = cluster.run().jobs
    (prefill,) = [replica for replica in cluster.gone if replica.role == "prefill"]
    assert job.finished is not None and job.prefill_arrival > 0.5
    assert prefill.removed_at is not None and prefill.removed_at >= job.prefill_done


def test_the_loopback_path_is_the_measured_one() -> None:
    # bench/path_costs.py's fit: a 3000-token PD request pays about 20 ms on the idle 2-core machine.
    prompt = 3000
    total = sum(h.seconds(prompt) for h in (LOOPBACK.router, LOOPBACK.engine_requests, LOOPBACK.kv_transfer))
    assert 0.015 < total + LOOPBACK.client.seconds(prompt) < 0.025
