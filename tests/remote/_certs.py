"""Certificates the TLS tests make for themselves: a CA, a server certificate for 127.0.0.1
signed by it, a client certificate signed by it, and a second CA (with its key) that signed
neither.

Made with ``cryptography``'s x509 builder (the ``test`` extra), EC P-256 keys, valid for one
day, written as PEM files into a directory the test owns.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True, slots=True)
class Certs:
    """Paths of the PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_key: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _signed(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    path: Path,
    *,
    ca: bool = False,
    ip: str | None = None,
) -> Path:
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_name, issuer_key = issuer if issuer is not None else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage, critical=True).add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
        )
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    if ip is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
            critical=False,
        )
    path.write_bytes(
        builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
    )
    return path


def make_certs(directory: Path) -> Certs:
    """A fresh CA, server (127.0.0.1) and client certificates, and an unrelated CA."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, server_key, client_key, other_key = (ec.generate_private_key(ec.SECP256R1())
                                                 for _ in range(4))  # fmt: skip
    ca = _signed("hybridkv test CA", ca_key, None, directory / "ca.crt", ca=True)
    issuer = ("hybridkv test CA", ca_key)
    return Certs(
        ca=ca,
        server_cert=_signed("127.0.0.1", server_key, issuer, directory / "server.crt",
                            ip="127.0.0.1"),
        server_key=_write_key(server_key, directory / "server.key"),
        client_cert=_signed("hybridkv engine", client_key, issuer, directory / "client.crt"),
        client_key=_write_key(client_key, directory / "client.key"),
        other_ca=_signed("another CA", other_key, None, directory / "other.crt", ca=True),
        other_key=_write_key(other_key, directory / "other.key"),
    )  # fmt: skip
