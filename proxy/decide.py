"""Pure checks the proxy applies around the decider's answer, and the allowlist match for tool-computer traffic.

Order in the shell: `agree` (before asking), `check_method` (before asking), the decider's verdict through
`check_verdict`, then resolve and `check_addresses` on exactly the addresses it will dial.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from wakeful.proxy.addresses import never_dialled
from wakeful.proxy.contract import (
    CREDENTIAL_NAME,
    Allow,
    ContractError,
    DecisionRequest,
    RefusalCode,
    Refuse,
    Verdict,
    clip,
    refuse,
)
from wakeful.proxy.hosts import default_port, is_ip, normalize_host, parse_authority
from wakeful.proxy.paths import AmbiguousPath, normalize_path, within

__all__ = [
    "AllowRule",
    "agree",
    "check_addresses",
    "check_method",
    "check_request",
    "check_verdict",
    "decide_by_allowlist",
    "is_public_address",
    "match_allowlist",
]

REFUSED_METHODS: Final = frozenset({"TRACE", "TRACK"})  # TRACK is IIS's TRACE: both echo the request, credentials too
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def _public(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    # is_global alone lets multicast through, and 3.11 does not look inside 6to4 or NAT64 addresses.
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return _public(addr.ipv4_mapped)
        if addr in _NAT64:  # DNS64 answers on IPv6-only networks: as public as the IPv4 address inside
            return _public(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
        if addr in _IPV4_COMPATIBLE:
            return False
        if addr.sixtofour is not None and not _public(addr.sixtofour):
            return False
        if addr.is_site_local:
            return False
    return addr.is_global and not (addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_multicast
                                   or addr.is_reserved or addr.is_unspecified)


def is_public_address(ip: str) -> bool:
    """Whether `ip` is a globally routable unicast address, looking through IPv4-mapped, 6to4 and NAT64 forms."""
    try:
        return _public(ipaddress.ip_address(ip))
    except ValueError:
        return False


def check_method(method: str) -> Refuse | None:
    if method.upper() in REFUSED_METHODS:
        return refuse(RefusalCode.METHOD_NOT_ALLOWED, f"{method.upper()} is never forwarded: it echoes credentials")
    return None


def check_addresses(host: str, ips: Iterable[str], *, allowed_private: frozenset[str]) -> Refuse | None:
    """Refuse unless every address is public, or the host is explicitly allowed to be private.

    An empty list is refused: an address nobody checked is never dialled. Unspecified (0.0.0.0, ::) and multicast
    addresses are refused even for allowed hosts, since connecting to 0.0.0.0 reaches this machine, and so are
    link-local and cloud-metadata addresses in any spelling (`proxy.addresses.never_dialled`).
    """
    addresses = list(ips)
    if not addresses:
        return refuse(RefusalCode.ADDRESS_NOT_ALLOWED, f"{host} has no checked address to connect to")
    try:
        private_ok = normalize_host(host) in {normalize_host(h) for h in allowed_private}
    except ValueError:
        private_ok = False
    for ip in addresses:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return refuse(RefusalCode.ADDRESS_NOT_ALLOWED, f"{host} resolved to something that is not an address")
        mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
        never = (mapped or addr).is_unspecified or (mapped or addr).is_multicast or never_dialled(addr)
        if never or not (_public(addr) or private_ok):
            return refuse(RefusalCode.ADDRESS_NOT_ALLOWED,
                          f"{host} resolves to {addr}, a private, loopback or reserved address")
    return None


def check_request(req: DecisionRequest, *, allowed_private: frozenset[str]) -> Refuse | None:
    """TRACE refused; every resolved address checked (see `check_addresses`). None means nothing objects."""
    return check_method(req.method) or check_addresses(req.host, req.resolved_ips, allowed_private=allowed_private)


def agree(connect_target: tuple[str, int] | None, sni: str | None, host_header: str | None, port: int, *,
          scheme: str | None = None) -> bool:
    """Whether the CONNECT target (or absolute-form authority), TLS server name and Host header name one host.

    Names compare case-insensitively without a trailing dot; every port present must equal `port`, and a Host
    header without one means the scheme's default (80 or 443 when the scheme is not known; 443 under TLS).
    Nothing present at all is disagreement: there is no host to check the request against.
    """
    names: list[str] = []
    try:
        if connect_target is not None:
            target_host, target_port = connect_target
            if target_port != port:
                return False
            names.append(normalize_host(target_host))
        if sni is not None:
            names.append(normalize_host(sni))
            scheme = scheme or "https"
        if host_header is not None:
            host, header_port = parse_authority(host_header)
            if header_port is None:
                defaults = {default_port(scheme)} if scheme else {80, 443}
                if port not in defaults:
                    return False
            elif header_port != port:
                return False
            names.append(host)
    except ValueError:
        return False
    return bool(names) and all(name == names[0] for name in names)


@dataclass(frozen=True, kw_only=True)
class AllowRule:
    """One egress allowlist entry for tool-computer traffic. Anything no rule matches is refused."""

    name: str
    host: str
    """An exact normalised host, or `*.example.com`: one or more labels under it, never the bare apex."""
    ports: frozenset[int]
    methods: frozenset[str]
    """Upper case; TRACE never. `CONNECT` allows a tunnel the proxy does not intercept (pinned hosts)."""
    path_prefix: str = "/"
    """Matched segment-wise on canonical paths (`proxy.paths`): `/v1` matches `/v1` and `/v1/x`, not `/v1x`, nor
    `/v1/%2e%2e/admin`."""
    credential: str | None = None
    """The credential binding injected for this rule; only with an exact host."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.isprintable():
            raise ContractError("rule name must be printable text")
        bare = self.host[2:] if self.host.startswith("*.") else self.host
        try:
            if normalize_host(bare) != bare:
                raise ContractError(f"rule host must be normalised: {self.host!r}")
        except ValueError as exc:
            raise ContractError(f"rule host: {exc}") from None
        if self.host.startswith("*.") and (is_ip(bare) or "." not in bare):
            raise ContractError(f"a wildcard needs a domain of two labels or more: {self.host!r}")
        if not self.ports or not all(type(p) is int and 0 < p < 65536 for p in self.ports):
            raise ContractError("ports must be a non-empty set of 1..65535")
        if not self.methods or not all(_TOKEN.fullmatch(m) and m == m.upper() for m in self.methods):
            raise ContractError("methods must be a non-empty set of upper-case tokens")
        if self.methods & REFUSED_METHODS:
            raise ContractError("TRACE is never allowed")
        if not self.path_prefix.startswith("/"):
            raise ContractError("path_prefix must start with /")
        if self.credential is not None:
            if not CREDENTIAL_NAME.fullmatch(self.credential):
                raise ContractError("credential must be a credential name")
            if self.host.startswith("*."):
                raise ContractError("a rule that binds a credential names its host exactly")

    def matches_host(self, host: str) -> bool:
        if self.host.startswith("*."):
            return not is_ip(host) and host.endswith(self.host[1:])
        return host == self.host


