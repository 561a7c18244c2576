"""Identifiers: time-sortable, random, prefixed by what they name (`ev_…`, `ses_…`)."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time

__all__ = ["new_id", "new_token", "token_digest"]

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case


_PAIRS = [a + b for a in _ALPHABET for b in _ALPHABET]  # every 10-bit value as its two digits


def _b32(value: int, width: int) -> str:
    """`value` as `width` Crockford digits, most significant first. Two digits per lookup: ids are minted for
    every delivery on the ingest path, where encoding them was a tenth of the committer's time."""
    even = width + width % 2
    digits = "".join([_PAIRS[(value >> shift) & 1023] for shift in range(5 * even - 10, -1, -10)])
    return digits[even - width:]


_lock = threading.Lock()
_last = (0, 0)  # (milliseconds, random part) of the last id this process issued


def new_id(prefix: str) -> str:
    """`prefix_` + 10 chars of milliseconds + 16 random chars: sorts by creation time, never collides in practice.

    Monotonic within a process (as ULIDs are): an id issued in the same millisecond as the previous one carries
    the previous random part plus one, so ids issued one after the other sort in the order they were issued —
    rows ordered by (time, id) keep the order they were written in. A fresh millisecond starts the random part
    below 2**79, so counting up never overflows its 80 bits.
    """
    global _last
    with _lock:
        ms = max(time.time_ns() // 1_000_000, _last[0])
        rand = _last[1] + 1 if ms == _last[0] else secrets.randbits(79)
        _last = (ms, rand)
    return f"{prefix}_{_b32(ms << 80 | rand, 26)}"  # 10 digits of milliseconds, 16 of the random part


def new_token(prefix: str = "wk_") -> str:
    """A bearer token (a user's: `wk_…`; an agent credential: `wka_…`); only its digest is stored."""
    return prefix + secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
