"""The deployment's ledger key (Ed25519) and checkpoint signatures.

The private key lives in `<data_dir>/ledger.key` (PEM, created owner-only on first use); the public key is printed
as `ed25519:<base64 of its 32 bytes>` (`wakeful ledger key`) for an auditor, who checks exports with it alone. A
checkpoint's signature covers `wakeful-ledger-checkpoint/1`, its position, the chain hash there and when it was
signed, one per line.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from wakeful.server.errors import BadRequest

__all__ = ["Checkpoint", "LedgerKey", "PublicKey", "load_or_create_key", "parse_public_key"]

_PREFIX = "ed25519:"


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """A signed statement that the chain hash at `pos` was `chain_hash`."""

    pos: int
    chain_hash: str
    signed_at: datetime
    key_id: str
    signature: str  # hex

    def message(self) -> bytes:
        at = self.signed_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return f"wakeful-ledger-checkpoint/1\n{self.pos}\n{self.chain_hash}\n{at}".encode()


@dataclass(frozen=True)
class PublicKey:
    """A ledger public key: checks checkpoint signatures."""

    key: Ed25519PublicKey

    @property
    def raw(self) -> bytes:
        return self.key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def key_id(self) -> str:
        """A short name for the key: the first 16 bytes of SHA-256 over it, hex."""
        return hashlib.sha256(self.raw).hexdigest()[:32]

    def text(self) -> str:
        return _PREFIX + base64.b64encode(self.raw).decode()

    def signed(self, checkpoint: Checkpoint) -> bool:
        """Whether `checkpoint` carries this key's valid signature."""
        if checkpoint.key_id != self.key_id:
            return False
        try:
            self.key.verify(bytes.fromhex(checkpoint.signature), checkpoint.message())
        except (InvalidSignature, ValueError):
            return False
        return True


@dataclass(frozen=True)
class LedgerKey:
    """The deployment's private ledger key: signs checkpoints."""

    key: Ed25519PrivateKey

    @property
    def public(self) -> PublicKey:
        return PublicKey(self.key.public_key())

    def checkpoint(self, *, pos: int, chain_hash: str, now: datetime) -> Checkpoint:
        unsigned = Checkpoint(pos=pos, chain_hash=chain_hash, signed_at=now, key_id=self.public.key_id, signature="")
        signature = self.key.sign(unsigned.message()).hex()
        return Checkpoint(pos=pos, chain_hash=chain_hash, signed_at=now, key_id=unsigned.key_id, signature=signature)


def load_or_create_key(path: Path) -> LedgerKey:
    """The key in `path`, created (0600, never overwritten) when there is none."""
    if not path.exists():
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Written whole under a name of its own, then linked in place: a process starting at the same moment
        # either sees no key or the whole of one, and a link never replaces a key already there.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the mode given to open is filtered by the umask
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another process made it first: theirs is the key
            os.link(tmp, path)
        tmp.unlink()
    loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(loaded, Ed25519PrivateKey):
        raise BadRequest("invalid_ledger_key", f"{path} holds no Ed25519 private key")
    return LedgerKey(loaded)


def parse_public_key(text: str) -> PublicKey:
    """`ed25519:<base64>` as `wakeful ledger key` prints it; BadRequest `invalid_key` for anything else."""
    text = text.strip()
    try:
        raw = base64.b64decode(text.removeprefix(_PREFIX), validate=True)
        if not text.startswith(_PREFIX) or len(raw) != 32:
            raise ValueError(text)
        return PublicKey(Ed25519PublicKey.from_public_bytes(raw))
    except ValueError:
        raise BadRequest("invalid_key", "a ledger key is `ed25519:` and 44 characters of base64, as `wakeful "
                                        "ledger key` prints it") from None
