"""Hypothesis strategies walked from pydantic models: the same typed models the tool schemas are generated from.

`arguments(Model, special)` draws dictionaries keyed as the schema names them (aliases), required fields always,
optional ones sometimes, every value within the model's constraints (lengths, bounds, patterns, literals), with
the extremes drawn often (empty and longest strings, the bounds of a range). `special` swaps in strategies for
values that mean something to the server (object and task IDs by their pattern, element refs by field name), so
real, forged and other users' IDs meet the tools. A type the walker does not know fails loudly: a model that grows
one must teach the walker, or the fuzz test would quietly stop covering it.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from hypothesis import strategies as st
from pydantic import AwareDatetime, BaseModel
from pydantic.fields import FieldInfo

__all__ = ["JSON", "Special", "arguments"]

JSON: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=6)
"""Any JSON value (finite numbers: JSON has no NaN)."""

UNBOUNDED_TEXT = 5000
"""The longest string drawn where a model sets no maximum."""


@dataclass(frozen=True)
class Special:
    by_pattern: Mapping[str, st.SearchStrategy[str]] = field(default_factory=dict)
    by_field: Mapping[str, st.SearchStrategy[Any]] = field(default_factory=dict)


def arguments(model: type[BaseModel], special: Special = Special()) -> st.SearchStrategy[dict[str, Any]]:
    required: dict[str, st.SearchStrategy[Any]] = {}
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for name, info in model.model_fields.items():
        key = info.alias or name
        value = _value(info.annotation, _flat(info.metadata), special, key)
        (required if info.is_required() else optional)[key] = value
    return st.fixed_dictionaries(required, optional=optional)


def _flat(metadata: list[Any]) -> list[Any]:
    out: list[Any] = []
    for m in metadata:
        out.extend(_flat(list(m.metadata)) if isinstance(m, FieldInfo) else [m])
    return out


def _constraint(metadata: list[Any], *names: str) -> Any:
    return next((getattr(m, n) for m in metadata for n in names if getattr(m, n, None) is not None), None)


def _value(tp: Any, metadata: list[Any], special: Special, name: str | None) -> st.SearchStrategy[Any]:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        return _value(base, metadata + _flat(extra), special, name)
    if origin in (Union, types.UnionType):
        return st.one_of(*(_value(a, metadata, special, name) for a in get_args(tp)))
    if origin is Literal:
        return st.sampled_from(get_args(tp))
    if tp in (str, int) and name in special.by_field:
        return special.by_field[name]
    if tp is str:
        return _text(metadata, special)
    if tp is bool:
        return st.booleans()
    if tp is int:
        low, high = _constraint(metadata, "ge"), _constraint(metadata, "le")
        edges = [v for v in (low, high) if v is not None]
        return st.integers(low, high) | st.sampled_from(edges) if edges else st.integers()
    if tp is float:  # as JSON carries it: finite, and a whole number now and then
        return st.floats(allow_nan=False, allow_infinity=False) | st.integers(-2, 2)
    if tp is type(None):
        return st.none()
    if tp is Any:
        return JSON
    if tp is AwareDatetime:  # as JSON carries it: ISO 8601 with an offset, anywhere from year 1 to 9999
        return st.datetimes(timezones=st.timezones()).map(datetime.isoformat)
    if origin is list:
        (item,) = get_args(tp)
        high = _constraint(metadata, "max_length")
        return st.lists(_value(item, [], special, None), min_size=_constraint(metadata, "min_length") or 0,
                        max_size=min(high if high is not None else 3, 3))
    if origin is dict:
        key, value = get_args(tp)
        return st.dictionaries(_value(key, [], special, None) if key is not str else st.text(max_size=20),
                               _value(value, [], special, None), max_size=3)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return arguments(tp, special)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return st.sampled_from([member.value for member in tp])
    raise TypeError(f"no strategy for {tp!r}: teach tests/support/model_strategies.py this type")


def _text(metadata: list[Any], special: Special) -> st.SearchStrategy[str]:
    pattern = _constraint(metadata, "pattern")
    if pattern in special.by_pattern:
        return special.by_pattern[pattern]
    low = _constraint(metadata, "min_length") or 0
    high = _constraint(metadata, "max_length")
    if pattern is not None:
        fits = st.from_regex(pattern, fullmatch=True).filter(lambda s: low <= len(s) <= (high or len(s)))
        return fits
    longest = high if high is not None else UNBOUNDED_TEXT
    return st.text(min_size=low, max_size=min(longest, 40)) | st.sampled_from([low, longest]).map(lambda n: "x" * n)
