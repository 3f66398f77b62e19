"""A private CA and a server certificate it signed, for TLS between the stream's processes
and Kafka or Redis where no CA of an organisation signs: docker-compose.yml's `kafka-tls`
step makes the broker's, and the TLS tests make throwaway ones.

    python -m deploy.certificates --directory /secrets --host kafka --host localhost \\
        --keystore kafka.p12

writes ``ca.crt`` (give it to every client: [kafka] ca_file or KAFKA_CA_FILE),
``server.crt`` and ``server.key`` (PEM; the key readable by its owner only), and with
``--keystore`` a PKCS#12 keystore of the key and its chain with a fresh password in
``keystore-password``, as the Java broker reads them. An existing CA in the directory is
kept, so clients that trust it go on trusting a renewed server certificate.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_NAME = "SPLU Stream private CA"
CA_DAYS = 3650
SERVER_DAYS = 825  # the longest lifetime clients that follow the CA/Browser rules accept


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of a CA and of the server certificate it signed."""

    ca: Path
    certificate: Path
    key: Path


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


def _alternative_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by its owner only, from its first byte on."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)
    with os.fdopen(descriptor, "wb") as stream:
        stream.write(data)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    _write_private(
        path,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )  # fmt: skip


def _certificate(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: ec.EllipticCurvePrivateKey,
    days: float, extensions: Sequence[tuple[x509.ExtensionType, bool]],
) -> x509.Certificate:  # fmt: skip
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(CA_NAME))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(issuer, hashes.SHA256())


def make_certificates(directory: Path, hosts: Sequence[str], days: float = SERVER_DAYS) -> TlsFiles:
    """A CA (kept if `directory` has one) and a server certificate for `hosts` (names or
    IP addresses, as clients connect by them) signed by it, valid for `days`."""
    if not hosts:
        raise ValueError("a server certificate names at least one host")
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key")
    ca_key_path = directory / "ca.key"
    if ca_key_path.exists() and files.ca.exists():
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey), f"{ca_key_path}: an EC key"
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _certificate(
            CA_NAME, ca_key, ca_key, CA_DAYS,
            [(x509.BasicConstraints(ca=True, path_length=0), True),
             (x509.KeyUsage(False, False, False, False, False, True, True, False, False), True)],
        )  # fmt: skip
        _write_key(ca_key_path, ca_key)
        files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    key = ec.generate_private_key(ec.SECP256R1())
    server = _certificate(
        hosts[0], key, ca_key, days,
        [(x509.SubjectAlternativeName([_alternative_name(h) for h in hosts]), False),
         (x509.BasicConstraints(ca=False, path_length=None), True),
         (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)],
    )  # fmt: skip
    _write_key(files.key, key)
    files.certificate.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    return files


def write_keystore(files: TlsFiles, path: Path, password: str) -> None:
    """A PKCS#12 keystore of the server's key, certificate and CA, encrypted with
    `password` by PBES2 (AES-256, SHA-256), as Java's keystores read it."""
    key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    certificate = x509.load_pem_x509_certificate(files.certificate.read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    encryption = (
        serialization.PrivateFormat.PKCS12.encryption_builder()
        .kdf_rounds(100_000)
        .key_cert_algorithm(pkcs12.PBES.PBESv2SHA256AndAES256CBC)
        .hmac_hash(hashes.SHA256())
        .build(password.encode())
    )
    _write_private(
        path, pkcs12.serialize_key_and_certificates(b"server", key, certificate, [ca], encryption)
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.certificates",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--directory", type=Path, required=True, help="where to write")
    parser.add_argument(
        "--host", action="append", required=True,
        help="a name or address clients connect by (repeat for each)",
    )  # fmt: skip
    parser.add_argument(
        "--keystore", help="also a PKCS#12 keystore of this name, its password beside it"
    )
    parser.add_argument("--days", type=float, default=SERVER_DAYS, help="server certificate")
    args = parser.parse_args(argv)
    files = make_certificates(args.directory, args.host, args.days)
    if args.keystore:
        password = secrets.token_hex(24)
        _write_private(args.directory / "keystore-password", password.encode())
        write_keystore(files, args.directory / args.keystore, password)
    print(f"CA {files.ca}; server certificate for {', '.join(args.host)}: {files.certificate}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
