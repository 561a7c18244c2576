"""The deployment's own CA, and the leaf certificates the proxy presents when it intercepts a CONNECT tunnel.

The CA lives in one directory: `ca.pem` (the certificate clients and guest images trust) and `ca.key.enc`, its
private key sealed with AES-GCM under the vault's current key. Leaves are minted in memory per host, all for one
key pair per process, and kept as ready `ssl.SSLContext`s in a small LRU.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import ipaddress
import json
import os
import ssl
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from wakeful.proxy.hosts import is_ip, normalize_host
from wakeful.proxy.vault import Key, KeyRing, VaultError, _atomic_write

__all__ = ["CA_CERT_FILE", "CA_KEY_FILE", "CAError", "DeploymentCA", "LeafCertificates", "ca_pem", "load_or_create_ca",
           "sni_of"]

CA_CERT_FILE: Final = "ca.pem"
CA_KEY_FILE: Final = "ca.key.enc"
_FORMAT: Final = "wakeful-ca-key"
CA_VALIDITY: Final = timedelta(days=3650)
LEAF_VALIDITY: Final = timedelta(days=30)
LEAF_BACKDATE: Final = timedelta(hours=1)  # a client whose clock runs a little behind still accepts a fresh leaf


class CAError(VaultError):
    """The CA directory is unreadable, malformed, readable by others, or sealed under a key that is not loaded."""


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _aad(key_id: str) -> bytes:
    # Binds the ciphertext to its purpose and key: a vault entry cannot be swapped in as the CA key, nor back.
    return json.dumps([_FORMAT, 1, "ca private key", key_id], separators=(",", ":")).encode("ascii")


def _seal(private_key: ec.EllipticCurvePrivateKey, key: Key) -> bytes:
    der = private_key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    nonce = os.urandom(12)
    ciphertext = AESGCM(key.material.reveal()).encrypt(nonce, der, _aad(key.key_id))
    doc = {"format": _FORMAT, "version": 1, "key_id": key.key_id, "nonce": base64.b64encode(nonce).decode("ascii"),
           "ciphertext": base64.b64encode(ciphertext).decode("ascii")}
    return json.dumps(doc, indent=1).encode("ascii") + b"\n"


def _unseal(raw: bytes, keys: KeyRing, where: Path) -> tuple[ec.EllipticCurvePrivateKey, str]:
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("version") != 1:
            raise ValueError("not a sealed wakeful CA key, version 1")
        key_id, nonce, ciphertext = doc["key_id"], doc["nonce"], doc["ciphertext"]
        if not all(isinstance(v, str) for v in (key_id, nonce, ciphertext)):
            raise ValueError("fields must be strings")
        nonce_bytes = base64.b64decode(nonce, validate=True)
        ciphertext_bytes = base64.b64decode(ciphertext, validate=True)
    except (ValueError, KeyError, binascii.Error) as exc:
        raise CAError(f"the CA key file {where} is malformed: {exc}") from None
    key = keys.find(key_id)
    if key is None:
        raise CAError(f"the CA key in {where} is sealed under key {key_id}, which is not loaded")
    try:
        der = AESGCM(key.material.reveal()).decrypt(nonce_bytes, ciphertext_bytes, _aad(key_id))
    except (InvalidTag, ValueError):
        raise CAError(f"the CA key in {where} does not decrypt: wrong key or tampered file") from None
    private_key = serialization.load_der_private_key(der, password=None)
    if not isinstance(private_key, ec.EllipticCurvePrivateKey):
        raise CAError(f"the CA key in {where} is not an EC key")
    return private_key, key_id


@dataclass(frozen=True, kw_only=True)
class DeploymentCA:
    """The CA certificate and its private key, decrypted in this process only."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def ca_pem(self) -> bytes:
        """The CA certificate in PEM, for `wakeful proxy ca`, guest images and clients' trust stores."""
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def __repr__(self) -> str:
        return f"DeploymentCA({self.cert.subject.rfc4514_string()!r})"


def _new_ca(now: datetime) -> DeploymentCA:
    key = ec.generate_private_key(ec.SECP256R1())
    short_id = os.urandom(4).hex()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"wakeful deployment CA {short_id}"),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "wakeful")])
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - LEAF_BACKDATE).not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return DeploymentCA(cert=cert, key=key)


