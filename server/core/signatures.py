"""Verify and produce HMAC-SHA256 webhook signatures for GitHub, Stripe, Slack and Wakeful's own generic scheme.

Everything here is pure: the caller passes the raw body, the request headers and the current time, and gets back
either nothing (the delivery is genuine) or a `SignatureError` with a stable code. The module does no I/O and never
reads the clock.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from wakeful.server.settings import SignatureKind

__all__ = ["SignatureError", "SignatureKind", "sign", "verify_signature"]


SIGNATURE_MISSING: Final = "signature_missing"
SIGNATURE_MALFORMED: Final = "signature_malformed"
SIGNATURE_MISMATCH: Final = "signature_mismatch"
SIGNATURE_EXPIRED: Final = "signature_expired"
_CODES: Final = frozenset({SIGNATURE_MISSING, SIGNATURE_MALFORMED, SIGNATURE_MISMATCH, SIGNATURE_EXPIRED})

GITHUB_HEADER: Final = "X-Hub-Signature-256"
STRIPE_HEADER: Final = "Stripe-Signature"
SLACK_SIGNATURE_HEADER: Final = "X-Slack-Signature"
SLACK_TIMESTAMP_HEADER: Final = "X-Slack-Request-Timestamp"
GENERIC_HEADER: Final = "X-Wakeful-Signature"

# Exactly one SHA-256 digest in hex. bytes.fromhex alone would accept embedded whitespace and any even length.
_HEX_DIGEST: Final = re.compile(r"[0-9a-fA-F]{64}")
# ASCII digits only (str.isdigit accepts e.g. "²"), and short enough that int() can never be slow or overflow.
_UNIX_SECONDS: Final = re.compile(r"[0-9]{1,15}")


class SignatureError(Exception):
    """Raised when a delivery's signature is missing, malformed, stale or wrong."""

    code: str

    def __init__(self, code: str, message: str) -> None:
        # A typo'd code would silently break callers that branch on it, so reject it at the raise site.
        if code not in _CODES:
            raise ValueError(f"unknown signature error code: {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, kw_only=True, slots=True)
class _StripeHeader:
    timestamp: str  # kept as sent: the signed payload uses these exact characters
    v1: tuple[bytes, ...]


def verify_signature(
    kind: SignatureKind,
    *,
    secret: bytes,
    body: bytes,
    headers: Mapping[str, str],
    now: float,
    tolerance_seconds: int = 300,
) -> None:
    """Raise SignatureError unless the delivery is signed by `secret`. `headers` lookups are case-insensitive
    (the caller may pass a starlette Headers object or a plain dict with any casing — normalise yourself). `now` is
    unix seconds (injected; never call time.time())."""
    _require_secret(secret)
    if tolerance_seconds < 0:
        raise ValueError("tolerance_seconds must be >= 0")
    if kind == "github":
        _verify_prefixed(secret, body, headers, GITHUB_HEADER)
    elif kind == "generic":
        _verify_prefixed(secret, body, headers, GENERIC_HEADER)
    elif kind == "stripe":
        _verify_stripe(secret, body, headers, now, tolerance_seconds)
    elif kind == "slack":
        _verify_slack(secret, body, headers, now, tolerance_seconds)
    else:
        # Unreachable for type-checked callers; a config string that slipped through is a bug, not a bad delivery.
        raise ValueError(f"unknown signature kind: {kind!r}")


def sign(kind: SignatureKind, *, secret: bytes, body: bytes, now: float) -> dict[str, str]:
    """Return the headers a correct sender of `kind` would attach to `body` at time `now`."""
    _require_secret(secret)
    if kind == "github":
        return {GITHUB_HEADER: "sha256=" + _hmac(secret, body).hex()}
    if kind == "generic":
        return {GENERIC_HEADER: "sha256=" + _hmac(secret, body).hex()}
    if kind == "stripe":
        ts = _format_timestamp(now)
        return {STRIPE_HEADER: f"t={ts},v1=" + _hmac(secret, _stripe_payload(ts, body)).hex()}
    if kind == "slack":
        ts = _format_timestamp(now)
        return {
            SLACK_TIMESTAMP_HEADER: ts,
            SLACK_SIGNATURE_HEADER: "v0=" + _hmac(secret, _slack_payload(ts, body)).hex(),
        }
    raise ValueError(f"unknown signature kind: {kind!r}")


# --- per-kind verification -------------------------------------------------------------------------------------


def _verify_prefixed(secret: bytes, body: bytes, headers: Mapping[str, str], name: str) -> None:
    value = _header(headers, name)
    given = _parse_digest(_strip_prefix(value, "sha256=", name), name)
    _check_digest(_hmac(secret, body), given, name)


def _verify_stripe(secret: bytes, body: bytes, headers: Mapping[str, str], now: float, tolerance: int) -> None:
    parsed = _parse_stripe_header(_header(headers, STRIPE_HEADER))
    expected = _hmac(secret, _stripe_payload(parsed.timestamp, body))
    # Check every candidate without stopping early, so timing doesn't reveal which (if any) of them matched.
    matched = False
    for candidate in parsed.v1:
        matched |= hmac.compare_digest(expected, candidate)
    if not matched:
        raise SignatureError(SIGNATURE_MISMATCH, f"no v1 signature in {STRIPE_HEADER} matches the body")
    # Freshness is judged only after authenticity, so "expired" always means a genuine but stale (or replayed) delivery.
    _check_fresh(int(parsed.timestamp), now, tolerance, STRIPE_HEADER)


def _verify_slack(secret: bytes, body: bytes, headers: Mapping[str, str], now: float, tolerance: int) -> None:
    ts = _header(headers, SLACK_TIMESTAMP_HEADER)
    value = _header(headers, SLACK_SIGNATURE_HEADER)
    if not _UNIX_SECONDS.fullmatch(ts):
        raise SignatureError(SIGNATURE_MALFORMED, f"{SLACK_TIMESTAMP_HEADER} is not an integer unix time")
    given = _parse_digest(_strip_prefix(value, "v0=", SLACK_SIGNATURE_HEADER), SLACK_SIGNATURE_HEADER)
    _check_digest(_hmac(secret, _slack_payload(ts, body)), given, SLACK_SIGNATURE_HEADER)
    _check_fresh(int(ts), now, tolerance, SLACK_TIMESTAMP_HEADER)


def _parse_stripe_header(value: str) -> _StripeHeader:
    timestamp: str | None = None
    v1: list[bytes] = []
    for item in value.split(","):
        key, sep, val = item.strip().partition("=")
        if not sep:
            raise SignatureError(SIGNATURE_MALFORMED, f"{STRIPE_HEADER} element {item.strip()!r} has no '='")
        if key == "t":
            # Two timestamps would make the signed payload ambiguous; a real sender never does this.
            if timestamp is not None:
                raise SignatureError(SIGNATURE_MALFORMED, f"{STRIPE_HEADER} has more than one t")
            if not _UNIX_SECONDS.fullmatch(val):
                raise SignatureError(SIGNATURE_MALFORMED, f"{STRIPE_HEADER} t is not an integer unix time")
            timestamp = val
        elif key == "v1":
            v1.append(_parse_digest(val, STRIPE_HEADER))
        # v0 (test-mode legacy scheme) and any future schemes are ignored, as Stripe's own libraries do.
    if timestamp is None:
        raise SignatureError(SIGNATURE_MALFORMED, f"{STRIPE_HEADER} has no t")
    if not v1:
        raise SignatureError(SIGNATURE_MALFORMED, f"{STRIPE_HEADER} has no v1 signature")
    return _StripeHeader(timestamp=timestamp, v1=tuple(v1))


# --- helpers ---------------------------------------------------------------------------------------------------


def _require_secret(secret: bytes) -> None:
    # An empty key is almost always an unset config value; accepting it would let anyone forge deliveries.
    if not secret:
        raise ValueError("webhook secret must not be empty")


def _header(headers: Mapping[str, str], name: str) -> str:
    """Case-insensitive lookup; an absent or blank header counts as missing."""
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            stripped = value.strip()
            if stripped:
                return stripped
            break
    raise SignatureError(SIGNATURE_MISSING, f"missing {name} header")


def _strip_prefix(value: str, prefix: str, name: str) -> str:
    if not value.startswith(prefix):
        raise SignatureError(SIGNATURE_MALFORMED, f"{name} does not start with {prefix!r}")
    return value[len(prefix) :]


def _parse_digest(text: str, name: str) -> bytes:
    if not _HEX_DIGEST.fullmatch(text):
        raise SignatureError(SIGNATURE_MALFORMED, f"{name} signature is not 64 hex characters")
    return bytes.fromhex(text)


def _check_digest(expected: bytes, given: bytes, name: str) -> None:
    if not hmac.compare_digest(expected, given):
        raise SignatureError(SIGNATURE_MISMATCH, f"{name} does not match the body")


def _check_fresh(timestamp: int, now: float, tolerance: int, name: str) -> None:
    # Both directions: a timestamp far in the future is as suspect as one far in the past.
    if abs(now - timestamp) > tolerance:
        raise SignatureError(SIGNATURE_EXPIRED, f"{name} timestamp is more than {tolerance}s from now")


def _hmac(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


def _stripe_payload(timestamp: str, body: bytes) -> bytes:
    return timestamp.encode("ascii") + b"." + body


def _slack_payload(timestamp: str, body: bytes) -> bytes:
    return b"v0:" + timestamp.encode("ascii") + b":" + body


def _format_timestamp(now: float) -> str:
    if now < 0:
        raise ValueError("now must be a non-negative unix time")
    return str(int(now))
