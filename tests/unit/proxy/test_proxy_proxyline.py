"""The PROXY line a relayed connection begins with: what the api's host tunnel writes, the proxy reads strictly;
and the relay socket it is read on, which needs the address book."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from wakeful.proxy.config import ProxyConfig
from wakeful.proxy.proxyline import MAX_LINE, MalformedProxyLine, ProxyLine, format_proxy_line, parse_proxy_line
from wakeful.proxy.vault import KeyRing, Vault, generate_key


def test_a_tcp4_line_names_the_source_and_destination() -> None:
    line = parse_proxy_line(b"PROXY TCP4 10.77.0.23 10.77.0.1 40112 3128\r\n")
    assert line == ProxyLine(source="10.77.0.23", source_port=40112, destination="10.77.0.1", destination_port=3128)


def test_what_the_tunnel_writes_the_proxy_reads_back() -> None:
    line = ProxyLine(source="255.255.255.255", source_port=65535, destination="255.255.255.255",
                     destination_port=65535)
    written = format_proxy_line(line)
    assert len(written) == 56 < MAX_LINE == 107  # the longest TCP4 line; 107 is the protocol's bound (TCP6)
    assert parse_proxy_line(written) == line


@pytest.mark.parametrize("raw", [
    b"",
    b"PROXY TCP4 10.77.0.23 10.77.0.1 40112 3128\n",  # LF alone
    b"PROXY TCP4 10.77.0.23 10.77.0.1 40112 3128",  # no line end
    b"PROXY TCP4 10.77.0.23 10.77.0.1 40112 3128\r\nGET",  # more than the line
    b"proxy TCP4 10.77.0.23 10.77.0.1 40112 3128\r\n",
    b"PROXY TCP4  10.77.0.23 10.77.0.1 40112 3128\r\n",  # two spaces
    b"PROXY TCP4 10.77.0.23 10.77.0.1 40112\r\n",
    b"PROXY TCP4 10.77.0.23 10.77.0.1 40112 3128 9\r\n",
    b"PROXY TCP4 10.77.0.023 10.77.0.1 40112 3128\r\n",  # not the usual form
    b"PROXY TCP4 10.77.0.256 10.77.0.1 40112 3128\r\n",
    b"PROXY TCP4 ten.77.0.1 10.77.0.1 40112 3128\r\n",
    b"PROXY TCP4 10.77.0.23 10.77.0.1 040112 3128\r\n",
    b"PROXY TCP4 10.77.0.23 10.77.0.1 65536 3128\r\n",
    b"PROXY TCP4 10.77.0.23 10.77.0.1 -1 3128\r\n",
    b"PROXY TCP4 10.77.0.23 10.77.0.1 +1 3128\r\n",
    b"PROXY TCP4 10.77.0.23 10.77.0.1 \xd9\xa1 3128\r\n",  # a digit, but not an ASCII one
    b"PROXY TCP4 ::ffff:10.77.0.23 10.77.0.1 40112 3128\r\n",
    b"PROXY TCP6 fd00::23 fd00::1 40112 3128\r\n",  # the address book is IPv4
    b"PROXY UNKNOWN\r\n",  # a connection that names no source would be nobody's
    b"PROXY UNKNOWN 10.77.0.23 10.77.0.1 40112 3128\r\n",
    b"\r\n\r\n\x00\r\nQUIT\n\x21\x11\x00\x0c",  # version 2's binary header
    b"PROXY TCP4 10.77.0.23 10.77.0.1 40112 3128\r\n".replace(b" ", b"\t"),
])
def test_anything_but_one_strict_tcp4_line_is_refused(raw: bytes) -> None:
    with pytest.raises(MalformedProxyLine):
        parse_proxy_line(raw)


def test_a_line_longer_than_the_protocol_allows_is_refused_without_being_quoted() -> None:
    raw = b"PROXY TCP4 10.77.0.23 10.77.0.1 40112 3128" + b"0" * 200 + b"\r\n"
    with pytest.raises(MalformedProxyLine) as caught:
        parse_proxy_line(raw)
    assert "longer" in str(caught.value) and "3128" not in str(caught.value)


def test_the_tunnel_cannot_write_a_line_for_an_address_that_is_not_ipv4() -> None:
    with pytest.raises(ValueError):
        format_proxy_line(ProxyLine(source="fd00::23", source_port=1, destination="10.77.0.1", destination_port=2))


def test_the_relay_socket_needs_the_address_book(tmp_path: Path) -> None:
    keys = KeyRing(current=generate_key())
    base: dict[str, Any] = {"decider_socket": tmp_path / "d.sock", "decider_token": "t", "ca_dir": tmp_path,
                            "keys": keys, "vault": Vault(tmp_path / "vault.json", keys)}
    with pytest.raises(ValueError, match="relay_socket needs address_book"):
        ProxyConfig(**base, relay_socket=tmp_path / "relay.sock")
    config = ProxyConfig(**base, address_listen=("10.77.0.1", 3128), address_book=tmp_path / "address-book.json",
                         relay_socket=tmp_path / "relay.sock")
    assert config.relay_socket == tmp_path / "relay.sock"