def _within(path: str, prefix: str) -> bool:
    # Both sides in canonical form (`proxy.paths`): no spelling of a path reads inside the prefix here and outside
    # it at the upstream. A path or prefix that cannot be read one way only matches nothing.
    try:
        return within(normalize_path(path).decoded, normalize_path(prefix).decoded)
    except AmbiguousPath:
        return False


def match_allowlist(rules: Iterable[AllowRule], host: str, port: int, method: str, path: str) -> AllowRule | None:
    """The first rule allowing this request, or None (deny by default). `path` is "" only for CONNECT."""
    try:
        host = normalize_host(host)
    except ValueError:
        return None
    method = method.upper()
    tunnel = method == "CONNECT" and path == ""
    if not tunnel:
        try:
            normalize_path(path)
        except AmbiguousPath:
            return None
    for rule in rules:
        if (rule.matches_host(host) and port in rule.ports and method in rule.methods
                and (tunnel or _within(path, rule.path_prefix))):
            return rule
    return None


def decide_by_allowlist(req: DecisionRequest, rules: Iterable[AllowRule]) -> Verdict:
    """The decision for tool-computer traffic: the matching rule's allow, else `host_not_allowed`."""
    if req.client != "tool_computer":
        return refuse(RefusalCode.NOT_ADMITTED, "connector calls are decided by their attempt, not the allowlist")
    rule = match_allowlist(rules, req.host, req.port, req.method, req.path)
    if rule is None:  # the path is cut: a reason is at most 1000 characters, a path up to 8192
        return refuse(RefusalCode.HOST_NOT_ALLOWED, f"no egress rule allows {req.method} "
                                                    f"{req.scheme}://{req.host}:{req.port}{clip(req.path, 200)}")
    return Allow(credential=rule.credential, rule=rule.name, attempt_id=None, action_id=None)


def check_verdict(req: DecisionRequest, verdict: Verdict) -> Verdict:
    """The verdict if it fits the request, else `malformed_verdict`: a connector allow names the attempt (the
    server's grant for this request) and, for an action's effect, the action; a tool-computer allow names neither;
    a connector call without an attempt token is never allowed."""
    if isinstance(verdict, Refuse):
        return verdict
    if req.client == "connector":
        fits = req.attempt_token is not None and verdict.attempt_id is not None
    else:
        fits = verdict.attempt_id is None and verdict.action_id is None
    return verdict if fits else refuse(RefusalCode.MALFORMED_VERDICT, "the allow does not fit the request's kind")
