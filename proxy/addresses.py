"""Addresses the proxy never dials, whatever `egress_allow_private` says: link-local ones and cloud metadata services.

A host may be allowed to resolve to private addresses (an intranet service, a test upstream on loopback); it may
never reach the link-local range, where cloud metadata services hand out instance credentials. The check is on the
address that would be dialled, looking through every form that carries an IPv4 address inside an IPv6 one.
"""

from __future__ import annotations

import ipaddress
from typing import Final

__all__ = ["METADATA_ADDRESSES", "never_dialled"]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

METADATA_ADDRESSES: Final = frozenset(ipaddress.ip_address(ip) for ip in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle
    "169.254.170.2",    # AWS ECS task credentials
    "fd00:ec2::254",    # AWS over IPv6
    "100.100.100.200",  # Alibaba Cloud
    "192.0.0.192",      # Oracle Cloud (classic)
))
"""Metadata services outside the link-local ranges too (those are refused whole)."""

_LINK_LOCAL_V4: Final = ipaddress.IPv4Network("169.254.0.0/16")
_LINK_LOCAL_V6: Final = ipaddress.IPv6Network("fe80::/10")
_NAT64: Final = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE: Final = ipaddress.IPv6Network("::/96")


def _embedded(addr: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """Every IPv4 address an IPv6 address may stand for on the way out: mapped, compatible, NAT64, 6to4, Teredo."""
    inside: list[ipaddress.IPv4Address] = []
    if addr.ipv4_mapped is not None:
        inside.append(addr.ipv4_mapped)
    if addr in _IPV4_COMPATIBLE or any(addr in net for net in _NAT64):
        inside.append(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
    if addr.sixtofour is not None:
        inside.append(addr.sixtofour)
    if addr.teredo is not None:
        inside.extend(addr.teredo)
    return inside


def _never(addr: Address) -> bool:
    if addr.scope_id if isinstance(addr, ipaddress.IPv6Address) else False:
        return True  # a zone only means something on a link: link-local by nature
    plain = ipaddress.ip_address(int(addr)) if isinstance(addr, ipaddress.IPv6Address) else addr
    if plain in METADATA_ADDRESSES:
        return True
    if isinstance(plain, ipaddress.IPv4Address):
        return plain in _LINK_LOCAL_V4
    return plain in _LINK_LOCAL_V6 or any(_never(v4) for v4 in _embedded(plain))


def never_dialled(ip: str | Address) -> bool:
    """Whether `ip` is link-local or a metadata service's, in any spelling; a string that is not an address is
    never dialled either."""
    try:
        addr = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
    except ValueError:
        return True
    return _never(addr)
