"""Rewriting: every client-sent credential goes, and the real one goes in only over HTTPS to its own host."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.proxy.contract import RefusalCode
from wakeful.proxy.credential import Credential, SecretBytes
from wakeful.proxy.rewrite import (
    CREDENTIAL_HEADERS,
    HeaderRejected,
    InjectionRefused,
    inject,
    refuse_placeholders,
    strip_credentials,
)

SECRET = b"sk_live_canary_7d1f0c"
CRED = Credential(name="merchant_api", host="api.merchant.com", header="Authorization", template="Bearer {secret}",
                  secret=SecretBytes(SECRET))


def names(headers: list[tuple[str, str]]) -> list[str]:
    return [n.lower() for n, _ in headers]


# --- strip -------------------------------------------------------------------------------------------------------

def test_every_client_sent_credential_header_is_stripped_in_any_casing_and_every_duplicate() -> None:
    headers = [("Host", "api.merchant.com"), ("AUTHORIZATION", "Bearer a"), ("authorization", "Bearer b"),
               ("Proxy-Authorization", "Basic x"), ("x-API-key", "k"), ("Api-Key", "k"), ("X-Auth-Token", "t"),
               ("X-Wakeful-Attempt", "att"), ("Accept", "*/*")]
    assert strip_credentials(headers, bound_host=False) == [("Host", "api.merchant.com"), ("Accept", "*/*")]


def test_cookies_are_stripped_only_for_a_host_with_a_bound_credential() -> None:
    headers = [("Cookie", "session=1"), ("COOKIE", "b=2")]
    assert strip_credentials(headers, bound_host=False) == headers
    assert strip_credentials(headers, bound_host=True) == []


def test_hop_by_hop_headers_and_those_connection_names_are_stripped_but_never_host_or_framing() -> None:
    headers = [("Host", "h.com"), ("Connection", "keep-alive, X-Secret-Thing, Host, Content-Length"),
               ("Keep-Alive", "5"), ("TE", "trailers"), ("Upgrade", "h2c"), ("Proxy-Connection", "keep-alive"),
               ("Transfer-Encoding", "chunked"), ("X-Secret-Thing", "1"), ("Content-Length", "3")]
    assert strip_credentials(headers, bound_host=False) == [("Host", "h.com"), ("Content-Length", "3")]


def test_an_obs_fold_continuation_of_a_credential_header_is_stripped_with_it() -> None:
    headers = [("Authorization", "Bearer"), (" ", "secret-part"), ("\tX-Api-Key", " smuggled"), ("Accept", "a"),
               ("", "b")]
    assert strip_credentials(headers, bound_host=False) == [("Accept", "a b")]


@pytest.mark.parametrize("headers", [
    [("X-Foo", "a\r\nAuthorization: Bearer x")], [("X-Foo", "a\nb")], [("X-Foo", "a\x00b")],
    [("Authorization ", "Bearer x")], [("Auth\rorization", "x")], [("X Foo", "x")], [("Authorızation", "x")],
    [(" ", "continuation first")], [("X-Foo", "a"), ("", "b\r\nc")],
])
def test_a_header_that_could_smuggle_is_rejected_with_header_mismatch(headers: list[tuple[str, str]]) -> None:
    with pytest.raises(HeaderRejected) as err:
        strip_credentials(headers, bound_host=False)
    assert err.value.code == RefusalCode.HEADER_MISMATCH


credential_names = st.sampled_from(sorted(CREDENTIAL_HEADERS | {"x-wakeful-attempt", "cookie"})).flatmap(
    lambda n: st.tuples(*[st.sampled_from([c.lower(), c.upper()]) for c in n]).map("".join))
header_names = st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,12}", fullmatch=True) | credential_names
values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)
continuations = st.tuples(st.sampled_from(["", " ", "\t"]), values)


@given(st.lists(st.one_of(st.tuples(header_names, values), continuations), max_size=12).filter(
    lambda hs: not hs or hs[0][0] not in ("", " ", "\t")))
@settings(max_examples=300, deadline=None)
def test_strip_credentials_leaves_no_credential_header_in_any_casing(headers: list[tuple[str, str]]) -> None:
    out = strip_credentials(headers, bound_host=True)
    assert not set(names(out)) & (CREDENTIAL_HEADERS | {"x-wakeful-attempt", "cookie"})
    assert all(n and n[0] not in " \t" for n, _ in out)


# --- inject ------------------------------------------------------------------------------------------------------

def test_the_configured_header_is_set_replacing_any_existing_one() -> None:
    out = inject([("Accept", "a"), ("authorization", "old")], CRED, scheme="https", host="API.merchant.com.")
    assert out == [("Accept", "a"), ("Authorization", "Bearer " + SECRET.decode())]


def test_a_placeholder_in_the_declared_header_is_replaced_by_the_secret_where_it_stands() -> None:
    out = inject([("Authorization", "key={{credential:merchant_api}};v=2")], CRED, scheme="https",
                 host="api.merchant.com")
    assert out == [("Authorization", f"key={SECRET.decode()};v=2")]


def test_a_placeholder_naming_another_credential_is_refused() -> None:
    with pytest.raises(InjectionRefused) as err:
        inject([("X-A", "{{credential:other}}")], CRED, scheme="https", host="api.merchant.com")
    assert err.value.code == RefusalCode.CREDENTIAL_UNAVAILABLE


def test_a_placeholder_in_a_request_allowed_without_a_credential_is_refused_not_forwarded_as_written() -> None:
    refuse_placeholders([("Accept", "a"), ("X-Note", "{credential:x} is not one")])  # nothing asked for
    with pytest.raises(InjectionRefused) as err:
        refuse_placeholders([("Accept", "a"), ("X-Merchant-Auth", "key={{credential:merchant_api}}")])
    assert err.value.code == RefusalCode.CREDENTIAL_UNAVAILABLE


def test_a_placeholder_in_the_host_header_is_rejected() -> None:
    with pytest.raises(HeaderRejected):
        inject([("Host", "{{credential:merchant_api}}")], CRED, scheme="https", host="api.merchant.com")


def test_a_credential_is_never_sent_over_plaintext_http() -> None:
    with pytest.raises(InjectionRefused) as err:
        inject([], CRED, scheme="http", host="api.merchant.com")
    assert err.value.code == RefusalCode.PLAINTEXT_CREDENTIAL


@pytest.mark.parametrize("host", ["evil.com", "api.merchant.com.evil.com", "evil.api.merchant.com", "merchant.com",
                                  "93.184.216.34", "api.merchant.com:443", ""])
def test_a_credential_is_never_sent_to_another_host(host: str) -> None:
    with pytest.raises(InjectionRefused) as err:
        inject([], CRED, scheme="https", host=host)
    assert err.value.code == RefusalCode.HOST_NOT_ALLOWED


def test_inject_rejects_smuggling_headers_too() -> None:
    with pytest.raises(HeaderRejected):
        inject([("X-A", "b\r\nHost: evil.com")], CRED, scheme="https", host="api.merchant.com")


def test_a_credential_and_its_secret_never_show_in_repr_or_str() -> None:
    for shown in (repr(CRED), str(CRED), repr(CRED.secret), str(CRED.secret), f"{CRED.secret}"):
        assert SECRET.decode() not in shown
    assert "<secret>" in repr(CRED.secret)


@pytest.mark.parametrize(("field", "value"), [
    ("secret", SecretBytes(b"abc\r\nX-Evil: 1")), ("secret", SecretBytes(b"")), ("secret", SecretBytes(b"\xff")),
    ("header", "Host"), ("header", "Content-Length"), ("header", "Bad Header"), ("template", "Bearer"),
    ("template", "{secret}{secret}"), ("template", "Bearer {secret}\r\n"), ("host", "API.merchant.com"),
    ("host", "1.2.3.4"), ("name", "Merchant API"),
])
def test_a_credential_that_could_break_a_request_cannot_be_built(field: str, value: object) -> None:
    fields: dict[str, object] = {"name": CRED.name, "host": CRED.host, "header": CRED.header,
                                 "template": CRED.template, "secret": CRED.secret, field: value}
    with pytest.raises(ValueError):
        Credential(**fields)  # type: ignore[arg-type]


hostnames = st.sampled_from(["api.merchant.com", "API.Merchant.com.", "merchant.com", "evil.com", "a.b.c"]) | \
    st.from_regex(r"[a-z]{1,8}\.[a-z]{2,4}", fullmatch=True)
secrets_ = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=16, max_size=32).map(
    lambda s: f"canary-{s}")


@given(hostnames, hostnames, st.sampled_from(["https", "http", "HTTPS", "ftp"]), secrets_,
       st.lists(st.tuples(st.sampled_from(["Accept", "X-Merchant-Auth", "authorization"]),
                          st.sampled_from(["x", "{{credential:merchant_api}}", "{{credential:other}}"])), max_size=4))
@settings(max_examples=300, deadline=None)
def test_the_injected_credentials_host_equals_the_requests_host(
        cred_host: str, req_host: str, scheme: str, secret: str, headers: list[tuple[str, str]]) -> None:
    cred = Credential(name="merchant_api", host=cred_host.lower().rstrip("."), header="Authorization",
                      template="Bearer {secret}", secret=SecretBytes(secret.encode()))
    try:
        out = inject(headers, cred, scheme=scheme, host=req_host)
    except (InjectionRefused, HeaderRejected):
        return
    assert req_host.lower().rstrip(".") == cred.host and scheme.lower() == "https"
    assert any(secret in v for _, v in out)


def test_a_secret_cannot_be_pickled_or_hashed() -> None:
    with pytest.raises(TypeError):
        pickle.dumps(CRED.secret)
    with pytest.raises(TypeError):
        hash(CRED.secret)
