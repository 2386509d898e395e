"""A throwaway PKI for TLS tests: a CA, a server certificate for localhost/127.0.0.1, client
certificates (one signed by the CA, one self-signed impostor), all written as PEM files."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


@dataclass(frozen=True)
class PKI:
    ca: str             # the CA certificate (trusted by clients, and by servers for client certs)
    server: Pair        # SAN localhost, 127.0.0.1
    client: Pair        # signed by the CA
    impostor: Pair      # self-signed: a server requiring client certs refuses it
    other_ca: str       # a CA that signed nothing here


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(out: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pair:
    cert_path, key_path = out / f"{stem}.crt", out / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return Pair(str(cert_path), str(key_path))


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False,
                 usage: x509.ObjectIdentifier | None = None,
                 sans: list[x509.GeneralName] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                      content_commitment=False, key_encipherment=False,
                                                      data_encipherment=False, key_agreement=False,
                                                      encipher_only=False, decipher_only=False), critical=True)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _ca(subject: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    return _certificate(subject, key, _name(subject), key, ca=True), key


def make_pki(out: Path) -> PKI:
    out.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _ca("lora-serving test CA")
    other_cert, _ = _ca("some other CA")
    (out / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (out / "other-ca.crt").write_bytes(other_cert.public_bytes(serialization.Encoding.PEM))

    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _certificate("localhost", server_key, ca_cert.subject, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH,
                          sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _certificate("test client", client_key, ca_cert.subject, ca_key,
                          usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    impostor_key = ec.generate_private_key(ec.SECP256R1())
    impostor = _certificate("impostor", impostor_key, _name("impostor"), impostor_key,
                            usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return PKI(ca=str(out / "ca.crt"), server=_write(out, "server", server, server_key),
               client=_write(out, "client", client, client_key),
               impostor=_write(out, "impostor", impostor, impostor_key), other_ca=str(out / "other-ca.crt"))
