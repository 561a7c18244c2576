"""Reading a ClientHello's server name without I/O: real handshakes from the ssl module, hand-built hellos, and
hypothesis over malformed records (every answer is NEED_MORE, a ClientHello or MalformedHello; nothing else)."""

from __future__ import annotations

import ssl
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.proxy.sni import MAX_HELLO_BYTES, NEED_MORE, ClientHello, MalformedHello, client_hello_sni


def real_hello(server_name: str | None) -> bytes:
    """The bytes Python's own TLS client opens with."""
    context = ssl.create_default_context()
    context.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def hello_body(extensions: list[tuple[int, bytes]] | None) -> bytes:
    body = b"\x03\x03" + b"\x11" * 32 + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00"
    if extensions is not None:
        encoded = b"".join(struct.pack("!HH", kind, len(data)) + data for kind, data in extensions)
        body += struct.pack("!H", len(encoded)) + encoded
    return body


def records(body: bytes, sizes: list[int] | None = None) -> bytes:
    message = b"\x01" + len(body).to_bytes(3, "big") + body
    out, pos = b"", 0
    for size in sizes or [len(message)]:
        chunk = message[pos:pos + size]
        if chunk:
            out += b"\x16\x03\x01" + struct.pack("!H", len(chunk)) + chunk
        pos += size
    if pos < len(message):
        out += b"\x16\x03\x01" + struct.pack("!H", len(message) - pos) + message[pos:]
    return out


def server_name(*names: tuple[int, bytes]) -> tuple[int, bytes]:
    entries = b"".join(struct.pack("!BH", kind, len(name)) + name for kind, name in names)
    return 0, struct.pack("!H", len(entries)) + entries


def test_the_server_name_of_a_real_client_hello_is_read() -> None:
    assert client_hello_sni(real_hello("pinned.test")) == ClientHello(sni="pinned.test")


def test_a_client_hello_without_a_server_name_has_none() -> None:
    assert client_hello_sni(real_hello(None)) == ClientHello(sni=None)
    assert client_hello_sni(records(hello_body(None))) == ClientHello(sni=None)  # no extensions at all


def test_every_prefix_of_a_client_hello_needs_more() -> None:
    data = real_hello("pinned.test")
    assert all(client_hello_sni(data[:n]) is NEED_MORE for n in range(len(data)))


def test_bytes_after_the_client_hello_are_left_to_the_caller() -> None:
    assert client_hello_sni(real_hello("pinned.test") + b"\x17\x03\x03junk") == ClientHello(sni="pinned.test")


@given(st.lists(st.integers(1, 64), min_size=1, max_size=20))
@settings(max_examples=200, deadline=None)
def test_a_client_hello_split_across_records_is_read_whole(sizes: list[int]) -> None:
    body = hello_body([(10, b"\x00\x02\x00\x1d"), server_name((0, b"pinned.test"))])
    assert client_hello_sni(records(body, sizes)) == ClientHello(sni="pinned.test")


@pytest.mark.parametrize(("extensions", "why"), [
    ([server_name((0, b"a.test"), (0, b"b.test"))], "two host names"),
    ([server_name((0, b"a.test")), server_name((0, b"b.test"))], "server_name twice"),
    ([server_name((0, b""))], "an empty name"),
    ([server_name((0, b"a.test\x00evil.test"))], "a NUL in the name"),
    ([server_name((1, b"a.test"))], "no host_name"),
    ([(0, b"\x00\x0a\x00\x00\x06a.test")], "a list longer than the extension"),
    ([(0, b"\x00\x09\x00\x00\x06a.test\x00\x00\x00")], "bytes after the list"),
])
def test_a_server_name_extension_that_can_be_read_two_ways_is_malformed(
        extensions: list[tuple[int, bytes]], why: str) -> None:
    with pytest.raises(MalformedHello):
        client_hello_sni(records(hello_body(extensions)))


@pytest.mark.parametrize("data", [
    b"GET / HTTP/1.1\r\nHost: pinned.test\r\n\r\n",          # not TLS at all
    b"\x17\x03\x03\x00\x05hello",                             # application data first
    b"\x16\x03\x01\x00\x00",                                  # an empty record
    b"\x16\x03\x01\x40\x01" + b"\x00" * 16385,                # a record over 2^14
    b"\x16\x03\x01\x00\x04\x02\x00\x00\x00",                  # a ServerHello
    b"\x16\x02\x00\x00\x04\x01\x00\x00\x00",                  # SSL 2 framing
    records(hello_body(None) + b"\x00"),                       # a byte where the extensions' length would be
])
def test_bytes_that_are_not_a_client_hello_are_malformed(data: bytes) -> None:
    with pytest.raises(MalformedHello):
        client_hello_sni(data)


def test_a_client_hello_over_the_size_limit_is_malformed_before_it_is_all_read() -> None:
    header = b"\x16\x03\x01\x00\x04\x01" + (MAX_HELLO_BYTES).to_bytes(3, "big")
    with pytest.raises(MalformedHello):
        client_hello_sni(header)


@given(st.binary(max_size=600))
@settings(max_examples=1000, deadline=None)
def test_random_bytes_are_need_more_a_hello_or_malformed_never_a_crash(data: bytes) -> None:
    try:
        result = client_hello_sni(data)
    except MalformedHello:
        return
    assert result is NEED_MORE or isinstance(result, ClientHello)


HELLO = real_hello("pinned.test")


@given(st.lists(st.tuples(st.integers(0, len(HELLO) - 1), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, len(HELLO)))
@settings(max_examples=2000, deadline=None)
def test_a_mutated_or_truncated_real_hello_never_crashes_and_never_names_a_host_it_does_not_hold(
        flips: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(HELLO)
    for index, value in flips:
        data[index] = value
    try:
        result = client_hello_sni(bytes(data[:cut]))
    except MalformedHello:
        return
    if isinstance(result, ClientHello) and result.sni is not None:
        assert result.sni.encode("ascii") in data


@given(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=80),
       st.lists(st.tuples(st.integers(1, 65535), st.binary(max_size=40)), max_size=5, unique_by=lambda e: e[0]))
@settings(max_examples=300, deadline=None)
def test_the_name_read_is_the_name_sent_among_any_other_extensions(name: str,
                                                                   others: list[tuple[int, bytes]]) -> None:
    body = hello_body([*others, server_name((0, name.encode()))])
    assert client_hello_sni(records(body)) == ClientHello(sni=name)
