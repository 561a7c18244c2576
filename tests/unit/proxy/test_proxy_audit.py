"""Egress records: strict both ways, and with no place for headers, bodies, queries or tokens."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.proxy.audit import EgressRecord, encode_record, parse_record
from wakeful.proxy.contract import ContractError, RefusalCode

RECORD = EgressRecord(request_id="egr_1", at=datetime(2030, 1, 1, 12, 0, tzinfo=UTC), user_id="usr_1",
                      client="connector", attempt_id="att_1", action_id="act_1", method="POST", scheme="https",
                      host="api.merchant.com", port=443, path="/v1/cancel", verdict="allow", code=None,
                      rule="action act_1", credential="merchant_api", bytes_up=12, bytes_down=340,
                      upstream_status=200, latency_ms=3.5)
REFUSED = dataclasses.replace(RECORD, verdict="refuse", code=RefusalCode.CONTENT_MISMATCH, rule="the body differs",
                              credential=None, bytes_up=0, bytes_down=0, upstream_status=None)


def test_a_record_round_trips_through_its_wire_form() -> None:
    assert parse_record(encode_record(RECORD)) == RECORD
    assert parse_record(encode_record(REFUSED)) == REFUSED


def test_a_record_has_exactly_the_audit_fields_and_nothing_that_could_hold_a_header_query_or_token() -> None:
    assert set(json.loads(encode_record(RECORD))) == {
        "v", "request_id", "at", "user_id", "client", "attempt_id", "action_id", "method", "scheme", "host", "port",
        "path", "verdict", "code", "rule", "credential", "bytes_up", "bytes_down", "upstream_status", "latency_ms"}


def test_a_whole_number_latency_survives_json() -> None:
    raw = encode_record(dataclasses.replace(RECORD, latency_ms=3.0)).replace(b'"latency_ms":3.0', b'"latency_ms":3')
    assert parse_record(raw).latency_ms == 3.0


@pytest.mark.parametrize("change", [
    {"path": "/v1/cancel?card=4111"}, {"path": "v1"}, {"path": "/a#frag"}, {"at": datetime(2030, 1, 1)},
    {"at": datetime(2030, 1, 1, tzinfo=timezone(timedelta(hours=2)))}, {"verdict": "maybe"},
    {"code": RefusalCode.NOT_ADMITTED}, {"code": "not_admitted"}, {"credential": "Bad Name"}, {"bytes_up": -1},
    {"bytes_down": 1.5}, {"upstream_status": 42}, {"latency_ms": float("nan")}, {"latency_ms": 3},
    {"host": "Merchant.com"}, {"port": 0}, {"client": "browser"}, {"request_id": ""}, {"rule": "a\nb"},
    {"user_id": "u\x00"},
])
def test_a_record_that_breaks_the_contract_is_refused_on_construction(change: dict[str, object]) -> None:
    with pytest.raises(ContractError):
        dataclasses.replace(RECORD, **change)  # type: ignore[arg-type]


def _wire(**changes: object) -> bytes:
    obj = json.loads(encode_record(REFUSED))
    obj.update(changes)
    return json.dumps({k: v for k, v in obj.items() if v is not ...}).encode()


@pytest.mark.parametrize("raw", [
    b"", b"[]", b"{}", b"nope", _wire(v=2), _wire(headers={"authorization": "x"}), _wire(query="a=1"),
    _wire(code="no_such_code"), _wire(at="yesterday"), _wire(at=5), _wire(latency_ms="1"), _wire(port="443"),
    _wire(bytes_up=...), _wire(upstream_status=True),
    encode_record(REFUSED).replace(b'"v":1', b'"v":1,"v":1'),
])
def test_a_malformed_record_raises_a_contract_error(raw: bytes) -> None:
    with pytest.raises(ContractError):
        parse_record(raw)


text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=20)
paths = st.from_regex(r"(/[A-Za-z0-9._~%-]{0,8}){1,4}", fullmatch=True) | st.just("")
records = st.builds(
    EgressRecord, request_id=text, user_id=st.none() | text, client=st.sampled_from(["connector", "tool_computer"]),
    at=st.datetimes(timezones=st.just(UTC)), attempt_id=st.none() | text, action_id=st.none() | text,
    method=st.sampled_from(["GET", "POST", "CONNECT"]), scheme=st.sampled_from(["http", "https"]),
    host=st.sampled_from(["merchant.test", "10.0.0.1", "2001:db8::1"]), port=st.integers(1, 65535), path=paths,
    verdict=st.just("refuse"), code=st.none() | st.sampled_from(list(RefusalCode)), rule=text,
    credential=st.none() | st.from_regex(r"[a-z0-9][a-z0-9_-]{0,10}", fullmatch=True),
    bytes_up=st.integers(0, 2**40), bytes_down=st.integers(0, 2**40), upstream_status=st.none() | st.integers(100, 599),
    latency_ms=st.floats(0, 1e7, allow_nan=False))


@given(records)
@settings(max_examples=200, deadline=None)
def test_every_valid_record_round_trips(record: EgressRecord) -> None:
    assert parse_record(encode_record(record)) == record
