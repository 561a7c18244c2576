"""The credential vault: AES-256-GCM entries in one JSON file, keys from a key file or an environment variable.

    VaultError
     ├── CredentialNotFound   no entry of that name
     ├── DecryptFailed        wrong key, unknown key id, tampered or swapped ciphertext
     └── VaultFileError       a vault or key file that is unreadable, malformed or readable by others

Key file: one base64 key (32 bytes) per line, the current key first; later lines are previous keys, present only
while a rotation is in progress. The environment variable holds the same keys, comma-separated.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from wakeful.proxy.clock import Clock, SystemClock
from wakeful.proxy.credential import Credential, CredentialInfo, SecretBytes, check_binding
from wakeful.proxy.hosts import normalize_host

__all__ = [
    "KEY_ENV",
    "CredentialNotFound",
    "DecryptFailed",
    "Key",
    "KeyRing",
    "Vault",
    "VaultError",
    "VaultFileError",
    "generate_key",
    "init_key",
    "keys_from_env",
    "load_keys",
    "rotate_key_file",
    "write_keys",
]

KEY_ENV: Final = "WAKEFUL_VAULT_KEY"
_FORMAT: Final = "wakeful-vault"
_KEY_ID = re.compile(r"k_[0-9a-f]{16}")
_ENTRY_KEYS: Final = frozenset({"name", "host", "header", "template", "nonce", "ciphertext", "key_id", "created_at"})


class VaultError(Exception):
    pass


class CredentialNotFound(VaultError, KeyError):
    pass


class DecryptFailed(VaultError):
    pass


class VaultFileError(VaultError):
    pass


@dataclass(frozen=True, kw_only=True)
class Key:
    key_id: str
    """Derived from the key itself, so the same key has the same id in a file and in the environment."""
    material: SecretBytes

    @classmethod
    def from_bytes(cls, material: bytes) -> Key:
        if len(material) != 32:
            raise VaultFileError("a vault key is 32 bytes (AES-256)")
        key_id = "k_" + hashlib.sha256(b"wakeful vault key id\0" + material).hexdigest()[:16]
        return cls(key_id=key_id, material=SecretBytes(material))

    def encoded(self) -> str:
        """The base64 form that key files and the environment variable hold."""
        return base64.b64encode(self.material.reveal()).decode("ascii")


@dataclass(frozen=True, kw_only=True)
class KeyRing:
    current: Key
    """Encrypts every new entry."""
    previous: tuple[Key, ...] = ()
    """Decrypt only; kept until a rotation completes."""

    def find(self, key_id: str) -> Key | None:
        return next((k for k in (self.current, *self.previous) if k.key_id == key_id), None)


def generate_key() -> Key:
    return Key.from_bytes(AESGCM.generate_key(bit_length=256))


def _parse_keys(text: str, where: str) -> KeyRing:
    if not text.strip():
        raise VaultFileError(f"{where} holds no key")
    keys: list[Key] = []
    for item in re.split(r"[\s,]+", text.strip()):
        try:
            keys.append(Key.from_bytes(base64.b64decode(item, validate=True)))
        except (binascii.Error, ValueError):
            raise VaultFileError(f"{where} does not hold base64 vault keys") from None
    return KeyRing(current=keys[0], previous=tuple(keys[1:]))


def load_keys(path: Path) -> KeyRing:
    """The key ring in a key file; refused if anyone but its owner may read it."""
    try:
        mode = path.stat().st_mode
        text = path.read_text("ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise VaultFileError(f"cannot read the key file {path}: {exc}") from None
    if mode & 0o077:
        raise VaultFileError(f"the key file {path} is readable by others: chmod 600 it")
    return _parse_keys(text, str(path))


def keys_from_env(environ: Mapping[str, str] | None = None, *, var: str = KEY_ENV) -> KeyRing:
    env = os.environ if environ is None else environ
    if not env.get(var, "").strip():
        raise VaultFileError(f"{var} is not set")
    return _parse_keys(env[var], var)


def _atomic_write(path: Path, data: bytes) -> None:
    # mkstemp creates the file 0600; replace is atomic, so a reader sees the old file or the new one, never half.
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_keys(path: Path, keys: KeyRing) -> None:
    """Write a key file atomically, mode 0600, current key first."""
    lines = [k.encoded() for k in (keys.current, *keys.previous)]
    _atomic_write(path, ("\n".join(lines) + "\n").encode("ascii"))


def init_key(path: Path) -> KeyRing:
    """Create the key file with a new key (mode 0600) if it is missing; load it either way. Never overwrites."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = generate_key()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_keys(path)
    with os.fdopen(fd, "w") as f:
        f.write(key.encoded() + "\n")
        f.flush()
        os.fsync(f.fileno())
    return KeyRing(current=key)


