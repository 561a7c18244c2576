"""Secrets as values that cannot be printed by accident, and the credential bindings that carry them."""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final

from wakeful.proxy.contract import CREDENTIAL_NAME
from wakeful.proxy.hosts import is_ip, normalize_host

__all__ = ["Credential", "CredentialInfo", "SecretBytes", "check_binding"]

SECRET_SLOT: Final = "{secret}"
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_PRINTABLE_ASCII = re.compile(rb"[\x20-\x7e]+")
# Headers that frame or route the message: a credential placed there would be a smuggling tool, not a credential.
FORBIDDEN_HEADERS: Final = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "proxy-connection", "te", "trailer",
    "upgrade", "proxy-authorization", "proxy-authenticate", "x-wakeful-attempt",
})


class SecretBytes:
    """Bytes that never show themselves: `repr`, `str` and formatting print `<secret>`; `reveal()` is explicit."""

    __slots__ = ("_value",)
    __hash__ = None  # type: ignore[assignment]  # a hash of a secret is a fingerprint of it

    def __init__(self, value: bytes | bytearray | memoryview) -> None:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError("SecretBytes wraps bytes")
        self._value = bytes(value)

    def reveal(self) -> bytes:
        return self._value

    def __len__(self) -> int:
        return len(self._value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SecretBytes):
            return NotImplemented
        return hmac.compare_digest(self._value, other._value)

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a secret is not pickled")


def check_binding(*, name: str, host: str, header: str, template: str) -> None:
    """Raises `ValueError` unless these describe a usable binding; `host` must already be normalised."""
    if not isinstance(name, str) or not CREDENTIAL_NAME.fullmatch(name):
        raise ValueError("a credential name is 1-64 of a-z 0-9 _ -, starting with a letter or digit")
    if not isinstance(host, str) or normalize_host(host) != host:
        raise ValueError(f"host must be a normalised host name: {host!r}")
    if is_ip(host):
        raise ValueError("a credential is bound to a host name, not an address")
    if not isinstance(header, str) or not _TOKEN.fullmatch(header) or header.lower() in FORBIDDEN_HEADERS:
        raise ValueError(f"{header!r} cannot carry a credential")
    if (not isinstance(template, str) or template.count(SECRET_SLOT) != 1
            or not template.isascii() or not _PRINTABLE_ASCII.fullmatch(template.encode("ascii"))
            or "{{" in template or "}}" in template):
        raise ValueError("template must be printable ASCII with {secret} exactly once, e.g. 'Bearer {secret}'")


def _check_secret(secret: SecretBytes) -> None:
    # The secret is written into a header value: CR, LF or NUL in it would split the request.
    if not _PRINTABLE_ASCII.fullmatch(secret.reveal()):
        raise ValueError("a secret must be non-empty printable ASCII (no newline)")


@dataclass(frozen=True, kw_only=True)
class Credential:
    """A decrypted credential binding. Only the proxy process ever holds one."""

    name: str
    host: str
    """The only host this credential is ever sent to (normalised, exact)."""
    header: str
    """The header set when the request carries no `{{credential:NAME}}` placeholder."""
    template: str
    """The configured header's value, with `{secret}` where the secret goes."""
    secret: SecretBytes = field(repr=False)

    def __post_init__(self) -> None:
        check_binding(name=self.name, host=self.host, header=self.header, template=self.template)
        if not isinstance(self.secret, SecretBytes):
            raise TypeError("secret must be SecretBytes")
        _check_secret(self.secret)

    def render(self) -> str:
        """The configured header's value, secret included. Call only while building the upstream request."""
        return self.template.replace(SECRET_SLOT, self.secret.reveal().decode("ascii"))

    def placeholder(self) -> str:
        return "{{credential:" + self.name + "}}"


@dataclass(frozen=True, kw_only=True)
class CredentialInfo:
    """What `Vault.list` shows: everything about a binding except its secret."""

    name: str
    host: str
    header: str
    template: str
    key_id: str
    created_at: datetime
