"""A port taken between choosing it and binding it makes the cluster retry with new ports, not fail."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pdserve_dev.cluster import cluster as cluster_module
from pdserve_dev.cluster.cluster import LocalCluster
from pdserve_dev.testing.net import free_ports

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_start_retries_when_a_chosen_port_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    squatter = socket.create_server(("127.0.0.1", 0))
    taken = squatter.getsockname()[1]
    real_free_ports = free_ports
    calls: list[list[int]] = []

    def first_one_taken(count: int) -> list[int]:
        ports = real_free_ports(count)
        if not calls:
            ports[0] = taken  # etcd's client port: etcd exits with "address already in use"
        calls.append(ports)
        return ports

    monkeypatch.setattr(cluster_module, "free_ports", first_one_taken)
    messages: list[str] = []
    try:
        with LocalCluster(tmp_path, topology="minimal", process_node=False, log=messages.append) as local:
            assert local.state is not None
            assert local.state.etcd_port != taken
    finally:
        squatter.close()
    assert len(calls) == 2
    assert any("retrying" in m for m in messages)