def _aad(name: str, host: str, header: str, template: str) -> bytes:
    # JSON of a list is unambiguous where concatenation is not ("ab"+"c" == "a"+"bc"): the tag binds each field.
    return json.dumps([_FORMAT, 1, name, host, header, template], separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True, kw_only=True)
class _Entry:
    info: CredentialInfo
    nonce: bytes
    ciphertext: bytes

    def to_json(self) -> dict[str, str]:
        return {"name": self.info.name, "host": self.info.host, "header": self.info.header,
                "template": self.info.template, "nonce": base64.b64encode(self.nonce).decode("ascii"),
                "ciphertext": base64.b64encode(self.ciphertext).decode("ascii"), "key_id": self.info.key_id,
                "created_at": self.info.created_at.isoformat()}

    @classmethod
    def from_json(cls, obj: object) -> _Entry:
        if not isinstance(obj, dict) or set(obj) != _ENTRY_KEYS or not all(isinstance(v, str) for v in obj.values()):
            raise ValueError("an entry is an object of exactly the known string fields")
        check_binding(name=obj["name"], host=obj["host"], header=obj["header"], template=obj["template"])
        if not _KEY_ID.fullmatch(obj["key_id"]):
            raise ValueError("bad key id")
        created_at = datetime.fromisoformat(obj["created_at"])
        if created_at.tzinfo is None:
            raise ValueError("created_at must carry a time zone")
        nonce = base64.b64decode(obj["nonce"], validate=True)
        ciphertext = base64.b64decode(obj["ciphertext"], validate=True)
        if len(nonce) != 12 or len(ciphertext) < 17:
            raise ValueError("bad nonce or ciphertext length")
        info = CredentialInfo(name=obj["name"], host=obj["host"], header=obj["header"], template=obj["template"],
                              key_id=obj["key_id"], created_at=created_at)
        return cls(info=info, nonce=nonce, ciphertext=ciphertext)


