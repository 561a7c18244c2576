"""Hostile JSON bodies are refused with a stable code, and every well-formed body within the limits whose text the
database can store (no NUL, no half of a surrogate pair) parses exactly as `json.loads` would."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wakeful.server.errors import BadRequest
from wakeful.server.faces.bodies import JsonLimits, loads

LIMITS = JsonLimits(max_depth=8, max_number_chars=32)  # a float as json.dumps writes it takes up to 24
COLUMNS = JsonLimits(max_depth=8, max_number_chars=32, column_text=True)


def _refusal(raw: bytes, limits: JsonLimits = LIMITS) -> str:
    with pytest.raises(BadRequest) as refused:
        loads(raw, limits)
    assert refused.value.http_status == 400
    return refused.value.code


def test_fifty_thousand_levels_of_nesting_are_too_deep_not_a_recursion_error() -> None:
    assert _refusal(b"[" * 50_000 + b"]" * 50_000, JsonLimits()) == "json_too_deep"
    assert _refusal(b'{"a":' * 50_000 + b"1" + b"}" * 50_000, JsonLimits()) == "json_too_deep"


def test_a_five_thousand_digit_integer_is_too_long_not_a_value_error() -> None:
    assert _refusal(b'{"n": ' + b"9" * 5000 + b"}", JsonLimits()) == "number_too_long"
    assert _refusal(b'{"n": 1.' + b"5" * 5000 + b"}", JsonLimits()) == "number_too_long"


@pytest.mark.parametrize("raw", [b'{"n": 1e999}', b"[-1.5e400]", b'{"n": 1E+309}'])
def test_a_number_beyond_a_double_is_out_of_range_not_an_infinity(raw: bytes) -> None:
    assert _refusal(raw) == "number_out_of_range"


@pytest.mark.parametrize("raw", [b'{"a": NaN}', b'{"a": Infinity}', b"[-Infinity]", b"{", b'{"a" 1}', b"\xff\xfe",
                                 b"", b'"\\ud800"x'])
def test_what_is_not_json_is_a_malformed_body(raw: bytes) -> None:
    assert _refusal(raw) == "malformed_body"


@pytest.mark.parametrize("raw", [b'{"t": "\\ud800"}', b'["\\udfff"]', b'{"\\uDBFF": 1}', b'["a\\ud83d b"]',
                                 b'["\\ud83d\\u0041"]', b'["\\ud83d\\\\ude00"]'])
def test_half_a_surrogate_pair_is_not_column_text_and_is_refused(raw: bytes) -> None:
    """The database cannot store it (SQLite's driver raises on encoding it): a 500 where it reached a column."""
    assert _refusal(raw, COLUMNS) == "malformed_body"
    loads(raw, LIMITS)  # a body stored as JSON keeps it, escaped


@pytest.mark.parametrize("raw", [b'{"title": "a\\u0000b"}', b'{"\\u0000": 1}', b'["\\ud83d\\ude00\\u0000"]'])
def test_nul_is_not_column_text_and_is_refused(raw: bytes) -> None:
    """PostgreSQL stores no NUL in text (its driver raises): a 500 where it reached a column."""
    assert _refusal(raw, COLUMNS) == "malformed_body"
    loads(raw, LIMITS)


def test_a_whole_surrogate_pair_and_an_escaped_backslash_before_u_are_text() -> None:
    assert loads(b'["\\ud83d\\ude00", "\\\\ud800", "\\\\u0000"]', COLUMNS) == ["\U0001f600", "\\ud800", "\\u0000"]


def test_two_values_for_one_key_are_refused_at_any_depth() -> None:
    assert _refusal(b'{"a": 1, "a": 2}') == "duplicate_key"
    assert _refusal(b'{"x": [{"b": 1, "b": 1}]}') == "duplicate_key"


def test_brackets_inside_strings_do_not_count_as_depth() -> None:
    body = {"text": "[[[[[[[[[[[[{{{{{{{{{{ \\\" ]]]]"}
    assert loads(json.dumps(body).encode(), LIMITS) == body


def test_depth_exactly_at_the_limit_parses() -> None:
    assert _depth(loads(b"[" * 8 + b"]" * 8, LIMITS)) == 8
    assert _refusal(b"[" * 9 + b"]" * 9) == "json_too_deep"


TEXT = st.characters(codec="utf-8", exclude_characters="\x00")  # text the database can store: no NUL, no surrogates
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**15), 10**15) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(TEXT, max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(TEXT, max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@given(json_values)
def test_a_body_within_the_limits_parses_as_json_loads_does(value: Any) -> None:
    raw = json.dumps(value).encode()
    if _depth(value) <= LIMITS.max_depth:
        assert loads(raw, LIMITS) == json.loads(raw)
    else:
        assert _refusal(raw) == "json_too_deep"


@given(st.binary(max_size=200))
def test_any_bytes_either_parse_or_are_refused_with_a_stable_code(raw: bytes) -> None:
    try:
        loads(raw, LIMITS)
    except BadRequest as exc:
        assert exc.code in {"malformed_body", "json_too_deep", "number_too_long", "duplicate_key"}
