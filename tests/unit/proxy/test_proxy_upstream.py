"""The bytes the proxy writes upstream, and the upstream headers it passes back."""

from __future__ import annotations

import pytest

from wakeful.proxy.hosts import is_ip
from wakeful.proxy.upstream import response_headers, serialize_request


def test_a_request_is_written_as_http11_with_its_headers_in_order_and_its_body() -> None:
    data = serialize_request(b"POST", b"/v1/x?a=1", [(b"host", b"merchant.test"), (b"X-A", b"1 2"),
                                                      (b"content-length", b"2")], b"hi")
    assert data == b"POST /v1/x?a=1 HTTP/1.1\r\nhost: merchant.test\r\nX-A: 1 2\r\ncontent-length: 2\r\n\r\nhi"


@pytest.mark.parametrize(("method", "target", "headers"), [
    (b"GET", b"/a b", []),
    (b"GE T", b"/", []),
    (b"GET", b"/", [(b"X-A", b" leading")]),
    (b"GET", b"/", [(b"X-A", b"trailing ")]),
    (b"GET", b"/", [(b"X-A", b"a\r\nX-Smuggled: 1")]),
    (b"GET", b"/", [(b"X-A", b"a\nb")]),
    (b"GET", b"/", [(b"X-A", b"a\x00b")]),
    (b"GET", b"/", [(b"Bad Name", b"x")]),
    (b"GET", b"/", [(b"", b"x")]),
])
def test_a_request_that_cannot_be_written_as_it_is_raises_without_quoting_it(
        method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(ValueError) as raised:
        serialize_request(method, target, headers, b"")
    assert all(value.decode("latin-1") not in str(raised.value) for _, value in headers if value.strip())


def test_upstream_hop_by_hop_headers_those_connection_names_and_a_forged_refusal_are_dropped() -> None:
    kept = response_headers([(b"Content-Type", b"text/plain"), (b"Connection", b"close, X-Hop"), (b"x-hop", b"1"),
                             (b"Transfer-Encoding", b"chunked"), (b"Keep-Alive", b"timeout=1"), (b"TE", b"trailers"),
                             (b"Trailer", b"X-T"), (b"Upgrade", b"h2c"), (b"Proxy-Authenticate", b"Basic"),
                             (b"X-Wakeful-Refusal", b"not_admitted"), (b"Content-Length", b"3")])
    assert kept == [(b"Content-Type", b"text/plain"), (b"Content-Length", b"3")]


@pytest.mark.parametrize(("host", "ip"), [("1.2.3.4", True), ("::1", True), ("fe80::1", True), ("merchant.test", False),
                                          ("123", False), ("1.2.3", False), ("1.2.3.4.5", False), ("abc", False)])
def test_is_ip_tells_literals_from_names(host: str, ip: bool) -> None:
    assert is_ip(host) is ip
