"""`pdserve dev demo --keep`, run as a user runs it (the README's main job, which installs pdserve with its Helm
chart), then used from the user's own shell while it keeps running.

The demo runs its cluster in a network namespace of its own. "The user's shell" is the namespace the demo was
started from, here the test session's (tests/conftest.py): the demo's pod and loopback addresses do not exist in it,
so the official OpenAI client, kubectl and HTTP calls below reach the demo only through what it published on this
namespace's 127.0.0.1 and printed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from pdserve_dev.cluster import build

ROOT = Path(__file__).resolve().parents[2]
MODEL = yaml.safe_load((ROOT / "examples" / "local-sim.yaml").read_text())["spec"]["model"]["name"]
LAST_LINE = "Ctrl-C stops everything."
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]


@dataclass
class KeptDemo:
    proc: subprocess.Popen[str]
    output: str
    banner: str
    router: str
    prometheus: str
    kubeconfig: Path


def _published(banner: str, pattern: str) -> str:
    match = re.search(pattern, banner)
    assert match is not None, f"{pattern!r} not in:\n{banner}"
    return match[1]


@pytest.fixture(scope="module")
def demo() -> Iterator[KeptDemo]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "dev", "demo", "--keep"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a shell's job: Ctrl-C is a SIGINT to the group
    )
    lines: list[str] = []
    kept = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == LAST_LINE:
                kept.set()
        kept.set()  # the demo ended: the assertion below says so with its output

    threading.Thread(target=read, daemon=True).start()
    workdir: Path | None = None
    try:
        kept.wait(timeout=400)
        output = "".join(lines)
        assert proc.poll() is None and LAST_LINE in output, output[-6000:]
        banner = output[output.rindex("Kept running") :]
        kubeconfig = Path(_published(banner, r"export KUBECONFIG=(\S+)"))
        workdir = kubeconfig.parent
        yield KeptDemo(
            proc,
            output,
            banner,
            router=_published(banner, r"OpenAI API \(router\)\s+(http://127\.0\.0\.1:\d+)/v1"),
            prometheus=_published(banner, r"Prometheus\s+(http://127\.0\.0\.1:\d+)"),
            kubeconfig=kubeconfig,
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        # A kept demo leaves its files (logs, kubeconfig: about 64 MB) for the user to read after Ctrl-C; the test
        # has read what it needs, and every run left one behind in the temporary folder.
        if workdir is not None and workdir.name.startswith("pdserve-demo-"):
            shutil.rmtree(workdir, ignore_errors=True)


def test_demo_routes_a_long_prompt_through_prefill_and_pulls_its_kv(demo: KeptDemo) -> None:
    output = demo.output
    assert "Installed pdserve with Helm in " in output and "-n pdserve-system" in output
    # The operator runs in-cluster: the chart's pods, on the process node (both replicas: one leads).
    operator_pods = [line for line in output.splitlines() if line.startswith("pdserve-") and " Running " in line]
    assert len(operator_pods) == 2 and all(" process-node " in line for line in operator_pods), output
    assert "PDService Available" in output
    assert "route=pd " in output
    assert "route=decode-only " in output
    assert ", 0 computed locally" in output
    # The SLO autoscaler's decision on the burst, as its Event says it, and in `kubectl get pds -o wide`.
    [event] = [line for line in output.splitlines() if line.startswith("Event after ")]
    # The decision states the prefill engines' TTFT against their budget and the demand it sized for; and the
    # routers' TTFT against the target when they saw one in the window: above it when the burst breached it first,
    # or still below it when the autoscaler scaled for the prefill demand it measured before the breach (CI saw
    # "TTFT p90 489 ms <= 500 ms target" once). At the first tick after autoscaling is turned on the routers may
    # have no TTFT in the window yet, and the engines' TTFT of the demo's earlier prompts decides (a fresh-clone run
    # saw "Scaled prefill 1 -> 2: prefill engine TTFT 931 ms (budget 395 ms); ..."): which comes first depends on
    # the machine's speed.
    stated = re.search(
        r"Scaled prefill 1 -> 2: (TTFT p90 [\d.]+ m?s (>|<=) 500 ms target; )?prefill engine TTFT [\d.]+ m?s "
        r"\(budget [\d.]+ m?s\); prefill demand [\d.]+k? uncached prompt tok/s",
        event,
    )
    assert stated, output[-4000:]
    assert "PREFILL-SCALING" in output


def test_the_demo_prints_only_addresses_of_this_namespace(demo: KeptDemo) -> None:
    assert "in its own network namespace; published on this machine's loopback" in demo.banner
    addresses = set(re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", demo.banner))
    assert addresses == {"127.0.0.1"}, demo.banner
    # The pod and loopback addresses of the demo's namespace exist only there: the router's pod address is not
    # reachable from here.
    pod_ips = set(re.findall(r"\b198\.1[89]\.\d+\.\d+\b", demo.output))
    assert pod_ips
    for ip in pod_ips:
        with pytest.raises(OSError), socket.create_connection((ip, 8080), timeout=2):
            pass


def test_the_openai_client_uses_the_published_router(demo: KeptDemo) -> None:
    client = openai.OpenAI(base_url=f"{demo.router}/v1", api_key="unused", timeout=60, max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
    assert chat.choices[0].message.content and chat.usage is not None and chat.usage.completion_tokens == 8

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": " ".join(f"word{i}" for i in range(400))}],  # long: prefill first
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text and usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens >= 400

    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6)
    assert completion.choices[0].text and completion.usage is not None and completion.usage.completion_tokens == 6

    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.status_code == 404 and "no-such-model" in str(missing.value)


def test_kubectl_with_the_printed_kubeconfig_and_prometheus_answer_from_here(demo: KeptDemo) -> None:
    env = {**os.environ, "KUBECONFIG": str(demo.kubeconfig)}
    proc = subprocess.run(
        [str(build.binary("kubectl")), "get", "pds", "-n", "demo", "-o", "wide"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].split()[0] == "demo", proc.stdout
    answer = httpx.get(f"{demo.prometheus}/api/v1/query", params={"query": "up"}, timeout=30).json()
    assert answer["status"] == "success" and answer["data"]["result"], answer


def test_ctrl_c_stops_the_demo_and_what_it_published(demo: KeptDemo) -> None:
    os.killpg(demo.proc.pid, signal.SIGINT)
    assert demo.proc.wait(timeout=120) == 130
    # Its files stay for the user to read after Ctrl-C (the fixture removes them): the kubeconfig, the cluster's logs.
    assert (demo.kubeconfig.parent / "cluster").is_dir() and demo.kubeconfig.is_file()
    for url in (demo.router, demo.prometheus):
        with pytest.raises(httpx.ConnectError):
            httpx.get(url, timeout=5)
