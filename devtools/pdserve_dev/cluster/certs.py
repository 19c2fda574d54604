"""The cluster's PKI: one CA, the API server's serving certificate, client certificates and service-account keys.

Everything uses ECDSA P-256 (fast to generate, accepted by every component). Client identities follow
Kubernetes' conventions: the certificate's CN is the user name and its O entries are the groups, so
`system:kube-controller-manager` and `system:kube-scheduler` get the RBAC roles kube-apiserver bootstraps
for them, and `admin` in `system:masters` is cluster-admin. Files are written once per workdir and reused,
which keeps a warm `up` fast; `generate_pki` regenerates only what is missing.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)

# Names the API server answers to: loopback for the host, and the in-cluster service names for pods.
API_SERVER_DNS_NAMES: tuple[str, ...] = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class ClientIdentity:
    """A user of the API server authenticated by a client certificate."""

    file_stem: str
    user: str
    groups: tuple[str, ...] = ()


CLIENTS: tuple[ClientIdentity, ...] = (
    ClientIdentity("admin", "admin", ("system:masters",)),
    ClientIdentity("controller-manager", "system:kube-controller-manager"),
    ClientIdentity("scheduler", "system:kube-scheduler"),
    # kwok and the process node play kubelets for many nodes and patch pod status; the Node authorizer only
    # admits one node per identity, so they run with cluster-admin rights like kwok's own examples do.
    ClientIdentity("kwok", "kwok-controller", ("system:masters",)),
    ClientIdentity("process-node", "pdserve-process-node", ("system:masters",)),
    # Prometheus' service discovery: no group, only the read-only ClusterRole `prometheus.rbac_objects()` binds.
    ClientIdentity("prometheus", "pdserve-dev:prometheus"),
)


@dataclass(frozen=True)
class Pki:
    """Paths of the generated files."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def apiserver_cert(self) -> Path:
        return self.directory / "apiserver.crt"

    @property
    def apiserver_key(self) -> Path:
        return self.directory / "apiserver.key"

    @property
    def service_account_key(self) -> Path:
        return self.directory / "sa.key"

    @property
    def service_account_pub(self) -> Path:
        return self.directory / "sa.pub"

    def client_cert(self, stem: str) -> Path:
        return self.directory / f"{stem}.crt"

    def client_key(self, stem: str) -> Path:
        return self.directory / f"{stem}.key"


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    attributes += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    return x509.Name(attributes)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    # Backdate a little so a clock that is a few seconds behind does not reject a fresh certificate.
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + VALIDITY)
    )


def _load_ca(pki: Pki) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{pki.ca_key} is not an ECDSA key")
    return cert, key


def _create_ca(pki: Pki) -> None:
    key = _new_key()
    name = _name("pdserve-devcluster-ca")
    cert = (
        _builder(name, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key, pki.ca_key)
    _write_cert(cert, pki.ca_cert)


def _leaf_key_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        key_encipherment=True,
        content_commitment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def _issue(
    pki: Pki,
    *,
    subject: x509.Name,
    usage: x509.ObjectIdentifier,
    cert_path: Path,
    key_path: Path,
    sans: list[x509.GeneralName] | None = None,
) -> None:
    ca_cert, ca_key = _load_ca(pki)
    key = _new_key()
    builder = (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_leaf_key_usage(), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    _write_key(key, key_path)
    _write_cert(builder.sign(ca_key, hashes.SHA256()), cert_path)


def generate_pki(directory: Path, service_ip: str) -> Pki:
    """Create whatever is missing of the cluster PKI under `directory` and return the paths.

    `service_ip` is the ClusterIP of the `kubernetes` Service (the first address of the service range); it is a
    SAN of the serving certificate so in-cluster clients that use it verify the server.
    """
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    if not (pki.ca_cert.exists() and pki.ca_key.exists()):
        _create_ca(pki)
        # A new CA invalidates everything it signed before.
        for path in directory.glob("*"):
            if path not in (pki.ca_cert, pki.ca_key) and path.suffix in (".crt", ".key", ".pub"):
                path.unlink()
    if not pki.apiserver_cert.exists():
        sans: list[x509.GeneralName] = [x509.DNSName(name) for name in API_SERVER_DNS_NAMES]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", service_ip)]
        _issue(
            pki,
            subject=_name("kube-apiserver"),
            usage=ExtendedKeyUsageOID.SERVER_AUTH,
            cert_path=pki.apiserver_cert,
            key_path=pki.apiserver_key,
            sans=sans,
        )
    for client in CLIENTS:
        if not pki.client_cert(client.file_stem).exists():
            _issue(
                pki,
                subject=_name(client.user, client.groups),
                usage=ExtendedKeyUsageOID.CLIENT_AUTH,
                cert_path=pki.client_cert(client.file_stem),
                key_path=pki.client_key(client.file_stem),
            )
    if not pki.service_account_key.exists():
        # The key pair kube-apiserver signs service-account tokens with and kube-controller-manager uses for
        # the legacy token controller; the public half verifies them.
        key = _new_key()
        _write_key(key, pki.service_account_key)
        pki.service_account_pub.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
    return pki
