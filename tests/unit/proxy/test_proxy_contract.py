"""The decision contract: valid values round-trip; every malformed verdict fails closed to `malformed_verdict`."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.proxy.contract import (
    REASONS,
    Allow,
    ContractError,
    DecisionRequest,
    ProxyRefusal,
    RefusalCode,
    Refuse,
    encode_request,
    encode_verdict,
    parse_request,
    parse_verdict,
)

EMPTY_SHA = hashlib.sha256(b"").hexdigest()
REQ = DecisionRequest(request_id="req_1", user_id="usr_1", attempt_token="att_tok", client_token=None,
                      method="POST", scheme="https",
                      host="api.example.com", port=443, path="/v1/cancel", query="a=1", body_sha256=EMPTY_SHA,
                      resolved_ips=("93.184.216.34", "2606:2800:220:1::1"), client="connector")
ALLOW = Allow(credential="merchant_api", rule="action act_1", attempt_id="att_1", action_id="act_1")
MALFORMED = Refuse(code=RefusalCode.MALFORMED_VERDICT, reason=REASONS[RefusalCode.MALFORMED_VERDICT])


def allow_json(**changes: object) -> bytes:
    obj: dict[str, object] = {"v": 1, "request_id": "req_1", "verdict": "allow", "credential": "merchant_api",
                              "rule": "r", "attempt_id": "att_1", "action_id": "act_1"}
    obj.update(changes)
    return json.dumps({k: v for k, v in obj.items() if v is not ...}).encode()


def test_a_decision_request_round_trips_through_its_wire_form() -> None:
    assert parse_request(encode_request(REQ)) == REQ


def test_a_client_token_round_trips_and_is_a_required_key_on_the_wire() -> None:
    with_token = dataclasses.replace(REQ, client="tool_computer", attempt_token=None, client_token="tok_9")
    assert parse_request(encode_request(with_token)).client_token == "tok_9"
    without_key = json.loads(encode_request(with_token))
    del without_key["client_token"]
    with pytest.raises(ContractError):
        parse_request(json.dumps(without_key).encode())


def test_an_allow_and_a_refusal_round_trip_through_their_wire_form() -> None:
    refusal = Refuse(code=RefusalCode.CONTENT_MISMATCH, reason="the body differs")
    assert parse_verdict(encode_verdict(ALLOW, request_id="req_1"), request_id="req_1") == ALLOW
    assert parse_verdict(encode_verdict(refusal, request_id="req_1")) == refusal


def test_every_refusal_code_has_a_stable_value_and_a_reason() -> None:
    assert {c.value for c in RefusalCode} == {
        "not_admitted", "host_not_allowed", "decider_unavailable", "address_not_allowed", "content_mismatch",
        "method_not_allowed", "header_mismatch", "plaintext_credential", "malformed_verdict",
        "credential_unavailable", "misplaced_credential", "ambiguous_path", "request_timeout",
        "too_many_connections", "proxy_busy", "request_too_large", "target_too_long", "malformed_request"}
    assert set(REASONS) == set(RefusalCode)


def test_a_proxy_refusal_carries_its_code_and_becomes_a_refuse() -> None:
    err = ProxyRefusal(RefusalCode.NOT_ADMITTED)
    assert err.refuse() == Refuse(code=RefusalCode.NOT_ADMITTED, reason=REASONS[RefusalCode.NOT_ADMITTED])


@pytest.mark.parametrize("raw", [
    b"", b"null", b"[]", b"{}", b"garbage", b"\xff\xfe", b'"allow"',
    allow_json(v=2), allow_json(v=True), allow_json(v=1.0), allow_json(verdict="ALLOW"), allow_json(verdict=None),
    allow_json(rule=""), allow_json(rule=7), allow_json(rule="two\nlines"), allow_json(credential="Bad Name!"),
    allow_json(credential=1), allow_json(attempt_id=5), allow_json(extra="x"), allow_json(action_id=...),
    allow_json(request_id=None),
    b'{"v":1,"request_id":"r","verdict":"refuse","code":"no_such_code","reason":"x"}',
    b'{"v":1,"request_id":"r","verdict":"refuse","code":"not_admitted","reason":""}',
    b'{"v":1,"request_id":"r","verdict":"refuse","code":"not_admitted"}',
    b'{"v":1,"request_id":"r","verdict":"refuse","code":"not_admitted","reason":"x","verdict":"allow"}',
    b'{"v":1,"request_id":"r","verdict":"allow","credential":null,"rule":"r","attempt_id":null,"action_id":NaN}',
    b"[" * 30_000 + b"]" * 30_000,
])
def test_a_malformed_verdict_is_a_malformed_verdict_refusal(raw: bytes) -> None:
    assert parse_verdict(raw) == MALFORMED


def test_a_duplicated_verdict_key_is_malformed_even_when_both_say_allow() -> None:
    raw = (b'{"v":1,"request_id":"r","verdict":"allow","verdict":"allow","credential":null,"rule":"r",'
           b'"attempt_id":null,"action_id":null}')
    assert parse_verdict(raw) == MALFORMED


def test_a_verdict_answering_another_request_is_malformed() -> None:
    assert parse_verdict(encode_verdict(ALLOW, request_id="req_2"), request_id="req_1") == MALFORMED


def test_parse_verdict_does_not_raise_on_values_that_are_not_bytes() -> None:
    assert parse_verdict("{}") == MALFORMED  # type: ignore[arg-type]
    assert parse_verdict(None) == MALFORMED  # type: ignore[arg-type]


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_parse_verdict_never_returns_allow_for_random_bytes(raw: bytes) -> None:
    assert isinstance(parse_verdict(raw), Refuse)


@given(st.dictionaries(st.sampled_from(["v", "request_id", "verdict", "credential", "rule", "attempt_id",
                                        "action_id", "code", "reason", "x"]),
                       st.none() | st.booleans() | st.integers(-2, 2) | st.text(max_size=8) | st.just("allow")))
@settings(max_examples=300, deadline=None)
def test_parse_verdict_allows_only_objects_with_exactly_the_allow_fields(obj: dict[str, object]) -> None:
    verdict = parse_verdict(json.dumps(obj).encode())
    if isinstance(verdict, Allow):
        assert set(obj) == {"v", "request_id", "verdict", "credential", "rule", "attempt_id", "action_id"}
        assert obj["verdict"] == "allow" and obj["v"] == 1 and isinstance(obj["rule"], str) and obj["rule"]


@pytest.mark.parametrize("change", [
    {"method": "get"}, {"method": "GE T"}, {"scheme": "ftp"}, {"host": "API.example.com"}, {"host": "a b"},
    {"port": 0}, {"port": 70000}, {"port": True}, {"path": "v1"}, {"path": "/a?b"}, {"body_sha256": "abc"},
    {"resolved_ips": ("not-an-ip",)}, {"resolved_ips": ["1.1.1.1"]}, {"client": "browser"}, {"request_id": ""},
    {"attempt_token": "a\r\nb"}, {"client_token": "t\x00k"}, {"client_token": "x" * 257}, {"client_token": 5},
])
def test_a_decision_request_that_breaks_the_contract_is_refused_on_construction(change: dict[str, object]) -> None:
    with pytest.raises(ContractError):
        dataclasses.replace(REQ, **change)  # type: ignore[arg-type]


def test_a_tunnel_request_has_an_empty_path() -> None:
    assert dataclasses.replace(REQ, method="CONNECT", path="").path == ""


@pytest.mark.parametrize("raw", [b"{}", b"nope", encode_request(REQ).replace(b'"port":443', b'"port":"443"'),
                                 encode_request(REQ).replace(b'"v":1', b'"v":2'),
                                 encode_request(REQ).replace(b'"client":"connector"', b'"client":"x"'),
                                 encode_request(REQ).replace(b'"path":"/v1/cancel"', b'"path":5'),
                                 encode_request(REQ).replace(b'"user_id":"usr_1"', b'"user_id":["usr_1"]')])
def test_a_malformed_decision_request_raises_a_contract_error(raw: bytes) -> None:
    with pytest.raises(ContractError):
        parse_request(raw)
