"""Verify and produce HMAC-SHA256 webhook signatures for GitHub, Stripe, Slack and Wakeful's own generic scheme.

Everything here is pure: the caller passes the raw body, the request headers and the current time, and gets back
either what the signature vouches for (`Signed`: the digest of the signed bytes and the header values they include)
or a `SignatureError` with a stable code. The module does no I/O and never reads the clock.

The generic scheme signs `<timestamp>\n<delivery ID>\n<body>` (docs/webhooks.md), so neither the delivery ID nor
the time can be changed to replay a delivery. Newlines separate the parts because no header value can hold one: the
three parts can never be cut another way. GitHub signs only the body; its delivery ID header is not vouched for.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from wakeful.server.settings import SignatureKind

__all__ = ["SignatureError", "SignatureKind", "Signed", "sign", "verify_signature"]


SIGNATURE_MISSING: Final = "signature_missing"
SIGNATURE_MALFORMED: Final = "signature_malformed"
SIGNATURE_MISMATCH: Final = "signature_mismatch"
SIGNATURE_EXPIRED: Final = "signature_expired"
_CODES: Final = frozenset({SIGNATURE_MISSING, SIGNATURE_MALFORMED, SIGNATURE_MISMATCH, SIGNATURE_EXPIRED})

GITHUB_HEADER: Final = "X-Hub-Signature-256"
STRIPE_HEADER: Final = "Stripe-Signature"
SLACK_SIGNATURE_HEADER: Final = "X-Slack-Signature"
SLACK_TIMESTAMP_HEADER: Final = "X-Slack-Request-Timestamp"
GITHUB_DELIVERY_HEADER: Final = "X-GitHub-Delivery"
GENERIC_HEADER: Final = "X-Wakeful-Signature"
GENERIC_TIMESTAMP_HEADER: Final = "X-Wakeful-Timestamp"
GENERIC_DELIVERY_HEADER: Final = "X-Wakeful-Delivery"

# Exactly one SHA-256 digest in hex. bytes.fromhex alone would accept embedded whitespace and any even length.
_HEX_DIGEST: Final = re.compile(r"[0-9a-fA-F]{64}")
# ASCII digits only (str.isdigit accepts e.g. "²"), and short enough that int() can never be slow or overflow.
_UNIX_SECONDS: Final = re.compile(r"[0-9]{1,15}")
# Visible ASCII, no spaces, short enough for the events table's source_id (300): what is signed is what is stored.
_DELIVERY_ID: Final = re.compile(r"[\x21-\x7e]{1,200}")


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
class Signed:
    """What a genuine delivery's signature vouches for, besides the body."""

    digest: str
    """Hex SHA-256 of the exact bytes the signature covers: a delivery sent again is the same digest, whatever
    unsigned headers came with it."""
    headers: Mapping[str, str]
    """The header values the signature covers, by lower-cased name (the generic scheme's delivery ID and timestamp,
    Slack's timestamp)."""


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
) -> Signed:
    """Raise SignatureError unless the delivery is signed by `secret` (and, for the schemes that sign a time, within
    `tolerance_seconds` of `now` either way). `headers` lookups are case-insensitive (the caller may pass a starlette
    Headers object or a plain dict with any casing). `now` is unix seconds (injected; never call time.time())."""
    _require_secret(secret)
    if tolerance_seconds < 0:
        raise ValueError("tolerance_seconds must be >= 0")
    headers = _by_lower_name(headers)
    if kind == "github":
        return _verify_github(secret, body, headers)
    if kind == "generic":
        return _verify_generic(secret, body, headers, now, tolerance_seconds)
    if kind == "stripe":
        return _verify_stripe(secret, body, headers, now, tolerance_seconds)
    if kind == "slack":
        return _verify_slack(secret, body, headers, now, tolerance_seconds)
    # Unreachable for type-checked callers; a config string that slipped through is a bug, not a bad delivery.
    raise ValueError(f"unknown signature kind: {kind!r}")


def sign(kind: SignatureKind, *, secret: bytes, body: bytes, now: float,
         delivery_id: str | None = None) -> dict[str, str]:
    """Return the headers a correct sender of `kind` would attach to `body` at time `now`. The generic scheme signs
    `delivery_id` and needs one; GitHub sends it unsigned; Stripe and Slack carry theirs in the body."""
    _require_secret(secret)
    if kind == "github":
        delivery = {} if delivery_id is None else {GITHUB_DELIVERY_HEADER: delivery_id}
        return {GITHUB_HEADER: "sha256=" + _hmac(secret, body).hex(), **delivery}
    if kind == "generic":
        if delivery_id is None or not _DELIVERY_ID.fullmatch(delivery_id):
            raise ValueError(f"the generic scheme signs a delivery ID of 1 to 200 visible ASCII characters, not "
                             f"{delivery_id!r}")
        ts = _format_timestamp(now)
        return {
            GENERIC_TIMESTAMP_HEADER: ts,
            GENERIC_DELIVERY_HEADER: delivery_id,
            GENERIC_HEADER: "v1=" + _hmac(secret, _generic_payload(ts, delivery_id, body)).hex(),
        }
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


