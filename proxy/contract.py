"""The typed contract between the proxy and the policy decider, and its strict JSON wire form.

`EgressRequest` is the one shape of an outbound request: the server builds it once from a connector operation,
stores it with the action, grants exactly it, sends it, and the decider compares what the proxy saw
(`DecisionRequest.request`) with it. The proxy sends a `DecisionRequest` and forwards only on an `Allow`.
`parse_verdict` fails closed: anything that is not a well-formed verdict becomes `Refuse(malformed_verdict)`, it
never raises and never allows.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Literal, TypeAlias, get_args
from urllib.parse import urlsplit

from wakeful.proxy.hosts import default_port, normalize_host

__all__ = [
    "MAX_TARGET_PART",
    "REASONS",
    "REFUSAL_HEADER",
    "Allow",
    "Client",
    "ContractError",
    "DecisionRequest",
    "EgressRequest",
    "ProxyRefusal",
    "RefusalCode",
    "Refuse",
    "Verdict",
    "check_destination",
    "clip",
    "encode_request",
    "encode_verdict",
    "parse_request",
    "parse_verdict",
    "refuse",
]

MAX_MESSAGE_BYTES: Final = 64 * 1024
MAX_TARGET_PART: Final = 8192
"""The longest path, and the longest query, a request may have: a longer one is refused (`target_too_long`)."""
CREDENTIAL_NAME: Final = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
"""How a credential binding is named: in the vault, in an `Allow`, in a `{{credential:NAME}}` placeholder."""
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")

Client: TypeAlias = Literal["connector", "tool_computer"]
_CLIENTS: Final = frozenset(get_args(Client))


REFUSAL_HEADER: Final = "X-Wakeful-Refusal"
"""The response header in which the proxy names its refusal or error code: its own word that nothing was sent (or
that the upstream failed). The proxy strips it from upstream answers; the server's dispatcher reads it."""


class RefusalCode(StrEnum):
    NOT_ADMITTED = "not_admitted"
    HOST_NOT_ALLOWED = "host_not_allowed"
    DECIDER_UNAVAILABLE = "decider_unavailable"
    ADDRESS_NOT_ALLOWED = "address_not_allowed"
    CONTENT_MISMATCH = "content_mismatch"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    HEADER_MISMATCH = "header_mismatch"
    PLAINTEXT_CREDENTIAL = "plaintext_credential"
    MALFORMED_VERDICT = "malformed_verdict"
    CREDENTIAL_UNAVAILABLE = "credential_unavailable"
    MISPLACED_CREDENTIAL = "misplaced_credential"
    AMBIGUOUS_PATH = "ambiguous_path"
    REQUEST_TIMEOUT = "request_timeout"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    PROXY_BUSY = "proxy_busy"
    REQUEST_TOO_LARGE = "request_too_large"
    TARGET_TOO_LONG = "target_too_long"
    MALFORMED_REQUEST = "malformed_request"


REASONS: Final[dict[RefusalCode, str]] = {
    RefusalCode.NOT_ADMITTED: "the request belongs to no admitted action that is still valid",
    RefusalCode.HOST_NOT_ALLOWED: "no egress rule allows this host, port, method and path",
    RefusalCode.DECIDER_UNAVAILABLE: "the policy component did not answer in time; nothing was sent",
    RefusalCode.ADDRESS_NOT_ALLOWED: "the host resolves to a private, loopback or reserved address",
    RefusalCode.CONTENT_MISMATCH: "the request differs from the approved action's method, host, path or body",
    RefusalCode.METHOD_NOT_ALLOWED: "this method is never forwarded",
    RefusalCode.HEADER_MISMATCH: "the Host header, TLS name and CONNECT target disagree, or a header is malformed",
    RefusalCode.PLAINTEXT_CREDENTIAL: "a credential is only ever sent over HTTPS",
    RefusalCode.MALFORMED_VERDICT: "the policy component's answer was not understood; nothing was sent",
    RefusalCode.CREDENTIAL_UNAVAILABLE: "the credential this request needs is not in the vault or cannot be used here",
    RefusalCode.MISPLACED_CREDENTIAL: "a credential placeholder stands where its declaration does not put it",
    RefusalCode.AMBIGUOUS_PATH: "the request path can be read more than one way (encoding, dot segments, slashes)",
    RefusalCode.REQUEST_TIMEOUT: "the client did not send its whole request head or body in time",
    RefusalCode.TOO_MANY_CONNECTIONS: "the proxy holds as many client connections as it may; retry later",
    RefusalCode.PROXY_BUSY: "the proxy holds as many request bodies as it may, for this client or in all; retry later",
    RefusalCode.REQUEST_TOO_LARGE: "the request body is larger than the proxy reads; it was not read, decided or sent",
    RefusalCode.TARGET_TOO_LONG: f"the request's path or query is longer than {MAX_TARGET_PART} characters",
    RefusalCode.MALFORMED_REQUEST: "no HTTP/1.1 request could be read: bytes that are not one, or another protocol "
                                   "(HTTP/2 with prior knowledge, TLS without CONNECT)",
}
"""A default reason per code, in words a user can act on."""


