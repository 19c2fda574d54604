"""In-cluster configuration parts of the process node without a cluster: the token refresh rule and the atomic
token file, the `kubernetes` Service variables and the relay behind its ClusterIP (over real sockets).

The TokenRequest itself is exercised against the real API server in test_process_node_cluster.py; here a
stand-in token source counts the requests, since the point is the file handling and the schedule.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve_dev.process_node import apiservice
from pdserve_dev.process_node.podenv import ContainerConfigError
from pdserve_dev.process_node.podworker import host_environment
from pdserve_dev.process_node.tokens import ProjectedToken, refresh_time
from pdserve_dev.testing.net import free_port


def test_tokens_are_renewed_at_80_percent_of_their_life_or_after_a_day() -> None:
    assert refresh_time(expires_at=10_000.0, expiration_seconds=3600) == 10_000.0 - 3600 + 2880
    assert refresh_time(expires_at=1_000_000.0, expiration_seconds=7 * 24 * 3600) == 1_000_000.0 - 7 * 24 * 3600 + 86400


class _Tokens:
    """Counts TokenRequests and hands out numbered tokens that expire an hour after `now`."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str | None, int, str, str]] = []
        self.now = 1_000.0

    def request_token(
        self,
        namespace: str,
        service_account: str,
        *,
        audience: str | None,
        expiration_seconds: int,
        pod_name: str,
        pod_uid: str,
    ) -> tuple[str, float]:
        self.requests.append((namespace, service_account, audience, expiration_seconds, pod_name, pod_uid))
        return f"token-{len(self.requests)}", self.now + expiration_seconds


POD = {"metadata": {"name": "op-0", "namespace": "ns", "uid": "u-1"}, "spec": {"serviceAccountName": "op"}}


def test_a_projected_token_is_requested_for_the_pods_service_account_and_replaced_whole(tmp_path: Path) -> None:
    tokens = _Tokens()
    token = ProjectedToken.from_source({"path": "token", "expirationSeconds": 3607}, tmp_path, 0o644, None)
    token.refresh(tokens, POD)
    assert tokens.requests == [("ns", "op", None, 3607, "op-0", "u-1")]
    assert (tmp_path / "token").read_text() == "token-1"
    assert (tmp_path / "token").stat().st_mode & 0o777 == 0o644
    assert token.refresh_at == pytest.approx(1_000.0 + 0.8 * 3607)
    assert not token.due(token.refresh_at - 1) and token.due(token.refresh_at)
    inode = (tmp_path / "token").stat().st_ino
    token.refresh(tokens, POD)
    assert (tmp_path / "token").read_text() == "token-2"
    assert (tmp_path / "token").stat().st_ino != inode  # renamed over, never rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token"]


def test_a_token_path_outside_its_volume_is_refused(tmp_path: Path) -> None:
    token = ProjectedToken.from_source({"path": "../escape", "audience": "vault"}, tmp_path / "v", None, None)
    with pytest.raises(ContainerConfigError, match="escapes the volume"):
        token.refresh(_Tokens(), POD)
    assert not (tmp_path / "escape").exists()


def test_the_kubernetes_service_variables_follow_the_kubelets_names() -> None:
    assert apiservice.service_env("198.19.128.1", 443) == {
        "KUBERNETES_SERVICE_HOST": "198.19.128.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBERNETES_SERVICE_PORT_HTTPS": "443",
        "KUBERNETES_PORT": "tcp://198.19.128.1:443",
        "KUBERNETES_PORT_443_TCP": "tcp://198.19.128.1:443",
        "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
        "KUBERNETES_PORT_443_TCP_PORT": "443",
        "KUBERNETES_PORT_443_TCP_ADDR": "198.19.128.1",
    }
    service = {"spec": {"clusterIP": "198.19.128.1", "ports": [{"name": "https", "port": 443}]}}
    assert apiservice.service_address(service) == ("198.19.128.1", 443)
    assert apiservice.service_address({"spec": {"clusterIP": "None", "ports": [{"port": 1}]}}) is None
    assert apiservice.service_address(None) is None
    assert apiservice.upstream_of("https://127.0.0.1:6443") == ("127.0.0.1", 6443)


@pytest.fixture
def echo_server() -> Iterator[tuple[str, int]]:
    """A TCP server that answers every chunk with the chunk upper-cased (stopped at the end)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)  # accept wakes up to see `stop`
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(10)
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data.upper())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[:2]
    stop.set()
    server.close()
    thread.join(5)


def test_the_relay_carries_bytes_both_ways_and_falls_back_when_it_cannot_listen(
    echo_server: tuple[str, int],
) -> None:
    port = free_port()
    env, relay = apiservice.start(("127.0.0.1", port), echo_server)
    assert relay is not None
    try:
        assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and env["KUBERNETES_SERVICE_PORT"] == str(port)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(b"hello " * 20000)
            received = b""
            while len(received) < 6 * 20000:
                received += client.recv(65536)
        assert received == b"HELLO " * 20000
        assert relay.connections == 1
        # The address is taken (here by the relay itself): pods get the upstream's address instead.
        env, second = apiservice.start(("127.0.0.1", port), echo_server)
        assert second is None
        assert env["KUBERNETES_SERVICE_HOST"] == echo_server[0]
        assert env["KUBERNETES_SERVICE_PORT"] == str(echo_server[1])
    finally:
        relay.stop()


def test_no_client_configuration_of_the_node_leaks_into_sandboxed_containers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", "/admin.kubeconfig")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    sandboxed = host_environment("/node.kubeconfig", sandbox=True)
    assert "KUBECONFIG" not in sandboxed and "KUBERNETES_SERVICE_HOST" not in sandboxed
    # Without the sandbox there is no token mount: the node's kubeconfig is how containers reach the API.
    assert host_environment("/node.kubeconfig", sandbox=False)["KUBECONFIG"] == "/node.kubeconfig"