def _verify_github(secret: bytes, body: bytes, headers: Mapping[str, str]) -> Signed:
    value = _header(headers, GITHUB_HEADER)
    given = _parse_digest(_strip_prefix(value, "sha256=", GITHUB_HEADER), GITHUB_HEADER)
    _check_digest(_hmac(secret, body), given, GITHUB_HEADER)
    return _signed(body, {})


def _verify_generic(secret: bytes, body: bytes, headers: Mapping[str, str], now: float, tolerance: int) -> Signed:
    value = _header(headers, GENERIC_HEADER)
    ts = _timestamp(headers, GENERIC_TIMESTAMP_HEADER)
    delivery_id = _header(headers, GENERIC_DELIVERY_HEADER)
    if not _DELIVERY_ID.fullmatch(delivery_id):
        raise SignatureError(SIGNATURE_MALFORMED, f"{GENERIC_DELIVERY_HEADER} must be 1 to 200 visible ASCII "
                                                  "characters (no spaces)")
    given = _parse_digest(_strip_prefix(value, "v1=", GENERIC_HEADER), GENERIC_HEADER)
    payload = _generic_payload(ts, delivery_id, body)
    _check_digest(_hmac(secret, payload), given, GENERIC_HEADER)
    _check_fresh(int(ts), now, tolerance, GENERIC_TIMESTAMP_HEADER)
    return _signed(payload, {GENERIC_TIMESTAMP_HEADER: ts, GENERIC_DELIVERY_HEADER: delivery_id})


def _verify_stripe(secret: bytes, body: bytes, headers: Mapping[str, str], now: float, tolerance: int) -> Signed:
    parsed = _parse_stripe_header(_header(headers, STRIPE_HEADER))
    payload = _stripe_payload(parsed.timestamp, body)
    expected = _hmac(secret, payload)
    # Check every candidate without stopping early, so timing doesn't reveal which (if any) of them matched.
    matched = False
    for candidate in parsed.v1:
        matched |= hmac.compare_digest(expected, candidate)
    if not matched:
        raise SignatureError(SIGNATURE_MISMATCH, f"no v1 signature in {STRIPE_HEADER} matches the body")
    # Freshness is judged only after authenticity, so "expired" always means a genuine but stale (or replayed) delivery.
    _check_fresh(int(parsed.timestamp), now, tolerance, STRIPE_HEADER)
    return _signed(payload, {})


def _verify_slack(secret: bytes, body: bytes, headers: Mapping[str, str], now: float, tolerance: int) -> Signed:
    ts = _timestamp(headers, SLACK_TIMESTAMP_HEADER)
    value = _header(headers, SLACK_SIGNATURE_HEADER)
    given = _parse_digest(_strip_prefix(value, "v0=", SLACK_SIGNATURE_HEADER), SLACK_SIGNATURE_HEADER)
    payload = _slack_payload(ts, body)
    _check_digest(_hmac(secret, payload), given, SLACK_SIGNATURE_HEADER)
    _check_fresh(int(ts), now, tolerance, SLACK_TIMESTAMP_HEADER)
    return _signed(payload, {SLACK_TIMESTAMP_HEADER: ts})


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


def _signed(payload: bytes, headers: dict[str, str]) -> Signed:
    return Signed(digest=hashlib.sha256(payload).hexdigest(), headers={k.lower(): v for k, v in headers.items()})


def _require_secret(secret: bytes) -> None:
    # An empty key is almost always an unset config value; accepting it would let anyone forge deliveries.
    if not secret:
        raise ValueError("webhook secret must not be empty")


def _by_lower_name(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers by lower-cased name, read once (a scheme looks up to three up); a repeated name keeps its first
    value, as a lookup by name would find it."""
    lowered: dict[str, str] = {}
    for key, value in headers.items():
        lowered.setdefault(key.lower(), value)
    return lowered


def _header(headers: Mapping[str, str], name: str) -> str:
    """A header by name, from `_by_lower_name`'s mapping; an absent or blank header counts as missing."""
    value = headers.get(name.lower(), "").strip()
    if not value:
        raise SignatureError(SIGNATURE_MISSING, f"missing {name} header")
    return value


def _timestamp(headers: Mapping[str, str], name: str) -> str:
    """A timestamp header's value as sent (the signed payload uses these exact characters): integer unix seconds."""
    ts = _header(headers, name)
    if not _UNIX_SECONDS.fullmatch(ts):
        raise SignatureError(SIGNATURE_MALFORMED, f"{name} is not an integer unix time")
    return ts


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
    return hmac.digest(secret, payload, "sha256")  # one call into OpenSSL: no HMAC object per delivery


def _stripe_payload(timestamp: str, body: bytes) -> bytes:
    return timestamp.encode("ascii") + b"." + body


def _generic_payload(timestamp: str, delivery_id: str, body: bytes) -> bytes:
    return f"{timestamp}\n{delivery_id}\n".encode("ascii") + body


def _slack_payload(timestamp: str, body: bytes) -> bytes:
    return b"v0:" + timestamp.encode("ascii") + b":" + body


def _format_timestamp(now: float) -> str:
    if now < 0:
        raise ValueError("now must be a non-negative unix time")
    return str(int(now))
