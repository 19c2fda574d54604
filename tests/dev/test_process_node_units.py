"""Pure parts of the process node: $(VAR) expansion, env, image map, IPs, probes, back-off, pod status."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve_dev.process_node.backoff import CrashBackoff
from pdserve_dev.process_node.expansion import expand
from pdserve_dev.process_node.imagemap import ImageMap, ImageMapError, NotMappedError
from pdserve_dev.process_node.ipam import PodIPAllocator, listening_ipv4_addresses, loopback_cidr
from pdserve_dev.process_node.lifecycle import grace_after_hook, run_hook
from pdserve_dev.process_node.podenv import (
    ContainerConfigError,
    PodAddresses,
    container_env,
    expand_command,
)
from pdserve_dev.process_node.podstatus import ContainerView, Terminated, pod_phase, pod_status
from pdserve_dev.process_node.podworker import Container, PodWorker
from pdserve_dev.process_node.probes import ProbeKind, ProbeSpec, ProbeTracker, resolve_port, running
from pdserve_dev.process_node.process import LocalProcess
from pdserve_dev.process_node.volumes import Mount, container_mounts, rewrite_path
from pdserve_dev.testing.net import free_port

Obj = dict[str, Any]


# --- $(VAR) expansion ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)", "a"),
        ("x$(A)y$(B)z", "xaybz"),
        ("$(MISSING)", "$(MISSING)"),
        ("$$(A)", "$(A)"),
        ("$$$(A)", "$a"),
        ("$A", "$A"),
        ("cost $5", "cost $5"),
        ("trailing $", "trailing $"),
        ("$(A", "$(A"),
        ("$(A$(B)", "$(A$(B)"),  # the name runs to the first ")": "A$(B" is undefined, kept as written
        ("$()", "$()"),
        ("$(NESTED)", "$(A)"),  # values are not expanded again
    ],
)
def test_expand_follows_kubernetes_rules(text: str, expected: str) -> None:
    assert expand(text, {"A": "a", "B": "b", "NESTED": "$(A)"}) == expected


@given(st.text(alphabet=st.characters(blacklist_characters="$")))
def test_expand_leaves_text_without_dollars_alone(text: str) -> None:
    assert expand(text, {"A": "a"}) == text


# --- env -----------------------------------------------------------------------------------------------
class _Objects:
    def __init__(self, configmaps: dict[str, dict[str, str]], secrets: dict[str, dict[str, str]]) -> None:
        self.configmaps = configmaps
        self.secrets = secrets

    def configmap_data(self, namespace: str, name: str) -> dict[str, str] | None:
        return self.configmaps.get(f"{namespace}/{name}")

    def secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        return self.secrets.get(f"{namespace}/{name}")


POD: Obj = {
    "metadata": {"name": "web-0", "namespace": "ns", "uid": "u-1", "labels": {"app": "web"}},
    "spec": {"nodeName": "proc", "serviceAccountName": "default"},
}
ADDR = PodAddresses(pod_ip="127.9.0.1", host_ip="127.0.0.1")


def test_env_resolves_downward_api_refs_and_expansion_in_order() -> None:
    container: Obj = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
        "env": [
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "URL", "value": "http://$(IP):8000/$(NAME)/$(LATER)"},
            {"name": "LATER", "value": "x"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
            {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
        ],
        "resources": {"limits": {"memory": "1536Mi"}},
    }
    objects = _Objects({"ns/cfg": {"MODE": "fast"}}, {"ns/s": {"token": "t0k"}})
    env = container_env(POD, container, ADDR, objects, {"memory": "1Gi"})
    assert env == {
        "CFG_MODE": "fast",
        "IP": "127.9.0.1",
        "NAME": "web-0",
        "APP": "web",
        # Only variables defined earlier expand; LATER is defined after URL.
        "URL": "http://127.9.0.1:8000/web-0/$(LATER)",
        "LATER": "x",
        "TOKEN": "t0k",
        "MEM": "1536",
    }
    command, args = expand_command({"command": ["serve", "$(NAME)"], "args": ["--host=$(IP)", "$$(IP)"]}, env)
    assert command == ["serve", "web-0"]
    assert args == ["--host=127.9.0.1", "$(IP)"]


def test_env_reports_missing_configmap_unless_optional() -> None:
    objects = _Objects({}, {})
    key_ref: Obj = {"name": "missing", "key": "k"}
    ref: Obj = {"name": "X", "valueFrom": {"configMapKeyRef": key_ref}}
    with pytest.raises(ContainerConfigError, match='configmap "missing" not found'):
        container_env(POD, {"name": "c", "env": [ref]}, ADDR, objects, {})
    key_ref["optional"] = True
    assert container_env(POD, {"name": "c", "env": [ref]}, ADDR, objects, {}) == {}


# --- image map -----------------------------------------------------------------------------------------
def test_default_map_runs_vllm_image_as_the_simulator() -> None:
    images = ImageMap.load(python="/py")
    kv = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
    args = ["tiny", "--port", "8000", "--kv-transfer-config", kv]
    explicit = images.resolve("vllm/vllm-openai:v0.32.0", ["vllm", "serve"], args)
    assert explicit.argv == ["/py", "-m", "pdserve.cli", "sim", "serve", *args]
    # Without command the image entrypoint `vllm serve` applies; docker.io prefixes name the same image.
    assert images.resolve("docker.io/vllm/vllm-openai:latest", None, args).argv == explicit.argv
    # With the timing the cluster tiers were sized on (a container's own env still wins).
    assert explicit.image_env["PDSERVE_SIM_PRESET"] == "cpu-tiny-shared"


def test_default_map_pdserve_testserver_and_passthrough() -> None:
    images = ImageMap.load(python="/py")
    assert images.resolve("ghcr.io/pdserve/pdserve:0.1", ["pdserve", "router", "--port", "80"], None).argv == [
        "/py",
        "-m",
        "pdserve.cli",
        "router",
        "--port",
        "80",
    ]
    assert images.resolve("pdserve-test/http:1", None, ["--port", "8080"]).argv == [
        "/py",
        "-m",
        "pdserve_dev.process_node.testserver",
        "--port",
        "8080",
    ]
    assert images.resolve("busybox:1.36", ["sh", "-c", "exit 3"], None).argv == ["sh", "-c", "exit 3"]
    assert images.resolve("python:3.11", ["/usr/local/bin/python3", "-c", "1"], None).argv == ["/py", "-c", "1"]
    # command replaces the image's entrypoint *and* cmd, even with no args.
    assert images.resolve("busybox", ["sleep", "5"], None).argv == ["sleep", "5"]
    assert images.resolve("busybox", None, None).argv == ["sh"]


def test_unknown_image_and_unmapped_command_are_clear_errors() -> None:
    images = ImageMap.load()
    with pytest.raises(NotMappedError) as unknown:
        images.resolve("quay.io/nobody/thing:1", None, None)
    assert unknown.value.reason == "ImageNotMapped"
    assert "quay.io/nobody/thing:1" in unknown.value.message
    assert "default_image_map.yaml" in unknown.value.message
    with pytest.raises(NotMappedError) as unmapped:
        images.resolve("vllm/vllm-openai:latest", ["python3", "-m", "vllm.entrypoints.openai.api_server"], None)
    assert unmapped.value.reason == "CommandNotMapped"


def test_image_map_file_comes_first_and_is_validated(tmp_path: Path) -> None:
    custom = tmp_path / "map.yaml"
    custom.write_text(
        "images:\n"
        "  - match: ['vllm/*']\n"
        "    entrypoint: [vllm, serve]\n"
        "    rewrite: [{from: [vllm, serve], to: ['{python}', -m, real.vllm]}]\n"
    )
    images = ImageMap.load(custom, python="/py")
    assert images.resolve("vllm/vllm-openai:x", None, ["m"]).argv == ["/py", "-m", "real.vllm", "m"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("images:\n  - match: [x]\n    bogus: 1\n")
    with pytest.raises(ImageMapError, match=r"bad\.yaml"):
        ImageMap.load(bad)


# --- loopback IPs --------------------------------------------------------------------------------------
def test_allocator_is_stable_round_robin_and_skips_busy_addresses() -> None:
    allocator = PodIPAllocator("127.7.0.0/16", busy=lambda: {"127.7.0.2"})
    first = allocator.allocate("a")
    assert first == "127.7.0.1"
    assert allocator.allocate("a") == first
    assert allocator.allocate("b") == "127.7.0.3"  # .2 has a listener
    allocator.release("a")
    # A released address is not handed out again right away.
    assert allocator.allocate("c") == "127.7.0.4"
    # A restarted node keeps a pod's reported IP when it belongs to the block and is free.
    assert allocator.allocate("d", preferred="127.7.0.1") == "127.7.0.1"
    assert allocator.allocate("e", preferred="127.0.0.1") != "127.0.0.1"
    assert allocator.allocate("f", preferred="127.7.0.3") != "127.7.0.3"  # b holds it


def test_allocator_covers_the_block_and_never_hands_out_127_0_0_1() -> None:
    allocator = PodIPAllocator("198.18.0.0/16", seed="/work/a", busy=set)
    addresses = [allocator.allocate(str(i)) for i in range(600)]
    assert len(set(addresses)) == 600
    assert all(a.startswith("198.18.") and not a.endswith((".0", ".255")) for a in addresses)
    # Different work directories start at different offsets of a shared block.
    other = PodIPAllocator("198.18.0.0/16", seed="/work/b", busy=set)
    assert other.allocate("x") not in addresses[:10]
    tiny = PodIPAllocator("127.0.0.0/30", busy=set)
    assert {tiny.allocate("1"), tiny.allocate("2")} == {"127.0.0.2", "127.0.0.3"}
    with pytest.raises(RuntimeError, match="no free pod address"):
        tiny.allocate("3")
    cidr = loopback_cidr("/some/workdir")
    assert cidr.startswith("127.") and cidr.endswith(".0.0/16") and not cidr.startswith(("127.0.", "127.1."))


def test_listening_addresses_are_read_from_proc(tmp_path: Path) -> None:
    proc = tmp_path / "tcp"
    proc.write_text(
        "  sl  local_address rem_address   st\n"
        "   0: 0100007F:1F90 00000000:0000 0A 0\n"  # 127.0.0.1:8080 LISTEN
        "   1: 0300077F:1F90 0100007F:9C40 01 0\n"  # 127.7.0.3 ESTABLISHED: not a listener
    )
    assert listening_ipv4_addresses(proc) == {"127.0.0.1"}


# --- probes and back-off -------------------------------------------------------------------------------
def test_readiness_probe_schedule_and_thresholds() -> None:
    spec = ProbeSpec.from_container(
        "readiness",
        {
            "httpGet": {"port": 80},
            "initialDelaySeconds": 5,
            "periodSeconds": 2,
            "successThreshold": 2,
            "failureThreshold": 3,
        },
    )
    tracker = ProbeTracker(spec, started_at=100.0)
    assert not tracker.success  # readiness starts failed
    assert not tracker.is_due(104.9) and tracker.is_due(105.0)
    assert not tracker.record(True, 105.0)  # one success is below successThreshold 2
    assert tracker.next_due == 107.0
    assert tracker.record(True, 107.0) and tracker.success
    assert not tracker.record(False, 109.0) and not tracker.record(False, 111.0)
    assert tracker.record(False, 113.0) and not tracker.success


def test_liveness_starts_healthy_and_defaults_apply() -> None:
    spec = ProbeSpec.from_container("liveness", {"tcpSocket": {"port": "http"}})
    assert (spec.period, spec.timeout, spec.failure_threshold, spec.initial_delay) == (10.0, 1.0, 3, 0.0)
    tracker = ProbeTracker(spec, started_at=0.0)
    assert tracker.success and tracker.is_due(0.0)
    assert resolve_port("http", {"ports": [{"name": "http", "containerPort": 8080}]}) == 8080
    with pytest.raises(ValueError, match="no port named"):
        resolve_port("metrics", {"name": "c", "ports": []})


def test_a_pods_worker_waits_only_for_the_probes_that_run(tmp_path: Path) -> None:
    """Until the startup probe succeeds only it runs; after that it never runs again, so its schedule (now in the
    past for good) must not wake the worker: it did, and each such pod's worker spun a core's fraction for life."""
    periods: dict[ProbeKind, int] = {"startup": 1, "readiness": 5, "liveness": 10}
    probes: dict[str, ProbeTracker] = {
        kind: ProbeTracker(ProbeSpec.from_container(kind, {"httpGet": {"port": 80}, "periodSeconds": period}), 0.0)
        for kind, period in periods.items()
    }
    assert running(probes) == [probes["startup"]]
    probes["startup"].record(True, 3.0)
    probes["readiness"].record(True, 3.0)
    probes["liveness"].record(True, 3.0)
    assert running(probes) == [probes["readiness"], probes["liveness"]]
    assert min(tracker.next_due for tracker in running(probes)) == 8.0  # readiness', not startup's stale 4.0
    without_startup: dict[str, ProbeTracker] = {kind: tracker for kind, tracker in probes.items() if kind != "startup"}
    assert running(without_startup) == [probes["readiness"], probes["liveness"]]
    # What the worker sleeps until: the running probes' schedules (a real process: the worker asks for one).
    process = LocalProcess.start(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={}, cwd=tmp_path, log_path=tmp_path / "log",
        pid_path=tmp_path / "pid",
    )  # fmt: skip
    try:
        container = Container({"name": "c"}, False, CrashBackoff(), ContainerView("c", "image"), process, dict(probes))
        assert PodWorker._due_times(container) == [8.0, 13.0]
    finally:
        process.stop(0.0)


def test_crash_backoff_doubles_to_the_cap_and_resets_after_a_long_run() -> None:
    backoff = CrashBackoff(initial=10, cap=300)
    delays = [backoff.next_delay(ran_for=1) for _ in range(8)]
    assert delays == [0, 10, 20, 40, 80, 160, 300, 300]
    assert backoff.next_delay(ran_for=600) == 0


# --- mount path rewriting ------------------------------------------------------------------------------
def test_mount_paths_are_rewritten_longest_first(tmp_path: Path) -> None:
    container: Obj = {
        "volumeMounts": [
            {"name": "cfg", "mountPath": "/etc/pdserve"},
            {"name": "model", "mountPath": "/etc/pdserve/model/"},
            {"name": "one", "mountPath": "/etc/one.yaml", "subPath": "one.yaml"},
            {"name": "pvc", "mountPath": "/data"},
        ]
    }
    dirs = {"cfg": tmp_path / "cfg", "model": tmp_path / "model", "one": tmp_path / "one"}
    mounts = container_mounts(container, dirs)
    assert mounts[0].mount_path == "/etc/pdserve/model"
    assert rewrite_path("/etc/pdserve/router.yaml", mounts) == f"{tmp_path}/cfg/router.yaml"
    assert rewrite_path("/etc/pdserve/model/w.bin", mounts) == f"{tmp_path}/model/w.bin"
    assert rewrite_path("--config=/etc/pdserve", mounts) == f"--config={tmp_path}/cfg"
    assert rewrite_path("/etc/one.yaml", mounts) == f"{tmp_path}/one/one.yaml"
    assert rewrite_path("/etc/pdservex", mounts) == "/etc/pdservex"
    assert rewrite_path("/data/x", mounts) == "/data/x"  # not materialised: left alone
    assert rewrite_path("relative/etc/pdserve", [Mount("/etc/pdserve", "/x")]) == "relative/etc/pdserve"


# --- pod status ----------------------------------------------------------------------------------------
def _view(name: str, **kwargs: Any) -> ContainerView:
    return ContainerView(name=name, image="img", **kwargs)


def test_phase_rules() -> None:
    running = _view("a", running_since=1.0, waiting=None)
    never_ran = _view("b")
    crashed = _view("c", waiting=("CrashLoopBackOff", ""), last_terminated=Terminated(1, "Error", 1, 2))
    done_ok = _view("d", waiting=None, terminated=Terminated(0, "Completed", 1, 2))
    done_bad = _view("e", waiting=None, terminated=Terminated(2, "Error", 1, 2))
    assert pod_phase("Always", [], [running, never_ran]) == "Pending"
    assert pod_phase("Always", [], [running, crashed]) == "Running"
    assert pod_phase("Always", [], [crashed]) == "Running"
    assert pod_phase("Never", [], [done_ok]) == "Succeeded"
    assert pod_phase("Never", [], [done_ok, done_bad]) == "Failed"
    assert pod_phase("OnFailure", [], [done_ok]) == "Succeeded"
    assert (
        pod_phase("Never", [_view("init", waiting=None, terminated=Terminated(1, "Error", 1, 2))], [never_ran])
        == "Failed"
    )
    assert pod_phase("Always", [_view("init", running_since=1.0, waiting=None)], [never_ran]) == "Pending"


def test_status_conditions_ip_and_transition_times() -> None:
    pod: Obj = {
        "metadata": {"name": "p"},
        "spec": {"restartPolicy": "Always", "readinessGates": [{"conditionType": "example.com/gate"}]},
        "status": {"conditions": [{"type": "ContainersReady", "status": "False", "lastTransitionTime": "old"}]},
    }
    ready = _view("a", running_since=1.0, waiting=None, ready=True, started=True, pid=42, command=["/py"])
    unready = _view("b", running_since=1.0, waiting=None, ready=False, started=True)
    status = pod_status(
        pod, pod_ip="127.9.0.5", host_ip="127.0.0.1", start_time=0, init=[], main=[ready, unready], now=10
    )
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Running"
    assert status["podIP"] == "127.9.0.5" and status["podIPs"] == [{"ip": "127.9.0.5"}]
    assert conditions["ContainersReady"]["status"] == "False"
    assert conditions["ContainersReady"]["lastTransitionTime"] == "old"  # status unchanged: time kept
    assert "[b]" in conditions["Ready"]["message"]
    assert status["containerStatuses"][0]["containerID"] == "process://42"
    assert status["containerStatuses"][0]["state"] == {"running": {"startedAt": "1970-01-01T00:00:01Z"}}
    # All containers ready, but the readiness gate is not set: Ready stays False.
    unready.ready = True
    status = pod_status(
        pod,
        pod_ip="127.9.0.5",
        host_ip="127.0.0.1",
        start_time=0,
        init=[],
        main=[ready, unready],
        now=20,
        previous_conditions=status["conditions"],
    )
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["ContainersReady"]["status"] == "True"
    assert conditions["ContainersReady"]["lastTransitionTime"] == "1970-01-01T00:00:20Z"
    assert conditions["Ready"]["reason"] == "ReadinessGatesNotReady"
    pod["status"]["conditions"].append({"type": "example.com/gate", "status": "True"})
    status = pod_status(
        pod,
        pod_ip="127.9.0.5",
        host_ip="127.0.0.1",
        start_time=0,
        init=[],
        main=[ready, unready],
        now=30,
        previous_conditions=status["conditions"],
    )
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"


def test_python_for_rewrites_is_this_interpreter() -> None:
    assert ImageMap.load().resolve("python:3", ["python", "-V"], None).argv == [sys.executable, "-V"]


# --- command line --------------------------------------------------------------------------------------
def test_command_line_reports_bad_inputs_clearly(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from pdserve_dev.process_node.__main__ import main

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    bad_map = tmp_path / "map.yaml"
    bad_map.write_text("images: [{match: []}]\n")
    base = ["--kubeconfig", str(kubeconfig), "--node-name", "n", "--workdir", str(tmp_path / "w")]
    runner = CliRunner()
    result = runner.invoke(main, [*base, "--image-map", str(bad_map)])
    assert result.exit_code == 1 and "does not follow the format" in result.output
    result = runner.invoke(main, [*base, "--pod-cidr", "not-a-cidr"])
    assert result.exit_code == 1 and "not-a-cidr" in result.output
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0 and "--pod-cidr" in result.output and "PDSERVE_POD_CIDR" in result.output


# --- lifecycle hooks -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("grace", "hook_seconds", "left"),
    [
        (30.0, 5.9, 25.0),  # the hook's run time in whole seconds comes off the grace period
        (10.0, 0.0, 10.0),
        (5.0, 4.2, 2.0),  # SIGTERM always gets at least 2 s before SIGKILL
        (5.0, 7.0, 2.0),  # a hook abandoned at the end of the grace period
    ],
)
def test_grace_left_after_the_prestop_hook(grace: float, hook_seconds: float, left: float) -> None:
    assert grace_after_hook(grace, hook_seconds) == left


def test_lifecycle_hooks_run_and_report_failures(tmp_path: Path) -> None:
    import os

    env = dict(os.environ, HOOK_MARK=str(tmp_path / "mark"))

    def hook(handler: Obj, timeout: float = 5.0) -> tuple[bool, str]:
        container: Obj = {"name": "c", "ports": [{"name": "http", "containerPort": free_port()}]}
        return run_hook(handler, container=container, pod_ip="127.0.0.1", env=env, cwd=tmp_path, timeout=timeout)

    assert hook({"sleep": {"seconds": 0}}) == (True, "")
    # exec runs on the host with the container's environment and folder.
    assert hook({"exec": {"command": ["sh", "-c", 'echo stopping > "$HOOK_MARK"']}}) == (True, "")
    assert (tmp_path / "mark").read_text() == "stopping\n"
    ok, why = hook({"exec": {"command": ["sh", "-c", "echo broken >&2; exit 3"]}})
    assert not ok and "exited 3" in why and "broken" in why
    ok, why = hook({"exec": {"command": ["/no/such/binary"]}})
    assert not ok and "failed to start" in why
    ok, why = hook({"exec": {"command": ["sleep", "30"]}}, timeout=0.2)
    assert not ok and "did not finish" in why
    ok, why = hook({"httpGet": {"path": "/quit", "port": "http"}})  # nothing listens there
    assert not ok and "Connection" in why
    ok, why = hook({"tcpSocket": {"port": 80}})
    assert not ok and "unsupported" in why
