"""The generated PKI: a TLS handshake over a real loopback socket, client identities, reuse."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import threading
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from pdserve_dev.cluster.certs import generate_pki
from pdserve_dev.cluster.kubeconfig import render_kubeconfig


def _subject(path: Path) -> tuple[str, list[str]]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    orgs = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    return str(cn), [str(o) for o in orgs]


def test_server_certificate_verifies_over_mutual_tls(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path, "198.19.128.1")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(pki.apiserver_cert, pki.apiserver_key)
    server_ctx.load_verify_locations(pki.ca_cert)
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    client_ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    client_ctx.load_cert_chain(pki.client_cert("admin"), pki.client_key("admin"))

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen: dict[str, object] = {}

    def serve() -> None:
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            seen["peer"] = tls.getpeercert()
            tls.sendall(b"ok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            assert tls.recv(2) == b"ok"
        thread.join(5)
    finally:
        listener.close()
    peer = seen["peer"]
    assert isinstance(peer, dict)
    assert tuple(x for x in peer["subject"] if x[0][0] == "commonName") == ((("commonName", "admin"),),)


def test_server_certificate_names_and_client_identities(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path, "198.19.128.1")
    cert = x509.load_pem_x509_certificate(pki.apiserver_cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("198.19.128.1")} <= set(
        sans.get_values_for_type(x509.IPAddress)
    )
    assert "kubernetes.default.svc" in sans.get_values_for_type(x509.DNSName)
    assert _subject(pki.client_cert("admin")) == ("admin", ["system:masters"])
    assert _subject(pki.client_cert("scheduler")) == ("system:kube-scheduler", [])
    assert _subject(pki.client_cert("controller-manager")) == ("system:kube-controller-manager", [])
    assert pki.service_account_key.stat().st_mode & 0o777 == 0o600
    assert pki.service_account_pub.read_text().startswith("-----BEGIN PUBLIC KEY-----")


def test_existing_files_are_reused_and_missing_ones_regenerated(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path, "198.19.128.1")
    ca_before = pki.ca_cert.read_bytes()
    admin_before = pki.client_cert("admin").read_bytes()
    pki.client_cert("kwok").unlink()
    generate_pki(tmp_path, "198.19.128.1")
    assert pki.ca_cert.read_bytes() == ca_before
    assert pki.client_cert("admin").read_bytes() == admin_before
    assert pki.client_cert("kwok").exists()


def test_kubeconfig_embeds_the_credentials(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path, "198.19.128.1")
    config = render_kubeconfig("https://127.0.0.1:6443", pki, "admin")
    assert config["current-context"] == "pdserve-dev"
    clusters = config["clusters"]
    assert isinstance(clusters, list)
    assert clusters[0]["cluster"]["server"] == "https://127.0.0.1:6443"
