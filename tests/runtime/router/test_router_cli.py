"""`pdserve router`: configuration precedence, and the real command serving traffic as a process."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import click
import pytest
import yaml

from pdserve.api.settings import RouterSettings
from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.sim import sim_in_process
from pdserve_dev.testing.wait import wait_for_async
from pdserve_runtime.router.cli import load_config

pytestmark = pytest.mark.timeout(60)


def test_flags_build_a_static_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_BIND_HOST", raising=False)
    config = load_config(RouterSettings(port=9000, prefill=("http://p:1/",), decode=("http://d:1",), threshold=0))
    assert config.discovery == "static"
    assert config.static_prefill == ["http://p:1/"]
    assert config.port == 9000 and config.host == "0.0.0.0"
    assert config.policy.disaggregation_threshold_tokens == 0


def test_flags_override_the_file_and_the_bind_env_overrides_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "servedModelName": "m",
                "host": "0.0.0.0",
                "port": 8080,
                "decode": {"namespace": "ns", "labelSelector": "pool=d"},
                "policy": {"fallbackToDecode": True},
            }
        )
    )
    monkeypatch.setenv("PDSERVE_BIND_HOST", "127.0.3.4")
    config = load_config(RouterSettings(config_path=str(path), port=8181, fallback=False))
    assert config.discovery == "kubernetes"
    assert (config.host, config.port) == ("127.0.3.4", 8181)
    assert config.policy.fallback_to_decode is False
    assert config.served_model_name == "m"


@pytest.mark.parametrize(
    ("path_text", "message"),
    [
        (None, "at least one --decode"),
        ("- a list\n", "must be a YAML mapping"),
        ("servedModelName: m\n", "decode selector"),
    ],
)
def test_bad_invocations_say_why(tmp_path: Path, path_text: str | None, message: str) -> None:
    path = None
    if path_text is not None:
        (tmp_path / "c.yaml").write_text(path_text)
        path = str(tmp_path / "c.yaml")
    with pytest.raises(click.ClickException, match=message):
        load_config(RouterSettings(config_path=path))


async def test_the_command_serves_on_the_bind_host_and_stops_on_sigterm() -> None:
    host = "127.0.0.7"
    port = free_port(host)
    async with sim_in_process(role="prefill") as p, sim_in_process(role="decode") as d:
        env = {**os.environ, "PDSERVE_BIND_HOST": host}
        args = ["-m", "pdserve.cli", "router", "--port", str(port), "--prefill", p.url, "--decode", d.url]
        args += ["--metrics-port", str(free_port(host))]
        args += ["--disaggregation-threshold", "0", "--served-model-name", "sim-model"]
        process = await asyncio.create_subprocess_exec(sys.executable, *args, env=env)
        try:
            url = f"http://{host}:{port}"
            async with aiohttp.ClientSession() as session:

                async def ready() -> bool:
                    async with session.get(url + "/ready") as response:
                        return response.status == 200

                await wait_for_async(ready, within=20, message="the router process to answer /ready")
                body = {"model": "sim-model", "prompt": "hello", "max_tokens": 3}
                async with session.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200
                    assert response.headers["X-Pdserve-Route"] == "pd"
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 10) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


def test_the_engine_metrics_interval_comes_from_the_file_unless_the_flag_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve_runtime.router.app import RouterApp

    monkeypatch.delenv("PDSERVE_BIND_HOST", raising=False)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"servedModelName": "m", "decode": {"namespace": "n", "labelSelector": "pool=d"},
                                    "engineMetricsIntervalSeconds": 7}))  # fmt: skip
    assert load_config(RouterSettings(config_path=str(path))).engine_metrics_interval_seconds == 7
    off = load_config(RouterSettings(config_path=str(path), engine_metrics_interval=0))
    assert off.engine_metrics_interval_seconds == 0
    static = off.model_copy(update={"discovery": "static", "static_decode": ["http://d:1"]})
    assert RouterApp(static, access_log=False)._scraper is None


def test_the_transport_settings_come_from_the_file_unless_the_flags_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDSERVE_BIND_HOST", raising=False)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"servedModelName": "m", "decode": {"namespace": "n", "labelSelector": "pool=d"},
                                    "metricsPort": 9100, "clientWriteTimeoutSeconds": 5}))  # fmt: skip
    from_file = load_config(RouterSettings(config_path=str(path)))
    assert (from_file.metrics_port, from_file.client_write_timeout_seconds) == (9100, 5)
    assert (from_file.min_body_bytes_per_second, from_file.max_chunk_metadata_bytes) == (65536, 4096)
    flagged = load_config(
        RouterSettings(
            config_path=str(path), metrics_port=9200, min_body_rate=1000, max_chunk_metadata_bytes=64,
            client_write_timeout=2,
        )
    )  # fmt: skip
    assert (flagged.metrics_port, flagged.min_body_bytes_per_second) == (9200, 1000)
    assert (flagged.max_chunk_metadata_bytes, flagged.client_write_timeout_seconds) == (64, 2)
    # Metrics are never served on the client port.
    with pytest.raises(click.ClickException, match="metricsPort must differ from port"):
        load_config(RouterSettings(config_path=str(path), port=9100))
