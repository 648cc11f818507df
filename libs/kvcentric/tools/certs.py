"""A throwaway certificate authority and the certificates it signs, for `kvcentric up --secure` and the tests:
PEM bytes in, PEM bytes out, the time passed in. It writes nothing but what `write_pair` is asked to write,
and it is no place to keep a production CA (that is the operator's PKI: cert-manager, Vault, a cloud CA).

Keys are ECDSA P-256: every party of a kvcentric cluster (nats-server's Go TLS, grpcio's BoringSSL, Python's
OpenSSL) speaks it, and a key is made in a millisecond where RSA takes a hundred.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 30
"""How long a throwaway certificate is valid: a local cluster lives hours, never this long."""
CLOCK_SKEW = datetime.timedelta(minutes=5)
"""A certificate is valid from this long before it was made, so a peer whose clock is a little behind takes it."""


@dataclasses.dataclass(frozen=True)
class Issued:
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes = dataclasses.field(repr=False)

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvcentric"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def subject_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """Each host as the subject alternative name it is: an IP address, else a DNS name."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def new_ca(name: str, now: datetime.datetime, days: int = VALID_DAYS) -> Issued:
    """A self-signed CA that may sign certificates but no CA below it."""
    key = new_key()
    subject = _name(name)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue(ca: Issued, name: str, hosts: Sequence[str], now: datetime.datetime, days: int = VALID_DAYS) -> Issued:
    """A certificate signed by `ca` for `name`, valid for `hosts` (IP addresses or DNS names) as a server and
    usable as a client too (one certificate per service serves its port and presents itself to its peers)."""
    key = new_key()
    ca_cert = ca.certificate
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    builder = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_agreement=True,
                                            key_cert_sign=False, crl_sign=False, content_commitment=False,
                                            data_encipherment=False, encipher_only=False, decipher_only=False),
                              critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName(subject_names(hosts)), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def write_private(path: str, data: bytes) -> str:
    """Write `data` to a file only its owner may read (made so before a byte is written); returns the path."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(data)
    return path


def write_pair(issued: Issued, folder: str, stem: str) -> tuple[str, str]:
    """`<stem>.pem` (readable) and `<stem>-key.pem` (owner only) in `folder`; returns their paths."""
    cert_path = os.path.join(folder, f"{stem}.pem")
    with open(cert_path, "wb") as out:
        out.write(issued.cert_pem)
    return cert_path, write_private(os.path.join(folder, f"{stem}-key.pem"), issued.key_pem)
