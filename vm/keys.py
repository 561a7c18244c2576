"""Per-VM SSH keys, generated at provisioning: the guest's host key (pinned by the SSH layer, never learnt on
first use) and the client key the host logs in with. Ed25519, OpenSSH formats, private files 0600."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

__all__ = ["VmKeys", "generate_keys", "load_keys"]

HOST_KEY = "ssh_host_ed25519_key"
CLIENT_KEY = "client_ed25519_key"


@dataclass(frozen=True, kw_only=True)
class VmKeys:
    host_key: Path
    """The guest's private host key (goes onto the seed disk, nowhere else)."""
    host_public: str
    """`ssh-ed25519 AAAA… comment`: what the SSH layer pins."""
    client_key: Path
    """The host's private key for logging into the guest (OpenSSH format, 0600)."""
    client_public: str
    """The guest's `authorized_keys` line."""


def _write_private(path: Path, key: Ed25519PrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not even briefly
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _public_line(key: Ed25519PrivateKey, comment: str) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return f"{raw.decode()} {comment}"


def generate_keys(directory: Path, *, name: str) -> VmKeys:
    """Create both key pairs in `directory` (made 0700). Refuses to overwrite existing keys."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    pairs = {}
    for filename, comment in ((HOST_KEY, f"host@{name}"), (CLIENT_KEY, f"wakeful@{name}")):
        key = Ed25519PrivateKey.generate()
        _write_private(directory / filename, key)
        public = _public_line(key, comment)
        (directory / f"{filename}.pub").write_text(public + "\n")
        pairs[filename] = public
    return VmKeys(host_key=directory / HOST_KEY, host_public=pairs[HOST_KEY],
                  client_key=directory / CLIENT_KEY, client_public=pairs[CLIENT_KEY])


def load_keys(directory: Path) -> VmKeys:
    return VmKeys(host_key=directory / HOST_KEY, host_public=(directory / f"{HOST_KEY}.pub").read_text().strip(),
                  client_key=directory / CLIENT_KEY,
                  client_public=(directory / f"{CLIENT_KEY}.pub").read_text().strip())
