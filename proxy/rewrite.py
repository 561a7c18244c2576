"""Header rewriting for an allowed request: strip what the client sent as a credential, then inject the real one.

Headers are `(name, value)` pairs in wire order. A pair whose name is empty or starts with a space or tab is an
obs-fold continuation of the pair before it (RFC 9112 §5.2): it is folded into that value, so a continuation of a
credential header is stripped with it and never forwarded as a header of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final
from urllib.parse import unquote_plus, unquote_to_bytes

from wakeful.proxy.contract import ProxyRefusal, RefusalCode
from wakeful.proxy.credential import FORBIDDEN_HEADERS, Credential
from wakeful.proxy.hosts import normalize_host

__all__ = [
    "ATTEMPT_HEADER",
    "CREDENTIAL_HEADERS",
    "HOP_BY_HOP",
    "HeaderRejected",
    "InjectionRefused",
    "check_placeholders",
    "header_key",
    "inject",
    "refuse_misplaced",
    "refuse_placeholders",
    "strip_credentials",
    "unfold",
]

ATTEMPT_HEADER: Final = "X-Wakeful-Attempt"
CREDENTIAL_HEADERS: Final = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "x-auth-token"})
COOKIE_HEADERS: Final = frozenset({"cookie", "cookie2"})
HOP_BY_HOP: Final = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                               "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"})
# `Connection: host` must not make the proxy drop the header that `agree` checked, nor the body's framing.
_NEVER_NOMINATED: Final = frozenset({"host", "content-length"})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # controls other than HTAB: CR, LF and NUL split requests
_PLACEHOLDER = re.compile(r"\{\{credential:([^{}]*)\}\}")
_PLACEHOLDER_BYTES = re.compile(rb"\{\{credential:([^{}]*)\}\}")


def header_key(name: str) -> str:
    """The name every header rule compares: lower case, `_` read as `-`. Servers behind CGI, WSGI and some proxies
    read `X_Api_Key` as `X-Api-Key` and `Transfer_Encoding` as `Transfer-Encoding`: a rule that matched the exact
    spelling would let those through."""
    return name.lower().replace("_", "-")


class HeaderRejected(ProxyRefusal):
    """A header that could smuggle a second request or a hidden header: bad name, control characters."""

    def __init__(self, reason: str) -> None:
        super().__init__(RefusalCode.HEADER_MISMATCH, reason)


class InjectionRefused(ProxyRefusal):
    """The credential must not go into this request: plaintext, another host, or a credential not approved."""


def _continuation(name: str, value: str) -> str:
    # The shell may hand a continuation line over as ("", text) or split at its first colon ("  text", "rest").
    if not name.strip():
        return value.strip()
    return f"{name.strip()}:{value}".strip() if value else name.strip()


def unfold(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Headers with continuation lines folded in, every name a token and no value holding CR, LF, NUL or controls.

    Raises `HeaderRejected`.
    """
    out: list[tuple[str, str]] = []
    for name, value in headers:
        if not isinstance(name, str) or not isinstance(value, str):
            raise HeaderRejected("header names and values must be text")
        if name == "" or name[0] in " \t":
            if not out:
                raise HeaderRejected("a continuation line with no header before it")
            text = _continuation(name, value)
            if _BAD_VALUE.search(text):
                raise HeaderRejected("a header continuation holds a control character")
            previous_name, previous_value = out[-1]
            out[-1] = (previous_name, f"{previous_value} {text}" if text else previous_value)
            continue
        if not _TOKEN.fullmatch(name):
            raise HeaderRejected(f"not a valid header name: {name!r}")
        if _BAD_VALUE.search(value):
            raise HeaderRejected(f"the {name} header holds a control character")
        out.append((name, value))
    return out


def strip_credentials(headers: Iterable[tuple[str, str]], *, bound_host: bool,
                      keep: str | None = None) -> list[tuple[str, str]]:
    """The client's headers without any credential it sent, hop-by-hop headers or the attempt token.

    Removes, in any casing, with `_` for `-` (see `header_key`) and every duplicate: Authorization,
    Proxy-Authorization, X-Api-Key, Api-Key, X-Auth-Token, X-Wakeful-Attempt, the hop-by-hop headers and those
    `Connection` names, and Cookie when the host has a bound credential. Raises `HeaderRejected` for malformed
    headers rather than guessing. With `keep` (a `header_key`), the values of that header that hold a credential
    placeholder stay, to be filled by `inject`: the credential's declared header, checked by `check_placeholders`.
    """
    unfolded = unfold(headers)
    nominated = {header_key(token.strip()) for name, value in unfolded if header_key(name) == "connection"
                 for token in value.split(",")} - _NEVER_NOMINATED
    drop = CREDENTIAL_HEADERS | HOP_BY_HOP | {ATTEMPT_HEADER.lower()} | nominated
    if bound_host:
        drop |= COOKIE_HEADERS
    return [(name, value) for name, value in unfolded
            if header_key(name) not in drop or (header_key(name) == keep and _PLACEHOLDER.search(value))]