@contextlib.contextmanager
def _lock(directory: Path) -> Iterator[None]:
    # Two processes starting at once (serve and a CLI call) must end up with one CA, not two half-written ones.
    fd = os.open(directory / ".ca.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def load_or_create_ca(directory: Path, keys: KeyRing, *, clock: Callable[[], datetime] = _utcnow) -> DeploymentCA:
    """The CA in `directory`, created on first use (directory 0700, files 0600, written atomically).

    A key sealed under a previous key of the ring is re-sealed under the current one, so a vault key rotation
    carries the CA along. Raises `CAError`.
    """
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    if directory.stat().st_mode & 0o077:
        raise CAError(f"the CA directory {directory} is open to others: chmod 700 it")
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    with _lock(directory):
        if not cert_path.exists() and not key_path.exists():
            ca = _new_ca(clock())
            _atomic_write(key_path, _seal(ca.key, keys.current))
            _atomic_write(cert_path, ca.ca_pem())
            return ca
        try:
            if key_path.stat().st_mode & 0o077:
                raise CAError(f"the CA key file {key_path} is readable by others: chmod 600 it")
            raw_key, raw_cert = key_path.read_bytes(), cert_path.read_bytes()
        except OSError as exc:
            raise CAError(f"cannot read the CA in {directory}: {exc}") from None
        private_key, key_id = _unseal(raw_key, keys, key_path)
        try:
            cert = x509.load_pem_x509_certificate(raw_cert)
        except ValueError:
            raise CAError(f"{cert_path} is not a PEM certificate") from None
        if cert.public_key() != private_key.public_key():
            raise CAError(f"{cert_path} and {key_path} do not belong together")
        if key_id != keys.current.key_id:
            _atomic_write(key_path, _seal(private_key, keys.current))
        return DeploymentCA(cert=cert, key=private_key)


def _load_chain(context: ssl.SSLContext, pem: bytes) -> None:
    # `load_cert_chain` only reads files. An anonymous memory file keeps the leaf key off any disk; where there is
    # none, a private temporary directory stands in and the file is gone as soon as OpenSSL read it.
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None:
        fd = memfd("wakeful-leaf", 0)
        try:
            os.write(fd, pem)
            context.load_cert_chain(f"/proc/self/fd/{fd}")
            return
        except OSError:
            pass
        finally:
            os.close(fd)
    with tempfile.TemporaryDirectory(prefix="wakeful-leaf-") as tmp:
        path = Path(tmp) / "leaf.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        context.load_cert_chain(str(path))


def _remember_sni(ssl_object: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: ssl.SSLContext) -> None:
    # Stored on the connection's own SSL object, read back after the handshake: the context is shared by hosts'
    # connections, the object is not.
    ssl_object.wakeful_sni = server_name  # type: ignore[union-attr]


def sni_of(ssl_object: object) -> str | None:
    """The server name the client sent in its ClientHello, or None when it sent none."""
    value = getattr(ssl_object, "wakeful_sni", None)
    return value if isinstance(value, str) else None


class LeafCertificates:
    """Leaf certificates per host, signed by the deployment CA, served as cached server-side `SSLContext`s."""

    def __init__(self, ca: DeploymentCA, *, cache_size: int = 1024, clock: Callable[[], datetime] = _utcnow,
                 validity: timedelta = LEAF_VALIDITY) -> None:
        self._ca = ca
        self._ca_pem = ca.ca_pem()
        self._clock = clock
        self._validity = validity
        self._cache_size = cache_size
        self._contexts: OrderedDict[str, tuple[ssl.SSLContext, datetime]] = OrderedDict()
        # One key pair for every leaf of this process: generating a key per host would dominate the CONNECT path.
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._key_pem = self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption())
        self._aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key())
        self._ski = x509.SubjectKeyIdentifier.from_public_key(self._key.public_key())

    def mint(self, host: str) -> x509.Certificate:
        """A fresh leaf for `host` (a DNS name or an IP literal). Raises `ValueError` for anything else."""
        host = normalize_host(host)
        now = self._clock()
        san: x509.GeneralName = (x509.IPAddress(ipaddress.ip_address(host)) if is_ip(host)
                                 else x509.DNSName(host))
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)] if len(host) <= 64 else [])
        return (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(self._ca.cert.subject).public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - LEAF_BACKDATE).not_valid_after(now + self._validity)
            .add_extension(x509.SubjectAlternativeName([san]), critical=not subject)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(self._aki, critical=False)
            .add_extension(self._ski, critical=False)
            .sign(self._ca.key, hashes.SHA256())
        )

    def context_for(self, host: str) -> ssl.SSLContext:
        """A server-side context presenting a leaf for `host`; cached, and re-minted before the leaf expires."""
        host = normalize_host(host)
        now = self._clock()
        cached = self._contexts.get(host)
        if cached is not None and cached[1] > now:
            self._contexts.move_to_end(host)
            return cached[0]
        cert = self.mint(host)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])  # the proxy speaks HTTP/1.1 only
        context.sni_callback = _remember_sni
        _load_chain(context, cert.public_bytes(serialization.Encoding.PEM) + self._ca_pem + self._key_pem)
        self._contexts[host] = (context, now + self._validity / 2)
        if len(self._contexts) > self._cache_size:
            self._contexts.popitem(last=False)
        return context


def ca_pem(directory: Path) -> bytes:
    """The CA certificate stored in `directory`, without decrypting anything. Raises `CAError` when there is none."""
    path = directory / CA_CERT_FILE
    try:
        raw = path.read_bytes()
        x509.load_pem_x509_certificate(raw)
    except (OSError, ValueError) as exc:
        raise CAError(f"no CA certificate in {directory}: {exc}") from None
    return raw
