"""A credential goes only where its declaration puts it: its declared header (`wakeful secret set --header`,
`Authorization` by default). A `{{credential:NAME}}` placeholder anywhere else is refused, never filled: a page
that echoes request headers (User-Agent, Referer, X-Anything) would otherwise hand the secret back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.proxy.contract import RefusalCode
from wakeful.proxy.credential import Credential, SecretBytes
from wakeful.proxy.rewrite import InjectionRefused, inject

SECRET = b"sk_live_canary_7d1f0c"
BEARER = Credential(name="merchant_api", host="api.merchant.com", header="Authorization",
                    template="Bearer {secret}", secret=SecretBytes(SECRET))
KEYED = Credential(name="merchant_key", host="api.merchant.com", header="X-Merchant-Key", template="{secret}",
                   secret=SecretBytes(SECRET))


@pytest.mark.parametrize("name", ["User-Agent", "Referer", "X-Debug", "Accept", "X-Forwarded-For", "Cookie"])
def test_a_placeholder_in_a_header_its_credential_does_not_declare_is_refused(name: str) -> None:
    with pytest.raises(InjectionRefused) as err:
        inject([(name, "{{credential:merchant_api}}")], BEARER, scheme="https", host="api.merchant.com")
    assert err.value.code == RefusalCode.MISPLACED_CREDENTIAL and SECRET.decode() not in err.value.reason


def test_a_placeholder_in_the_declared_header_is_filled_where_it_stands() -> None:
    out = inject([("x_merchant_KEY", "key={{credential:merchant_key}};v=2")], KEYED, scheme="https",
                 host="api.merchant.com")
    assert out == [("x_merchant_KEY", f"key={SECRET.decode()};v=2")]


def test_without_a_placeholder_the_declared_header_gets_the_template() -> None:
    out = inject([("User-Agent", "ua")], KEYED, scheme="https", host="api.merchant.com")
    assert out == [("User-Agent", "ua"), ("X-Merchant-Key", SECRET.decode())]


@given(st.lists(st.tuples(st.sampled_from(["Accept", "User-Agent", "X-Merchant-Key", "X-Echo", "Referer"]),
                          st.sampled_from(["x", "{{credential:merchant_key}}", "a {{credential:merchant_key}} b"])),
                max_size=5))
@settings(max_examples=300, deadline=None)
def test_the_secret_only_ever_lands_in_the_declared_header(headers: list[tuple[str, str]]) -> None:
    try:
        out = inject(headers, KEYED, scheme="https", host="api.merchant.com")
    except InjectionRefused as err:
        assert err.code == RefusalCode.MISPLACED_CREDENTIAL
        assert any("{{" in v for n, v in headers if n != "X-Merchant-Key")
        return
    assert all(SECRET.decode() not in value for name, value in out if name.lower() != "x-merchant-key")
    assert any(SECRET.decode() in value for name, value in out if name.lower() == "x-merchant-key")
