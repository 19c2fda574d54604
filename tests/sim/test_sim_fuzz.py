"""Fuzz the HTTP API: whatever the body, the simulator answers 2xx or a vLLM-shaped 4xx, promptly, and
keeps serving. One simulator subprocess serves every example (its context is capped so that valid
requests stay short)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve_dev.testing.sim import READY_PREFIX

pytestmark = pytest.mark.timeout(120)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
small_ints = st.integers(-3, 40)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["user", "system", "assistant"]) | json_values,
            "content": st.text(max_size=40)
            | json_values
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10) | json_values})),
        },
    )
    | json_values,
    max_size=3,
)
kv_params = st.fixed_dictionaries(
    {},
    optional={
        "do_remote_decode": st.booleans() | json_values,
        "do_remote_prefill": st.booleans() | json_values,
        "remote_host": st.just("127.0.0.1") | json_values,
        "remote_port": st.integers(1, 65535) | json_values,
        "remote_request_id": st.text(max_size=8) | json_values,
        "remote_block_ids": st.lists(st.lists(st.integers(0, 10), max_size=3), max_size=2) | json_values,
        "remote_engine_id": json_values,
    },
)
request_fields = {
    "model": st.sampled_from(["sim-model", "other"]) | json_values,
    "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 40000), max_size=8) | json_values,
    "messages": messages,
    "max_tokens": small_ints | json_values,
    "max_completion_tokens": small_ints | json_values,
    "min_tokens": small_ints | json_values,
    "n": small_ints | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values}) | json_values,
    "ignore_eos": st.booleans() | json_values,
    "temperature": st.floats(0, 2) | json_values,
    "kv_transfer_params": kv_params | json_values,
}
bodies = st.fixed_dictionaries({}, optional=request_fields) | json_values


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    cmd = [sys.executable, "-m", "pdserve_sim", "--fast", "--host", "127.0.0.1", "--port", "0",
           "--side-channel-port", "0", "--max-model-len", "256", "--kv-transfer-timeout", "0.05",
           "--log-level", "error"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), line
        ready = json.loads(line[len(READY_PREFIX) :])
        yield f"http://127.0.0.1:{ready['http_port']}"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    # One client for every example: creating one costs an SSL context, more than a request here.
    with httpx.Client(timeout=5) as c:
        yield c


def check(resp: httpx.Response) -> None:
    assert resp.status_code in (200, 400, 404, 500), resp.text
    if resp.status_code == 500:
        # Only a KV pull the fuzzer asked for (do_remote_prefill to some host) may fail, as vLLM does.
        assert "KV transfer failed" in resp.json()["error"]["message"]
    elif resp.status_code != 200:
        error = resp.json()["error"]
        assert error["code"] == resp.status_code and isinstance(error["message"], str)
    elif resp.headers["content-type"].startswith("text/event-stream"):
        assert resp.text.endswith("data: [DONE]\n\n")
    else:
        assert resp.json()["choices"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, chat=st.booleans())
def test_json_bodies_never_crash_or_hang(sim_url: str, client: httpx.Client, body: Any, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    check(client.post(sim_url + path, json=body))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    raw=st.binary(max_size=200),
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/abort", "/sim/faults"]),
)
def test_raw_bytes_never_crash_or_hang(sim_url: str, client: httpx.Client, raw: bytes, path: str) -> None:
    resp = client.post(sim_url + path, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code in (200, 400, 404), resp.text
    # Undo any fault the bytes happened to configure.
    client.delete(sim_url + "/sim/faults")


def test_still_healthy_after_fuzzing(sim_url: str, client: httpx.Client) -> None:
    assert client.get(sim_url + "/health").status_code == 200
    state = client.get(sim_url + "/sim/state").json()
    assert state["running"] == 0 and state["waiting"] == 0
