"""The real-engine tier's PDService and the reads its tests make of real vLLM engines.

The PDService is what a user with CPU nodes would write for vLLM's CPU image: `kvBufferDevice: cpu` with a block
size of 128 (vLLM's CPU attention needs a multiple of 32), `placement.rdma: off` (UCX over TCP), and through
`engine.args` the two flags that keep a CPU engine small and quick to start (`--enforce-eager`,
`--kv-cache-memory-bytes`). Each pool's engines are pinned to their own core (`VLLM_CPU_OMP_THREADS_BIND`): unpinned,
engines fight over core 0 and decode slows 30x. Every pod lands on the local cluster's process node, where the
image map runs vLLM's CPU image as the installed real vLLM (:mod:`pdserve_dev.realvllm.install`).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from pdserve_dev.process_node.node import SELECTOR, TOLERATION
from pdserve_dev.realvllm.models import MODEL_NAME, REPO_ID
from pdserve_dev.testing.metrics import by_label, scrape_sync

#: vLLM's x86 CPU image at the installed version (the process node's image map runs it as real vLLM).
IMAGE = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"
ENGINE_PORT = 8000
ROUTER_PORT = 8080
#: 256 MiB of KV cache: 2048 blocks of 128 tokens of the tiny model (1 KiB per token).
KV_CACHE_BYTES = 268435456


def manifest(
    name: str,
    namespace: str,
    *,
    prefill: int = 1,
    decode: int = 1,
    max_model_len: int = 4096,
    run_as_user: int | None = None,
    threshold: int = 256,
) -> dict[str, Any]:
    """The tier's PDService: real vLLM on CPU, everything on the process node."""
    engine: dict[str, Any] = {
        "image": IMAGE,
        "kvBufferDevice": "cpu",
        "blockSize": 128,
        "maxModelLen": max_model_len,
        "kvLeaseSeconds": 20,
        "drainSeconds": 30,
        "args": ["--enforce-eager", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)],
    }
    if run_as_user is not None:
        engine["runAsUser"] = run_as_user
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": MODEL_NAME, "uri": f"hf://{REPO_ID}"},
            "engine": engine,
            "prefill": {
                "replicas": prefill,
                "gpusPerPod": 0,
                "maxNumSeqs": 16,
                "env": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0"}],
            },
            "decode": {
                "replicas": decode,
                "gpusPerPod": 0,
                "maxNumSeqs": 16,
                "env": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "1"}],
            },
            "placement": {"gpuNodeSelector": SELECTOR, "tolerations": [TOLERATION], "rdma": "off"},
            "router": {
                "replicas": 1,
                "nodeSelector": SELECTOR,
                "tolerations": [TOLERATION],
                "routing": {"disaggregationThreshold": threshold},
            },
        },
    }


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[dict[str, str], dict[str, Any]]:
    """POST JSON, return (headers, JSON body); raises urllib's HTTPError with the body on a non-2xx answer."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return dict(response.headers), json.loads(response.read())


def post_stream(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """POST a streaming request, return (headers, the JSON events before `[DONE]`); fails if `[DONE]` is missing."""
    request = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    events: list[dict[str, Any]] = []
    done = False
    with urllib.request.urlopen(request, timeout=timeout) as response:
        headers = dict(response.headers)
        for raw in response.read().decode().split("\n\n"):
            line = raw.strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            events.append(json.loads(data))
    if not done:
        raise AssertionError(f"stream ended without [DONE] after {len(events)} events")
    return headers, events


def tokens_by_source(ips: list[str]) -> dict[str, float]:
    """`vllm:prompt_tokens_by_source_total` summed over the engines at `ips`, by source."""
    totals: dict[str, float] = {}
    for ip in ips:
        for source, value in by_label(
            scrape_sync(f"http://{ip}:{ENGINE_PORT}/metrics"), "vllm:prompt_tokens_by_source_total", "source"
        ).items():
            totals[source] = totals.get(source, 0.0) + value
    return totals


def handed_out(ip: str, model: str = MODEL_NAME) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill engine hands out for a one-token prefill (step 1 of the PD flow)."""
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
    _, body = post(
        f"http://{ip}:{ENGINE_PORT}/v1/completions",
        {"model": model, "prompt": "engine id", "max_tokens": 1, "kv_transfer_params": params},
    )
    handed: dict[str, Any] = body["kv_transfer_params"]
    return handed


def engine_id(ip: str, model: str = MODEL_NAME) -> str:
    """The NIXL engine id a prefill engine hands out."""
    return str(handed_out(ip, model)["remote_engine_id"])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def elapsed(since: float) -> str:
    return f"{time.monotonic() - since:.0f}s"
