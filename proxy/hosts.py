"""Host names and authorities in one canonical form, so every comparison in the proxy compares like with like."""

from __future__ import annotations

import functools
import ipaddress
import re

__all__ = ["default_port", "is_ip", "normalize_host", "parse_authority"]

_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
# glibc's inet_aton reads "2130706433", "0x7f.1" or "0177.0.0.1" as addresses; a name made only of such labels is
# refused so that no spelling of an IP address can pass as a host name.
_NUMERIC_LABEL = re.compile(r"0x[0-9a-f]*|[0-9]+")
_PORT = re.compile(r"[0-9]{1,5}")
_DEFAULT_PORTS = {"http": 80, "https": 443}


@functools.lru_cache(maxsize=4096)  # pure, and called several times per proxied request
def normalize_host(host: str) -> str:
    """The canonical spelling of a DNS name or IP literal: lower case, no trailing dot, no IPv6 brackets.

    Raises `ValueError` for anything else: non-ASCII (A-labels only), ports, userinfo, zone ids, empty labels,
    numeric spellings of addresses that are not the canonical dotted quad.
    """
    if not isinstance(host, str) or not host or not host.isascii() or "%" in host:
        raise ValueError(f"not a host name: {host!r}")
    if host.startswith("[") and host.endswith("]"):
        return ipaddress.IPv6Address(host[1:-1]).compressed
    name = host[:-1] if host.endswith(".") else host
    name = name.lower()
    try:
        return ipaddress.ip_address(name).compressed
    except ValueError:
        pass
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"not a host name: {host!r}")
    if all(_NUMERIC_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"a numeric host must be a canonical IP address: {host!r}")
    return name


def is_ip(host: str) -> bool:
    """Whether a normalised host is an IP literal rather than a DNS name."""
    # `ipaddress` reads IPv4 from digits and dots only and IPv6 only with a colon: anything else is a name, told
    # without the cost of the exception.
    if ":" not in host and host.strip("0123456789."):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_authority(authority: str) -> tuple[str, int | None]:
    """`host`, `host:port`, `[v6]` or `[v6]:port` → (normalised host, port or None). Raises `ValueError`."""
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise ValueError(f"unclosed IPv6 literal: {authority!r}")
        host, rest = authority[: end + 1], authority[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"junk after IPv6 literal: {authority!r}")
        port_text = rest[1:] if rest else None
    elif authority.count(":") == 1:
        host, port_text = authority.split(":")
    elif ":" in authority:
        raise ValueError(f"an IPv6 literal needs brackets: {authority!r}")
    else:
        host, port_text = authority, None
    port: int | None = None
    if port_text is not None:
        if not _PORT.fullmatch(port_text) or not 0 < int(port_text) < 65536:
            raise ValueError(f"bad port in {authority!r}")
        port = int(port_text)
    return normalize_host(host), port


def default_port(scheme: str) -> int:
    """80 for http, 443 for https. Raises `ValueError` for any other scheme."""
    try:
        return _DEFAULT_PORTS[scheme.lower()]
    except KeyError:
        raise ValueError(f"unsupported scheme {scheme!r}") from None