class ContractError(ValueError):
    """A value that does not satisfy the contract (raised by constructors and `parse_request`)."""


class ProxyRefusal(Exception):
    """Raised by the pure core when a request must not go out; `refuse()` is what the shell answers with."""

    def __init__(self, code: RefusalCode, reason: str | None = None) -> None:
        self.code = code
        self.reason = reason or REASONS[code]
        super().__init__(f"{code}: {self.reason}")

    def refuse(self) -> Refuse:
        return Refuse(code=self.code, reason=self.reason)


def clip(text: str, width: int) -> str:
    """`text`, or its start and `…` when it is longer than `width` characters: for text that quotes what a client
    sent (a path, a name) in a field of bounded width."""
    return text if len(text) <= width else text[:width - 1] + "…"


def _text(value: object, what: str, *, limit: int = 256, empty: bool = False) -> str:
    # Printable only: these strings end up in logs, headers and the audit, where a control character is an injection.
    if not isinstance(value, str) or len(value) > limit or not value.isprintable() or (not value and not empty):
        raise ContractError(f"{what} must be printable text of at most {limit} characters")
    return value


def _optional_text(value: object, what: str) -> str | None:
    return None if value is None else _text(value, what)


def check_destination(scheme: str, host: str, port: int) -> None:
    """Raises `ContractError` unless scheme is http(s), host is normalised and port is in 1..65535."""
    if scheme not in ("http", "https"):
        raise ContractError("scheme must be http or https")
    try:
        if normalize_host(host) != host:
            raise ContractError("host must be normalised")
    except ValueError as exc:
        raise ContractError(f"host: {exc}") from None
    if type(port) is not int or not 0 < port < 65536:
        raise ContractError("port must be an integer in 1..65535")


def _check_request_line(method: object, scheme: str, host: str, port: int, path: object, query: object,
                        body_sha256: object) -> None:
    if not isinstance(method, str) or not _TOKEN.fullmatch(method) or method != method.upper():
        raise ContractError("method must be an upper-case token")
    check_destination(scheme, host, port)
    _text(path, "path", limit=MAX_TARGET_PART, empty=True)
    assert isinstance(path, str)
    path_ok = path.startswith("/") or (method == "CONNECT" and path == "")
    if not path_ok or "?" in path or "#" in path:
        raise ContractError("path must start with / and carry no query or fragment")
    _text(query, "query", limit=MAX_TARGET_PART, empty=True)
    if not isinstance(body_sha256, str) or not _SHA256.fullmatch(body_sha256):
        raise ContractError("body_sha256 must be 64 lower-case hex digits")


