"""One egress audit record per request the proxy handled, and its strict JSON wire form.

A record says who asked for what and what became of it. It never holds headers, bodies, queries or tokens: the
path is kept without its query because a query can carry secrets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final, Literal, get_args

from wakeful.proxy.contract import (
    CREDENTIAL_NAME,
    Client,
    ContractError,
    RefusalCode,
    _dumps,
    _exact_keys,
    _loads,
    _optional_text,
    _text,
    check_destination,
)

__all__ = ["EgressRecord", "encode_record", "parse_record"]

VerdictKind = Literal["allow", "refuse"]
_CLIENTS: Final = frozenset(get_args(Client))
_VERDICTS: Final = frozenset(get_args(VerdictKind))


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
    scheme: Literal["http", "https"]
    host: str
    port: int
    path: str
    """Without the query; "" for a raw tunnel."""
    verdict: VerdictKind
    """`allow` when the request was forwarded (even if the upstream then failed), else `refuse`."""
    code: RefusalCode | None
    """The refusal's code; None for an allow, and for a refusal that has no code (an oversized body)."""
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
        _optional_text(self.user_id, "user_id")
        if self.client not in _CLIENTS:
            raise ContractError("client must be connector or tool_computer")
        _optional_text(self.attempt_id, "attempt_id")
        _optional_text(self.action_id, "action_id")
        _text(self.method, "method", limit=32)
        check_destination(self.scheme, self.host, self.port)
        _text(self.path, "path", limit=8192, empty=True)
        if "?" in self.path or "#" in self.path or (self.path and not self.path.startswith("/")):
            raise ContractError("path must start with / and carry no query or fragment")
        if self.verdict not in _VERDICTS:
            raise ContractError("verdict must be allow or refuse")
        if self.code is not None and not isinstance(self.code, RefusalCode):
            raise ContractError("code must be a RefusalCode or None")
        if self.verdict == "allow" and self.code is not None:
            raise ContractError("an allow has no refusal code")
        _text(self.rule, "rule", limit=1000)
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
