"""What the proxy reads off the request line and its own headers: exact, or rejected with header_mismatch."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.proxy.contract import RefusalCode
from wakeful.proxy.rewrite import HeaderRejected
from wakeful.proxy.wire import (
    ANONYMOUS,
    Identity,
    IdentityChanged,
    Target,
    attempt_token,
    error_body,
    parse_connect_target,
    parse_proxy_authorization,
    parse_target,
    refusal_status,
    settle_identity,
)


def basic(text: str) -> str:
    return "Basic " + base64.b64encode(text.encode()).decode()


def test_no_proxy_authorization_is_anonymous() -> None:
    assert parse_proxy_authorization([]) == ANONYMOUS


def test_a_basic_proxy_authorization_names_the_user_and_carries_the_token() -> None:
    identity = parse_proxy_authorization([basic("usr_1:tok:with:colons")])
    assert identity == Identity(user_id="usr_1", token="tok:with:colons")
    assert "tok" not in repr(identity)


@pytest.mark.parametrize("values", [
    [basic("usr_1:a"), basic("usr_1:b")], ["Bearer abc"], ["Basic not-base64!"], [basic("no-colon")],
    [basic(":token")], [basic("user:")], [basic("user:tok\nen")], ["Basic " + base64.b64encode(b"\xff:\xfe").decode()],
    [basic("u:" + "t" * 300)],
])
def test_a_proxy_authorization_that_cannot_be_read_exactly_is_rejected(values: list[str]) -> None:
    with pytest.raises(HeaderRejected) as err:
        parse_proxy_authorization(values)
    assert err.value.code == RefusalCode.HEADER_MISMATCH


users = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=":"), min_size=1,
                max_size=40)
tokens = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=80)


@given(users, tokens, st.sampled_from(["Basic", "basic", "BASIC"]))
@settings(max_examples=200, deadline=None)
def test_every_basic_user_and_token_round_trips(user: str, token: str, scheme: str) -> None:
    value = f"{scheme} " + base64.b64encode(f"{user}:{token}".encode()).decode()
    assert parse_proxy_authorization([value]) == Identity(user_id=user, token=token)


@given(st.lists(st.text(max_size=40), min_size=1, max_size=2))
@settings(max_examples=300, deadline=None)
def test_proxy_authorization_either_reads_printable_values_or_rejects(values: list[str]) -> None:
    try:
        identity = parse_proxy_authorization(values)
    except HeaderRejected:
        return
    assert identity.user_id and identity.user_id.isprintable() and ":" not in identity.user_id
    assert identity.token and identity.token.isprintable()


def test_the_attempt_header_is_read_in_any_casing_and_twice_is_rejected() -> None:
    assert attempt_token([("x-WAKEFUL-attempt", " att_1 "), ("Accept", "*/*")]) == "att_1"
    assert attempt_token([("Accept", "*/*")]) is None
    with pytest.raises(HeaderRejected):
        attempt_token([("X-Wakeful-Attempt", "a"), ("x-wakeful-attempt", "a")])


@pytest.mark.parametrize(("target", "expected"), [
    ("http://Shop.Example:8080/a/b?x=1&y=2", Target(host="shop.example", port=8080, path="/a/b", query="x=1&y=2")),
    ("http://shop.example", Target(host="shop.example", port=80, path="/", query="")),
    ("http://shop.example?x", Target(host="shop.example", port=80, path="/", query="x")),
    ("HTTP://[2001:db8::1]:81/p", Target(host="2001:db8::1", port=81, path="/p", query="")),
])
def test_an_absolute_http_target_is_split_into_host_port_path_and_query(target: str, expected: Target) -> None:
    assert parse_target(target, in_tunnel=False) == expected


@pytest.mark.parametrize("target", [
    "/relative", "https://shop.example/", "ftp://shop.example/", "http://user:pw@shop.example/", "http://a b/",
    "http://shop.example:99999/", "http:///path", "http://shop.example/#frag", "*", "http://shöp.example/",
    "http://shop.example:80:80/",
])
def test_a_target_outside_a_tunnel_must_be_an_absolute_http_url(target: str) -> None:
    with pytest.raises(HeaderRejected):
        parse_target(target, in_tunnel=False)


def test_inside_a_tunnel_the_target_is_a_path_and_the_host_comes_from_the_tunnel() -> None:
    assert parse_target("/a?b=c?d", in_tunnel=True) == Target(host=None, port=None, path="/a", query="b=c?d")
    for bad in ("http://shop.example/", "*", "a/b"):
        with pytest.raises(HeaderRejected):
            parse_target(bad, in_tunnel=True)


@given(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=60), st.booleans())
@settings(max_examples=300, deadline=None)
def test_a_parsed_target_never_carries_a_query_or_fragment_in_its_path(target: str, in_tunnel: bool) -> None:
    try:
        parsed = parse_target(target, in_tunnel=in_tunnel)
    except HeaderRejected:
        return
    assert parsed.path.startswith("/") and "?" not in parsed.path and "#" not in parsed.path
    assert (parsed.host is None) == in_tunnel


def test_a_connect_target_needs_a_host_and_a_port() -> None:
    assert parse_connect_target("Merchant.Test:8443") == ("merchant.test", 8443)
    for bad in ("merchant.test", "merchant.test:0", "http://merchant.test:443", "[::1", ""):
        with pytest.raises(HeaderRejected):
            parse_connect_target(bad)


def test_refusals_are_403_and_failures_of_the_decider_or_upstream_are_gateway_errors() -> None:
    special = {RefusalCode.DECIDER_UNAVAILABLE: 502, RefusalCode.MALFORMED_VERDICT: 502,
               RefusalCode.REQUEST_TIMEOUT: 408, RefusalCode.TOO_MANY_CONNECTIONS: 503, RefusalCode.PROXY_BUSY: 503,
               RefusalCode.REQUEST_TOO_LARGE: 413, RefusalCode.TARGET_TOO_LONG: 414,
               RefusalCode.MALFORMED_REQUEST: 400}
    assert {code: refusal_status(code) for code in RefusalCode} == {code: special.get(code, 403)
                                                                    for code in RefusalCode}
    assert (refusal_status("upstream_timeout"), refusal_status("upstream_failed"),
            refusal_status("request_too_large")) == (504, 502, 413)
    assert error_body("not_admitted", "why") == b'{"error":{"code":"not_admitted","message":"why"}}'


def test_the_first_request_settles_a_connections_identity_and_later_ones_without_one_inherit_it() -> None:
    owner = Identity(user_id="usr_1", token="tok_1")
    assert settle_identity(None, owner) == owner
    assert settle_identity(None, ANONYMOUS) == ANONYMOUS
    assert settle_identity(owner, ANONYMOUS) == owner
    assert settle_identity(owner, Identity(user_id="usr_1", token="tok_1")) == owner
    assert settle_identity(ANONYMOUS, ANONYMOUS) == ANONYMOUS


@pytest.mark.parametrize("presented", [Identity(user_id="usr_2", token="tok_2"), Identity(user_id="usr_1", token="x")])
def test_a_later_request_naming_another_identity_is_refused(presented: Identity) -> None:
    with pytest.raises(IdentityChanged) as refused:
        settle_identity(Identity(user_id="usr_1", token="tok_1"), presented)
    assert refused.value.code == RefusalCode.HEADER_MISMATCH
    with pytest.raises(IdentityChanged):
        settle_identity(ANONYMOUS, presented)  # a connection that began anonymous cannot take an identity on later
