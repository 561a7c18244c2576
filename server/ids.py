"""Identifiers: time-sortable, random, prefixed by what they name (`ev_…`, `ses_…`)."""

from __future__ import annotations

import hashlib
import secrets
import time

__all__ = ["new_id", "new_token", "token_digest"]

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case


def _b32(value: int, width: int) -> str:
    out = []
    for _ in range(width):
        value, rem = divmod(value, 32)
        out.append(_ALPHABET[rem])
    return "".join(reversed(out))


def new_id(prefix: str) -> str:
    """`prefix_` + 10 chars of milliseconds + 16 random chars: sorts by creation time, never collides in practice."""
    return f"{prefix}_{_b32(time.time_ns() // 1_000_000, 10)}{_b32(secrets.randbits(80), 16)}"


def new_token() -> str:
    """A bearer token for a user; only its digest is stored."""
    return "wk_" + secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
