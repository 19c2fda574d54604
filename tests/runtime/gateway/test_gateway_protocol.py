"""The picker's protocol pieces (pure): generated messages current, header parsing, subset and served endpoint,
the sidecar's `x-prefiller-host-port` parser, and the picker's choice on a table."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.api.router_config import PickerConfig, RouterConfig
from pdserve_runtime.gateway import protocol
from pdserve_runtime.gateway.picker import EndpointPicker, Pick, Refusal, host_port
from pdserve_runtime.gateway.proto import ext_proc_pb2 as pb
from pdserve_runtime.gateway.proto.generate import HERE, OUTPUTS, generate
from pdserve_runtime.gateway.sidecar import parse_host_port
from pdserve_runtime.router.endpoints import Endpoint, EndpointTable
from pdserve_runtime.router.metrics import RouterMetrics
from pdserve_runtime.router.policy.scheduler import Scheduler
from pdserve_runtime.router.prefix import PrefixTracker
from pdserve_runtime.router.tokens import describe_prompt


def test_generated_messages_match_the_proto(tmp_path: Path) -> None:
    generate(tmp_path)
    for name in OUTPUTS:
        assert (tmp_path / name).read_bytes() == (HERE / name).read_bytes(), (
            f"{name} is stale: run `python -m pdserve_runtime.gateway.proto.generate`"
        )


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("10.0.0.5:8000", ("10.0.0.5", 8000)),
        (" 10.0.0.5:8000 ", ("10.0.0.5", 8000)),
        ("[fd00::5]:8000", ("fd00::5", 8000)),
        ("prefill.example:8000", None),  # a name would be resolved by the sidecar: never
        ("10.0.0.5", None),
        ("10.0.0.5:", None),
        ("10.0.0.5:0", None),
        ("10.0.0.5:70000", None),
        ("10.0.0.5:80a", None),
        ("0.0.0.0:8000", None),
        ("224.0.0.1:8000", None),
        ("10.0.0.5:8000,10.0.0.6:8000", None),
    ],
)
def test_prefiller_header_is_an_ip_and_port_or_nothing(value: str, parsed: tuple[str, int] | None) -> None:
    assert parse_host_port(value) == parsed


def test_headers_raw_values_win_and_names_are_lower_case() -> None:
    headers = pb.HttpHeaders(
        headers=pb.HeaderMap(
            headers=[pb.HeaderValue(key=":Path", raw_value=b"/v1/completions"), pb.HeaderValue(key="X-A", value="b")]
        )
    )
    assert protocol.headers_of(headers) == {":path": "/v1/completions", "x-a": "b"}


def test_pick_sets_the_same_value_in_header_and_metadata_and_strips_a_client_prefiller() -> None:
    answer = protocol.pick_response(["10.0.0.7:8100", "10.0.0.8:8100"], None)
    mutation = answer.request_headers.response.header_mutation
    assert [(h.header.key, h.header.raw_value) for h in mutation.set_headers] == [
        (protocol.DESTINATION_HEADER, b"10.0.0.7:8100,10.0.0.8:8100")
    ]
    assert list(mutation.remove_headers) == [protocol.PREFILLER_HEADER]
    lb = answer.dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value
    assert lb.fields[protocol.DESTINATION_HEADER].string_value == "10.0.0.7:8100,10.0.0.8:8100"
    with_prefill = protocol.pick_response(["10.0.0.7:8100"], "10.0.0.5:8000").request_headers.response
    assert (protocol.PREFILLER_HEADER, b"10.0.0.5:8000") in [
        (h.header.key, h.header.raw_value) for h in with_prefill.header_mutation.set_headers
    ]
    assert not with_prefill.header_mutation.remove_headers


def test_subset_and_served_endpoint_are_read_from_metadata_and_attributes() -> None:
    request = pb.ProcessingRequest()
    assert protocol.endpoint_subset(request) is None
    hint = request.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE]
    hint.fields[protocol.SUBSET_KEY].list_value.values.add().string_value = "10.0.0.7:8100"
    assert protocol.endpoint_subset(request) == frozenset({"10.0.0.7:8100"})
    hint.fields[protocol.SUBSET_KEY].string_value = "10.0.0.7:8100, 10.0.0.8:8100"
    assert protocol.endpoint_subset(request) == frozenset({"10.0.0.7:8100", "10.0.0.8:8100"})
    assert protocol.served_endpoint(request) is None
    request.attributes[protocol.ATTRIBUTES_NAMESPACE].fields[protocol.UPSTREAM_ADDRESS].string_value = "10.0.0.8:8100"
    assert protocol.served_endpoint(request) == "10.0.0.8:8100"
    lb = request.metadata_context.filter_metadata[protocol.LB_NAMESPACE]
    lb.fields[protocol.SERVED_KEY].string_value = "10.0.0.7:8100"
    assert protocol.served_endpoint(request) == "10.0.0.7:8100"  # the protocol's own key wins


def _picker(**settings: int) -> EndpointPicker:
    config = RouterConfig(served_model_name="m", discovery="static", static_decode=["http://10.0.0.7:8000"])
    table = EndpointTable()
    table.replace("decode", [Endpoint(url=f"http://10.0.0.{i}:8000", role="decode") for i in (7, 8, 9)])
    table.replace("prefill", [Endpoint(url="http://10.0.0.5:8000", role="prefill")])
    tracker = PrefixTracker(max_blocks=1000, ttl_seconds=60, block_size=16)
    scheduler = Scheduler(table, tracker, config.policy, rng=random.Random(1))
    return EndpointPicker(config, PickerConfig(target_port=8100, **settings), scheduler, tracker, RouterMetrics(table))


def test_the_pick_respects_the_gateways_subset_and_lists_fallbacks_in_order() -> None:
    picker = _picker(fallback_endpoints=2)
    prompt = describe_prompt({"prompt": "hi"}, False, 16)
    choice = picker.choose(prompt, frozenset({"10.0.0.8:8100", "10.0.0.9:8100"}))
    assert isinstance(choice, Pick)
    assert len(choice.destinations) == 2 and set(choice.destinations) == {"10.0.0.8:8100", "10.0.0.9:8100"}
    refused = picker.choose(prompt, frozenset({"10.0.0.99:8100"}))
    assert isinstance(refused, Refusal) and refused.status == 503
    long = describe_prompt({"prompt": "word " * 400}, False, 16)
    pd = picker.choose(long, None)
    assert isinstance(pd, Pick) and pd.prefill is not None and host_port(pd.prefill.url) == "10.0.0.5:8000"
    assert len(pd.destinations) == 3


def test_shedding_starts_only_when_every_usable_engine_is_at_the_limit() -> None:
    picker = _picker(max_in_flight_per_decode=1)
    prompt = describe_prompt({"prompt": "hi"}, False, 16)
    states = picker.table.states("decode")
    for state in states[:2]:
        state.in_flight = 1
    assert isinstance(picker.choose(prompt, None), Pick)
    states[2].in_flight = 1
    refused = picker.choose(prompt, None)
    assert isinstance(refused, Refusal) and refused.status == 429


async def test_the_process_nodes_grpc_probe_follows_the_pickers_readiness() -> None:
    """The picker's gRPC health as a kubelet's grpc probe reads it (the process node's probe, over a socket)."""
    import asyncio

    from pdserve_dev.process_node.probes import grpc_health
    from pdserve_dev.testing.net import free_port
    from pdserve_runtime.gateway.server import PickerApp

    config = RouterConfig(served_model_name="m", discovery="static", static_decode=["http://127.0.0.1:9"])
    app = PickerApp(config)
    port = await app.start("127.0.0.1", free_port(), 0, metrics_port=0)
    try:
        probe = {"port": port, "service": "liveness"}
        assert await asyncio.to_thread(grpc_health, probe, "127.0.0.1", 5.0) == (True, "")
        # The one decode engine is not usable (its breaker is open): not ready, still alive.
        state = app.core.table.states("decode")[0]
        state.breaker.opened_at = 0.0
        await app._update_readiness()
        ready, why = await asyncio.to_thread(grpc_health, {"port": port, "service": "readiness"}, "127.0.0.1", 5.0)
        assert (ready, why) == (False, "gRPC health status NOT_SERVING")
        assert (await asyncio.to_thread(grpc_health, probe, "127.0.0.1", 5.0))[0]
    finally:
        await app.stop()
    assert not (await asyncio.to_thread(grpc_health, {"port": port}, "127.0.0.1", 2.0))[0]