_EMPTY_SHA256: Final = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True, kw_only=True)
class EgressRequest:
    """One outbound HTTP request, exactly as it may leave: built once by the server (`EgressRequest.of`), stored
    with the action (`to_json`), granted part by part, sent as it is (minus the credential the proxy adds), and
    compared by the decider with what the proxy saw (`differs`). Validated on construction.

    `headers` and `body` are what the server sends; the proxy's view of a request (`DecisionRequest.request`) has
    neither, only the body's digest, which is what a grant pins."""

    method: str
    scheme: Literal["http", "https"]
    host: str
    """Normalised (see `proxy.hosts.normalize_host`)."""
    port: int
    path: str
    """Starts with `/`, without the query."""
    query: str
    """Without the leading `?`; "" when there is none."""
    body_sha256: str
    """Lower-case hex SHA-256 of the body (of b"" when there is none)."""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes | None = field(default=None, repr=False)
    """None when there is no body, or when only its digest is known (a grant, the proxy's view)."""

    def __post_init__(self) -> None:
        _check_request_line(self.method, self.scheme, self.host, self.port, self.path, self.query, self.body_sha256)
        if not isinstance(self.headers, tuple) or not all(
                isinstance(h, tuple) and len(h) == 2 and all(isinstance(x, str) for x in h) for h in self.headers):
            raise ContractError("headers must be a tuple of (name, value) string pairs")
        if self.body is not None and hashlib.sha256(self.body).hexdigest() != self.body_sha256:
            raise ContractError("body_sha256 must be the digest of the body")

    @classmethod
    def of(cls, method: str, url: str, *, headers: tuple[tuple[str, str], ...] = (), body: bytes | None = None,
           body_sha256: str | None = None) -> EgressRequest:
        """The request for an absolute http(s) URL; the digest is the body's (of b"" without one) unless only the
        digest is known. Raises `ContractError` for anything else."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username is not None:
            raise ContractError(f"not an http(s) URL without userinfo: {url!r}")
        try:
            host, port = normalize_host(parts.hostname), parts.port or default_port(parts.scheme)
        except ValueError as exc:
            raise ContractError(f"{url!r}: {exc}") from None
        digest = body_sha256 or (hashlib.sha256(body).hexdigest() if body is not None else _EMPTY_SHA256)
        return cls(method=method.upper(), scheme=parts.scheme, host=host, port=port,  # type: ignore[arg-type]
                   path=parts.path or "/", query=parts.query, body_sha256=digest, headers=headers, body=body)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = "" if self.port == default_port(self.scheme) else f":{self.port}"
        return f"{self.scheme}://{host}{port}{self.path}" + (f"?{self.query}" if self.query else "")

    def differs(self, other: EgressRequest) -> str | None:
        """The first part in which `other` is not this request (method, scheme, host, port, path, query, body by
        its digest), named, never shown: a query can hold secrets. Headers are not compared."""
        for part in ("method", "scheme", "host", "port", "path", "query", "body_sha256"):
            if getattr(self, part) != getattr(other, part):
                return "body" if part == "body_sha256" else part
        return None

    def to_json(self) -> dict[str, Any]:
        """The stored form (in an action's content, which its hash covers, and in its attempts). It is the form
        actions were stored in before this type existed, so every stored action reads back with `from_json`."""
        return {"method": self.method, "url": self.url, "headers": dict(self.headers),
                "body": self.body.decode() if self.body is not None else None, "body_sha256": self.body_sha256}

    @classmethod
    def from_json(cls, stored: Mapping[str, Any]) -> EgressRequest:
        body = stored.get("body")
        return cls.of(stored["method"], stored["url"], headers=tuple((stored.get("headers") or {}).items()),
                      body=body.encode() if isinstance(body, str) else None, body_sha256=stored.get("body_sha256"))


@dataclass(frozen=True, kw_only=True)
class DecisionRequest:
    """One request the proxy would forward, described to the decider. Validated on construction."""

    request_id: str
    user_id: str | None
    attempt_token: str | None
    """Added by the dispatcher to connector calls (header `X-Wakeful-Attempt`); never forwarded upstream."""
    client_token: str | None = field(repr=False)
    """The credential a tool-computer client presented to the proxy in Proxy-Authorization (Basic, as
    `user_id:token`); checked by the decider; never logged or audited."""
    method: str
    """Upper-case token, e.g. `GET`; `CONNECT` for a tunnel the proxy does not intercept (then `path` is "")."""
    scheme: Literal["http", "https"]
    host: str
    """Normalised (see `proxy.hosts.normalize_host`)."""
    port: int
    path: str
    """Starts with `/`, without the query."""
    query: str
    """Without the leading `?`; "" when there is none."""
    body_sha256: str
    """Lower-case hex SHA-256 of the body (of b"" when there is none)."""
    resolved_ips: tuple[str, ...]
    """The addresses the proxy would dial; empty until it resolved the host."""
    client: Client

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", limit=128)
        _optional_text(self.user_id, "user_id")
        _optional_text(self.attempt_token, "attempt_token")
        _optional_text(self.client_token, "client_token")
        _check_request_line(self.method, self.scheme, self.host, self.port, self.path, self.query, self.body_sha256)
        if not isinstance(self.resolved_ips, tuple):
            raise ContractError("resolved_ips must be a tuple")
        for ip in self.resolved_ips:
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                raise ContractError(f"resolved_ips: not an IP address: {ip!r}") from None
        if self.client not in _CLIENTS:
            raise ContractError("client must be connector or tool_computer")

    @property
    def request(self) -> EgressRequest:
        """The request as the proxy saw it (the body by its digest only), to compare with what was granted."""
        return EgressRequest(method=self.method, scheme=self.scheme, host=self.host, port=self.port, path=self.path,
                             query=self.query, body_sha256=self.body_sha256)


@dataclass(frozen=True, kw_only=True)
class Allow:
    credential: str | None
    """The name of the credential binding to inject, or None to forward without one."""
    rule: str
    """Why: the egress rule's name, or the admitted action's description."""
    attempt_id: str | None
    action_id: str | None

    def __post_init__(self) -> None:
        if self.credential is not None and (
            not isinstance(self.credential, str) or not CREDENTIAL_NAME.fullmatch(self.credential)
        ):
            raise ContractError("credential must be a credential name")
        _text(self.rule, "rule")
        _optional_text(self.attempt_id, "attempt_id")
        _optional_text(self.action_id, "action_id")


@dataclass(frozen=True, kw_only=True)
class Refuse:
    code: RefusalCode
    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.code, RefusalCode):
            raise ContractError("code must be a RefusalCode")
        _text(self.reason, "reason", limit=1000)


Verdict: TypeAlias = Allow | Refuse


def refuse(code: RefusalCode, reason: str | None = None) -> Refuse:
    """A refusal with the default reason for its code unless a more precise one is given."""
    return Refuse(code=code, reason=reason or REASONS[code])


_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=True)
# One encoder for every message: `json.dumps` with options builds a new one per call.


def _dumps(obj: dict[str, object]) -> bytes:
    return _ENCODER.encode(obj).encode("ascii")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # A repeated key ("verdict" twice) means two readers may see two different answers: refuse the message.
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ContractError("duplicate key")
    return result


def _reject_constant(name: str) -> object:
    raise ContractError(f"{name} is not JSON")


def _loads(raw: object) -> dict[str, object]:
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise ContractError("expected bytes")
    data = bytes(raw)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ContractError("message too large")
    obj = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    if not isinstance(obj, dict):
        raise ContractError("expected a JSON object")
    if obj.get("v") != 1 or type(obj.get("v")) is not int:
        raise ContractError("unsupported version")
    return obj


def _exact_keys(obj: dict[str, object], keys: frozenset[str]) -> None:
    if set(obj) != keys:
        raise ContractError(f"expected exactly the keys {sorted(keys)}")


_REQUEST_KEYS = frozenset({"v", "request_id", "user_id", "attempt_token", "client_token", "method", "scheme", "host",
                           "port", "path", "query", "body_sha256", "resolved_ips", "client"})


def encode_request(req: DecisionRequest) -> bytes:
    return _dumps({
        "v": 1, "request_id": req.request_id, "user_id": req.user_id, "attempt_token": req.attempt_token,
        "client_token": req.client_token, "method": req.method, "scheme": req.scheme, "host": req.host,
        "port": req.port, "path": req.path,
        "query": req.query, "body_sha256": req.body_sha256, "resolved_ips": list(req.resolved_ips),
        "client": req.client,
    })


def parse_request(raw: bytes) -> DecisionRequest:
    """The decider's side: a `DecisionRequest` from its wire form. Raises `ContractError` on anything else."""
    try:
        obj = _loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ContractError(f"malformed decision request: {exc}") from None
    _exact_keys(obj, _REQUEST_KEYS)
    ips = obj["resolved_ips"]
    if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
        raise ContractError("resolved_ips must be a list of strings")
    fields = {k: v for k, v in obj.items() if k != "v"}
    fields["resolved_ips"] = tuple(ips)
    return DecisionRequest(**fields)  # type: ignore[arg-type]  # every field is validated in __post_init__


def encode_verdict(verdict: Verdict, *, request_id: str) -> bytes:
    """The decider's answer on the wire; `request_id` echoes the request so a stray answer is never applied."""
    if isinstance(verdict, Allow):
        return _dumps({"v": 1, "request_id": request_id, "verdict": "allow", "credential": verdict.credential,
                       "rule": verdict.rule, "attempt_id": verdict.attempt_id, "action_id": verdict.action_id})
    return _dumps({"v": 1, "request_id": request_id, "verdict": "refuse", "code": verdict.code.value,
                   "reason": verdict.reason})


_ALLOW_KEYS = frozenset({"v", "request_id", "verdict", "credential", "rule", "attempt_id", "action_id"})
_REFUSE_KEYS = frozenset({"v", "request_id", "verdict", "code", "reason"})


def _parse_verdict(raw: object, request_id: str | None) -> Verdict:
    obj = _loads(raw)
    kind = obj.get("verdict")
    _exact_keys(obj, _ALLOW_KEYS if kind == "allow" else _REFUSE_KEYS)
    if kind not in ("allow", "refuse"):
        raise ContractError("verdict must be allow or refuse")
    if not isinstance(obj["request_id"], str) or (request_id is not None and obj["request_id"] != request_id):
        raise ContractError("the verdict answers another request")
    if kind == "allow":
        return Allow(credential=obj["credential"], rule=obj["rule"],  # type: ignore[arg-type]
                     attempt_id=obj["attempt_id"], action_id=obj["action_id"])  # type: ignore[arg-type]
    if not isinstance(obj["code"], str):
        raise ContractError("code must be a string")
    return Refuse(code=RefusalCode(obj["code"]), reason=obj["reason"])  # type: ignore[arg-type]


def parse_verdict(raw: bytes, *, request_id: str | None = None) -> Verdict:
    """The decider's answer, or `Refuse(malformed_verdict)` for anything not well-formed. Never raises.

    With `request_id`, a verdict that does not echo it is malformed too.
    """
    try:
        return _parse_verdict(raw, request_id)
    except Exception:  # fail closed on *any* defect in the answer: the caller must get a verdict, never a crash
        return refuse(RefusalCode.MALFORMED_VERDICT)
