"""`EgressRequest`, the one shape of an outbound request: built from a URL, stored, granted, compared with what the
proxy saw."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wakeful.proxy.contract import ContractError, DecisionRequest, EgressRequest

BODY = b'{"quantity":1}'
BUY = EgressRequest.of("post", "https://Shop.Example.com/v1/buy?x=1", headers=(("content-type", "application/json"),),
                       body=BODY)


def seen_by_proxy(request: EgressRequest, **changes: object) -> DecisionRequest:
    fields = {"method": request.method, "scheme": request.scheme, "host": request.host, "port": request.port,
              "path": request.path, "query": request.query, "body_sha256": request.body_sha256, **changes}
    return DecisionRequest(request_id="req_1", user_id=None, attempt_token="tok", client_token=None,
                           resolved_ips=(), client="connector", **fields)  # type: ignore[arg-type]


def test_a_request_built_from_a_url_is_normalised_and_digests_its_body() -> None:
    assert (BUY.method, BUY.scheme, BUY.host, BUY.port, BUY.path, BUY.query) == (
        "POST", "https", "shop.example.com", 443, "/v1/buy", "x=1")
    assert BUY.body_sha256 == hashlib.sha256(BODY).hexdigest() and BUY.url == "https://shop.example.com/v1/buy?x=1"


def test_the_stored_form_reads_back_as_the_same_request() -> None:
    assert EgressRequest.from_json(BUY.to_json()) == BUY
    # The form actions were stored in before the type existed (a url as written, headers as a dict) reads back too.
    old = {"method": "POST", "url": "https://shop.example.com:443/v1/buy?x=1",
           "headers": {"content-type": "application/json"}, "body": BODY.decode(),
           "body_sha256": hashlib.sha256(BODY).hexdigest()}
    assert EgressRequest.from_json(old) == BUY


def test_what_the_proxy_saw_matches_the_granted_request_part_by_part() -> None:
    assert BUY.differs(seen_by_proxy(BUY).request) is None
    for changes, part in [({"method": "PUT"}, "method"), ({"scheme": "http", "port": 80}, "scheme"),
                          ({"host": "evil.example"}, "host"), ({"port": 8443}, "port"),
                          ({"path": "/v1/admin"}, "path"), ({"query": "x=2"}, "query"),
                          ({"body_sha256": hashlib.sha256(b"{}").hexdigest()}, "body")]:
        assert BUY.differs(seen_by_proxy(BUY, **changes).request) == part


@pytest.mark.parametrize("url", ["ftp://shop.example.com/x", "https:///nohost", "https://user@shop.example.com/",
                                 "https://shop.example.com:99999/"])
def test_anything_but_an_http_url_without_userinfo_is_refused(url: str) -> None:
    with pytest.raises(ContractError):
        EgressRequest.of("GET", url)


def test_a_body_that_does_not_match_its_digest_is_refused() -> None:
    with pytest.raises(ContractError, match="digest of the body"):
        dataclasses.replace(BUY, body=b"{}")


segment = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~%", min_size=1, max_size=12)


@given(host=st.sampled_from(["shop.example.com", "127.0.0.1", "[2001:db8::1]", "Merchant.Test"]),
       port=st.none() | st.integers(1, 65535), scheme=st.sampled_from(["http", "https"]),
       path=st.lists(segment, max_size=4), query=st.none() | segment, body=st.none() | st.binary(max_size=64))
def test_a_request_rebuilt_from_its_own_url_is_the_same_request(host: str, port: int | None, scheme: str,
                                                               path: list[str], query: str | None,
                                                               body: bytes | None) -> None:
    authority = host if port is None else f"{host}:{port}"
    url = f"{scheme}://{authority}/{'/'.join(path)}" + ("" if query is None else f"?{query}")
    request = EgressRequest.of("GET", url, body=body)
    assert EgressRequest.of("GET", request.url, body=body) == request
    assert request.differs(seen_by_proxy(request).request) is None
