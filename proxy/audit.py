"""One egress audit record per request the proxy read (and per CONNECT it accepted), and its strict JSON wire form.

A record says who asked for what and what became of it. It never holds headers, bodies, queries or tokens: the
path is kept without its query because a query can carry secrets. Every field fits the column the server stores it
in (`fit_path`, `clip`), so a record is never refused for its size: a request is recorded however long its path.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final, Literal, get_args

from wakeful.proxy.contract import (
    CREDENTIAL_NAME,
    MAX_TARGET_PART,
    Client,
    ContractError,
    RefusalCode,
    _dumps,
    _exact_keys,
    _loads,
    _optional_text,
    _text,
    check_destination,
    clip,
)

__all__ = ["METHOD_WIDTH", "RULE_WIDTH", "USER_WIDTH", "EgressRecord", "clip", "encode_record", "fit_path",
           "parse_record"]

VerdictKind = Literal["allow", "refuse"]
_CLIENTS: Final = frozenset(get_args(Client))
_VERDICTS: Final = frozenset(get_args(VerdictKind))

METHOD_WIDTH: Final = 16
USER_WIDTH: Final = 40
RULE_WIDTH: Final = 1000
"""The widest method, user ID and rule a record holds: the server's `egress_audit` columns are no wider."""


def fit_path(path: str) -> str:
    """`path` if a record can hold it, else its start and, after a space (which no path holds), how long it was and
    its digest: ` [cut from 9217 chars, sha256:…]`."""
    if len(path) <= MAX_TARGET_PART:
        return path
    marker = f" [cut from {len(path)} chars, sha256:{hashlib.sha256(path.encode('utf-8')).hexdigest()}]"
    return path[:MAX_TARGET_PART - len(marker)] + marker


@dataclass(frozen=True, kw_only=True)
class EgressRecord:
    """What the proxy did with one request (or one raw tunnel). Validated on construction."""

    request_id: str
    """The `DecisionRequest`'s id: the decider's deduplication key."""
    at: datetime
    """When the proxy received the request; UTC."""
    user_id: str | None
    client: Client
    attempt_id: str | None
    action_id: str | None
    method: str
    """"" when no request line could be read."""
    scheme: Literal["http", "https"]
    host: str
    """Normalised; "" (and `port` 0) for a refusal that named no destination the proxy could read."""
    port: int
    path: str
    """Without the query (see `fit_path` for a long one); "" for a CONNECT, or when no path could be read."""
    verdict: VerdictKind
    """`allow` when the request was forwarded (even if the upstream then failed), else `refuse`."""
    code: RefusalCode | None
    """The refusal's code; None for an allow, and for a request that was not refused but not completed either (the
    client left, or its TLS handshake in an intercepted tunnel failed)."""
    rule: str
    """The allow's rule, or the refusal's reason."""
    credential: str | None
    """The NAME of the injected credential binding, never its value."""
    bytes_up: int
    """Request body bytes sent upstream (for a tunnel: bytes from the client)."""
    bytes_down: int
    """Response body bytes returned to the client (for a tunnel: bytes from the upstream)."""
    upstream_status: int | None
    """None when no response came back (refused, upstream failed, or a tunnel)."""
    latency_ms: float
    """From the request being read to the response being sent (for a tunnel: until it closed)."""

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", limit=128)
        if not isinstance(self.at, datetime) or self.at.utcoffset() != timedelta(0):
            raise ContractError("at must be a UTC datetime")
        if self.user_id is not None:
            _text(self.user_id, "user_id", limit=USER_WIDTH)
        if self.client not in _CLIENTS:
            raise ContractError("client must be connector or tool_computer")
        _optional_text(self.attempt_id, "attempt_id")
        _optional_text(self.action_id, "action_id")
        _text(self.method, "method", limit=METHOD_WIDTH, empty=True)
        if (self.host, self.port) == ("", 0):
            if self.verdict != "refuse":
                raise ContractError("only a refusal may name no destination")
        else:
            check_destination(self.scheme, self.host, self.port)
        _text(self.path, "path", limit=MAX_TARGET_PART, empty=True)
        if "?" in self.path or "#" in self.path or (self.path and not self.path.startswith("/")):
            raise ContractError("path must start with / and carry no query or fragment")
        if self.verdict not in _VERDICTS:
            raise ContractError("verdict must be allow or refuse")
        if self.code is not None and not isinstance(self.code, RefusalCode):
            raise ContractError("code must be a RefusalCode or None")
        if self.verdict == "allow" and self.code is not None:
            raise ContractError("an allow has no refusal code")
        _text(self.rule, "rule", limit=RULE_WIDTH)
        if self.credential is not None and (
                not isinstance(self.credential, str) or not CREDENTIAL_NAME.fullmatch(self.credential)):
            raise ContractError("credential must be a credential name")
        for name in ("bytes_up", "bytes_down"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ContractError(f"{name} must be a non-negative integer")
        if self.upstream_status is not None and (
                type(self.upstream_status) is not int or not 100 <= self.upstream_status <= 999):
            raise ContractError("upstream_status must be an HTTP status or None")
        if type(self.latency_ms) is not float or not math.isfinite(self.latency_ms) or self.latency_ms < 0:
            raise ContractError("latency_ms must be a finite non-negative float")


_KEYS = frozenset({"v", "request_id", "at", "user_id", "client", "attempt_id", "action_id", "method", "scheme",
                   "host", "port", "path", "verdict", "code", "rule", "credential", "bytes_up", "bytes_down",
                   "upstream_status", "latency_ms"})


def encode_record(record: EgressRecord) -> bytes:
    return _dumps({
        "v": 1, "request_id": record.request_id, "at": record.at.isoformat(), "user_id": record.user_id,
        "client": record.client, "attempt_id": record.attempt_id, "action_id": record.action_id,
        "method": record.method, "scheme": record.scheme, "host": record.host, "port": record.port,
        "path": record.path, "verdict": record.verdict, "code": None if record.code is None else record.code.value,
        "rule": record.rule, "credential": record.credential, "bytes_up": record.bytes_up,
        "bytes_down": record.bytes_down, "upstream_status": record.upstream_status, "latency_ms": record.latency_ms,
    })


def parse_record(raw: bytes) -> EgressRecord:
    """A record from its wire form. Raises `ContractError` on anything else."""
    try:
        obj = _loads(raw)
        _exact_keys(obj, _KEYS)
        at, code, latency = obj["at"], obj["code"], obj["latency_ms"]
        if not isinstance(at, str):
            raise ContractError("at must be an ISO-8601 string")
        if code is not None and not isinstance(code, str):
            raise ContractError("code must be a string or null")
        if type(latency) is int:  # JSON does not keep 3.0 apart from 3
            latency = float(latency)
        fields = {k: v for k, v in obj.items() if k != "v"}
        fields.update(at=datetime.fromisoformat(at), code=None if code is None else RefusalCode(code),
                      latency_ms=latency)
        return EgressRecord(**fields)  # type: ignore[arg-type]  # every field is validated in __post_init__
    except ContractError:
        raise
    except (ValueError, TypeError, RecursionError) as exc:
        raise ContractError(f"malformed egress record: {exc}") from None