class Vault:
    """Credential bindings encrypted at rest. Every call reads the file, so a running proxy sees `secret set` at
    once; writers serialise on a lock file beside it. Nothing here logs, and nothing returned prints a secret."""

    def __init__(self, path: Path, keys: KeyRing, *, clock: Clock | None = None, key_file: Path | None = None) -> None:
        self.path = path
        self._keys = keys
        self._clock = clock or SystemClock()
        self._key_file = key_file
        """When given, the keys are read again from it whenever it changes (a rotation by another process)."""
        self._key_stamp = self._stamp()

    def _stamp(self) -> tuple[int, int, int] | None:
        if self._key_file is None:
            return None
        try:
            st = self._key_file.stat()
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _fresh_keys(self) -> KeyRing:
        stamp = self._stamp()
        if self._key_file is not None and stamp != self._key_stamp:
            self._keys, self._key_stamp = load_keys(self._key_file), stamp
        return self._keys

    @property
    def keys(self) -> KeyRing:
        return self._keys

    def __repr__(self) -> str:
        return f"Vault({str(self.path)!r}, key_id={self._keys.current.key_id!r})"

    def set(self, name: str, secret: bytes, host: str, header: str, template: str) -> CredentialInfo:
        """Store (or replace) a binding; the secret is validated as a header value before it is encrypted."""
        host = normalize_host(host)
        Credential(name=name, host=host, header=header, template=template, secret=SecretBytes(secret))
        info = CredentialInfo(name=name, host=host, header=header, template=template,
                              key_id=self._keys.current.key_id, created_at=self._clock.now())
        with self._locked() as entries:
            entries[name] = self._seal(info, bytes(secret), self._keys.current)
        return info

    def list(self) -> list[CredentialInfo]:
        return sorted((e.info for e in self._read().values()), key=lambda i: i.name)

    def remove(self, name: str) -> None:
        with self._locked() as entries:
            if entries.pop(name, None) is None:
                raise CredentialNotFound(name)

    def get(self, name: str) -> Credential:
        """Decrypt one binding. Raises `CredentialNotFound` or `DecryptFailed`."""
        entry = self._read().get(name)
        if entry is None:
            raise CredentialNotFound(name)
        return self._open(entry, self._fresh_keys())

    def rotate(self, new_key: Key) -> None:
        """Re-encrypt every entry under `new_key`; all or nothing. Afterwards only `new_key` is kept.

        Persist `new_key` before calling this (see `rotate_key_file`): the file is rewritten under it."""
        ring = KeyRing(current=new_key, previous=(self._keys.current, *self._keys.previous))
        with self._locked() as entries:
            for name, entry in list(entries.items()):
                credential = self._open(entry, ring)
                info = CredentialInfo(name=entry.info.name, host=entry.info.host, header=entry.info.header,
                                      template=entry.info.template, key_id=new_key.key_id,
                                      created_at=entry.info.created_at)
                entries[name] = self._seal(info, credential.secret.reveal(), new_key)
        self._keys = KeyRing(current=new_key)

    @staticmethod
    def _seal(info: CredentialInfo, secret: bytes, key: Key) -> _Entry:
        nonce = os.urandom(12)  # random 96-bit nonces: safe far beyond any vault's number of writes per key
        aad = _aad(info.name, info.host, info.header, info.template)
        return _Entry(info=info, nonce=nonce, ciphertext=AESGCM(key.material.reveal()).encrypt(nonce, secret, aad))

    @staticmethod
    def _open(entry: _Entry, keys: KeyRing) -> Credential:
        info = entry.info
        key = keys.find(info.key_id)
        if key is None:
            raise DecryptFailed(f"credential {info.name} is encrypted under key {info.key_id}, which is not loaded")
        try:
            secret = AESGCM(key.material.reveal()).decrypt(
                entry.nonce, entry.ciphertext, _aad(info.name, info.host, info.header, info.template))
        except InvalidTag:
            raise DecryptFailed(f"credential {info.name} does not decrypt: wrong key or tampered entry") from None
        return Credential(name=info.name, host=info.host, header=info.header, template=info.template,
                          secret=SecretBytes(secret))

    def _read(self) -> dict[str, _Entry]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise VaultFileError(f"cannot read the vault {self.path}: {exc}") from None
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("version") != 1:
                raise ValueError("not a wakeful vault, version 1")
            entries = [_Entry.from_json(e) for e in doc["entries"]]
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise VaultFileError(f"the vault {self.path} is malformed: {exc}") from None
        by_name = {e.info.name: e for e in entries}
        if len(by_name) != len(entries):
            raise VaultFileError(f"the vault {self.path} holds a name twice")
        return by_name

    def _write(self, entries: dict[str, _Entry]) -> None:
        doc = {"format": _FORMAT, "version": 1, "entries": [entries[n].to_json() for n in sorted(entries)]}
        _atomic_write(self.path, json.dumps(doc, indent=1).encode("utf-8") + b"\n")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, _Entry]]:
        # Read-modify-write under an exclusive lock, so two `secret set` calls never lose each other's entry.
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            entries = self._read()
            yield entries
            self._write(entries)
        finally:
            os.close(fd)


def rotate_key_file(vault: Vault, key_path: Path, *, reseal: Callable[[KeyRing], None] = lambda ring: None) -> Key:
    """Rotate to a fresh key, crash-safely: the key file holds new + old keys until every entry is re-encrypted
    and `reseal` (given the ring of both) has sealed under the new key whatever else was sealed under an old one.

    A crash at any step leaves a vault readable with the key file as it is, and running this again finishes."""
    new_key = generate_key()
    both = KeyRing(current=new_key, previous=(vault.keys.current, *vault.keys.previous))
    write_keys(key_path, both)
    vault.rotate(new_key)
    reseal(both)
    write_keys(key_path, KeyRing(current=new_key))
    return new_key