def _misplaced(credential: Credential) -> InjectionRefused:
    return InjectionRefused(RefusalCode.MISPLACED_CREDENTIAL,
                            f"credential {credential.name} goes only in its declared header, {credential.header}")


def check_placeholders(headers: Iterable[tuple[str, str]], credential: Credential | None) -> str | None:
    """Where the client's `{{credential:NAME}}` placeholders may be filled: the `header_key` of the credential's
    declared header when a value of it holds one, else None. Run on the client's headers before stripping, so a
    placeholder in a header that would be stripped is refused too, not silently dropped.

    Raises `InjectionRefused`: credential_unavailable for a placeholder when no credential (or another one) was
    approved, misplaced_credential for one outside the declared header; `HeaderRejected` for malformed headers.
    """
    unfolded = unfold(headers)
    if credential is None:
        refuse_placeholders(unfolded)
        return None
    declared = header_key(credential.header)
    keep: str | None = None
    for name, value in unfolded:
        named = _PLACEHOLDER.findall(value)
        if not named:
            continue
        if any(n != credential.name for n in named):
            raise InjectionRefused(RefusalCode.CREDENTIAL_UNAVAILABLE,
                                   "the request asks for a credential that was not approved for it")
        if header_key(name) != declared:
            raise _misplaced(credential)
        keep = declared
    return keep


def refuse_misplaced(query: str, body: bytes) -> None:
    """A credential is never put in a query or a body: a placeholder there (as written or percent-encoded) is
    refused (misplaced_credential) rather than forwarded as written, which would name the credential to the
    upstream and, echoed back, look like a place it could go."""
    if (_PLACEHOLDER.search(query) or _PLACEHOLDER.search(unquote_plus(query))
            or _PLACEHOLDER_BYTES.search(body) or (b"%" in body and _PLACEHOLDER_BYTES.search(
                unquote_to_bytes(body.replace(b"+", b" "))))):
        raise InjectionRefused(RefusalCode.MISPLACED_CREDENTIAL,
                               "a credential placeholder stands in the query or the body; credentials go only in "
                               "their declared header")


def refuse_placeholders(headers: Iterable[tuple[str, str]]) -> None:
    """For a request allowed without a credential: a `{{credential:NAME}}` placeholder in it asks for one that was
    not approved. Raises `InjectionRefused` (credential_unavailable) rather than forwarding the placeholder as
    written, which would name the credential to a host that must not get it and fail there unexplained."""
    if any(_PLACEHOLDER.search(value) for _, value in headers):
        raise InjectionRefused(RefusalCode.CREDENTIAL_UNAVAILABLE,
                               "the request asks for a credential that was not approved for it")


def inject(headers: Iterable[tuple[str, str]], credential: Credential, *, scheme: str,
           host: str) -> list[tuple[str, str]]:
    """The headers with `credential` in them, only over HTTPS to the credential's own host.

    A `{{credential:NAME}}` placeholder in the credential's declared header is replaced by the bare secret (one
    in any other header is refused, misplaced_credential); without one, the declared header is set to the rendered
    template, replacing any header of that name. Apply to headers that
    went through `strip_credentials` first. Raises `InjectionRefused` (plaintext_credential, host_not_allowed,
    credential_unavailable, misplaced_credential) or `HeaderRejected`.
    """
    if scheme.lower() != "https":
        raise InjectionRefused(RefusalCode.PLAINTEXT_CREDENTIAL,
                               f"credential {credential.name} is only sent over HTTPS, not {scheme}")
    try:
        target = normalize_host(host)
    except ValueError:
        raise InjectionRefused(RefusalCode.HOST_NOT_ALLOWED, "the destination is not a valid host name") from None
    if target != credential.host:
        raise InjectionRefused(RefusalCode.HOST_NOT_ALLOWED,
                               f"credential {credential.name} is bound to another host than {target}")
    out: list[tuple[str, str]] = []
    placed = False
    for name, value in unfold(headers):
        named = _PLACEHOLDER.findall(value)
        if not named:
            out.append((name, value))
            continue
        if any(n != credential.name for n in named):
            raise InjectionRefused(RefusalCode.CREDENTIAL_UNAVAILABLE,
                                   "the request asks for a credential that was not approved for it")
        if name.lower() in FORBIDDEN_HEADERS:
            raise HeaderRejected(f"a credential cannot go into the {name} header")
        if header_key(name) != header_key(credential.header):
            raise _misplaced(credential)
        out.append((name, value.replace(credential.placeholder(), credential.secret.reveal().decode("ascii"))))
        placed = True
    if not placed:
        out = [(name, value) for name, value in out if header_key(name) != header_key(credential.header)]
        out.append((credential.header, credential.render()))
    return out
