"""Link-local and cloud-metadata addresses are never dialled, in any spelling, whatever `egress_allow_private` says.

The check is on the address that would be dialled (after resolution), so every test hands `check_addresses` the
resolved addresses themselves; nothing here connects anywhere.
"""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.proxy.contract import RefusalCode, Refuse
from wakeful.proxy.decide import check_addresses
from wakeful.proxy.hosts import normalize_host

ALLOWED = frozenset({"metadata.internal", "169.254.169.254", "fd00:ec2::254"})

METADATA_SPELLINGS = [
    "169.254.169.254",                # AWS, GCP, Azure, OpenStack
    "fd00:ec2::254",                  # AWS over IPv6
    "FD00:EC2:0:0:0:0:0:254",
    "fd00:ec2:0000::0254",
    "::ffff:169.254.169.254",         # IPv4-mapped
    "::ffff:a9fe:a9fe",
    "0:0:0:0:0:ffff:a9fe:a9fe",
    "::169.254.169.254",              # IPv4-compatible (deprecated, still parsed)
    "64:ff9b::a9fe:a9fe",             # NAT64 (DNS64 answers)
    "64:ff9b::169.254.169.254",
    "2002:a9fe:a9fe::1",              # 6to4
    "100.100.100.200",                # Alibaba Cloud
    "169.254.170.2",                  # ECS task metadata
    "169.254.0.1",                    # anything link-local
    "fe80::1",
    "fe80::a9fe:a9fe",
    "fe80::1%eth0",
]


def refused(result: Refuse | None) -> bool:
    return result is not None and result.code == RefusalCode.ADDRESS_NOT_ALLOWED


@pytest.mark.parametrize("ip", METADATA_SPELLINGS)
def test_a_host_allowed_private_that_resolves_to_a_metadata_or_link_local_address_is_refused(ip: str) -> None:
    assert refused(check_addresses("metadata.internal", [ip], allowed_private=ALLOWED))


@pytest.mark.parametrize("ip", METADATA_SPELLINGS)
def test_one_metadata_address_among_allowed_ones_refuses_the_whole_answer(ip: str) -> None:
    assert refused(check_addresses("metadata.internal", ["10.0.0.5", ip], allowed_private=ALLOWED))


@pytest.mark.parametrize("host", ["169.254.169.254", "fd00:ec2::254"])
def test_the_metadata_address_itself_is_refused_even_when_it_is_listed_as_allowed_private(host: str) -> None:
    assert refused(check_addresses(host, [host], allowed_private=ALLOWED))


@pytest.mark.parametrize("spelling", ["2852039166", "0xa9fea9fe", "0251.0376.0251.0376", "169.254.43518",
                                      "0xa9.0xfe.0xa9.0xfe", "169.254.169.254.", "0x00000000a9fea9fe"])
def test_decimal_hex_and_octal_spellings_of_the_metadata_address_are_not_host_names_nor_resolved_addresses(
        spelling: str) -> None:
    if spelling != "169.254.169.254.":
        with pytest.raises(ValueError):
            normalize_host(spelling)
    else:  # the trailing dot is the same address, and it is refused as one
        assert normalize_host(spelling) == "169.254.169.254"
    assert refused(check_addresses("metadata.internal", [spelling], allowed_private=ALLOWED))


def test_a_private_address_stays_allowed_for_a_host_listed_in_allow_private() -> None:
    for ip in ("10.0.0.5", "192.168.1.10", "127.0.0.1", "fd12:3456::1", "100.64.0.1"):
        assert check_addresses("metadata.internal", [ip], allowed_private=ALLOWED) is None, ip


link_local_v4 = st.integers(0, 0xFFFF).map(lambda n: ipaddress.IPv4Address(0xA9FE0000 + n))


def _wrapped(v4: ipaddress.IPv4Address, form: str) -> str:
    n = int(v4)
    return {"plain": str(v4), "mapped": f"::ffff:{v4}", "mapped-hex": f"::ffff:{n >> 16:x}:{n & 0xFFFF:x}",
            "nat64": f"64:ff9b::{v4}", "6to4": f"2002:{n >> 16:x}:{n & 0xFFFF:x}::1", "compatible": f"::{v4}"}[form]


@given(link_local_v4, st.sampled_from(["plain", "mapped", "mapped-hex", "nat64", "6to4", "compatible"]))
@settings(max_examples=300, deadline=None)
def test_no_spelling_of_a_link_local_ipv4_address_is_ever_allowed(v4: ipaddress.IPv4Address, form: str) -> None:
    assert refused(check_addresses("metadata.internal", [_wrapped(v4, form)], allowed_private=ALLOWED))


@given(st.integers(0, 2**118 - 1).map(lambda n: ipaddress.IPv6Address((0xFE80 << 112) | n)))
@settings(max_examples=200, deadline=None)
def test_no_ipv6_link_local_address_is_ever_allowed(ip: ipaddress.IPv6Address) -> None:
    assert refused(check_addresses("metadata.internal", [str(ip)], allowed_private=ALLOWED))
