"""The sandbox launcher run for real (it needs root for mount namespaces; skipped elsewhere): what a container
sees and may do, checked from inside by a Python child, and what the host keeps (no folder created, nothing
written outside the volumes)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from pdserve_dev.process_node import launch
from pdserve_dev.process_node.security import CAPABILITIES, DEFAULT_CAPABILITIES, Security

# Reports, as JSON, who the child is and which writes succeed.
CHILD = r"""
import json, os, socket, sys
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
writes = {}
for path in sys.argv[1:]:
    try:
        with open(path, "w") as handle:
            handle.write("x")
        writes[path] = "ok"
    except OSError as exc:
        writes[path] = exc.strerror
print(json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()), "hostname": socket.gethostname(),
    "cwd": os.getcwd(), "home": os.environ.get("HOME"), "cap_eff": int(status["CapEff"], 16),
    "cap_bnd": int(status["CapBnd"], 16), "no_new_privs": status["NoNewPrivs"].strip(),
    "token": open("/var/run/secrets/kubernetes.io/serviceaccount/token").read(),
    "config": open("/etc/pdserve-sandbox-test/app.yaml").read(), "writes": writes,
}))
"""
MOUNT_HOST_PARENT = Path("/etc/pdserve-sandbox-test")
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> launch.SandboxSettings:
    why_not = launch.probe(tmp_path_factory.mktemp("probe"))
    if why_not is not None:
        pytest.skip(f"no sandbox here: {why_not}")
    return launch.SandboxSettings(reachable=launch.host_reachable_paths())


def _run(
    settings: launch.SandboxSettings, pod: Path, security: Security, paths: list[str], working_dir: str = "/"
) -> tuple[int, dict[str, Any], str]:
    volumes = {name: pod / "volumes" / name for name in ("scratch", "config", "token")}
    for folder in volumes.values():
        folder.mkdir(parents=True, exist_ok=True)
    volumes["scratch"].chmod(0o777)
    (volumes["config"] / "app.yaml").write_text("port: 1\n")
    (volumes["token"] / "token").write_text("the-token")
    mounts = [
        {"source": str(volumes["scratch"]), "target": "/tmp", "readOnly": False},
        {"source": str(volumes["config"]), "target": str(MOUNT_HOST_PARENT), "readOnly": True},
        {"source": str(volumes["token"]), "target": TOKEN_DIR, "readOnly": True},
    ]
    spec = pod / "spec.json"
    launch.write_spec(
        spec,
        root=pod / "rootfs",
        mounts=mounts,
        security=security,
        working_dir=working_dir,
        hostname="pod-1",
        reachable=settings.reachable,
    )
    (pod / "rootfs").mkdir(exist_ok=True)
    argv = settings.command(spec, [sys.executable, "-c", CHILD, *paths])
    env = {"PATH": "/usr/bin:/bin", "HOME": "/" if security.uid else "/root"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=env, cwd=pod)
    report = json.loads(proc.stdout) if proc.returncode == 0 else {}
    return proc.returncode, report, proc.stderr


def _mask(names: set[str]) -> int:
    return sum(1 << CAPABILITIES[name] for name in names)


def test_a_non_root_container_on_a_read_only_root_writes_only_to_its_volumes(
    settings: launch.SandboxSettings, tmp_path: Path
) -> None:
    host_marker = Path("/tmp") / f"pdserve-sandbox-{uuid.uuid4().hex}"
    inside = ["/tmp/ok", str(host_marker), "/x", str(Path.cwd() / "x"), f"{TOKEN_DIR}/y", "/dev/shm/ok"]
    security = Security(uid=65532, gid=65532, capabilities=(), no_new_privs=True, read_only_root=True)
    code, report, stderr = _run(settings, tmp_path, security, inside)
    assert code == 0, stderr
    assert (report["uid"], report["gid"], report["groups"], report["hostname"]) == (65532, 65532, [], "pod-1")
    assert (report["cap_eff"], report["cap_bnd"], report["no_new_privs"]) == (0, 0, "1")
    assert report["token"] == "the-token" and report["config"] == "port: 1\n"
    assert report["writes"] == {
        "/tmp/ok": "ok",  # the emptyDir at /tmp
        str(host_marker): "ok",  # also /tmp: the volume, not the host's /tmp
        "/x": "Read-only file system",
        str(Path.cwd() / "x"): "Read-only file system",
        f"{TOKEN_DIR}/y": "Read-only file system",
        "/dev/shm/ok": "ok",  # a private tmpfs, as containers have
    }
    assert (tmp_path / "volumes" / "scratch" / "ok").read_text() == "x"
    assert not host_marker.exists()
    assert not MOUNT_HOST_PARENT.exists(), "the mount point was made on the host"
    assert not (Path.cwd() / "x").exists()


def test_a_root_container_keeps_the_default_capabilities_and_a_private_tmp(
    settings: launch.SandboxSettings, tmp_path: Path
) -> None:
    kept = DEFAULT_CAPABILITIES | {"IPC_LOCK"}
    security = Security(capabilities=tuple(sorted(CAPABILITIES[c] for c in kept)))
    host_marker = Path("/var/tmp") / f"pdserve-sandbox-{uuid.uuid4().hex}"
    code, report, stderr = _run(settings, tmp_path, security, [str(host_marker)], working_dir="/work/dir")
    assert code == 0, stderr
    assert (report["uid"], report["cwd"]) == (0, "/work/dir")
    assert report["cap_eff"] == report["cap_bnd"] == _mask(set(kept))
    assert report["no_new_privs"] == "0"
    # A writable root is the host's file system (no images): the write lands there.
    assert report["writes"] == {str(host_marker): "ok"}
    assert host_marker.read_text() == "x"
    host_marker.unlink()
    assert not Path("/work/dir").exists(), "the working folder was made on the host"


def test_a_command_that_does_not_exist_exits_127_and_says_so(settings: launch.SandboxSettings, tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    (tmp_path / "rootfs").mkdir()
    launch.write_spec(
        spec, root=tmp_path / "rootfs", mounts=[], security=Security(), working_dir="/", hostname="h", reachable=()
    )
    proc = subprocess.run(
        settings.command(spec, ["no-such-program-anywhere"]), capture_output=True, text=True, timeout=30, check=False
    )
    assert proc.returncode == 127
    assert "cannot execute 'no-such-program-anywhere'" in proc.stderr


@pytest.mark.parametrize("read_only_root", [True, False], ids=["tmp-volume", "private-tmp"])
def test_an_install_under_the_hosts_tmp_stays_runnable_below_the_containers_tmp(
    settings: launch.SandboxSettings, tmp_path: Path, read_only_root: bool
) -> None:
    """A checkout under /tmp (CI clones there) holds the interpreter that stands in for the image: the container's
    /tmp (an emptyDir volume, or its private tmpfs) must not hide it."""
    install = Path("/tmp") / f"pdserve-sandbox-install-{uuid.uuid4().hex}"
    (install / "bin").mkdir(parents=True)
    try:
        tool = install / "bin" / "tool"
        tool.write_text("#!/bin/sh\necho ran\n")
        tool.chmod(0o755)
        install.chmod(0o755)
        reachable = launch.SandboxSettings(
            python=settings.python, launcher=settings.launcher, reachable=(*settings.reachable, str(install / "bin"))
        )
        security = Security(uid=65532, gid=65532, capabilities=(), no_new_privs=True, read_only_root=read_only_root)
        pod = tmp_path / "pod"
        scratch = pod / "volumes" / "scratch"
        scratch.mkdir(parents=True)
        scratch.chmod(0o777)
        mounts = [{"source": str(scratch), "target": "/tmp", "readOnly": False}] if read_only_root else []
        spec = pod / "spec.json"
        launch.write_spec(
            spec,
            root=pod / "rootfs",
            mounts=mounts,
            security=security,
            working_dir="/",
            hostname="pod-1",
            reachable=reachable.reachable,
        )
        (pod / "rootfs").mkdir()
        argv = reachable.command(spec, [str(tool)])
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, cwd=pod)
        assert (proc.returncode, proc.stdout) == (0, "ran\n"), proc.stderr
        # With a /tmp volume the mount points are made in it: empty folders named like the hidden host entries
        # (this one, and this checkout's when it lives under /tmp too).
        made = sorted(scratch.iterdir())
        assert (scratch / install.name in made) == read_only_root
        assert all(p.is_dir() and not any(p.iterdir()) and (Path("/tmp") / p.name).is_dir() for p in made)
    finally:
        tool.unlink(missing_ok=True)
        (install / "bin").rmdir()
        install.rmdir()
