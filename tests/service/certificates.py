"""Certificates for the TLS tests, made with `cryptography`: a CA, a server certificate for localhost and
127.0.0.1 it signs, a client certificate it signs, and an unrelated second CA."""

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Pem:
    cert: bytes
    key: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(cert: x509.Certificate, key) -> Pem:
    return Pem(cert.public_bytes(serialization.Encoding.PEM),
               key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption()))


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def make_ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(name, _name(name), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def issue(ca, common_name: str, server: bool) -> Pem:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(common_name, ca_cert.subject, key.public_key()).add_extension(
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
        critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return _pem(builder.sign(ca_key, hashes.SHA256()), key)


@dataclass
class TestPki:
    ca: bytes
    other_ca: bytes
    server: Pem
    client: Pem
    stranger: Pem              # a client certificate the other CA signed
    files: dict[str, str]      # server cert, key, client CA as paths


def make_pki(directory: Path) -> TestPki:
    ca, other = make_ca("metrale test CA"), make_ca("someone else's CA")
    server, client = issue(ca, "localhost", server=True), issue(ca, "gateway", server=False)
    ca_pem = _pem(*ca).cert
    files = {}
    for name, data in (("server.crt", server.cert), ("server.key", server.key), ("ca.crt", ca_pem)):
        (directory / name).write_bytes(data)
        files[name] = str(directory / name)
    return TestPki(ca_pem, _pem(*other).cert, server, client, issue(other, "stranger", server=False), files)
